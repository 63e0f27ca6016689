"""lora_grpo against TRL's GRPOTrainer, side by side in one run: step time, tokens/s, peak memory.

The same work for both: one random-init Qwen2 (_common.build_qwen2: nothing downloaded), the same
prompts (P pseudo-random tokens each), the same cheap reward, G = 4 completions per prompt, 8
sequences a step, T new tokens, LoRA r 8 on every linear layer, beta 0.04, float32 compute, 2
threads.

- TRL (the `bench` extra pins 1.16): GRPOTrainer + peft_config at its defaults (gradient
  checkpointing on) with one micro-batch of 8 (per_device_train_batch_size = 8). Its reference is
  the base with the adapter disabled (TRL cannot sync a reference under PEFT); it samples with
  transformers' `generate`.
- lora_grpo: reference syncs on (exact soft sync, alpha 0.6, every 2 steps, so the reference
  slot differs from the policy and its forward runs every step but the first; the sync's time is
  inside the step time); micro_batch_size --micro-batch (default auto); one row per
  --ours-checkpointing value: "auto" (our default: recompute only when memory needs it) and
  "true" (recompute on, as TRL).

Both run their own `train()` with logging every step, as a user runs them, and a step's time is
from its start to the next step's start (TRL: transformers' on_step_begin; ours: the trainer's
"step_begin" hook), so reporting, logging, syncs and callbacks are inside it.

On a 4-bit base both get lora_grpo's `keep_4bit_weights_fixed`: on a CPU with AVX512-BF16,
bitsandbytes otherwise repacks the weights into a kernel without autograd after the first no-grad
forward, and the step is neither correct nor comparable (issue 7). Both then dequantise per
matmul: the 4-bit rows compare the trainers, not the kernels.

Each (shape, base, trainer) runs in its own fresh process, so peak RSS is that run's own: the
process's maximum resident set (ru_maxrss), model load included ("above load": the peak minus
the resident set once the trainer is built). The trainers' order rotates over --repeats rounds; a run
reports the median of its measured steps after --warmup steps; the table shows the median over
rounds and the ratio ours/TRL (< 1: ours is faster or leaner).

A random model rarely samples EOS (1/V per token), so nearly every completion runs to T tokens;
tokens/s counts the completion tokens actually sampled.

    pip install -e ".[bench]"
    # tiny, small, the Qwen2.5-0.5B body; fp32 and 4-bit; prompts of 6 and 32 tokens:
    python benchmarks/vs_trl.py
    python benchmarks/vs_trl.py --shapes small --bases fp32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (
    QWEN2_SHAPES,
    build_qwen2,
    environment,
    even_token_share,
    load_peer_model,
    print_markdown_table,
    run_worker,
    token_prompts,
    train_steps,
    trl_step_timer,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
G, SEQUENCES, LORA_R, BETA, LR = 4, 8, 8, 0.04, 1e-5


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


# ------------------------------------------------------------------ one run per process


def run_ours(args) -> dict:
    from lora_grpo import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        model_name_or_path=args.path,
        tokenizer_name_or_path=f"{args.path}/tokenizer",
        quantization="4bit" if args.base == "4bit" else "none",
        torch_dtype="float32",
        lora_r=LORA_R,
        lora_alpha=2 * LORA_R,
        lora_target_modules=TARGETS,
        num_generations=G,
        prompts_per_step=SEQUENCES // G,
        max_prompt_length=None,
        max_completion_length=args.completion_length,
        micro_batch_size=args.micro_batch,
        gradient_checkpointing={"true": True, "false": False}.get(
            args.ours_checkpointing, args.ours_checkpointing
        ),
        beta=BETA,
        ref_sync_steps=2,
        ref_sync_alpha=0.6,
        ref_sync_mode="exact",
        learning_rate=LR,
        max_steps=args.warmup + args.steps + 1,
        save_steps=0,
        logging_steps=1,
        output_dir=tempfile.mkdtemp(),
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        config,
        reward_funcs=[even_token_share],
        train_dataset=token_prompts(QWEN2_SHAPES[args.shape]["vocab_size"], args.prompt_length),
    )
    loaded_rss = rss_mib()
    steps = train_steps(trainer)
    times = [seconds for _, seconds in steps]
    tokens = [metrics["completion_length/mean"] * SEQUENCES for metrics, _ in steps]
    # What auto resolved to, at start (memory/probe.py).
    return measured(
        times,
        tokens,
        args,
        loaded_rss,
        micro_batch=str(getattr(trainer, "micro_batch_size", config.micro_batch_size)),
    )


def run_trl(args) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = load_peer_model(args.path, args.base)
    tokenizer = AutoTokenizer.from_pretrained(f"{args.path}/tokenizer")
    step_times, times, tokens = trl_step_timer(SEQUENCES)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=SEQUENCES,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=args.completion_length,
        gradient_checkpointing=True,
        beta=BETA,
        learning_rate=LR,
        max_steps=args.warmup + args.steps + 1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=args.seed,
    )
    peft_config = LoraConfig(
        r=LORA_R, lora_alpha=2 * LORA_R, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    dataset = Dataset.from_list(token_prompts(QWEN2_SHAPES[args.shape]["vocab_size"], args.prompt_length))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[even_token_share],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[step_times],
    )
    loaded_rss = rss_mib()
    trainer.train()
    return measured(times, tokens, args, loaded_rss, micro_batch=str(SEQUENCES))


def measured(times, tokens, args, loaded_rss, micro_batch) -> dict:
    steps = slice(args.warmup, None)
    step = statistics.median(times[steps])
    return {
        "step_s": step,
        "tokens_per_s": statistics.median(n / t for n, t in zip(tokens[steps], times[steps])),
        "peak_rss_mib": peak_rss_mib(),
        "loaded_rss_mib": loaded_rss,
        "micro_batch": micro_batch,
    }


# ------------------------------------------------------------------ the comparison


def child(trainer: str, shape: str, base: str, prompt_length: int, path: Path, args) -> dict:
    """One run in a fresh process. `trainer`: "trl", or "ours:<gradient_checkpointing>"."""
    name, _, checkpointing = trainer.partition(":")
    command = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--path",
        str(path),
        "--shape",
        shape,
        "--base",
        base,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--prompt-length",
        str(prompt_length),
        "--completion-length",
        str(args.completion_length),
        "--micro-batch",
        str(args.micro_batch),
        "--ours-checkpointing",
        checkpointing or "true",
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
    ]
    return run_worker(command, f"{trainer} on {shape}/{base}")


def compare(args) -> None:
    import peft
    import transformers
    import trl

    torch.set_num_threads(args.threads)
    variants = [f"ours:{c}" for c in args.ours_checkpointing.split(",")]
    print(f"# {environment(transformers, peft, trl)}")
    print(
        f"# G={G}, {SEQUENCES} sequences a step, prompts of {args.prompt_lengths} tokens, {args.completion_length} new "
        f"tokens, LoRA r {LORA_R}, beta {BETA}; TRL: its defaults (gradient checkpointing on, one micro-batch of "
        f"{SEQUENCES}); ours: micro_batch_size {args.micro_batch}, gradient_checkpointing {args.ours_checkpointing} "
        f"(one row each); median of {args.steps} steps after {args.warmup}, median over {args.repeats} rounds "
        "(the trainers' order rotating, each run in a fresh process)"
    )
    rows = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp)
            build_qwen2(shape, path)
            for base, prompt_length in [
                (b, int(n)) for b in args.bases.split(",") for n in args.prompt_lengths.split(",")
            ]:
                runs = {k: [] for k in ["trl", *variants]}
                order = list(runs)
                for r in range(args.repeats):
                    for trainer in order[r % len(order) :] + order[: r % len(order)]:
                        runs[trainer].append(child(trainer, shape, base, prompt_length, path, args))
                        print(
                            f"  {shape} {base} prompt {prompt_length} round {r + 1} {trainer}: {runs[trainer][-1]}",
                            file=sys.stderr,
                        )
                peer = summarize(runs["trl"])
                for variant in variants:
                    ours = summarize(runs[variant])
                    rows.append(
                        [
                            shape,
                            base,
                            str(prompt_length),
                            f"checkpointing {variant.split(':')[1]}, micro-batch {runs[variant][0]['micro_batch']}",
                            f"{ours['step_s']:.3f}",
                            f"{peer['step_s']:.3f}",
                            f"{ours['step_s'] / peer['step_s']:.2f}",
                            f"{ours['tokens_per_s']:.0f}",
                            f"{peer['tokens_per_s']:.0f}",
                            f"{ours['peak_rss_mib']:.0f}",
                            f"{peer['peak_rss_mib']:.0f}",
                            f"{ours['peak_rss_mib'] / peer['peak_rss_mib']:.2f}",
                            f"{ours['train_rss_mib']:.0f}",
                            f"{peer['train_rss_mib']:.0f}",
                        ]
                    )
    print_markdown_table(
        [
            "model",
            "base",
            "prompt",
            "ours",
            "ours step s",
            "TRL step s",
            "step vs TRL",
            "ours tok/s",
            "TRL tok/s",
            "ours peak MiB",
            "TRL peak MiB",
            "peak vs TRL",
            "ours above load MiB",
            "TRL above load MiB",
        ],
        rows,
        text_columns=4,
    )


def summarize(runs: list[dict]) -> dict:
    return {
        "step_s": statistics.median(r["step_s"] for r in runs),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
        "train_rss_mib": statistics.median(r["peak_rss_mib"] - r["loaded_rss_mib"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="tiny,small,qwen2.5-0.5b-cpu")
    parser.add_argument("--bases", default="fp32,4bit")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (ours, TRL), alternating the order")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    parser.add_argument("--prompt-lengths", default="6,32", help="prompt tokens, one row each")
    parser.add_argument("--prompt-length", type=int, help=argparse.SUPPRESS)  # a worker's
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument(
        "--micro-batch", default="auto", help="ours: micro_batch_size (TRL: 8, one micro-batch)"
    )
    parser.add_argument(
        "--ours-checkpointing",
        default="auto,true",
        help="ours: gradient_checkpointing values to run, one row each (auto: our default)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro_batch != "auto":
        args.micro_batch = int(args.micro_batch)
    if args.worker:
        torch.set_num_threads(args.threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        result = (run_ours if args.worker == "ours" else run_trl)(args)
        print("RESULT " + json.dumps(result), flush=True)
    else:
        compare(args)


if __name__ == "__main__":
    main()
