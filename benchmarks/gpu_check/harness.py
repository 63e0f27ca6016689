"""The GPU check's run machinery, apart from what the sections measure: the Section record, the Run
(the budget and its clock, the scratch folder, the models built so far, and what the sections found),
one section's run and its verdict, the summary files, the rerun command, and the hard deadline
(a watchdog thread, SIGTERM, faulthandler). The package's docstring says what each rule is for."""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._common import CHILDREN, build_qwen2
from benchmarks.gpu_bundle import rerun_command

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
# Seconds before the deadline at which a child process is ended, so its section records it.
MARGIN = 2.0
# Seconds past the deadline at which faulthandler ends a process its watchdog could not.
GRACE = 10.0
# A fresh process's start-up on the lent machine (the interpreter, torch, transformers): ~10 s on the first GPU run.
PROCESS_START_S = 10.0
# Seconds between a lane's own deadline and the parent's (lanes.py): the lane writes its summary, then the parent.
LANE_MARGIN = 5.0
IMPORTED = time.perf_counter()
LABELS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "stopped": "STOP"}
# The most files a lent machine gives back from --out ($OUT; the device tool's limit): the check writes 5.
OUT_FILES = 8


def process_age() -> float:
    """Seconds since this process started (Linux: /proc, so the interpreter's start-up and the imports
    count; elsewhere since this module's imports finished)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - IMPORTED


class Skip(Exception):
    """A section that cannot run here (a package missing, an earlier section's result missing): skipped."""


class Late(Skip):
    """A section with too little of the budget left to start: skipped, and named in the rerun command."""


class Stopped(Exception):
    """A section whose own time limit (what the budget left it) ran out: stopped, and named in the rerun."""


@dataclass(frozen=True)
class Section:
    """One section of the check: its number (the docs' numbering, not the order it runs in), its title,
    the function that runs it, its expected seconds on the lent H200 (the plan printed at the start
    and benchmarks/README.md's device-time table), and the sections whose results it runs on in the
    same process (a rerun of it brings them, run before it)."""

    number: int
    title: str
    check: Callable[[Run], None]
    estimate_s: float
    needs: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        """The section's key in the summary files and its heading in the log: "3. decode: ..."."""
        return f"{self.number}. {self.title}"


def mib(value) -> str:
    return "-" if value is None else f"{value / MiB:,.1f}"


def worker_command(*args: str) -> list[str]:
    """The command line of one of the check's worker processes (sections 7, 11, 12), run as
    `python -m benchmarks.gpu_check` from the checkout (worker_options gives it its folder and path)."""
    return [sys.executable, "-m", "benchmarks.gpu_check", *args]


def worker_options(env: dict | None = None) -> dict:
    """cwd and env for a worker process: the checkout first on PYTHONPATH (the parent may have been
    started from elsewhere, or with a relative path), and the allocator variable that lora_grpo set
    in this process left out, so that the worker decides as a fresh process does (lora_grpo sets it
    again when imported; TRL's worker runs torch's default: cli.main). A variable the user set stays."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {"cwd": REPO, "env": without_our_allocator(env)}


def without_our_allocator(env) -> dict:
    """`env` (a dict, or os.environ itself) without the allocator variable lora_grpo set in this
    process when it was imported (device.use_expandable_segments); a variable the user set stays."""
    from lora_grpo.device import allocator_setting

    if "set by lora_grpo" in allocator_setting():
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return env


class Run:
    """What the sections share: the arguments, the device, the scratch folder, the clock, the models
    built so far, what a section leaves for a later one (section 2's trainer for section 3, by the
    number of the section that left it), and what the run found: `summary` (section name → status,
    seconds, reason, rerun, findings), `running` (the section running now) and `findings` (the
    running section's), guarded by `lock` (the main thread's and the watchdog's)."""

    def __init__(self, args, device: torch.device, root: str, sections: list[Section]):
        self.args, self.device, self.root = args, device, Path(root)
        self.sections = sections
        self.cuda = device.type == "cuda"
        # The budget counts from the process's start.
        self.start = time.perf_counter() - process_age()
        self.results: dict = {}
        self._models: dict = {}
        self.summary: dict[str, dict] = {}
        self.running: dict = {}
        self.findings: dict = {}
        self.lock = threading.RLock()
        # The lanes started (lanes.Lane: sections side by side, a worker process each), for stop.
        self.lanes: list = []

    # -------------------------------------------------------------------- what a section reports
    def expect(self, ok: bool, what: str) -> bool:
        """One threshold of the running section, printed; a miss fails the section once the rest has run."""
        print(f"{'ok' if ok else 'FAIL'}: {what}", flush=True)
        if not ok:
            self.findings.setdefault("failures", []).append(what)
        return ok

    def not_here(self, what: str) -> None:
        """A part of the running section that only CUDA has, left out of this (CPU) run and listed."""
        print(f"(skipped here: {what})", flush=True)
        self.findings.setdefault("skipped_parts", []).append(what)

    def over_time(self, what: str, limit: float, cap: float) -> None:
        """A child process killed at its time limit: stopped (to rerun) when the budget set the limit,
        a failure when its own cap did."""
        if limit < cap:
            raise Stopped(f"{what} stopped at the deadline ({limit:.0f} s of the --budget were left for it)")
        self.expect(False, f"{what} finished within {cap:.0f} s")

    # -------------------------------------------------------------------- the clock and the models
    def selected(self, number: int) -> bool:
        """Whether section `number` is to run (--only)."""
        return not self.args.only or number in self.args.only

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.args.budget - self.elapsed()

    def limit(self, cap: float) -> float:
        """A child process's time limit: `cap` seconds, or what the budget leaves less MARGIN."""
        return max(1.0, min(cap, self.left() - MARGIN))

    def shape(self, shape: str) -> str:
        """The shape to use: the tiny one in the CPU dry run."""
        return "tiny" if self.args.cpu else shape

    def model(self, shape: str, dtype: torch.dtype | None = None) -> str:
        """The path of a random Qwen2 of `shape` (built once): bf16 on a GPU unless `dtype`."""
        dtype = dtype or (torch.bfloat16 if self.cuda else torch.float32)
        key = (shape, dtype)
        if key not in self._models:
            name = str(dtype).removeprefix("torch.")
            path = self.root / f"{shape}-{name}"
            start = time.perf_counter()
            build_qwen2(shape, path, dtype, device=self.device)
            print(f"(built a random {shape} in {name}: {time.perf_counter() - start:.1f} s)")
            self._models[key] = str(path)
        return self._models[key]

    # -------------------------------------------------------------------- the verdict so far
    @staticmethod
    def entry(status: str, seconds: float, reason: str | None, again: bool, findings: dict) -> dict:
        """One section's entry in the summary; `again`: it is named in the rerun command (stopped, or
        skipped for want of time)."""
        return {
            "status": status,
            "seconds": round(seconds, 1),
            "reason": reason,
            "rerun": again,
            "findings": dict(findings),
        }

    def record(self, section: Section, status: str, seconds: float, reason: str | None, again: bool) -> None:
        """The running section's entry, with its findings."""
        self.summary[section.name] = self.entry(status, seconds, reason, again, self.findings)

    def names(self, numbers) -> list[str]:
        """The summary's names of the sections numbered `numbers`."""
        return [s.name for s in self.sections if s.number in numbers]

    def failed(self) -> list[str]:
        return [name for name, v in self.summary.items() if v["status"] == "failed"]

    def rerun(self) -> str | None:
        """The second command on the lent machine, if any: the sections this run stopped or skipped for want
        of time, with the sections they need, in the order they run."""
        by_name = {s.name: s for s in self.sections}
        again = [by_name[name].number for name, v in self.summary.items() if v.get("rerun")]
        needed = [n for s in self.sections if s.number in again for n in s.needs]
        again += [n for n in dict.fromkeys(needed) if n not in again]
        order = [s.number for s in self.sections]
        again.sort(key=lambda n: order.index(n) if n in order else len(order))
        return rerun_command(",".join(map(str, again))) if again else None


def release(run: Run) -> None:
    """On a GPU: collect what was dropped, and give the allocator's cached blocks back to the device
    (on a CPU reference counting frees the tensors; a collection over a loaded trainer takes ~0.4 s)."""
    if run.cuda:
        gc.collect()
        torch.cuda.empty_cache()


def fresh_compiler(run: Run) -> None:
    """Dynamo's caches and the CUDA graph trees reset, as in a fresh process: a user's process compiles
    one model, and dynamo's recompile limit (8 per code object) counts every model of this one."""
    if run.cuda:
        torch._dynamo.reset()
        release(run)


def no_plots() -> None:
    """Every run here ends without its metrics.png: not what this checks, and matplotlib costs a CPU
    second or two a run (reporting.RunReporter.plot, replaced for this process)."""
    from lora_grpo.run.reporting import RunReporter

    RunReporter.plot = lambda self: None


def run_section(section: Section, run: Run) -> None:
    """Run one section (or skip it: not selected, past the budget, or Skip raised) and record its
    status, seconds and findings; a failure is printed with its traceback and the run goes on."""
    print(f"\n## {section.name}", flush=True)
    start = time.perf_counter()
    status, reason, again = "passed", None, False
    with run.lock:
        run.findings = {}
        run.running.update(
            section=section.name, since=time.strftime("%H:%M:%S"), at_s=round(run.elapsed(), 1)
        )
    if not run.selected(section.number):
        status, reason = "skipped", "not in --only"
    elif run.left() <= 0:
        status, reason, again = "skipped", f"past the --budget of {run.args.budget:.0f} s", True
    elif any(run.summary.get(name, {}).get("rerun") for name in run.names(section.needs)):
        # What it runs on was left for the rerun: so is it (the rerun brings both, in order).
        status, reason, again = (
            "skipped",
            f"needs section {', '.join(map(str, section.needs))}, left for the rerun",
            True,
        )
    elif run.cuda and run.left() < section.estimate_s:
        # On the lent GPU a section that would be cut at the deadline is left whole for the rerun,
        # and the time goes to the shorter sections after it.
        left = run.left()
        status, reason, again = (
            "skipped",
            f"{left:.0f} s of the budget left, ~{section.estimate_s:g} s needed",
            True,
        )
    else:
        running = run.running
        print(
            f"running: §{section.number} since {running['since']} ({running['at_s']} s into the run)",
            flush=True,
        )
        if run.args.out:
            with run.lock:
                write_summary(run, run.elapsed())
        try:
            section.check(run)
            if run.findings.get("failures"):
                status = "failed"
        except Late as e:
            status, reason, again = "skipped", str(e), True
        except Skip as e:
            status, reason = "skipped", str(e)
        except Stopped as e:
            status, reason, again = "stopped", str(e), True
        except Exception as e:  # noqa: BLE001 - one section's failure must not hide the others' findings
            status = "failed"
            run.findings["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"FAILED: {section.name}\n{traceback.format_exc()}", flush=True)
        finally:
            release(run)
    if reason:
        print(f"({status}: {reason})", flush=True)
    with run.lock:
        run.record(section, status, time.perf_counter() - start, reason, again)
        run.running.clear()
    # What an earlier section left for this one was for it alone (run or skipped).
    for number in section.needs:
        run.results.pop(number, None)
    print(f"({time.perf_counter() - start:.1f} s)", flush=True)
    if run.args.out:
        with run.lock:
            write_summary(run, run.elapsed())


def write_summary(run: Run, seconds: float) -> None:
    """summary.json and summary.txt in --out: the run's verdict so far, one entry per section in the
    order of the list (lanes end in any order), each file replaced whole (a lane's parent may read it
    at any moment)."""
    # summary.json is JSON to every reader (jq, a browser): a figure not measured (NaN) as null
    from lora_grpo.run.reporting import plain

    out = Path(run.args.out)
    out.mkdir(parents=True, exist_ok=True)
    order = {s.name: k for k, s in enumerate(run.sections)}
    summary = dict(sorted(run.summary.items(), key=lambda item: order.get(item[0], len(order))))
    running_lanes = [lane.label for lane in run.lanes if not lane.collected and lane.process is not None]
    verdict = {
        "passed": not run.failed(),
        "failed": run.failed(),
        "skipped": [name for name, v in summary.items() if v["status"] == "skipped"],
        "stopped": [name for name, v in summary.items() if v["status"] == "stopped"],
        "rerun": run.rerun(),
        "seconds": round(seconds, 1),
        "budget": run.args.budget,
        "running": dict(run.running) or None,
        "lanes_running": running_lanes or None,
        "sections": summary,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    replace(out / "summary.json", json.dumps(plain(verdict), indent=2, allow_nan=False) + "\n")
    lines = []
    for name, v in summary.items():
        line = f"{LABELS[v['status']]} {name} ({v['seconds']} s{', ' + v['lane'] if v.get('lane') else ''})"
        detail = v["findings"].get("error") or "; ".join(v["findings"].get("failures", [])) or v["reason"]
        lines.append(line + (f": {detail[:300]}" if detail else ""))
    command = run.rerun()
    lines.append(f"{len(run.failed())} failed, {seconds:.0f} s")
    replace(out / "summary.txt", "\n".join(lines + ([f"rerun: {command}"] if command else [])) + "\n")


def replace(path: Path, text: str) -> None:
    """`path` written whole: the text to a temporary file beside it, renamed over it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def in_lanes(lanes) -> set[int]:
    """The numbers of the sections that run in one of `lanes` (the rest run alone, before them)."""
    return {number for lane in lanes for number in lane}


def planned_s(sections: list[Section], lanes, selected: Callable[[int], bool] = lambda number: True) -> float:
    """The selected sections' estimated seconds on the H200: those alone one after another, then the
    longest lane (lanes run side by side, each a fresh process: PROCESS_START_S more, under a deadline
    LANE_MARGIN before this process's), and this process's own start-up."""
    side = in_lanes(lanes)
    estimate = {s.number: s.estimate_s for s in sections if selected(s.number)}
    alone = sum(seconds for number, seconds in estimate.items() if number not in side)
    longest = max((sum(estimate.get(n, 0.0) for n in lane) for lane in lanes), default=0.0)
    return PROCESS_START_S + alone + (PROCESS_START_S + LANE_MARGIN + longest if longest else 0.0)


def print_plan(run: Run, lanes) -> None:
    """The sections selected, alone in the order they run, then the lanes side by side, with their
    estimated seconds, against the budget."""
    side = in_lanes(lanes)
    alone = [s for s in run.sections if run.selected(s.number) and s.number not in side]
    estimate = {s.number: s.estimate_s for s in run.sections}
    chosen = [[n for n in lane if run.selected(n)] for lane in lanes]
    together = " ".join(f"[{', '.join(f'§{n} ~{estimate[n]:g}' for n in lane)}]" for lane in chosen if lane)
    print(
        f"plan: {', '.join(f'§{s.number} ~{s.estimate_s:g} s' for s in alone) or 'nothing'} alone"
        + (f", then side by side {together}" if together else "")
        + f" (~{planned_s(run.sections, lanes, run.selected):g} s estimated on an H200, start-ups included); "
        f"--budget {run.args.budget:g} s from the process's start, {run.elapsed():.0f} s gone",
        flush=True,
    )


def print_rerun(run: Run) -> None:
    """The run's last line: the exact command for what it stopped or skipped for want of time."""
    command = run.rerun()
    print(
        f"rerun: {command}" if command else "rerun: none (no section was stopped or skipped for time)",
        flush=True,
    )


class Tee:
    """A stream that writes to the console and to log.txt in --out (what the lent machine returns)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text)
        return self.stream.write(text)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def stop(run: Run, why: str) -> None:
    """End the run now (the deadline's watchdog, or SIGTERM): the running section recorded as
    stopped, the selected sections not started yet as skipped (both named in the rerun command),
    the child processes killed, the summary written; the exit status is the number of failed
    sections, as at a normal end (a stopped section is not a failure)."""
    # The main thread holds the lock only while it writes the summary.
    run.lock.acquire(timeout=10)
    try:
        # Each lane is past its own deadline: ended, and what it recorded taken (lanes.Lane.end).
        for lane in run.lanes:
            lane.end(run)
        by_name = {s.name: s for s in run.sections}
        if run.running:
            name = run.running["section"]
            run.record(by_name[name], "stopped", run.elapsed() - run.running["at_s"], why, True)
            run.running.clear()
        for section in run.sections:
            if section.name not in run.summary and run.selected(section.number):
                run.findings = {}
                run.record(section, "skipped", 0.0, f"not started: {why}", True)
        for child in list(CHILDREN):
            child.kill()
        print(f"\n{why} after {run.elapsed():.0f} s", flush=True)
        print_rerun(run)
        if run.args.out:
            write_summary(run, run.elapsed())
        sys.stdout.flush()
        sys.stderr.flush()
        # The models built (os._exit skips the cleanup).
        shutil.rmtree(run.root, ignore_errors=True)
    finally:
        os._exit(len(run.failed()))


def watch(run: Run) -> threading.Timer:
    """The hard deadline: a timer thread at the budget (counted from the process's start) calls stop.
    A section stuck in C code that holds the GIL would keep that thread from running: faulthandler's
    own thread, which needs no GIL, ends the process GRACE seconds later (its tracebacks on stderr,
    exit 1; summary.json then still names the section running)."""
    timer = threading.Timer(max(0.0, run.left()), stop, (run, "stopped at the deadline"))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(max(1.0, run.left() + GRACE), exit=True, file=sys.__stderr__)
    return timer
