"""The GPU check's run machinery (benchmarks/gpu_check/) on a CPU: the budget and its deadline, the order of the
sections and the rerun command, what the memory sections start with, the bundled calculator base,
section 11's worker process. (Its whole --cpu dry run: tests/test_gpu_bundle.py.)"""

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(REPO))

from benchmarks import _common, gpu_bundle  # noqa: E402
from benchmarks.gpu_check import harness, paged_adamw, tools  # noqa: E402
from benchmarks.gpu_check.decode import check_decode  # noqa: E402
from benchmarks.gpu_check.harness import Section, run_section  # noqa: E402
from benchmarks.gpu_check.sections import SECTIONS  # noqa: E402

BY_NUMBER = {section.number: section for section in SECTIONS}


def dry_run(tmp_path, only=None, steps=1, sections=SECTIONS):
    """A CPU Run of the check with 60 s of budget left writing its summary to tmp_path."""
    import argparse

    # The budget counts from the process's start: this one (pytest's) started a while ago.
    args = argparse.Namespace(
        budget=harness.process_age() + 60, only=only, out=str(tmp_path), cpu=True, steps=steps
    )
    return args, harness.Run(args, torch.device("cpu"), str(tmp_path), sections)


def test_a_section_past_the_budget_is_skipped_and_a_missed_threshold_fails_after_the_rest(tmp_path):
    ran = []

    def check(run):
        run.expect(False, "a threshold")
        ran.append("after")

    first, late = Section(1, "thresholds", check, 1), Section(2, "late", lambda run: ran.append("late"), 1)
    args, run = dry_run(tmp_path, sections=[first, late])
    run_section(first, run)
    args.budget = 0.0
    run_section(late, run)
    assert ran == ["after"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    first, late = summary["sections"]["1. thresholds"], summary["sections"]["2. late"]
    assert first["status"] == "failed" and first["findings"]["failures"] == ["a threshold"]
    assert late["status"] == "skipped" and "budget" in late["reason"]
    assert summary["failed"] == ["1. thresholds"] and summary["skipped"] == ["2. late"]


def test_the_running_section_is_named_and_a_budget_skip_is_offered_as_the_rerun(tmp_path):
    seen = []

    def check(run):
        seen.append(json.loads((tmp_path / "summary.json").read_text())["running"]["section"])

    first, late = Section(1, "first", check, 1), Section(4, "late", check, 1)
    args, run = dry_run(tmp_path, sections=[first, late])
    run_section(first, run)
    args.budget = 0.0
    run_section(late, run)
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
sys.path.insert(0, {repo!r})
from benchmarks.gpu_check.cli import main
from benchmarks.gpu_check.harness import Section
sections = [
    Section(1, "devices", lambda run: None, 1),
    Section(5, "sleeps past the deadline", lambda run: time.sleep(600), 1),
    Section(9, "after it", lambda run: None, 1),
]
sys.exit(main(["--cpu", "--budget", "{budget}", "--out", {out!r}], sections))
"""


def test_the_deadline_stops_the_running_section_writes_the_summary_and_exits_0(tmp_path):
    """--budget is a hard deadline from the process's start: a section still running at it is
    recorded as stopped, the ones after it as not started, both in the rerun command; exit 0."""
    budget, out = 30, tmp_path / "out"
    script = DEADLINE_RUN.format(repo=str(REPO), budget=budget, out=str(out))
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


def test_the_unmeasured_sections_run_first_and_a_rerun_of_section_3_brings_section_2(tmp_path):
    """What the first GPU run left unmeasured (12 against TRL, 2 and 4 after the memory fix) runs
    before what passed there; section 3 runs right after section 2, on its trained model."""
    order = [section.number for section in SECTIONS]
    # What the first GPU run left unmeasured first: 12, the profile (14) and the weight forms (13) on its step.
    assert sorted(order) == list(range(1, 16)) and order[:6] == [12, 14, 13, 2, 3, 4]
    assert all(section.estimate_s > 0 for section in SECTIONS)
    assert BY_NUMBER[3].check is check_decode and BY_NUMBER[3].needs == (2,)
    args, run = dry_run(tmp_path)
    args.budget = 0.0  # section 3 past the budget: its rerun needs section 2 again, run before it
    run_section(BY_NUMBER[3], run)
    assert run.rerun() == gpu_bundle.rerun_command("2,3")


def test_on_a_gpu_a_section_longer_than_the_budget_left_is_left_whole_for_the_rerun(tmp_path):
    """A section whose estimate exceeds what the budget leaves is not started (the deadline would cut
    it and waste its seconds): skipped, in the rerun command; a shorter one after it still runs."""
    ran = []
    long = Section(4, "long", lambda run: ran.append(4), 1e6)
    short = Section(1, "short", lambda run: ran.append(1), 1)
    args, run = dry_run(tmp_path, sections=[long, short])
    run.cuda = True  # the GPU rule, on this CPU
    run_section(long, run)
    run_section(short, run)
    assert ran == [1]
    assert run.summary[long.name]["status"] == "skipped" and "needed" in run.summary[long.name]["reason"]
    assert run.rerun() == gpu_bundle.rerun_command("4")


def test_a_section_whose_needed_section_was_left_for_the_rerun_goes_with_it(tmp_path):
    ran = []
    first = Section(2, "first", lambda run: ran.append(2), 1e6)
    then = Section(3, "then", lambda run: ran.append(3), 1, needs=(2,))
    args, run = dry_run(tmp_path, sections=[first, then])
    run.cuda = True  # the GPU rule, on this CPU
    run_section(first, run)
    run_section(then, run)
    assert ran == [] and run.summary[then.name]["status"] == "skipped"
    assert run.rerun() == gpu_bundle.rerun_command("2,3")


def test_section_9_loads_the_bundled_calculator_base_and_never_pretrains(tmp_path, monkeypatch):
    """The bundle carries the base pre-trained here; gpu_check loads it by path (no pre-training on
    the lent machine's CPU), and without it a GPU run fails the section naming the fix."""
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
    monkeypatch.setattr(tools, "BUNDLE", bundle)
    args, run = dry_run(tmp_path / "run")
    run_section(BY_NUMBER[9], run)
    section = run.summary[BY_NUMBER[9].name]
    assert section["status"] == "passed", section
    assert section["findings"]["base"] == str(base)

    monkeypatch.setattr(tools, "BUNDLE", tmp_path / "no-bundle")
    args.cpu = False  # the GPU path's choice of base, on this CPU
    run_section(BY_NUMBER[9], run)
    section = run.summary[BY_NUMBER[9].name]
    assert section["status"] == "failed" and "benchmarks/gpu_bundle.py" in section["findings"]["error"]


def test_section_11_runs_the_paged_optimizer_in_a_process_that_its_time_limit_stops(tmp_path):
    """Section 11 (CUDA managed memory, which can hang) runs in a fresh process with a time limit
    from what the budget leaves; cut off, the section is stopped (named in the rerun) and the process
    killed. (Finished, its findings come back: the dry run above, sections["11"].)"""
    args, run = dry_run(tmp_path)
    run.model("tiny", torch.float32)  # built before the clock is set
    args.budget = run.elapsed() + 2.5  # the section starts; the worker gets 1 s, too little to import torch
    assert BY_NUMBER[11].check is paged_adamw.check_paged_adamw
    run_section(BY_NUMBER[11], run)
    section = run.summary[BY_NUMBER[11].name]
    assert section["status"] == "stopped" and "did not finish within 1 s" in section["reason"], section
    assert run.rerun() == gpu_bundle.rerun_command("11") and not _common.CHILDREN


PEER_STUB = """
import json, sys, time
which = sys.argv[sys.argv.index("--peer-worker") + 1]
def step(variant, number, seconds):
    figures = dict(variant=variant, step=number, step_s=seconds, generation_s=0.5 * seconds,
                   scoring_s=0.1 * seconds, update_s=0.4 * seconds, tokens=64)
    print("STEP " + json.dumps(figures), flush=True)
if which == "ours":
    result = {}
    for variant in ("ours", "ours_checkpointing"):
        for number, seconds in ((1, 50.0), (2, 1.0), (3, 3.0)):
            step(variant, number, seconds)
        result[variant] = dict(steps_timed=2, step_s=2.0, peak_rss_mib=100.0)
        print("VARIANT " + json.dumps(dict(variant=variant, **result[variant])), flush=True)
    print("RESULT " + json.dumps(result))
else:
    step("trl", 1, 40.0)
    step("trl", 2, 8.0)
    if "--fail" in sys.argv:
        sys.exit("TRL's worker broke")
    time.sleep(600)
"""


def test_section_12_keeps_the_first_workers_figures_when_the_second_times_out(tmp_path, monkeypatch):
    """Each worker's figures are recorded as it ends; TRL's worker, killed at what the budget left
    it, keeps ours and gives its own finished steps (read from the lines it printed), and the
    section is stopped, named in the rerun command (the workers: a stub printing their protocol)."""
    from benchmarks.gpu_check import vs_trl

    monkeypatch.setattr(vs_trl, "worker_command", lambda *args: [sys.executable, "-c", PEER_STUB, *args])
    args, run = dry_run(tmp_path)
    run.model("tiny", torch.float32)  # built before the clock is set
    args.budget = run.elapsed() + 12  # the TRL worker gets what the stub of ours leaves, under its cap
    run_section(BY_NUMBER[12], run)
    section = run.summary[BY_NUMBER[12].name]
    assert section["status"] == "stopped" and "the trl run stopped at the deadline" in section["reason"], (
        section
    )
    found = section["findings"]
    assert found["ours"] == {"steps_timed": 2, "step_s": 2.0, "peak_rss_mib": 100.0}
    assert found["ours_checkpointing"]["step_s"] == 2.0
    trl = found["trl"]
    assert trl["partial"] and trl["steps_timed"] == 1 and trl["first_step_s"] == 40.0 and trl["step_s"] == 8.0
    assert trl["generation_s"] == 4.0 and trl["update_s"] == 3.2
    assert run.rerun() == gpu_bundle.rerun_command("12") and not _common.CHILDREN


def test_section_12_fails_naming_a_worker_that_broke_and_keeps_the_others_figures(tmp_path, monkeypatch):
    from benchmarks.gpu_check import vs_trl

    monkeypatch.setattr(
        vs_trl, "worker_command", lambda *args: [sys.executable, "-c", PEER_STUB, *args, "--fail"]
    )
    args, run = dry_run(tmp_path)
    args.budget = float("inf")
    run_section(BY_NUMBER[12], run)
    section = run.summary[BY_NUMBER[12].name]
    assert section["status"] == "failed" and "TRL's worker broke" in section["findings"]["trl_error"]
    assert section["findings"]["ours"]["step_s"] == 2.0
    assert "every worker ran (trl failed)" in section["findings"]["failures"]


def test_a_worker_stops_itself_after_the_step_that_would_leave_too_little_of_its_time():
    from benchmarks.gpu_check import vs_trl

    age = harness.process_age()
    steps = vs_trl.Steps("trl", 16, deadline=age + 100)
    steps.add(step_s=10.0, tokens=1)
    assert steps.more()
    steps.add(step_s=80.0, tokens=1)
    assert not steps.more()
    assert vs_trl.Steps("ours", 16, deadline=None).more()


def test_only_2_4_starts_section_4_with_no_tensor_of_section_2_alive(tmp_path, monkeypatch):
    """The rerun `--only 2,4`: section 2's trainer is not kept (section 3 does not run), and when
    section 4 builds its trainer nothing of section 2's is alive (its trainer, every parameter,
    buffer and optimizer state: weak references, no collection by the test), so section 4's
    emulated card holds only its own run."""
    import weakref

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
    for section in SECTIONS:
        run_section(section, run)
    statuses = {int(name.split(".")[0]): v["status"] for name, v in run.summary.items()}
    assert statuses[2] == statuses[4] == "passed", run.summary
    assert {n for n, v in statuses.items() if v == "skipped"} == set(range(1, 16)) - {2, 4}
    assert len(trained) == 2 and len(trained[0]) > 100  # section 2's trainer, its tensors
    assert alive_at_start == [0, 0]


def test_the_readme_lists_the_sections_in_their_order_with_their_estimates():
    """benchmarks/README.md's device-time table is sections.py's list, row by row."""
    readme = (BENCHMARKS / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and line.endswith(" s |")]
    expected = [f"| {k} | {s.number} | {s.title} | ~{s.estimate_s:g} s |" for k, s in enumerate(SECTIONS, 1)]
    assert rows == expected
    total = sum(section.estimate_s for section in SECTIONS)
    assert f"add up to ~{total:g} s" in readme.replace("\n", " ")
