"""The exact zero-advantage saving (update.zero_gradient_rows), timed: one optimizer update with the
rows of zero advantage left out of its forward and backward, against the same update over every row.

On a random-init Qwen2 built locally (_common.build_qwen2, "small": 20 M parameters, 32k vocab), a
rollout of --prompts prompts × G 8 completions of --completion-length tokens is sampled once; its
advantages are set so that a share z of the groups has all-equal rewards (advantage 0 on each of their
rows) and the others get ±1. beta 0, loss dapo, micro_batch_size 8: the saving is on. For each z,
the two updates alternate (A, B, A, B, ...; --repeats each), the gradients are checked equal, and
the median seconds and their ratio are printed. Run it alone on the machine.

    python benchmarks/zero_advantage.py --threads 2      # z = 0, 0.25, 0.5, 0.75; about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from _common import QWEN2_SHAPES, add_threads_argument, build_qwen2, even_token_share, token_prompts


def main() -> None:
    from lora_grpo import GRPOConfig, GRPOTrainer
    from lora_grpo import update as update_module
    from lora_grpo.batch import Batch

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shares", default="0,0.25,0.5,0.75")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    add_threads_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = tempfile.mkdtemp()
    build_qwen2("small", path)
    config = GRPOConfig(
        model_name_or_path=path,
        tokenizer_name_or_path=f"{path}/tokenizer",
        quantization="none",
        num_generations=8,
        prompts_per_step=args.prompts,
        max_prompt_length=None,
        max_completion_length=args.completion_length,
        micro_batch_size=8,
        gradient_checkpointing=False,
        beta=0.0,
        learning_rate=1e-5,
        output_dir=tempfile.mkdtemp(),
    )
    prompts = token_prompts(QWEN2_SHAPES["small"]["vocab_size"], 16)
    trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
    rollout = trainer.generate([p["prompt"] for p in prompts[: args.prompts]])
    B, groups = rollout.completion_ids.shape[0], args.prompts
    real = update_module.zero_gradient_rows
    update = trainer.update
    grads: list[torch.Tensor] = []
    update._step_unless_nonfinite = lambda *a: (
        grads.append(torch.cat([p.grad.flatten() for p in trainer.params])) or False
    )  # measure the gradient, leave the adapters as they are

    def timed(saving: bool, batch: Batch) -> float:
        update_module.zero_gradient_rows = real if saving else (lambda *a: None)
        for p in trainer.params:
            p.grad = None
        start = time.perf_counter()
        update(batch, config.micro_batch_size)
        return time.perf_counter() - start

    print(
        f"{B} sequences of {rollout.completion_ids.shape[1]} completion tokens, micro-batches of 8, "
        f"{args.threads} torch threads"
    )
    print("| share of groups with equal rewards | full update (s) | saving (s) | ratio |")
    print("|---|---|---|---|")
    for share in (float(s) for s in args.shares.split(",")):
        idle = round(share * groups)
        signs = torch.tensor([1.0, -1.0]).repeat(4)
        advantages = torch.cat([torch.zeros(8) if g < idle else signs for g in range(groups)])
        batch = Batch.from_rollout(rollout, advantages, mask_truncated_completions=False)
        full, saved = [], []
        timed(True, batch), timed(False, batch)  # warm-up
        for _ in range(args.repeats):
            full.append(timed(False, batch))
            saved.append(timed(True, batch))
        a, b = grads[-2], grads[-1]
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8), "the saving changed the gradient"
        f, s = statistics.median(full), statistics.median(saved)
        print(f"| {idle}/{groups} | {f:.3f} | {s:.3f} | {s / f:.2f} |", flush=True)
    update_module.zero_gradient_rows = real


if __name__ == "__main__":
    main()
