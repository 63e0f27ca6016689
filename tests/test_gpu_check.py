"""The GPU check's run machinery (benchmarks/gpu_check/) on a CPU: the budget and its deadline, the order of the
sections and the rerun command, what the memory sections start with, the bundled calculator base,
section 11's worker process. (Its whole --cpu dry run: tests/test_gpu_bundle.py.)"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(REPO))

from benchmarks import _common, gpu_bundle  # noqa: E402
from benchmarks.gpu_check import cli as harness_cli  # noqa: E402
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


LANE_SECTIONS = """
import os, re, time
from pathlib import Path
from benchmarks.gpu_check.harness import Section

MEETING = Path(os.environ["MEETING"])


def here(run):
    run.findings["pid"] = os.getpid()
    run.findings["caches"] = [os.environ.get(name) for name in ("LORA_GRPO_CACHE", "TORCHINDUCTOR_CACHE_DIR")]


def meet(run):
    # Each lane's first section marks its process, then waits for the other lane's mark: in lanes run
    # one after another it would wait in vain.
    here(run)
    (MEETING / str(os.getpid())).write_text("")
    waited = time.monotonic() + 60
    while len(list(MEETING.iterdir())) < 2 and time.monotonic() < waited:
        time.sleep(0.05)
    run.expect(len(list(MEETING.iterdir())) == 2, "the other lane ran beside this one")


def dies(run):
    os._exit(3)


def fails(run):
    run.expect(False, "a threshold")


SECTIONS = [
    Section(1, "alone", here, 1),
    Section(2, "meets", meet, 1),
    Section(3, "on 2's result", here, 1, needs=(2,)),
    Section(4, "meets too", meet, 1),
    Section(5, "misses a threshold", fails, 1),
    Section(6, "dies", dies, 1),
    Section(7, "after the death", here, 1),
    Section(8, "{last}", {last_check}, 1),
]
LANES = [(2, 3, 8), (4, 5, 6, 7)]
"""


def lane_run(tmp_path, budget, last="after it", last_check="here"):
    """The check over LANE_SECTIONS (a module of its own, which each lane's process imports) in a fresh
    process: its exit status, its summary.json, its log, the parent's process id and the seconds it took."""
    (tmp_path / "lane_sections.py").write_text(LANE_SECTIONS.format(last=last, last_check=last_check))
    (tmp_path / "meeting").mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path), MEETING=str(tmp_path / "meeting"))
    for name in harness_cli.CACHES:
        env.pop(name, None)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--budget", str(budget)]
    command += ["--out", str(out), "--sections", "lane_sections"]
    started = time.monotonic()
    with subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as child:
        log, _ = child.communicate(timeout=budget + 120)
    summary = json.loads((out / "summary.json").read_text())
    return child.returncode, summary, log, child.pid, time.monotonic() - started


def test_lanes_run_side_by_side_in_processes_of_their_own_and_their_verdicts_join_the_summary(tmp_path):
    """The sections in no lane run alone in the check's process, then each lane in a process of its
    own beside the others (each lane's first section waits for the other's); every lane's verdict
    joins the summary in the list's order. A lane whose process dies fails the section it ran and
    leaves the rest of that lane for the rerun; the other lane and the exit status (the failures)
    are the run's."""
    code, summary, log, parent, _ = lane_run(tmp_path, budget=240)
    sections = summary["sections"]
    status = {name.split(".")[0]: v["status"] for name, v in sections.items()}
    assert list(sections) == [
        "1. alone",
        "2. meets",
        "3. on 2's result",
        "4. meets too",
        "5. misses a threshold",
        "6. dies",
        "7. after the death",
        "8. after it",
    ], log
    assert status == {
        "1": "passed",
        "2": "passed",
        "3": "passed",
        "4": "passed",
        "5": "failed",
        "6": "failed",
        "7": "skipped",
        "8": "passed",
    }, log
    pid = {name.split(".")[0]: v["findings"].get("pid") for name, v in sections.items()}
    assert pid["1"] == parent and pid["2"] == pid["3"] == pid["8"] and pid["4"] not in (parent, pid["2"])
    assert sections["5. misses a threshold"]["findings"]["failures"] == ["a threshold"]
    assert "exit 3" in sections["6. dies"]["reason"] and "while it ran" in sections["6. dies"]["reason"]
    assert sections["7. after the death"]["reason"] == "not started: its lane's process ended (exit 3)"
    assert sections["2. meets"]["lane"] == "lane §2,3,8" and "lane" not in sections["1. alone"]
    assert code == 2 and summary["failed"] == ["5. misses a threshold", "6. dies"]
    assert summary["rerun"] == gpu_bundle.rerun_command("7") and summary["lanes_running"] is None
    assert "[lane §4,5,6,7] FAIL: a threshold" in log
    # The compile caches are the check's own, one set for the parent and its lanes (section 15 reads what
    # section 2 wrote), in its folder, gone with it: a rerun compiles cold, and nothing is written under $HOME.
    caches = {tuple(v["findings"]["caches"]) for v in sections.values() if "caches" in v["findings"]}
    ((ours, inductor),) = caches
    assert ours.endswith("/caches/lora_grpo") and inductor.endswith("/caches/inductor"), caches
    assert Path(ours).parent == Path(inductor).parent and not Path(ours).parent.exists()
    assert Path(ours).is_relative_to(tempfile.gettempdir())


@pytest.mark.parametrize(
    "last, last_check, reason",
    [
        # The lane's own watchdog stops it, 5 s before the check's deadline.
        ("sleeps", "lambda run: time.sleep(600)", "stopped at the deadline"),
        # Stuck in C code holding the GIL, the lane cannot stop itself: the check ends it at its deadline.
        (
            "holds the GIL",
            "lambda run: re.match('(a+)+$', 'a' * 64 + 'b')",
            "its lane's process was ended at the parent's deadline while it ran (lane-2-3-8/log.txt)",
        ),
    ],
    ids=["the lane's deadline", "the check's deadline"],
)
def test_a_lane_running_at_the_deadline_stops_its_section_and_the_rest_of_the_lane_goes_to_the_rerun(
    tmp_path, last, last_check, reason
):
    """The section a lane runs at the deadline is stopped, the ones after it not started, both named
    in the rerun; the other lane's verdicts stand; the exit status counts the failures alone."""
    budget = 40
    code, summary, log, _, wall = lane_run(tmp_path, budget, last=last, last_check=last_check)
    sections = summary["sections"]
    stopped = sections[f"8. {last}"]
    assert stopped["status"] == "stopped" and stopped["reason"] == reason, log
    assert sections["7. after the death"]["status"] == "skipped"
    assert sections["2. meets"]["status"] == sections["3. on 2's result"]["status"] == "passed"
    assert summary["rerun"] == gpu_bundle.rerun_command("7,8") and summary["lanes_running"] is None
    assert code == 2  # sections 5 and 6; a stop is not a failure
    # A correctness bound on the deadlines (no one waited for the section to end), not a timing.
    assert wall < budget + 10, wall


def test_lanes_with_too_little_of_the_budget_left_are_not_started_and_go_to_the_rerun(tmp_path):
    from benchmarks.gpu_check import lanes

    first, second = Section(2, "first", lambda run: None, 1), Section(4, "second", lambda run: None, 1)
    args, run = dry_run(tmp_path, sections=[first, second])
    args.budget = run.elapsed() + lanes.LANE_START_S - 1
    lanes.run_lanes(run, [(2,), (4,)])
    assert [v["status"] for v in run.summary.values()] == ["skipped", "skipped"]
    assert "too little to start its lane" in run.summary["2. first"]["reason"] and not _common.CHILDREN
    assert run.rerun() == gpu_bundle.rerun_command("2,4")


def test_the_lanes_fit_the_plan_one_command_of_the_budget_by_the_estimates():
    """Each section in one lane at most; the lanes' sections after the alone ones in the list, each
    lane in its list order; what a section needs in its own lane before it (or alone with it); the
    estimates (the alone sections' sum, the longest lane's, and the start-ups) within one --budget."""
    from benchmarks.gpu_check.sections import LANES

    in_lanes = [number for lane in LANES for number in lane]
    assert len(in_lanes) == len(set(in_lanes))
    order = [section.number for section in SECTIONS]
    alone = [n for n in order if n not in in_lanes]
    assert order == alone + in_lanes
    for lane in LANES:
        for k, number in enumerate(lane):
            assert all(need in lane[:k] for need in BY_NUMBER[number].needs), number
    for number in alone:
        assert all(need in alone[: alone.index(number)] for need in BY_NUMBER[number].needs), number
    assert harness.planned_s(SECTIONS, LANES) <= gpu_bundle.FIRST_BUDGET, harness.planned_s(SECTIONS, LANES)


def test_the_unmeasured_sections_run_first_and_a_rerun_of_section_3_brings_section_2(tmp_path):
    """What the first GPU run left unmeasured (12 against TRL, 2 and 4 after the memory fix) runs
    before what passed there; section 3 runs right after section 2, on its trained model."""
    order = [section.number for section in SECTIONS]
    # What the first GPU run left unmeasured first: 12, the profile (14) and the weight forms (13) on its step.
    assert sorted(order) == list(range(1, 16)) and order[:6] == [12, 14, 13, 2, 3, 15]
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
        if "--ours-hangs" in sys.argv:
            time.sleep(600)
    print("RESULT " + json.dumps(result))
else:
    step("trl", 1, 40.0)
    step("trl", 2, 8.0)
    if "--fail" in sys.argv:
        sys.exit("TRL's worker broke")
    if "--trl-ends" in sys.argv:
        print("RESULT " + json.dumps({"trl": dict(steps_timed=1, step_s=8.0, peak_rss_mib=90.0)}))
        sys.exit(0)
    if "--trl-untimed" in sys.argv:  # stopped itself after its first step: no time for a second
        print("RESULT " + json.dumps({"trl": dict(steps_timed=0, step_s=float("nan"), peak_rss_mib=90.0)}))
        sys.exit(0)
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


def test_section_12_runs_trls_worker_when_ours_ends_at_its_limit(tmp_path, monkeypatch):
    """Ours killed at its cap (after its first variant) leaves TRL's worker its own run: both recorded, the
    section failed naming ours' cap (a cap too small for the work is a failure; the budget's end, a stop)."""
    from benchmarks.gpu_check import vs_trl

    monkeypatch.setattr(
        vs_trl,
        "worker_command",
        lambda *args: [sys.executable, "-c", PEER_STUB, *args, "--ours-hangs", "--trl-ends"],
    )
    monkeypatch.setattr(vs_trl, "CAPS", {"ours": 2.0, "trl": 20.0})  # × 3 in the dry run
    args, run = dry_run(tmp_path)
    args.budget = float("inf")
    run_section(BY_NUMBER[12], run)
    section = run.summary[BY_NUMBER[12].name]
    failures = section["findings"]["failures"]
    assert section["status"] == "failed" and "the ours run finished within 6 s" in failures, section
    found = section["findings"]
    assert found["ours"]["step_s"] == 2.0 and found["trl"] == {
        "steps_timed": 1,
        "step_s": 8.0,
        "peak_rss_mib": 90.0,
    }
    assert found["ours_over_trl"]["defaults"]["step_s"] == 0.25 and not _common.CHILDREN


def test_section_12_stops_for_the_rerun_when_a_worker_had_time_for_its_first_step_alone(
    tmp_path, monkeypatch
):
    """A worker that ended well but had no time for a step after its first (TRL's first step on the GPU near its
    cap) ran out of time, not into a fault: the section is stopped and rerun, not failed; its NaN figures make no
    ratio, and summary.json stays JSON to strict readers (NaN as null)."""
    from benchmarks.gpu_check import vs_trl

    monkeypatch.setattr(
        vs_trl, "worker_command", lambda *args: [sys.executable, "-c", PEER_STUB, *args, "--trl-untimed"]
    )
    args, run = dry_run(tmp_path)
    args.budget = float("inf")
    run_section(BY_NUMBER[12], run)
    section = run.summary[BY_NUMBER[12].name]
    assert section["status"] == "stopped", section
    assert section["reason"] == "trl stopped after the first step: too little of its worker's time left"
    assert run.rerun() == gpu_bundle.rerun_command("12")
    assert section["findings"]["ours_over_trl"]["defaults"] == {"peak_rss_mib": 100.0 / 90.0}
    harness.write_summary(run, 1.0)

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    written = json.loads((Path(args.out) / "summary.json").read_text(), parse_constant=refuse)
    assert written["sections"][BY_NUMBER[12].name]["findings"]["trl"]["step_s"] is None


def test_a_worker_stops_itself_after_the_step_that_would_leave_too_little_of_its_time():
    from benchmarks.gpu_check import vs_trl

    age = harness.process_age()
    steps = vs_trl.Steps("trl", 16, deadline=age + 100)
    steps.add(step_s=80.0, tokens=1)  # the first (ours: the decode's compile) does not predict the next
    assert steps.more()
    steps.add(step_s=10.0, tokens=1)
    assert steps.more()
    steps.add(step_s=80.0, tokens=1)
    assert not steps.more()
    assert vs_trl.Steps("ours", 16, deadline=None).more()
    late = vs_trl.Steps("ours", 16, deadline=age + vs_trl.FIRST_RESERVE - 1)
    late.add(step_s=1.0, tokens=1)
    assert not late.more()  # after the first step alone: FIRST_RESERVE must be left


def test_a_second_variant_starts_only_where_its_load_retrace_and_two_steps_fit():
    from benchmarks.gpu_check import vs_trl

    first = {"first_step_s": 50.0, "step_s": 6.0}  # need LOAD_S + 0.3 × 50 + 2 × 6 = 34 s
    age = harness.process_age()
    assert vs_trl.room_for_another(age + 40, first)
    assert not vs_trl.room_for_another(age + 30, first)
    assert vs_trl.room_for_another(None, first)
    # Short steps: after its first step the variant wants FIRST_RESERVE left, more than two steps (it was let in
    # on two, then stopped after its first: no timed step).
    short = {"first_step_s": 50.0, "step_s": 2.5}  # LOAD_S + 15 + max(10, 5) = 32 s
    assert not vs_trl.room_for_another(age + 30, short) and vs_trl.room_for_another(age + 34, short)
    untimed = {"first_step_s": 50.0, "step_s": float("nan")}  # no step after the first: FIRST_RESERVE
    assert vs_trl.room_for_another(age + 15, untimed) and not vs_trl.room_for_another(age + 5, untimed)


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
    """benchmarks/README.md's device-time table is sections.py's list, row by row, with where each
    section runs (alone, or its lane), and the page gives the sums the plan computes."""
    from benchmarks.gpu_check.sections import LANES

    readme = (BENCHMARKS / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and line.endswith(" s |")]
    lane_of = {number: k for k, lane in enumerate(LANES, 1) for number in lane}
    expected = [
        f"| {k} | {s.number} | {s.title} | {f'lane {lane_of[s.number]}' if s.number in lane_of else 'alone'} "
        f"| ~{s.estimate_s:g} s |"
        for k, s in enumerate(SECTIONS, 1)
    ]
    assert rows == expected
    text = readme.replace("\n", " ")
    total = sum(section.estimate_s for section in SECTIONS)
    assert f"add up to ~{total:g} s" in text
    assert f"~{harness.planned_s(SECTIONS, LANES):g} s of the first command" in text


def test_workers_decide_their_allocator_as_fresh_processes_and_a_users_variable_reaches_them(
    cuda_build, monkeypatch
):
    """The allocator variable lora_grpo set in the check's process (expandable segments) is not handed
    to a worker or a lane: ours sets it again when it imports lora_grpo, and TRL's worker runs torch's
    default, as its users do (section 12's memory figures); a variable the user set reaches every one."""
    from lora_grpo import device

    # No allocator variable set on a CUDA build (cuda_build): lora_grpo sets its own.
    assert device.use_expandable_segments() is True
    assert "PYTORCH_CUDA_ALLOC_CONF" not in harness.worker_options()["env"]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # this process keeps it
    environ = dict(os.environ)
    harness.without_our_allocator(environ)  # what TRL's worker does to its own environment
    assert "PYTORCH_CUDA_ALLOC_CONF" not in environ

    monkeypatch.setattr(device, "_ALLOCATOR", {"set": False, "why": "not decided"})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert device.use_expandable_segments() is False
    assert harness.worker_options()["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert (
        harness.without_our_allocator(dict(os.environ))["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    )
