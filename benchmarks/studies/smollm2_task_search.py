"""Which verifiable task does SmolLM2-135M-Instruct (the real model every machine here reaches) learn?

Measures the base's held-out greedy accuracy and pass@k through the chat template, for a task kind
(lora_grpo.tasks.chat_arithmetic.KINDS) and a completion budget, with the trainer's own evaluator:

    python benchmarks/studies/smollm2_task_search.py --kind add-1-1 --new-tokens 20 24 --prompts 210

A task is worth a recipe when the greedy accuracy is about 0.15–0.6 (room to learn) and pass@8 is at
least 0.7 (most groups of 8 hold a right answer, so GRPO has signal).
"""

from __future__ import annotations

import argparse
import json
import time

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.tasks.chat_arithmetic import chat_sum_problems, last_number_reward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="add-1-1")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[24])
    p.add_argument("--prompts", type=int, default=210)
    p.add_argument("--pass-k", type=int, default=8)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for pass@k")
    args = p.parse_args()
    held_out = chat_sum_problems(args.prompts, split="eval", kind=args.kind)
    for budget in args.new_tokens:
        config = GRPOConfig(
            model_name_or_path="smollm2-135m-instruct",
            max_completion_length=budget,
            max_prompt_length=96,
            eval_pass_k=[1, args.pass_k],
            eval_kl_to_base=False,
            temperature=args.temperature,
            system_prompt=args.system_prompt,
            max_steps=1,
            output_dir="runs/smollm2-task-search",
            micro_batch_size=16,
            gradient_checkpointing=False,
        )
        trainer = GRPOTrainer(
            config, reward_funcs=[last_number_reward], train_dataset=held_out, eval_dataset=held_out
        )
        start = time.perf_counter()
        metrics = trainer.evaluate()
        row = {
            "kind": args.kind,
            "new_tokens": budget,
            "system_prompt": args.system_prompt,
            "temperature": args.temperature,
            "prompts": args.prompts,
            "greedy": metrics["eval/last_number_reward"],
            "pass@1": metrics["eval/pass@1"],
            f"pass@{args.pass_k}": metrics[f"eval/pass@{args.pass_k}"],
            "greedy_length": metrics.get("eval/completion_length"),
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
