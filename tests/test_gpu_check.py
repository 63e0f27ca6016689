"""benchmarks/gpu_check.py's run machinery on a CPU: the budget and its deadline, the order of the
sections and the rerun command, what the memory sections start with, the bundled calculator base,
section 11's worker process. (Its whole --cpu dry run: tests/test_gpu_bundle.py.)"""

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_bundle  # noqa: E402


def dry_run(tmp_path, only=None, steps=1):
    """A CPU Run of gpu_check with 60 s of budget left writing its summary to tmp_path, the summary emptied."""
    import argparse

    import gpu_check

    # The budget counts from the process's start: this one (pytest's) started a while ago.
    args = argparse.Namespace(
        budget=gpu_check.process_age() + 60, only=only, out=str(tmp_path), cpu=True, steps=steps
    )
    gpu_check.SUMMARY.clear()
    return args, gpu_check.Run(args, torch.device("cpu"), str(tmp_path))


def test_a_section_past_the_budget_is_skipped_and_a_missed_threshold_fails_after_the_rest(tmp_path):
    import gpu_check

    args, run = dry_run(tmp_path)
    ran = []

    def check(run):
        gpu_check.expect(False, "a threshold")
        ran.append("after")

    gpu_check.run_section("1. thresholds", check, run)
    args.budget = 0.0
    gpu_check.run_section("2. late", lambda run: ran.append("late"), run)
    assert ran == ["after"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    first, late = summary["sections"]["1. thresholds"], summary["sections"]["2. late"]
    assert first["status"] == "failed" and first["findings"]["failures"] == ["a threshold"]
    assert late["status"] == "skipped" and "budget" in late["reason"]
    assert summary["failed"] == ["1. thresholds"] and summary["skipped"] == ["2. late"]


def test_the_running_section_is_named_and_a_budget_skip_is_offered_as_the_rerun(tmp_path):
    import gpu_check

    args, run = dry_run(tmp_path)
    seen = []

    def check(run):
        seen.append(json.loads((tmp_path / "summary.json").read_text())["running"]["section"])

    gpu_check.run_section("1. first", check, run)
    args.budget = 0.0
    gpu_check.run_section("4. late", check, run)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert seen == ["1. first"] and summary["running"] is None
    assert summary["rerun"] == gpu_bundle.rerun_command("4")
    assert (tmp_path / "summary.txt").read_text().splitlines()[
        -1
    ] == f"rerun: {gpu_bundle.rerun_command('4')}"


def test_section_2_keeps_its_trainer_only_when_section_3_runs(tmp_path):
    for only, keeps in ((None, True), ({2, 3}, True), ({2, 4}, False)):
        assert dry_run(tmp_path, only)[1].selected(3) is keeps


DEADLINE_RUN = """
import sys, time
sys.path.insert(0, {benchmarks!r})
import gpu_check
gpu_check.SECTIONS[:] = [
    ("1. devices", lambda run: None),
    ("5. sleeps past the deadline", lambda run: time.sleep(600)),
    ("9. after it", lambda run: None),
]
sys.argv = ["gpu_check.py", "--cpu", "--budget", "{budget}", "--out", {out!r}]
sys.exit(gpu_check.main())
"""


def test_the_deadline_stops_the_running_section_writes_the_summary_and_exits_0(tmp_path):
    """--budget is a hard deadline from the process's start: a section still running at it is
    recorded as stopped, the ones after it as not started, both in the rerun command; exit 0."""
    budget, out = 30, tmp_path / "out"
    script = DEADLINE_RUN.format(benchmarks=str(BENCHMARKS), budget=budget, out=str(out))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=budget + 120, cwd=tmp_path
    )
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # A correctness bound on the watchdog (it fired at the deadline, not at the sleep's end), not a timing.
    assert wall < budget + 10, wall
    summary = json.loads((out / "summary.json").read_text())
    sections = summary["sections"]
    assert sections["1. devices"]["status"] == "passed"
    assert sections["5. sleeps past the deadline"]["status"] == "stopped"
    assert sections["5. sleeps past the deadline"]["reason"] == "stopped at the deadline"
    assert sections["9. after it"]["status"] == "skipped"
    assert sections["9. after it"]["reason"] == "not started: stopped at the deadline"
    assert (
        summary["running"] is None
        and summary["passed"]
        and summary["stopped"] == ["5. sleeps past the deadline"]
    )
    assert summary["rerun"] == gpu_bundle.rerun_command("5,9")
    assert (out / "summary.txt").read_text().splitlines()[-1] == f"rerun: {gpu_bundle.rerun_command('5,9')}"
    assert done.stdout.splitlines()[-1] == f"rerun: {gpu_bundle.rerun_command('5,9')}"
    assert "running: §5" in (out / "log.txt").read_text()


def test_the_cheap_sections_run_first_and_a_rerun_of_section_3_brings_section_2(tmp_path):
    import gpu_check

    order = [gpu_check.section_number(title) for title, _ in gpu_check.SECTIONS]
    assert sorted(order) == list(range(1, 13)) and order[:6] == [1, 7, 8, 10, 11, 6]
    assert set(order[6:]) == {2, 3, 4, 5, 9, 12} and order.index(3) == order.index(2) + 1
    assert set(gpu_check.ESTIMATES) == set(order)
    args, run = dry_run(tmp_path)
    args.budget = 0.0  # section 3 past the budget: its rerun needs section 2 again, run before it
    gpu_check.run_section(
        "3. decode: compiled vs eager, graph breaks, recompiles", gpu_check.check_decode, run
    )
    assert gpu_check.rerun() == gpu_bundle.rerun_command("2,3")


def test_section_9_loads_the_bundled_calculator_base_and_never_pretrains(tmp_path, monkeypatch):
    """The bundle carries the base pre-trained here; gpu_check loads it by path (no pre-training on
    the lent machine's CPU), and without it a GPU run fails the section naming the fix."""
    import gpu_check

    from lora_grpo.tasks import calculator

    bundle = tmp_path / "gpu_bundle"
    sizes = gpu_bundle.copy_bases(bundle)
    cached = Path(calculator.ensure_calculator_base())
    base = bundle / gpu_bundle.CALCULATOR_BASE
    assert sorted(p.name for p in base.iterdir()) == sorted(p.name for p in cached.iterdir())
    assert (base / "model.safetensors").read_bytes() == (cached / "model.safetensors").read_bytes()
    assert sizes == {f"{gpu_bundle.CALCULATOR_BASE}/": sum(p.stat().st_size for p in base.iterdir())}

    def no_pretraining(*args, **kwargs):
        raise AssertionError("pre-trained on the check's machine")

    monkeypatch.setattr(calculator, "ensure_calculator_base", no_pretraining)
    monkeypatch.setattr(calculator, "pretrain_calculator_base", no_pretraining)
    monkeypatch.setattr(gpu_check, "BUNDLE", bundle)
    args, run = dry_run(tmp_path / "run")
    gpu_check.run_section("9. tools with the compiled decode", gpu_check.check_tools, run)
    section = gpu_check.SUMMARY["9. tools with the compiled decode"]
    assert section["status"] == "passed", section
    assert section["findings"]["base"] == str(base)

    monkeypatch.setattr(gpu_check, "BUNDLE", tmp_path / "no-bundle")
    args.cpu = False  # the GPU path's choice of base, on this CPU
    gpu_check.run_section("9. tools with the compiled decode", gpu_check.check_tools, run)
    section = gpu_check.SUMMARY["9. tools with the compiled decode"]
    assert section["status"] == "failed" and "benchmarks/gpu_bundle.py" in section["findings"]["error"]


def test_section_11_runs_the_paged_optimizer_in_a_process_that_its_time_limit_stops(tmp_path):
    """Section 11 (CUDA managed memory, which can hang) runs in a fresh process with a time limit
    from what the budget leaves; cut off, the section is stopped (named in the rerun) and the process
    killed. (Finished, its findings come back: the dry run above, sections["11"].)"""
    import _common
    import gpu_check

    title = "11. paged_adamw_8bit"
    args, run = dry_run(tmp_path)
    run.model("tiny", torch.float32)  # built before the clock is set
    args.budget = run.elapsed() + 2.5  # the section starts; the worker gets 1 s, too little to import torch
    gpu_check.run_section(title, gpu_check.check_paged_adamw, run)
    section = gpu_check.SUMMARY[title]
    assert section["status"] == "stopped" and "did not finish within 1 s" in section["reason"], section
    assert gpu_check.rerun() == gpu_bundle.rerun_command("11") and not _common.CHILDREN


def test_only_2_4_starts_section_4_with_no_tensor_of_section_2_alive(tmp_path, monkeypatch):
    """The rerun `--only 2,4`: section 2's trainer is not kept (section 3 does not run), and when
    section 4 builds its trainer nothing of section 2's is alive (its trainer, every parameter,
    buffer and optimizer state: weak references, no collection by the test), so section 4's
    emulated card holds only its own run."""
    import weakref

    import gpu_check

    import lora_grpo

    trained: list[list] = []  # per trainer: weak references to it and to its tensors, after train()
    alive_at_start: list[int] = []  # per trainer built: how many of the earlier trainers' objects live

    class Watched(lora_grpo.GRPOTrainer):
        def __init__(self, *args, **kwargs):
            alive_at_start.append(sum(ref() is not None for refs in trained for ref in refs))
            super().__init__(*args, **kwargs)

        def train(self, *args, **kwargs):
            result = super().train(*args, **kwargs)
            tensors = [*self.model.parameters(), *self.model.buffers()]
            tensors += [
                t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)
            ]
            trained.append([weakref.ref(self), *map(weakref.ref, tensors)])
            return result

    monkeypatch.setattr(lora_grpo, "GRPOTrainer", Watched)
    _, run = dry_run(tmp_path, only={2, 4})
    run.args.budget = float("inf")
    for title, check in gpu_check.SECTIONS:
        gpu_check.run_section(title, check, run)
    statuses = {gpu_check.section_number(t): v["status"] for t, v in gpu_check.SUMMARY.items()}
    assert statuses[2] == statuses[4] == "passed", gpu_check.SUMMARY
    assert {n for n, v in statuses.items() if v == "skipped"} == set(range(1, 13)) - {2, 4}
    assert len(trained) == 2 and len(trained[0]) > 100  # section 2's trainer, its tensors
    assert alive_at_start == [0, 0]


def test_the_readme_lists_the_sections_in_their_order_with_their_estimates():
    """benchmarks/README.md's device-time table is SECTIONS and ESTIMATES, row by row."""
    import gpu_check

    readme = (BENCHMARKS / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and line.endswith(" s |")]
    numbers = [gpu_check.section_number(title) for title, _ in gpu_check.SECTIONS]
    expected = [
        f"| {k} | {n} | {title.split('. ', 1)[1]} | ~{gpu_check.ESTIMATES[n]} s |"
        for k, (n, (title, _)) in enumerate(zip(numbers, gpu_check.SECTIONS), 1)
    ]
    assert rows == expected
    total = sum(gpu_check.ESTIMATES.values())
    assert f"add up to ~{total} s" in readme.replace("\n", " ")
