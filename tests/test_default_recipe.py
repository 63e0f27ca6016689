"""The default recipe (toy-addition.yaml), the README's main job: end to end, on the toy base the session
pre-trained."""

import json
from pathlib import Path

import pytest

from lora_grpo.cli import main

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "toy-addition.yaml"


@pytest.mark.slow
def test_toy_recipe_learns(tmp_path, monkeypatch, toy_base):
    # the toy base the session built (its pretraining is test_toy's and the toy_base fixture's)
    monkeypatch.setenv("LORA_GRPO_CACHE", str(Path(toy_base).parent))
    assert main(["train", str(RECIPE), "--set", f"output_dir={tmp_path / 'run'}"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.15, summary
    assert summary["reward_last"] > summary["reward_first"]
    assert summary["syncs"] >= 1
    # An ordinary run cries no wolf: no health condition held at any step (run/health.py; the planted faults
    # that do raise each their own are in test_health.py).
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    raised = {
        k
        for r in records
        for k, v in r.items()
        if k.startswith("health/") and k != "health/zero_std_streak" and v
    }
    assert not raised, raised
    # micro_batch_size / gradient_checkpointing 'auto': the whole 128-sequence step in one pass, no recompute
    assert (summary["micro_batch_size"], summary["gradient_checkpointing"]) == (128, False), summary
