"""The Python API on the offline toy task, with reward functions of our own.

    python recipes/python_api.py

The toy-addition recipe's task and model (recipes/toy-addition.yaml) written as code, with two rewards
of our own (the sum, and a small format reward): the config is one dataclass, reward functions are
plain Python callables with TRL's contract: every argument by keyword (prompts,
completions, completion_ids, the dataset's columns, completion_lengths, truncated, trainer_state),
so a function names what it uses, takes **kwargs for the rest, and returns list[float | None].
A reward function written for TRL works unchanged.
"""

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.tasks.toy import parse_answer, toy_problems


def correct_sum(completions, answer, **kwargs):
    """1 when the completion is the right sum; `answer` is the dataset column, one per completion."""
    return [float(parse_answer(c) == int(a)) for c, a in zip(completions, answer)]


def three_digits(completions, **kwargs):
    """A small format reward: the toy answers are written with exactly three digits."""
    return [float(len(c.strip()) == 3 and c.strip().isdigit()) for c in completions]


config = GRPOConfig(
    model_name_or_path="toy",  # pre-trained locally on first use, then cached
    quantization="4bit",
    torch_dtype="float32",
    lora_r=8,
    lora_alpha=16,
    gradient_checkpointing=False,
    num_generations=8,
    prompts_per_step=16,
    max_prompt_length=16,
    max_completion_length=4,
    micro_batch_size=128,
    learning_rate=1e-3,
    beta=0.04,
    ref_sync_steps=10,
    ref_sync_alpha=0.6,
    ref_sync_mode="exact",
    reward_weights=[1.0, 0.1],
    max_steps=30,
    save_steps=0,
    logging_steps=5,
    output_dir="runs/python-api",
)
trainer = GRPOTrainer(
    config,
    reward_funcs=[correct_sum, three_digits],
    train_dataset=toy_problems(2000, seed=0, split="train"),
    eval_dataset=toy_problems(200, seed=0, split="eval"),
)
summary = trainer.train()
print(f"held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}")
