"""The GPU check's section 15 (compile once per machine) on a CPU: its place in the order (after
section 2, whose compile it finds) and its --cpu stand-in end to end: inductor's artifacts written to
a fresh lora_grpo cache and read back by a fresh process."""

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu_check import harness  # noqa: E402
from benchmarks.gpu_check.compile_cache import check_compile_cache  # noqa: E402
from benchmarks.gpu_check.sections import SECTIONS  # noqa: E402

BY_NUMBER = {section.number: section for section in SECTIONS}


def test_section_15_runs_after_section_2_and_its_stand_in_writes_and_reads_the_cache(tmp_path, monkeypatch):
    from benchmarks.gpu_check.sections import LANES

    assert BY_NUMBER[15].check is check_compile_cache
    # a fresh process finds what section 2 compiled in this run: after it, in the same lane's process
    # (section 15 reads that process's summary to know that section 2 compiled)
    lane = next(lane for lane in LANES if 15 in lane)
    assert 2 in lane and lane.index(2) < lane.index(15)
    # the suite keeps the cache off (conftest); the section turns it on in a cache of its own
    monkeypatch.setenv("LORA_GRPO_COMPILE_CACHE", "0")
    args = argparse.Namespace(budget=float("inf"), only={15}, out=str(tmp_path / "out"), cpu=True, steps=1)
    run = harness.Run(args, torch.device("cpu"), str(tmp_path), SECTIONS)
    harness.run_section(BY_NUMBER[15], run)
    result = run.summary[BY_NUMBER[15].name]
    assert result["status"] == "passed", result
    assert result["findings"]["loaded_artifacts"] >= 1 and result["findings"]["skipped_parts"]
    assert not list(tmp_path.glob("compile-cache-*")), "the stand-in's cache is removed"
