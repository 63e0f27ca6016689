"""The GPU check's command line: the arguments, the worker processes' entry points (sections 7, 11
and 12 start this module again with a hidden option), and main, which runs the sections in order
under the budget's deadline."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

import torch

import benchmarks.gpu_check as package
from benchmarks.gpu_check.harness import (
    Run,
    Section,
    Tee,
    in_lanes,
    no_plots,
    print_plan,
    print_rerun,
    run_section,
    stop,
    watch,
    without_our_allocator,
    write_summary,
)
from benchmarks.gpu_check.lanes import run_lanes


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.gpu_check",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU with tiny shapes")
    parser.add_argument("--steps", type=int, default=2, help="training steps of sections 2 and 4")
    parser.add_argument(
        "--budget",
        type=float,
        default=540,
        help="seconds of wall time from the process's start: a hard deadline (sections past it stopped or skipped)",
    )
    parser.add_argument(
        "--only", type=lambda s: {int(x) for x in s.split(",")}, help="e.g. 2,4: these sections alone"
    )
    parser.add_argument("--out", help="write summary.json, summary.txt and log.txt to this folder")
    # A lane's process (lanes.py): these sections, in this order, alone in it.
    parser.add_argument("--lane", type=lambda s: [int(x) for x in s.split(",")], help=argparse.SUPPRESS)
    # The module that lists SECTIONS and LANES (the tests give their own, which a lane's process imports).
    parser.add_argument("--sections", default="benchmarks.gpu_check.sections", help=argparse.SUPPRESS)
    # The worker processes' options: section 7's, section 12's, section 11's (its LoRA rank).
    parser.add_argument("--resume-on-cpu", help=argparse.SUPPRESS)
    parser.add_argument("--peer-worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--peer-settings", help=argparse.SUPPRESS)
    parser.add_argument("--paged-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser


def work(args) -> int:
    """One worker process's job: what it measured, as a "RESULT {json}" line (section 7's prints)."""
    from benchmarks.gpu_check.paged_adamw import paged_run
    from benchmarks.gpu_check.resume import resume_here
    from benchmarks.gpu_check.vs_trl import peer_run

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    no_plots()
    if args.resume_on_cpu:
        resume_here(args.model, args.resume_on_cpu)
    elif args.paged_worker:
        print("RESULT " + json.dumps(paged_run(args.model, args.paged_worker, args.scratch)))
    else:
        result = peer_run(
            args.peer_worker, args.model, json.loads(args.peer_settings), torch.cuda.is_available()
        )
        print("RESULT " + json.dumps(result))
    return 0


# The compile caches the check's processes write: lora_grpo's (rollout/compile_cache.py), inductor's, Triton's.
CACHES = {"LORA_GRPO_CACHE": "lora_grpo", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def own_caches(root: str) -> None:
    """The compile caches in the check's own folder, unless the caller set them: a rerun on the same warm machine
    compiles cold again, as the figures it is judged by were taken, and section 15's first process is cold; and
    nothing is written under $HOME, which may be read-only there. Set in the environment before the lanes start,
    so that their processes (and section 15's workers) share the parent's: section 15 reads what section 2 wrote."""
    for name, folder in CACHES.items():
        os.environ.setdefault(name, str(Path(root) / "caches" / folder))


def main(argv: list[str] | None = None, sections: list[Section] | None = None, lanes=None) -> int:
    """Run the check: the sections that are in no lane alone, in the order of the list, then the
    lanes side by side (`sections` and `lanes`: the --sections module's SECTIONS and LANES unless
    given, as the tests give theirs; given sections without lanes run one after another). In a
    lane's process (--lane), its sections one after another. The exit status is the number of
    failed sections."""
    options = parser()
    args = options.parse_args(argv)
    # lora_grpo sets CUDA's allocator up when its device module is imported (expandable segments:
    # device.use_expandable_segments), before this process starts CUDA, as a user's script does.
    import lora_grpo.device  # noqa: F401

    if args.peer_worker == "trl":
        # TRL's worker runs torch's default allocator, as a TRL user's script does (torch reads the
        # variable at its first CUDA allocation, after this).
        without_our_allocator(os.environ)

    if args.resume_on_cpu or args.peer_worker or args.paged_worker:
        return work(args)
    if sections is None:
        listed = importlib.import_module(args.sections)
        sections, lanes = listed.SECTIONS, getattr(listed, "LANES", ()) if lanes is None else lanes
    lanes = [tuple(lane) for lane in lanes or ()]
    if args.lane:
        by_number = {s.number: s for s in sections}
        sections, lanes = [by_number[number] for number in args.lane], []
    if not args.cpu and not torch.cuda.is_available():
        options.error("no CUDA device: run on a GPU, or pass --cpu for a dry run")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        # Line-buffered: a run killed mid-section still leaves every line it printed.
        log = open(Path(args.out) / "log.txt", "w", buffering=1)  # noqa: SIM115 - open for the whole run
        sys.stdout, sys.stderr = Tee(sys.stdout, log), Tee(sys.stderr, log)
    if not args.cpu:
        # Section 7's deterministic mode needs it before cuBLAS starts (a 32 MiB workspace, Hopper's default).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # What 'auto' chose, in one line each.
    logging.getLogger("lora_grpo").setLevel(logging.INFO)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    # TORCH_LOGS="graph_breaks,recompiles"
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    no_plots()
    with tempfile.TemporaryDirectory() as root:
        own_caches(root)
        run = Run(args, device, root, sections)
        signal.signal(signal.SIGTERM, lambda signum, frame: stop(run, "stopped by SIGTERM"))
        deadline = watch(run)
        print_plan(run, lanes)
        side = in_lanes(lanes)
        for section in sections:
            if section.number not in side:
                run_section(section, run)
        run_lanes(run, lanes)
        # Past the last section: the watchdog has nothing left to stop.
        with run.lock:
            deadline.cancel()
            faulthandler.cancel_dump_traceback_later()
        seconds = run.elapsed()
    failed = run.failed()
    statuses = [v["status"] for v in run.summary.values()]
    print(
        f"\n{len(failed)} section(s) failed{': ' + ', '.join(failed) if failed else ''}; "
        f"{statuses.count('skipped')} skipped, {statuses.count('stopped')} stopped; {seconds:.0f} s in all"
    )
    print_rerun(run)
    if args.out:
        write_summary(run, seconds)
    return len(failed)
