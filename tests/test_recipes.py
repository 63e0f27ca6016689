"""Every GPU recipe parses and runs one step with its own settings, on a tiny local model and a
GSM8K-shaped local file in place of the hub model and dataset (nothing is downloaded)."""

import json
from pathlib import Path

import pytest

from lora_grpo.cli import main
from lora_grpo.config import GRPOConfig

RECIPES = sorted(p for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml") if "toy" not in p.name)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_one_step_offline(recipe, tiny_base_dir, tmp_path):
    config = GRPOConfig.from_yaml(recipe)
    assert config.quantization == "4bit" and config.beta > 0 and config.sync_enabled
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(
        json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}) + "\n"
        for i in range(8)
    ))
    overrides = {
        "model_name_or_path": tiny_base_dir, "dataset": str(data), "dataset_config": "null",
        "eval_dataset": str(data), "eval_limit": 3, "num_generations": 2, "prompts_per_step": 2,
        "max_completion_length": 4, "micro_batch_size": 4, "max_steps": 1, "num_epochs": 1,
        "output_dir": str(tmp_path / "run"), "torch_dtype": "float32",
    }
    args = ["train", str(recipe)]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and "accuracy_after" in summary
    saved = GRPOConfig.from_yaml(tmp_path / "run" / "config.yaml")
    assert saved.use_chat_template == config.use_chat_template and saved.reward_funcs == config.reward_funcs
