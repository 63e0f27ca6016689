"""Start-up checks (startup.py): what a run will really hold against the model's context, each prompt
tokenised once, and nothing probed or sampled by a trainer that only evaluates."""

import pytest

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.tasks.toy import make_tiny_model, make_tokenizer

from conftest import PROMPTS, digit_share, make_trainer


def _model_with_context(context: int):
    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=context)
    return model, tokenizer


def _trainer(model, tokenizer, prompts, tmp_path, **fields):
    config = GRPOConfig(**{"model_name_or_path": "in-memory", "num_generations": 2, "prompts_per_step": 2,
                           "max_steps": 1, "save_steps": 0, "micro_batch_size": 4, "gradient_checkpointing": False,
                           "output_dir": str(tmp_path / "run"), **fields})
    from lora_grpo.model import attach_adapters

    return GRPOTrainer(config, reward_funcs=[digit_share], train_dataset=[{"prompt": p} for p in prompts],
                       model=attach_adapters(model, config), tokenizer=tokenizer)


@pytest.mark.parametrize("context, prompt_chars, new_tokens", [(64, 6, 4), (512, 32, 16)])
def test_a_run_that_fits_is_not_refused_for_the_default_max_prompt_length(tmp_path, context, prompt_chars, new_tokens):
    # The default max_prompt_length (512) plus the completion exceeds both contexts; the prompts
    # as the rollout cuts them do not.
    model, tokenizer = _model_with_context(context)
    prompts = [("%d+1=" % i).ljust(prompt_chars, " ") for i in range(4)]
    trainer = _trainer(model, tokenizer, prompts, tmp_path, max_completion_length=new_tokens)
    assert GRPOConfig.__dataclass_fields__["max_prompt_length"].default == 512
    assert trainer.prompt_lengths["train_dataset"].longest == prompt_chars
    assert trainer.train()["steps"] == 1


def test_a_prompt_that_does_not_fit_is_named(tmp_path):
    prompts = ["1+1=", "2+2=", "x" * 70, "3+3="]
    with pytest.raises(ValueError, match=r"1 of 4 prompts do not fit the model's context of 64 tokens.*prompt 2 \('xxxx"):
        _trainer(*_model_with_context(64), prompts, tmp_path, max_prompt_length=None, max_completion_length=4)
    # Cut by max_prompt_length, the same prompt fits (and the cut is announced once, at start).
    with pytest.warns(UserWarning, match=r"train_dataset: 1 of 4 prompts are longer than max_prompt_length=32"):
        trainer = _trainer(*_model_with_context(64), prompts, tmp_path, max_prompt_length=32, max_completion_length=4)
    assert trainer.prompt_lengths["train_dataset"].longest == 32
    with pytest.raises(ValueError, match=r"max_completion_length=64 leaves no room for a prompt"):
        _trainer(*_model_with_context(64), prompts[:2], tmp_path, max_completion_length=64)


def test_each_prompt_is_tokenised_once_at_start(tiny_base_dir, tmp_path, monkeypatch):
    import lora_grpo.startup as startup

    seen = []
    real = startup.prompt_token_rows
    monkeypatch.setattr(startup, "prompt_token_rows", lambda tok, prompts: seen.extend(prompts) or real(tok, prompts))
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", micro_batch_size="auto",
                           gradient_checkpointing="auto", eval_dataset=PROMPTS[:5])
    trainer.plan_memory()  # the probe reads the lengths measured at start
    train_prompts = [r["prompt"] for r in PROMPTS]
    assert sorted(seen) == sorted(train_prompts + train_prompts[:5])  # train and eval, each once
    assert trainer.memory_plan.tokens[0] == max(len(p) for p in train_prompts)


def test_an_eval_only_trainer_runs_no_memory_probe(tiny_base_dir, tmp_path, monkeypatch):
    import lora_grpo.trainer as trainer_module

    def no_probe(*args, **kwargs):
        raise AssertionError("the memory probe ran for an evaluation")

    monkeypatch.setattr(trainer_module, "plan_run_memory", no_probe)
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", micro_batch_size="auto",
                           gradient_checkpointing="auto", eval_dataset=PROMPTS[:4])
    metrics = trainer.evaluate()
    assert "eval/digit_share" in metrics and trainer.memory_plan is None
    with pytest.raises(AssertionError, match="memory probe ran"):
        trainer.train()  # training does probe, first thing
