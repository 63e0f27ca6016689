"""How well the start-up memory probe (lora_grpo/memory/probe.py) predicts a real training pass.

For micro-batch sizes m, on a random-init Llama built locally (nothing downloaded):

- probe:      memory.measure_peak of one worst-case pass (memory.probe_pass: m sequences of
              prompt + max_completion_length tokens, forward + backward, no optimizer step);
- linear:     the probe's line through m = 1 and 2, extrapolated (what the search predicts before
              it measures the candidate);
- real:       memory.measure_peak of trainer.optimize() on a real rollout of the same lengths with
              micro_batch_size = m (a random model almost never samples EOS, so completions run
              to max_completion_length), after one warm-up update so that AdamW's states exist.

On CPU both are resident-set growth (sampled every 0.5 ms), on CUDA torch.cuda.max_memory_allocated.

    python benchmarks/memory_probe.py                       # CPU, hidden 256, 4 layers, 32+192 tokens
    python benchmarks/memory_probe.py --hidden 512 --completion 384
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.batch import Batch
from lora_grpo.memory import probe as memory
from lora_grpo.model.load import set_gradient_checkpointing
from lora_grpo.tasks.toy import save_tiny_base

MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--completion", type=int, default=192)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--quantization", default="none")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = save_tiny_base(
            f"{tmp}/base",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=4 * args.hidden,
            max_positions=1024,
        )
        prompts = [{"prompt": f"{i:02d}+{i:02d}=" * 4} for i in range(64)]  # 24 characters, one token each
        batch = max(args.sizes)
        cfg = GRPOConfig(
            model_name_or_path=base,
            quantization=args.quantization,
            torch_dtype="float32",
            lora_r=16,
            num_generations=batch // 2,
            prompts_per_step=2,
            max_completion_length=args.completion,
            max_prompt_length=64,
            output_dir=f"{tmp}/run",
            save_steps=0,
            beta=0.04,
        )
        t0 = time.perf_counter()
        trainer = GRPOTrainer(
            cfg,
            reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
            train_dataset=prompts,
        )
        plan = trainer.plan_memory()  # what train() does first
        print(f"construction and plan {time.perf_counter() - t0:.1f} s, of which probe {plan.seconds:.2f} s")
        tokens, device = plan.tokens, trainer.accelerator.device
        rollout = trainer.generate([p["prompt"] for p in prompts[:2]])
        real_batch = Batch(
            rollout.input_ids,
            rollout.attention_mask,
            rollout.completion_mask,
            torch.linspace(-1, 1, rollout.input_ids.shape[0]),
        )
        print(
            f"rollout: {tuple(rollout.input_ids.shape)}, completion tokens {int(rollout.completion_mask.sum())} of "
            f"{rollout.completion_mask.numel()}; worst case {tokens[0]}+{tokens[1]}"
        )
        set_gradient_checkpointing(trainer.model, False)  # both columns without recompute
        trainer.micro_batch_size = batch
        trainer.optimize(real_batch)  # AdamW's states now exist, as in every step after the first
        probe = {
            m: memory.measure_peak(lambda: memory.probe_pass(trainer.update, m, True, tokens, device), device)
            for m in args.sizes
        }
        slope = probe[2] - probe[1]
        print(f"{'m':>4} {'probe MiB':>10} {'linear MiB':>11} {'real MiB':>9} {'probe/real':>10}")
        for m in args.sizes:
            trainer.micro_batch_size = m
            real = memory.measure_peak(lambda: trainer.optimize(real_batch), device)
            linear = probe[1] + slope * (m - 1)
            print(
                f"{m:>4} {probe[m] / MiB:>10.1f} {linear / MiB:>11.1f} {real / MiB:>9.1f} {probe[m] / real:>10.2f}"
            )


if __name__ == "__main__":
    main()
