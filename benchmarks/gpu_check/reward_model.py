"""Section 10, reward model: a tiny sequence-classification RewardModel in a 4-bit run with 'auto'
sizes: on the run's device and dtype, finite rewards, its scoring forwards within the plan's rows."""

from __future__ import annotations

import math

import torch

from benchmarks._common import QWEN2_SHAPES
from benchmarks.gpu_check.common import tiny_config, tiny_prompts
from benchmarks.gpu_check.harness import Run


def check_reward_model(run: Run) -> None:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from lora_grpo import GRPOTrainer
    from lora_grpo.rewards import RewardModel

    path = run.model("tiny", torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(f"{path}/tokenizer")
    reward_path = run.root / "reward"
    torch.manual_seed(1)
    spec = Qwen2Config(
        **QWEN2_SHAPES["tiny"], num_labels=1, pad_token_id=0, eos_token_id=1, bos_token_id=None
    )
    Qwen2ForSequenceClassification(spec).save_pretrained(reward_path)  # float32 on disk
    scorer = RewardModel(str(reward_path), tokenizer=tokenizer)
    seen: list[int] = []
    scorer.model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(
            int((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[0])
        ),
        with_kwargs=True,
    )
    config = tiny_config(
        path, str(run.root / "reward-run"), micro_batch_size="auto", max_steps=2, save_steps=0
    )
    trainer = GRPOTrainer(config, reward_funcs=[scorer], train_dataset=tiny_prompts())
    trainer.hooks.append(
        lambda event, _t, **_: seen.clear() if event == "train_begin" else None
    )  # the probe's are planned
    trainer.train()
    plan = trainer.memory_plan
    dtype = trainer.model.get_input_embeddings().weight.dtype
    parameter = next(scorer.model.parameters())
    means = [m.get(f"rewards/{scorer.__name__}/mean") for m in trainer.state.log_history]
    run.findings.update(
        {
            "rows_per_forward": sorted(set(seen)),
            "plan_forward_rows": plan.forward_rows if plan else None,
            "reward_model": f"{parameter.dtype} on {parameter.device}",
            "reward_means": means,
        }
    )
    print(
        f"reward model {scorer.__name__}: {parameter.dtype} on {parameter.device} (run: {dtype}); rows per scoring "
        f"forward {sorted(set(seen))}, plan {plan.forward_rows if plan else '-'}; rewards/mean {means}"
    )
    run.expect(
        parameter.device.type == run.device.type and parameter.dtype == dtype,
        "the reward model on the run's device and dtype",
    )
    run.expect(all(m is not None and math.isfinite(m) for m in means), "finite rewards at every step")
    run.expect(
        plan is not None and bool(seen) and max(seen) <= plan.forward_rows,
        "scoring forwards within the plan's rows",
    )
