import json

import pytest
import torch

from lora_grpo.cli import main


@pytest.fixture
def recipe(tiny_base_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(8)))
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"model_name_or_path: {tiny_base_dir}\n"
        f"dataset: {data}\n"
        f"eval_dataset: {data}\n"
        "prompt_template: 'Q: {question} A:'\n"
        "reward_funcs:\n  - accuracy\n  - name: length\n    kwargs: {target_length: 2}\n"
        "num_generations: 2\nprompts_per_step: 2\nmax_completion_length: 4\nmax_steps: 2\nsave_steps: 0\n"
        "gradient_checkpointing: false\nlora_r: 4\nlearning_rate: 1e-3\n"
        f"output_dir: {tmp_path / 'run'}\n"
    )
    return path


def test_train_from_recipe_with_overrides(recipe, tmp_path, capsys):
    assert main(["train", str(recipe), "--set", "max_steps=3", "--set", "beta=0.1"]) == 0
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    assert "accuracy_before" in summary and "accuracy_after" in summary
    saved = (run / "config.yaml").read_text()
    assert "max_steps: 3" in saved and "beta: 0.1" in saved
    out = capsys.readouterr().out
    assert "step 3/3" in out and "eval after training" in out


def test_config_errors_exit_2_with_the_field_named(recipe, capsys):
    assert main(["train", str(recipe), "--set", "lora_rank=8"]) == 2
    assert "did you mean 'lora_r'" in capsys.readouterr().err
    assert main(["train", str(recipe), "--set", "num_generations=1"]) == 2
    assert "num_generations=1" in capsys.readouterr().err


def test_help_lists_every_config_field(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for field in ["ref_sync_alpha", "ref_sync_mode", "micro_batch_size", "loss_type"]:
        assert field in out


def test_plot_and_merge(recipe, tmp_path, tiny_base_dir):
    pytest.importorskip("matplotlib")
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "run"
    assert main(["plot", str(run)]) == 0
    assert (run / "metrics.png").stat().st_size > 1000

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert main(["merge", str(run / "adapter"), "--recipe", str(recipe), "--out", str(out)]) == 0
    x = torch.tensor([[5, 6, 7, 8]])
    merged = AutoModelForCausalLM.from_pretrained(out)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(run / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, peft(input_ids=x).logits, rtol=0, atol=1e-5)
