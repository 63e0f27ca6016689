"""How far a GRPO step is from the machine's limit: each stage's FLOPs against the measured matmul peak.

1. The limit: the best float32 matmul throughput this machine reaches with torch (--threads
   threads), over square matmuls and the step's own GEMM shapes (tokens × hidden @ hidden ×
   intermediate, ...): the most any stage of a dense step could run at.
2. The work: the FLOPs of one step from the model's shapes (below), per stage.
3. The time: lora_grpo's own stage timers (`time/rollout`, `time/log_probs`, `time/train`,
   median over --steps steps after --warmup) on a random-init Qwen2 of that shape
   (_common.build_qwen2), with the same settings as vs_trl.py by default.

Each stage then reports GFLOP, seconds, GFLOP/s and its fraction of the matmul peak, and its
floor: the larger of FLOPs / peak and weight bytes read / the measured memory read bandwidth.
Decoding a few sequences is bound by reads, not FLOPs: each token step reads every weight once.
"floor / seconds" is how close the stage runs to what the machine allows (100% = at the limit).

FLOPs counted (useful work, multiply-add = 2 FLOPs; d = head dim, c = positions attended):
- per token through the body: 2·(parameters of the linear layers) + 2·r·(in + out) per LoRA
  linear of the active adapter + attention 4·layers·heads·d·c, with c = the causal context;
- the LM head, 2·hidden·vocab, only where logits are needed: the last prompt token and every
  decoded token in the rollout, the completion tokens in log-prob passes;
- rollout: each distinct prompt prefilled once (prefix sharing), then B·T one-token decode steps;
- reference log-probs: one forward over B·(P+T) tokens with the reference adapter (rank ref_rank);
- training: forward + backward + (with gradient checkpointing) the recomputed forward of the body.
  The base is frozen, so its backward is the input gradient only (the same FLOPs as its forward);
  LoRA's backward is twice its forward (input and weight gradients); attention's backward twice its
  forward; the chunked LM head recomputes its logits in backward (forward + 2 × forward).

    python benchmarks/limit.py                                   # the Qwen2.5-0.5B body, fp32
    python benchmarks/limit.py --shape small --base 4bit
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    QWEN2_SHAPES,
    build_qwen2,
    environment,
    even_token_share,
    print_markdown_table,
    token_prompts,
    train_steps,
)

# ------------------------------------------------------------------ the limit


def matmul_peak(shapes: list[tuple[int, int, int]], repeats: int = 5) -> tuple[float, tuple[int, int, int]]:
    """(best GFLOP/s, its (m, k, n)) of float32 torch.mm over `shapes`; median of `repeats` per shape."""
    best = (0.0, shapes[0])
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        rate = 2 * m * k * n / statistics.median(times) / 1e9
        best = max(best, (rate, (m, k, n)))
    return best


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of reading a float32 tensor of `gib` GiB from memory (torch.sum), median of `repeats`."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


# ------------------------------------------------------------------ the work


def weight_bytes(spec: dict, base: str) -> float:
    """Bytes of the weights one forward reads: the linear layers (4-bit: half a byte per weight
    plus the absmax) and the LM head (kept in float32 by the 4-bit load too)."""
    H, I, L, V = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"], spec["vocab_size"]
    d = H // spec["num_attention_heads"]
    linear = L * (
        2 * H * spec["num_attention_heads"] * d + 2 * H * spec["num_key_value_heads"] * d + 3 * H * I
    )
    return linear * (4 if base == "fp32" else 0.5 + 4 / 64) + 4 * H * V


def step_flops(
    spec: dict, *, prompts: int, G: int, P: int, T: float, lora_r: int, ref_rank: int, recompute: bool
) -> dict[str, float]:
    """FLOPs of one GRPO step's stages (see the docstring) for a Qwen2-like `spec`."""
    H, I, L, V = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"], spec["vocab_size"]
    heads, kv = spec["num_attention_heads"], spec["num_key_value_heads"]
    d = H // heads
    shapes = [
        (H, heads * d),
        (H, kv * d),
        (H, kv * d),
        (heads * d, H),
        (H, I),
        (H, I),
        (I, H),
    ]  # q k v o gate up down
    linear = 2 * L * sum(i * o for i, o in shapes)
    lora = lambda r: 2 * L * r * sum(i + o for i, o in shapes)  # noqa: E731
    attend = lambda c: 4 * L * heads * d * c  # noqa: E731  one token attending to c positions
    head = 2 * H * V
    B, S = prompts * G, P + T

    def forward(sequences, length, r, logits):  # body over whole sequences + the head on `logits` tokens each
        body = sequences * length * (linear + lora(r)) + sequences * attend(length * (length + 1) / 2)
        return body, sequences * logits * head

    prefill_body, prefill_head = forward(prompts, P, lora_r, 1)
    decode = B * T * (linear + lora(lora_r) + head) + B * sum(attend(P + t + 1) for t in range(int(round(T))))
    ref_body, ref_head = forward(B, S, ref_rank, T)
    body, lm_head = forward(B, S, lora_r, T)
    body_backward = B * S * (linear + 2 * lora(lora_r)) + 2 * B * attend(S * (S + 1) / 2)
    return {
        "rollout": prefill_body + prefill_head + decode,
        "reference log-probs": ref_body + ref_head,
        "train": body + body_backward + (body if recompute else 0) + 3 * lm_head,
    }


# ------------------------------------------------------------------ the time


def measure_step(path: str, args) -> dict[str, float]:
    from lora_grpo import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        model_name_or_path=path,
        tokenizer_name_or_path=f"{path}/tokenizer",
        quantization="4bit" if args.base == "4bit" else "none",
        torch_dtype="float32",
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        num_generations=args.generations,
        prompts_per_step=args.prompts,
        max_prompt_length=None,
        max_completion_length=args.completion_length,
        micro_batch_size=args.micro_batch,
        gradient_checkpointing=args.gradient_checkpointing,
        beta=0.04,
        ref_sync_steps=2,
        ref_sync_alpha=0.6,
        learning_rate=1e-5,
        max_steps=args.warmup + args.steps + 1,
        save_steps=0,
        logging_steps=10**6,
        output_dir=tempfile.mkdtemp(),
        disable_tqdm=True,
    )
    vocab = QWEN2_SHAPES[args.shape]["vocab_size"]
    trainer = GRPOTrainer(
        config, reward_funcs=[even_token_share], train_dataset=token_prompts(vocab, args.prompt_length)
    )
    # The soft syncs keep the reference slot apart from the policy: its forward runs.
    measured = [metrics for metrics, _ in train_steps(trainer)[args.warmup :]]  # train(), as a user runs it
    med = lambda key: statistics.median(m[key] for m in measured)  # noqa: E731
    return {
        "rollout": med("time/rollout"),
        "reference log-probs": med("time/log_probs"),
        "train": med("time/train"),
        "step": med("time/step"),
        "completion_length": med("completion_length/mean"),
        "micro_batch": getattr(trainer, "micro_batch_size", config.micro_batch_size),
        "gradient_checkpointing": getattr(trainer, "gradient_checkpointing", config.gradient_checkpointing),
        "ref_rank": config.ref_rank,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(QWEN2_SHAPES), default="qwen2.5-0.5b-cpu")
    parser.add_argument("--base", choices=["fp32", "4bit"], default="fp32")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="G")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--micro-batch", default="auto")
    parser.add_argument("--gradient-checkpointing", default="true", help="true | false | auto")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.micro_batch = args.micro_batch if args.micro_batch == "auto" else int(args.micro_batch)
    args.gradient_checkpointing = {"true": True, "false": False}.get(
        args.gradient_checkpointing, args.gradient_checkpointing
    )
    torch.set_num_threads(args.threads)
    import peft
    import transformers

    spec = QWEN2_SHAPES[args.shape]
    B, S = args.prompts * args.generations, args.prompt_length + args.completion_length
    H, I = spec["hidden_size"], spec["intermediate_size"]
    peak, peak_shape = matmul_peak([(2048, 2048, 2048), (B * S, H, I), (B * S, I, H), (B * S, H, H)])
    bandwidth = read_bandwidth()
    with tempfile.TemporaryDirectory() as path:
        build_qwen2(args.shape, path)
        times = measure_step(path, args)
    recompute = times["gradient_checkpointing"] is True
    flops = step_flops(
        spec,
        prompts=args.prompts,
        G=args.generations,
        P=args.prompt_length,
        T=times["completion_length"],
        lora_r=args.lora_r,
        ref_rank=times["ref_rank"],
        recompute=recompute,
    )
    print(f"# {environment(transformers, peft)}")
    print(
        f"# {args.shape} ({args.base} base), {args.prompts} prompts × G={args.generations}, prompt "
        f"{args.prompt_length}, "
        f"completion {times['completion_length']:.1f} tokens (mean), LoRA r {args.lora_r}, reference rank "
        f"{times['ref_rank']}, micro-batch {times['micro_batch']}, gradient checkpointing "
        f"{times['gradient_checkpointing']}; "
        f"median of {args.steps} steps after {args.warmup}"
    )
    print(
        f"# limits: float32 matmul peak {peak:.1f} GFLOP/s (torch.mm {peak_shape[0]}×{peak_shape[1]} @ "
        f"{peak_shape[1]}×{peak_shape[2]}, {args.threads} threads); memory read bandwidth {bandwidth:.1f} GB/s"
    )
    # Decoding reads every weight once per token step: its floor is the larger of compute and reads.
    passes = {
        "rollout": 1 + round(times["completion_length"]),
        "reference log-probs": 1,
        "train": 2 + recompute,
    }
    weights = weight_bytes(spec, args.base)
    rows, total_flops, total_floor = [], 0.0, 0.0
    for stage, f in flops.items():
        seconds = times[stage]
        floor = max(f / (peak * 1e9), passes[stage] * weights / (bandwidth * 1e9))
        total_flops, total_floor = total_flops + f, total_floor + floor
        rows.append(
            [
                stage,
                f"{f / 1e9:.1f}",
                f"{passes[stage] * weights / 1e9:.2f}",
                f"{seconds:.3f}",
                f"{f / seconds / 1e9:.1f}",
                f"{100 * f / seconds / 1e9 / peak:.0f}%",
                f"{floor:.3f}",
                f"{100 * floor / seconds:.0f}%",
            ]
        )
    rows.append(
        [
            "whole step (with rewards)",
            f"{total_flops / 1e9:.1f}",
            "",
            f"{times['step']:.3f}",
            f"{total_flops / times['step'] / 1e9:.1f}",
            f"{100 * total_flops / times['step'] / 1e9 / peak:.0f}%",
            f"{total_floor:.3f}",
            f"{100 * total_floor / times['step']:.0f}%",
        ]
    )
    print_markdown_table(
        [
            "stage",
            "GFLOP",
            "weights read GB",
            "seconds",
            "GFLOP/s",
            "of matmul peak",
            "floor s",
            "floor / seconds",
        ],
        rows,
        text_columns=1,
    )


if __name__ == "__main__":
    main()
