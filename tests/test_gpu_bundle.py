"""benchmarks/gpu_bundle.py (the wheels a lent GPU machine needs) and benchmarks/gpu_check.py's --cpu dry run."""

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_bundle  # noqa: E402


def test_trimming_keeps_the_python_files_and_the_cuda13_and_cpu_libraries(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.0-py3-none-manylinux_2_24_x86_64.whl"
    files = {
        "bitsandbytes/__init__.py": b"x = 1\n",
        "bitsandbytes/libbitsandbytes_cpu.so": b"c" * 10,
        "bitsandbytes/libbitsandbytes_cuda130.so": b"a" * 10,
        "bitsandbytes/libbitsandbytes_cuda128.so": b"b" * 1000,
        "bitsandbytes/libbitsandbytes_rocm72.so": b"r" * 1000,
    }
    record = (
        "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items())
        + "bitsandbytes-0.0.dist-info/RECORD,,\n"
    )
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("bitsandbytes-0.0.dist-info/RECORD", record)
    gpu_bundle.trim_bitsandbytes(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        kept_record = z.read("bitsandbytes-0.0.dist-info/RECORD").decode()
    assert names == {
        "bitsandbytes/__init__.py",
        "bitsandbytes/libbitsandbytes_cpu.so",
        "bitsandbytes/libbitsandbytes_cuda130.so",
        "bitsandbytes-0.0.dist-info/RECORD",
    }
    assert "cuda128" not in kept_record and "rocm72" not in kept_record and "cuda130" in kept_record


@pytest.mark.slow
def test_the_bundle_downloads_and_fits_the_carry_limit(tmp_path):
    """Needs PyPI (CI has it): the real wheels, trimmed, under the limit the lent machine's carry allows."""
    try:
        sizes = gpu_bundle.build(tmp_path / "bundle", limit_mib=60)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"pip download failed (no PyPI here?): {e}")
    assert {name.split("-")[0] for name in sizes} >= {"bitsandbytes", "datasets", "dill", "multiprocess"}
    bnb = next(size for name, size in sizes.items() if name.startswith("bitsandbytes"))
    assert bnb < 10 * gpu_bundle.MiB  # trimmed: the full wheel is ~43 MB
    assert sum(sizes.values()) <= 60 * gpu_bundle.MiB


@pytest.mark.slow
def test_the_gpu_checks_dry_run_passes_and_writes_its_summary(tmp_path):
    """Every section's code runs on a CPU in a tiny shape; what only CUDA has is skipped and listed."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--cpu", "--steps", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=BENCHMARKS.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    sections = {title.split(".")[0]: v for title, v in summary["sections"].items()}
    assert summary["passed"] and len(sections) == 12
    skipped = {n for n, v in sections.items() if v["status"] == "skipped"}
    assert skipped == {"8"} and sections["8"]["reason"].startswith("CUDA only")  # pytest -m gpu
    for n in ("2", "3", "4", "5", "6", "11"):  # their CUDA-only parts, named
        assert sections[n]["findings"]["skipped_parts"], n
    paged = sections["11"]["findings"]  # from its worker process
    assert paged["optimizer"] == "PagedAdamW8bit" and paged["tensors_moved"] > 0 and len(paged["losses"]) == 3
    assert sections["7"]["findings"]["equal"] is True  # the resumed run's adapters, tensor by tensor
    text = (out / "summary.txt").read_text()
    assert text.count("PASS") == 11 and text.count("SKIP") == 1
    assert (out / "log.txt").read_text().count("\n## ") == 12


def dry_run(tmp_path, only=None):
    """A CPU Run of gpu_check with 60 s of budget left writing its summary to tmp_path, the summary emptied."""
    import argparse

    import gpu_check

    # The budget counts from the process's start: this one (pytest's) started a while ago.
    args = argparse.Namespace(budget=gpu_check.process_age() + 60, only=only, out=str(tmp_path), cpu=True)
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


def test_the_readme_shows_the_commands_the_bundle_prints():
    """The lent machine's commands: python3 -m pip into /tmp/site, no network, no editable install."""
    readme = (BENCHMARKS / "README.md").read_text()
    first = gpu_bundle.first_command()
    assert f"    {first}\n" in readme
    assert f"    {gpu_bundle.rerun_command('4,9,12')}\n" in readme
    assert (
        first.startswith("python3 -m pip install ")
        and "--no-index" in first
        and "--target /tmp/site" in first
    )
    assert " -e ." not in first and "--budget 300" in first
    assert not {"peft", "xxhash"} & {p.split("==")[0] for p in gpu_bundle.PACKAGES}


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
