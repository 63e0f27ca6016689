"""Training with tools: the trainer's multi-turn rollouts on a 4-bit base with a moving reference, the
tool metrics and conversation in the logs, an environment's reward, and the TRL front door's tools=."""

import json

import pytest
from helpers import PROMPTS, Counter

from lora_grpo import GRPOConfig, GRPOTrainer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def _chat(n):
    return [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in PROMPTS[:n]
    ]


def _calls_reward(completions, **kwargs):
    """1 for a completion that called a tool (its messages hold a tool reply): what GRPO would raise."""
    return [float(any(m.get("role") == "tool" for m in c)) for c in completions]


def _config(base, out, **fields):
    return GRPOConfig(
        **{
            "model_name_or_path": base,
            "num_generations": 4,
            "prompts_per_step": 2,
            "max_completion_length": 48,
            "max_steps": 2,
            "save_steps": 0,
            "micro_batch_size": 8,
            "gradient_checkpointing": False,
            "output_dir": str(out),
            "learning_rate": 1e-3,
            **fields,
        }
    )


def test_a_4bit_run_with_tools_and_soft_syncs_trains_on_its_own_tokens_only(
    qwen_tool_base_dir, tmp_path, monkeypatch
):
    import lora_grpo.update as update_module

    masks = []
    real = update_module.grpo_loss

    def spy(logp, old, ref, adv, mask, **kw):
        masks.append(mask.detach().clone())
        return real(logp, old, ref, adv, mask, **kw)

    monkeypatch.setattr(update_module, "grpo_loss", spy)
    config = _config(
        qwen_tool_base_dir,
        tmp_path / "run",
        quantization="4bit",
        torch_dtype="float32",
        beta=0.04,
        ref_sync_steps=1,
        ref_sync_alpha=0.6,
        tools=["test_tool_training:add"],
        log_completions=True,
        max_tool_calling_iterations=2,
        temperature=1.5,
    )
    trainer = GRPOTrainer(config, reward_funcs=[_calls_reward], train_dataset=_chat(8))
    steps = []
    original = trainer.generation_round

    def remember(rows):
        out = original(rows)
        steps.append(trainer.sampler.environments)
        return out

    trainer.generation_round = remember
    trainer.train()
    history = trainer.state.log_history
    assert all("tools/call_frequency" in m and "tools/failure_frequency" in m for m in history)
    assert [m.get("sync/reason") for m in history] == ["steps", "steps"]  # the reference moves with tools too
    records = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert all(
        isinstance(r["completion"], list) and r["completion"][0]["role"] == "assistant" for r in records
    )
    assert masks  # the loss saw the completions; where a tool replied, those tokens were masked out
    replied = [r for r in records if any(m["role"] == "tool" for m in r["completion"])]
    if replied:  # a random tiny model calls rarely; when it did, its reply is context, not action
        assert any(int(m.sum()) < m.numel() for m in masks)


def test_an_environment_is_reset_per_completion_and_its_reward_is_scored(qwen_tool_base_dir, tmp_path):
    config = _config(
        qwen_tool_base_dir, tmp_path / "run", max_steps=1, eval_on_start=False, eval_on_end=False
    )
    trainer = GRPOTrainer(
        config,
        reward_funcs=[_calls_reward],
        train_dataset=_chat(8),
        eval_dataset=_chat(3),
        environment_factory=Counter,
    )
    assert trainer.reward_names == ["_calls_reward", "Counter"]  # get_reward joins the rewards, as in TRL
    trainer.train()
    envs = trainer.sampler.environments
    assert len(envs) == 8 and all(isinstance(e, Counter) and e.answer for e in envs)
    assert "rewards/Counter/mean" in trainer.state.log_history[0]
    metrics = (
        trainer.evaluate()
    )  # greedy, one completion per prompt, with the tools and the rows' environments
    assert len(trainer.sampler.environments) == 3 and all(e.answer for e in trainer.sampler.environments)
    assert 0.0 <= metrics["eval/tools/calling_fraction"] <= 1.0
    assert metrics["eval/tools/call_frequency"] >= metrics["eval/tools/calling_fraction"]
    assert (
        metrics["eval/_calls_reward"] == metrics["eval/tools/calling_fraction"]
    )  # same thing, counted twice


class Tagged:
    """An environment whose reward is its row's tag: which row's instance scored a completion shows."""

    def reset(self, tag, **row):
        self.tag = tag

    def get_reward(self):
        return float(self.tag)


def test_an_eval_of_several_parts_scores_each_with_its_own_environments(qwen_tool_base_dir, tmp_path):
    """The eval samples its prompts in parts of the training rollout's rows (here 2 prompts × G 4 = 8); every
    part was sampled before any was scored, so each was scored with the last part's environments (wrong
    rewards), and a shorter last part raised (found in review)."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "tag": str(i)} for i in range(20)]
    config = _config(
        qwen_tool_base_dir, tmp_path / "run", max_steps=1, eval_on_start=False, eval_on_end=False
    )
    trainer = GRPOTrainer(
        config,
        reward_funcs=[_calls_reward],
        train_dataset=rows,
        eval_dataset=rows,
        environment_factory=Tagged,
    )
    assert trainer.evaluate()["eval/Tagged"] == sum(range(20)) / 20  # parts of 8, 8 and 4 rows
    assert trainer.evaluate(rows[:16])["eval/Tagged"] == sum(range(16)) / 16


def test_an_environment_without_tools_renders_prompts_without_a_tools_list(qwen_tool_base_dir, tmp_path):
    """An environment with reset and get_reward alone has no tool schemas: the prompts were rendered with
    tools=[], which Llama 3's template takes as defined (its tool-calling preamble in every prompt: 397 tokens
    for TRL's 109); TRL passes None (found in review)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_tool_base_dir)
    tokenizer.chat_template = (  # as Llama 3.x's: a tools list, even empty, is rendered
        "{% if tools is not none %}TOOLS {{ tools | length }}\n{% endif %}"
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "tag": str(i)} for i in range(4)]
    config = _config(qwen_tool_base_dir, tmp_path / "run", max_steps=1)
    trainer = GRPOTrainer(
        config,
        reward_funcs=[_calls_reward],
        train_dataset=rows,
        environment_factory=Tagged,
        tokenizer=tokenizer,
    )
    assert trainer.train_dataset[0]["prompt"] == "q0\n"


class Briefs:
    """An environment that gives the task in reset()'s text."""

    def reset(self, **row):
        return " the task"

    def get_reward(self):
        return 0.0


def test_a_reset_text_with_text_prompts_is_refused_not_dropped(qwen_tool_base_dir, tmp_path):
    """reset()'s text joins a chat prompt's last message (TRL); with text prompts it was silently dropped, and the
    policy trained on prompts without the task (found in review)."""
    from lora_grpo.run.failures import StepFailed

    config = _config(
        qwen_tool_base_dir, tmp_path / "run", max_steps=1, eval_on_start=False, eval_on_end=False
    )
    rows = [{"prompt": f"q{i}"} for i in range(4)]
    trainer = GRPOTrainer(config, train_dataset=rows, environment_factory=Briefs)
    with pytest.raises(
        StepFailed,
        match=r"the environment \(in the rollout\) raised ValueError: an environment's reset\(\) returned text",
    ):
        trainer.train()


def test_the_trl_front_door_takes_tools(qwen_tool_base_dir, tmp_path):
    from datasets import Dataset

    from lora_grpo.trl import GRPOConfig as TRLConfig
    from lora_grpo.trl import GRPOTrainer as TRLTrainer

    args = TRLConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=32,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        max_tool_calling_iterations=1,
    )
    trainer = TRLTrainer(
        model=qwen_tool_base_dir,
        reward_funcs=_calls_reward,
        args=args,
        train_dataset=Dataset.from_list(_chat(8)),
        tools=[add],
    )
    trainer.train()
    assert trainer.state.global_step == 1 and "tools/call_frequency" in trainer.state.log_history[0]


@pytest.mark.parametrize("template", ["plain"])
def test_a_template_that_cannot_render_tools_is_refused_at_start(tiny_base_dir, tmp_path, template):
    config = _config(tiny_base_dir, tmp_path / "run", tools=["test_tool_training:add"])
    with pytest.raises(ValueError, match="tool"):
        GRPOTrainer(config, reward_funcs=[_calls_reward], train_dataset=_chat(8))
