"""Sections side by side: each lane (sections.py's LANES) is a worker process of the check that runs
its sections in order under a deadline of its own, LANE_MARGIN seconds before the parent's, while
the other lanes run theirs. The parent prints their lines, each behind its lane's label, and takes a
lane's summary into its own as the lane ends (at the parent's deadline: what the lane wrote so far).

What runs in a lane checks memory and correctness, not speed: each process has its own allocator
(and the emulated card's cap, set per process), its own compiler and CUDA graphs, and the sections
measure peaks and equalities, which a neighbour does not change; their seconds are what they are
beside each other. The sections that time something run before the lanes, alone (cli.main)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import CHILDREN
from benchmarks.gpu_check.harness import (
    LANE_MARGIN,
    PROCESS_START_S,
    Run,
    worker_command,
    worker_options,
    write_summary,
)

# A lane is not started with less of the budget left: its start-up, and its margin.
LANE_START_S = PROCESS_START_S + LANE_MARGIN
# One lane's line at a time on the parent's stdout (and log.txt).
PRINTING = threading.Lock()


@dataclass
class Lane:
    """One lane of the run: its sections' numbers, its folder (its own summary.json, summary.txt and
    log.txt), and its process once started; `collected` once its summary is in the parent's."""

    numbers: tuple[int, ...]
    folder: Path
    process: subprocess.Popen | None = None
    relay: threading.Thread | None = None
    ended_by_parent: bool = False
    collected: bool = False
    started: float = 0.0

    @property
    def label(self) -> str:
        return "lane §" + ",".join(map(str, self.numbers))

    def collect(self, run: Run) -> None:
        """The lane's sections into the parent's summary: each as the lane recorded it; the one its process
        was running when it ended, stopped (the parent's deadline ended it) or failed (it died by itself);
        the ones it had not started, skipped and named in the rerun."""
        if self.collected:
            return
        self.collected = True
        code = self.process.returncode if self.process else None
        try:
            written = json.loads((self.folder / "summary.json").read_text())
        except (OSError, ValueError):
            written = {}
        sections = written.get("sections", {})
        running = (written.get("running") or {}).get("section")
        by_number = {s.number: s for s in run.sections}
        how = "was ended at the parent's deadline" if self.ended_by_parent else f"ended (exit {code})"
        for number in self.numbers:
            section = by_number[number]
            if section.name in sections:
                entry = sections[section.name]
            elif section.name == running:
                seconds = time.perf_counter() - self.started - (written.get("running") or {}).get("at_s", 0)
                status = "stopped" if self.ended_by_parent else "failed"
                reason = f"its lane's process {how} while it ran ({self.folder.name}/log.txt)"
                entry = run.entry(status, seconds, reason, self.ended_by_parent, {})
            else:
                entry = run.entry("skipped", 0.0, f"not started: its lane's process {how}", True, {})
            self.put(run, section.name, entry)

    def put(self, run: Run, name: str, entry: dict) -> None:
        """One of the lane's sections into the parent's summary, named with the lane."""
        run.summary[name] = {**entry, "lane": self.label}

    def end(self, run: Run) -> None:
        """At the parent's deadline: the lane's process ended (it is past its own deadline), its summary taken."""
        if self.process is not None and self.process.poll() is None:
            self.ended_by_parent = True
            self.process.kill()
            self.process.wait()
        self.collect(run)


def lane_threads(lanes: int) -> int:
    """Each lane's CPU threads (OMP_NUM_THREADS, when the user set none): the cores this process may run on
    (not the host's count a container may report) shared, so that a lane's CPU work (section 7's CPU resume,
    inductor's compiles) does not oversubscribe."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, lanes))


def relay(lane: Lane) -> None:
    """The lane's lines on the parent's stdout, each behind the lane's label."""
    for line in lane.process.stdout:
        text = line if line.endswith("\n") else line + "\n"
        with PRINTING:
            sys.stdout.write(f"[{lane.label}] {text}")
            sys.stdout.flush()


def start(run: Run, lane: Lane, budget: float, threads: int) -> None:
    """The lane's worker process: `--lane` with its sections, `budget` seconds from its start."""
    args = [
        "--lane",
        ",".join(map(str, lane.numbers)),
        "--budget",
        f"{budget:.1f}",
        "--out",
        str(lane.folder),
    ]
    args += ["--steps", str(run.args.steps), "--sections", run.args.sections]
    if run.args.cpu:
        args.append("--cpu")
    options = worker_options()
    options["env"].setdefault("OMP_NUM_THREADS", str(threads))
    options["env"]["PYTHONUNBUFFERED"] = "1"
    # What an earlier run left in the same --out is not this lane's (its process may die before it writes).
    (lane.folder / "summary.json").unlink(missing_ok=True)
    lane.started = time.perf_counter()
    lane.process = subprocess.Popen(
        worker_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",  # a stray byte must not end the relay (the lane would then block on a full pipe)
        **options,
    )
    CHILDREN.add(lane.process)
    lane.relay = threading.Thread(target=relay, args=(lane,), daemon=True)
    lane.relay.start()


def run_lanes(run: Run, lanes: list[tuple[int, ...]]) -> None:
    """The selected sections of `lanes`, a worker process a lane, side by side; returns when every lane
    has ended and its summary is in the run's (written to --out as each ends)."""
    chosen = [tuple(n for n in numbers if run.selected(n)) for numbers in lanes]
    chosen = [numbers for numbers in chosen if numbers]
    if not chosen:
        return
    # Each lane's own --out in the scratch folder, not under --out: the device tool brings back at most 8 files
    # (OUT_FILES), and the lane's lines are in log.txt, its verdicts in summary.json.
    run.lanes = [
        Lane(numbers, run.root / "lanes" / f"lane-{'-'.join(map(str, numbers))}") for numbers in chosen
    ]
    budget = run.left() - LANE_MARGIN
    labels = ", ".join(lane.label for lane in run.lanes)
    if budget < LANE_START_S:
        for lane in run.lanes:
            lane.collected = True
            for section in (s for s in run.sections if s.number in lane.numbers):
                reason = f"{run.left():.0f} s of the budget left: too little to start its lane"
                lane.put(run, section.name, run.entry("skipped", 0.0, reason, True, {}))
        print(f"\n## side by side: {labels}: not started, {run.left():.0f} s of the budget left", flush=True)
        return
    threads = lane_threads(len(run.lanes))
    print(
        f"\n## side by side: {labels} (a process each, {threads} CPU thread(s) each, "
        f"{budget:.0f} s of the budget each)",
        flush=True,
    )
    with run.lock:
        for lane in run.lanes:
            start(run, lane, budget, threads)
    waiting = list(run.lanes)
    while waiting:
        for lane in list(waiting):
            if lane.process.poll() is None:
                continue
            lane.relay.join(timeout=5)
            CHILDREN.discard(lane.process)
            waiting.remove(lane)
            with run.lock:
                lane.collect(run)
                seconds = time.perf_counter() - lane.started
                with PRINTING:
                    print(
                        f"({lane.label} ended, exit {lane.process.returncode}, after {seconds:.1f} s)",
                        flush=True,
                    )
                if run.args.out:
                    write_summary(run, run.elapsed())
        time.sleep(0.2)
