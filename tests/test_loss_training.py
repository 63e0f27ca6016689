"""Every loss_type of TRL 1.16, and the entropy options, train the toy: the reward rises in a few steps.
(The values and gradients of each are tested against hand derivations in test_loss_variants.py.)"""

import statistics

import pytest

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.algo.loss import LOSS_TYPES
from lora_grpo.tasks.toy import toy_problems, toy_reward

SETTINGS = {"cispo": {"epsilon_high": 5.0}, "luspo": {"importance_sampling": "sequence"}}


def _run(toy_base, tmp_path, **fields):
    # The default recipe's settings (toy-addition.yaml), 16 steps.
    config = GRPOConfig(
        **{
            "model_name_or_path": toy_base,
            "num_generations": 8,
            "prompts_per_step": 16,
            "max_prompt_length": 16,
            "max_completion_length": 4,
            "micro_batch_size": 128,
            "gradient_checkpointing": False,
            "learning_rate": 1e-3,
            "max_steps": 16,
            "save_steps": 0,
            "beta": 0.04,
            "seed": 0,
            "output_dir": str(tmp_path / "run"),
            "disable_tqdm": True,
            **fields,
        }
    )
    trainer = GRPOTrainer(config, reward_funcs=[toy_reward], train_dataset=toy_problems(512, seed=0))
    trainer.train()
    return trainer


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_each_loss_type_raises_the_reward_on_the_toy(toy_base, tmp_path, loss_type):
    trainer = _run(toy_base, tmp_path, loss_type=loss_type, **SETTINGS.get(loss_type, {}))
    rewards = [m["reward/mean"] for m in trainer.state.log_history]
    first, last = statistics.mean(rewards[:4]), statistics.mean(rewards[-4:])
    assert last > first + 0.05, (loss_type, rewards)


def test_the_adaptive_entropy_bonus_trains_and_logs_its_coefficient(toy_base, tmp_path):
    trainer = _run(
        toy_base,
        tmp_path,
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_target=10.0,
        top_entropy_quantile=0.5,
        off_policy_mask_threshold=0.5,
        num_iterations=2,
    )
    coefs = [m["entropy_coef"] for m in trainer.state.log_history]
    # The toy's entropy is far below a target of 10 nats: the coefficient rises by its delta every step.
    assert coefs == pytest.approx([0.01 + 0.005 * (i + 1) for i in range(len(coefs))])
    assert trainer.state.adaptive_entropy.coef == pytest.approx(coefs[-1])
    rewards = [m["reward/mean"] for m in trainer.state.log_history if "reward/mean" in m]
    assert statistics.mean(rewards[-2:]) > statistics.mean(rewards[:2])


def test_a_reward_model_scores_a_run(tiny_base_dir, tmp_path):
    from helpers import make_trainer
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from lora_grpo.rewards import RewardModel
    from lora_grpo.tasks.toy import make_tokenizer

    tok = make_tokenizer()
    model = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_labels=1,
            pad_token_id=tok.pad_token_id,
        )
    )
    judge = RewardModel(model, tok)
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", max_steps=1, reward_funcs=[judge])
    trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["rewards/LlamaForSequenceClassification/mean"] == pytest.approx(metrics["reward/mean"])
    assert metrics["rewards/LlamaForSequenceClassification/std"] > 0  # it told the completions apart
