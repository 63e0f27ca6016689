"""Time and peak memory of whole GRPO training steps: QLoRA (4-bit base) vs LoRA on a 16-bit base.

Prepared for a GPU session (4-bit CUDA kernels, throughput and peak GPU memory mean something only
there); it also runs on CPU with --shape tiny to check that it works.

What is measured, per quantization ("4bit" = ours as the recipes run it, "none" = the peer: the same
trainer on an unquantized base), on a random-init Qwen2 built locally (_common.build_qwen2, nothing is downloaded;
"qwen2.5-0.5b" is Qwen2.5-0.5B's shape with its 151,936-token vocabulary):

- step seconds: median of `time/step` over the measured steps (after --warmup steps), split into
  rollout / log-probs (reference, and old when num_iterations > 1) / train;
- tokens/s: completion tokens sampled per second of step;
- sync ms: the exact weight-space sync of the reference slot, timed on its own after the steps;
- peak memory: torch.cuda.max_memory_allocated over the measured steps (GPU only; "-" on CPU);
- what `micro_batch_size: auto` and `gradient_checkpointing: auto` chose (the start-up memory
  probe, memory/probe.py) and how long the probe took; the warm-up steps' seconds, which include
  compiling the decode step when the sampler is compiled (`decode_mode`: auto = compiled on CUDA).

A random model samples EOS with probability about 1/vocab per token, so nearly every completion
runs to max_completion_length: the step does about the same work in both columns. The reward is a cheap function of the
completion text, so reward time is negligible.

    python benchmarks/train_step.py --shape qwen2.5-0.5b --steps 5          # on a GPU
    python benchmarks/train_step.py --shape tiny --steps 2                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from _common import (
    QWEN2_SHAPES,
    MiB,
    add_threads_argument,
    build_qwen2,
    environment,
    even_token_share,
    print_markdown_table,
    token_prompts,
)


def run(path: str, quantization: str, args) -> dict[str, float | str]:
    from lora_grpo import GRPOConfig, GRPOTrainer
    from lora_grpo.model.reference import sync_reference

    prompts = token_prompts(QWEN2_SHAPES[args.shape]["vocab_size"], args.prompt_length)
    config = GRPOConfig(
        model_name_or_path=path,
        tokenizer_name_or_path=f"{path}/tokenizer",
        quantization=quantization,
        lora_r=16,
        lora_alpha=32,
        num_generations=args.generations,
        prompts_per_step=args.prompts,
        max_prompt_length=None,
        max_completion_length=args.completion_length,
        micro_batch_size=args.micro_batch,
        beta=0.04,
        ref_sync_steps=0,
        learning_rate=1e-5,
        max_steps=args.warmup + args.steps,
        save_steps=0,
        logging_steps=1000,
        output_dir=tempfile.mkdtemp(),
        gradient_checkpointing=args.gradient_checkpointing,
        decode_mode=args.decode_mode,
    )
    start = time.perf_counter()
    trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
    plan = (
        trainer.plan_memory()
    )  # what micro_batch_size / gradient_checkpointing "auto" chose (memory/probe.py)
    built = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    # the first rollout compiles the decode step (decode_mode compiled / auto on CUDA)
    for _ in range(args.warmup):
        trainer.training_step(next(trainer.state.batches)[1])
    warmup = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    steps = [trainer.training_step(next(trainer.state.batches)[1]) for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() / MiB if torch.cuda.is_available() else None
    start = time.perf_counter()
    sync = sync_reference(trainer.model, alpha=0.6, mode="exact")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    sync_ms = (time.perf_counter() - start) * 1000

    def med(key):
        return statistics.median(m[key] for m in steps)

    result = {
        "step": med("time/step"),
        "rollout": med("time/rollout"),
        "log_probs": med("time/log_probs"),
        "train": med("time/train"),
        "tokens/s": med("tokens_per_second"),
        "sync_ms": sync_ms,
        "sync_err": sync["sync/truncation_error"],
        "peak_mib": peak,
        "warmup_s": warmup,
        "build_s": built,
        "micro_batch": trainer.micro_batch_size,
        "checkpointing": "on" if trainer.gradient_checkpointing else "off",
        "probe_s": plan.seconds if plan is not None else None,
        "decode": config.decode_mode,
    }
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(QWEN2_SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="G")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--completion-length", type=int, default=256)
    parser.add_argument(
        "--micro-batch", default="auto", help="micro_batch_size: auto (the default) or an int"
    )
    parser.add_argument("--gradient-checkpointing", default="auto", help="auto (the default) | true | false")
    parser.add_argument(
        "--decode-mode", default="auto", help="auto (compiled on CUDA) | eager | static | compiled"
    )
    parser.add_argument("--quantizations", default="4bit,none")
    add_threads_argument(parser)
    args = parser.parse_args()
    args.micro_batch = args.micro_batch if args.micro_batch == "auto" else int(args.micro_batch)
    args.gradient_checkpointing = {"true": True, "false": False}.get(
        args.gradient_checkpointing, args.gradient_checkpointing
    )
    torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    import bitsandbytes
    import peft
    import transformers

    print(
        f"# {environment(transformers, peft, bitsandbytes)}; device {device}; shape {args.shape}; "
        f"{args.prompts} prompts × G={args.generations}, prompt {args.prompt_length}, completion "
        f"{args.completion_length} tokens, micro-batch {args.micro_batch}, gradient checkpointing "
        f"{args.gradient_checkpointing}, decode {args.decode_mode}; median of {args.steps} steps "
        f"after {args.warmup}"
    )
    with tempfile.TemporaryDirectory() as path:
        build_qwen2(args.shape, path, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        results = {q: run(path, q, args) for q in args.quantizations.split(",")}
    peer = results.get("none")
    table = []
    for q, r in results.items():
        ratio = f"{r['step'] / peer['step']:.2f}" if peer else "-"
        mem_ratio = f"{r['peak_mib'] / peer['peak_mib']:.2f}" if peer and r["peak_mib"] else "-"
        table.append(
            [
                f"{q} base" + (" (peer)" if q == "none" else ""),
                f"{r['step']:.2f}",
                f"{r['rollout']:.2f}",
                f"{r['log_probs']:.2f}",
                f"{r['train']:.2f}",
                f"{r['tokens/s']:.0f}",
                f"{r['sync_ms']:.1f}",
                f"{r['sync_err']:.1e}",
                "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}",
                ratio,
                mem_ratio,
                f"{r['micro_batch']} / {r['checkpointing']}",
                "-" if r["probe_s"] is None else f"{r['probe_s']:.1f}",
                f"{r['warmup_s']:.1f}",
            ]
        )
    print_markdown_table(
        [
            "base",
            "step s",
            "rollout s",
            "log-probs s",
            "train s",
            "tokens/s",
            "sync ms",
            "sync err",
            "peak MiB",
            "step vs peer",
            "memory vs peer",
            "micro-batch / recompute",
            "probe s",
            f"first {args.warmup} step(s) s",
        ],
        table,
        text_columns=1,
    )


if __name__ == "__main__":
    main()
