"""Cost of one reference sync: the reference slot (two LoRA adapters on one base) vs a full-model EMA.

What is measured, per model, for one sync of the reference towards the policy:

- ours, through `lora_grpo.model.load.attach_adapters` and `lora_grpo.model.reference.sync_reference`
  (lora_r = 16, lora_alpha = 32, target "all-linear"):
    exact     alpha = 0.6, weight-space mix recompressed to ref_rank = 2r (QR + small SVD)
    factors   alpha = 0.6, A and B blended name by name, ref_rank = r (approximate: cross terms)
    copy      alpha = 1, hard copy of the policy factors into the ref_rank = 2r slot
- the peer, what a full-model trainer does: a second, full copy of the same base as the reference,
    full EMA   ref.mul_(1 − α).add_(policy, alpha=α) for every parameter (TRL's SyncRefModelCallback;
               the `alpha=` form allocates no temporary, so the peer is not charged for one)
    full copy  ref.copy_(policy) for every parameter (α = 1)

Columns:
- sync time: median wall time (time.perf_counter) of `repeats` syncs after one warm-up sync.
  Before each of ours, the policy adapter takes an untimed random step (see `policy_step`), so every
  timed sync mixes a reference that holds an older nonzero ΔW (the steady state), not zeros.
- persistent extra: bytes held for as long as the reference exists. Ours: the reference adapter's
  parameters (its factors are float32 whatever the base dtype). Peer: every parameter and buffer of
  the full reference copy (tied embeddings counted once).
- peak temporary: the largest amount of memory a sync allocates on top of what existed before it,
  at any moment during the sync. Measured with torch.profiler(profile_memory=True), which records
  every allocation and free of torch's CPU allocator (c10) with a timestamp, including tensors an
  op allocates inside its kernel (e.g. LAPACK work buffers); the running sum of those events from
  the start of the sync, at its maximum, is the peak. It cannot see memory that a BLAS/LAPACK
  library mallocs by itself (small, per call), nor Python objects. The profiled sync is a separate,
  untimed run. Checks made while writing this: a TorchDispatchMode that tracks the storages of op
  outputs until they are freed gave the same peak to the byte for the exact sync (both models), and
  the profiler reports exactly one embedding matrix for an EMA written as `add_(α * policy)`, which
  allocates that temporary.
- vs full EMA: ours / the full EMA's, for time and for memory (persistent + peak temporary).
- trunc. err: `sync/truncation_error` as reported by the exact sync (relative Frobenius norm of what
  the rank cap dropped, over all layers), on one more untimed steady-state sync, the checked one:
- err vs mix: that same sync checked densely: √Σ‖ΔW_ref_new − (αΔW_p + (1−α)ΔW_ref_old)‖²
  / √Σ‖αΔW_p + (1−α)ΔW_ref_old‖² over all LoRA layers, in float32. For exact it should equal the
  reported truncation error (Eckart–Young); for factors it is the cross-term error; a copy is 0.

A note line per model also gives the truncation error of a worst case: every sync meets a policy of
independent random factors, unrelated to what the reference holds (see `worst_case_truncation`).

Threads: the default is ONE torch thread. On a machine whose cores are shared with other busy
processes, 2 threads (OpenMP/MKL) make the many small LAPACK calls of the exact sync 100–1000×
slower (threads spin at barriers waiting for a descheduled sibling): a 48-column QR took 0.1 ms
with 1 thread and 50–600 ms with 2 on the 2-core machine this was written on. Use --threads to
change it; the header prints the load average so a contended run can be recognised.

Models are random-init, built locally from a Qwen2Config or LlamaConfig (nothing is downloaded):
"smollm2-135m" (SmolLM2-135M-Instruct's shape, a Llama: hidden 576, intermediate 1536, 30 layers, 9 heads,
3 KV heads, vocab 49152, tied embeddings; 134.5 M parameters), "tiny" and
"qwen2-0.5b" (Qwen2-0.5B's shape: hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads,
vocab 151936, tied embeddings; 494 M parameters). The base dtype is --dtype (default float32).

    python benchmarks/sync_cost.py [--models tiny,qwen2-0.5b] [--repeats 7] [--repeats-large 3]
                                   [--dtype float32|bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import dataclass

import torch
from _common import (
    DTYPES,
    MiB,
    add_threads_argument,
    environment,
    median_seconds,
    peak_temporary_bytes,
    print_markdown_table,
)

ALPHA = 0.6  # the soft-sync mix
LORA_R = 16
LORA_ALPHA = 32
POLICY_STEP = 0.1  # relative size of the random policy change between two syncs

MODELS = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
    ),
    # SmolLM2-135M-Instruct's shape (the smollm2-135m-chat-sum recipe's model): a Llama
    "smollm2-135m": dict(
        architecture="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}
LARGE = 100_000_000  # models with more parameters than this use --repeats-large


@dataclass
class Row:
    model: str
    method: str
    seconds: float
    persistent: int  # bytes
    peak: int  # bytes
    truncation_error: float | None = None
    mix_error: float | None = None


# ------------------------------------------------------------------ models


def build_base(name: str, dtype: torch.dtype):
    """A random-init causal LM with the named shape, frozen, built locally."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(MODELS[name])
    config = {"qwen2": Qwen2Config, "llama": LlamaConfig}[shape.pop("architecture", "qwen2")](**shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.requires_grad_(False)
    return model


def lora_grpo_config(mode: str):
    from lora_grpo.config import GRPOConfig

    return GRPOConfig(
        model_name_or_path="local",
        lora_r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_target_modules="all-linear",
        ref_sync_alpha=ALPHA,
        ref_sync_mode=mode,
    )


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied weight counts once)."""
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


# ------------------------------------------------------------------ policy values


def _policy_factors(model):
    from lora_grpo.model.load import POLICY
    from lora_grpo.model.reference import lora_layers

    return [(m.lora_A[POLICY].weight, m.lora_B[POLICY].weight) for _, m in lora_layers(model)]


@torch.no_grad()
def randomize_policy(model, generator) -> None:
    """Independent random factors: A ~ N(0, 1/in) (LoRA's init scale), B ~ N(0, 0.01²) (a trained B)."""
    for A, B in _policy_factors(model):
        A.copy_(torch.randn(A.shape, generator=generator) / math.sqrt(A.shape[1]))
        B.copy_(torch.randn(B.shape, generator=generator) * 0.01)


@torch.no_grad()
def policy_step(model, generator) -> None:
    """A training-like change: each factor moves by POLICY_STEP of its own RMS, in a random direction."""
    for A, B in _policy_factors(model):
        for p in (A, B):
            rms = p.square().mean().sqrt()
            p.add_(torch.randn(p.shape, generator=generator) * (POLICY_STEP * rms))


def steady_state(model, generator) -> None:
    """Random policy → hard sync → random policy step: the reference holds a nonzero, older ΔW."""
    from lora_grpo.model.reference import sync_reference

    randomize_policy(model, generator)
    sync_reference(model, alpha=1.0)
    policy_step(model, generator)


# ------------------------------------------------------------------ measurements


@torch.no_grad()
def checked_sync(model, alpha: float, mode: str) -> tuple[float, float]:
    """One sync, checked against the dense weight-space mix.

    Returns (the truncation error the sync reports, its relative Frobenius error over all layers).
    """
    from lora_grpo.model.load import POLICY, REFERENCE
    from lora_grpo.model.reference import delta_weight, lora_layers, sync_reference

    layers = lora_layers(model)
    targets = [alpha * delta_weight(m, POLICY) + (1 - alpha) * delta_weight(m, REFERENCE) for _, m in layers]
    reported = sync_reference(model, alpha, mode)["sync/truncation_error"]
    diff = sum((delta_weight(m, REFERENCE) - t).square().sum().item() for (_, m), t in zip(layers, targets))
    total = sum(t.square().sum().item() for t in targets)
    return reported, math.sqrt(diff / total) if total > 0 else 0.0


def measure_ours(model, name: str, method: str, alpha: float, mode: str, repeats: int, seed: int) -> Row:
    """Time, memory and errors of sync_reference(model, alpha, mode) in the steady state."""
    from lora_grpo.model.load import REFERENCE
    from lora_grpo.model.reference import sync_reference
    from lora_grpo.run.checkpoint import adapter_state_dict

    g = torch.Generator().manual_seed(seed)
    steady_state(model, g)
    seconds, _ = median_seconds(
        lambda: sync_reference(model, alpha, mode), repeats, before=lambda: policy_step(model, g)
    )
    policy_step(model, g)
    peak = peak_temporary_bytes(lambda: sync_reference(model, alpha, mode))
    policy_step(model, g)
    reported, dense = checked_sync(model, alpha, mode)
    return Row(
        name,
        method,
        seconds,
        tensor_bytes(adapter_state_dict(model, REFERENCE).values()),
        peak,
        reported if mode == "exact" and alpha < 1 else None,
        dense,
    )


def worst_case_truncation(model, seed: int) -> float:
    """The exact sync's reported truncation error when every sync meets an unrelated, random policy.

    Copy P1, mix in an independent P2 (the slot now holds 2r strong directions), then mix in an
    independent P3: 3r strong directions compete for 2r slots.
    """
    from lora_grpo.model.reference import sync_reference

    g = torch.Generator().manual_seed(seed)
    randomize_policy(model, g)
    sync_reference(model, alpha=1.0)
    randomize_policy(model, g)
    sync_reference(model, ALPHA, "exact")
    randomize_policy(model, g)
    return sync_reference(model, ALPHA, "exact")["sync/truncation_error"]


@torch.no_grad()
def measure_full(base, name: str, repeats: int) -> list[Row]:
    """The full-model peer: a full copy of the base as the reference, EMA'd or copied parameter by parameter."""
    reference = copy.deepcopy(base)
    persistent = tensor_bytes(list(reference.parameters()) + list(reference.buffers()))
    pairs = list(zip(reference.parameters(), base.parameters()))

    def ema():
        for r, p in pairs:
            r.mul_(1 - ALPHA).add_(p, alpha=ALPHA)

    def hard_copy():
        for r, p in pairs:
            r.copy_(p)

    return [  # the reference copy is freed on return
        Row(
            name,
            f"full EMA (a={ALPHA})",
            median_seconds(ema, repeats)[0],
            persistent,
            peak_temporary_bytes(ema),
            mix_error=0.0,
        ),
        Row(
            name,
            "full copy (a=1)",
            median_seconds(hard_copy, repeats)[0],
            persistent,
            peak_temporary_bytes(hard_copy),
            mix_error=0.0,
        ),
    ]


def benchmark_model(name: str, dtype: torch.dtype, repeats: int, repeats_large: int) -> tuple[list[Row], str]:
    """Every row for one model, and a note line; models over LARGE parameters get `repeats_large` repeats."""
    from lora_grpo.model.load import attach_adapters

    start = time.perf_counter()
    base = build_base(name, dtype)
    n_params = sum(p.numel() for p in base.parameters())
    if n_params > LARGE:
        repeats = repeats_large
    built = time.perf_counter() - start
    rows = measure_full(base, name, repeats)

    model = attach_adapters(base, lora_grpo_config("exact"))
    rows.append(
        measure_ours(model, name, f"ours exact (a={ALPHA}, rank {2 * LORA_R})", ALPHA, "exact", repeats, 1)
    )
    rows.append(measure_ours(model, name, f"ours copy (a=1, rank {2 * LORA_R})", 1.0, "exact", repeats, 2))
    worst = worst_case_truncation(model, 3)
    base = model.unload()  # the bare base again, for the factors slot

    model = attach_adapters(base, lora_grpo_config("factors"))
    rows.append(
        measure_ours(model, name, f"ours factors (a={ALPHA}, rank {LORA_R})", ALPHA, "factors", repeats, 4)
    )
    n_layers = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    note = (
        f"{name}: {n_params / 1e6:.1f} M params, {n_layers} LoRA layers, {repeats} repeats, "
        f"built in {built:.1f} s; worst case, every sync meets an unrelated random policy: the exact "
        f"sync reports truncation error {worst:.3g}"
    )
    return rows, note


# ------------------------------------------------------------------ report


def print_table(rows: list[Row]) -> None:
    header = [
        "model",
        "method",
        "sync time (ms)",
        "persistent extra (MiB)",
        "peak temporary (MiB)",
        "time vs full EMA",
        "memory vs full EMA",
        "trunc. err",
        "err vs mix",
    ]
    full = {r.model: r for r in rows if r.method.startswith("full EMA")}

    def fmt(x):
        return "-" if x is None else f"{x:.3g}"

    table = []
    for r in rows:
        f = full[r.model]
        table.append(
            [
                r.model,
                r.method,
                f"{r.seconds * 1e3:.3f}",
                f"{r.persistent / MiB:.3f}",
                f"{r.peak / MiB:.3f}",
                f"{r.seconds / f.seconds:.3g}",
                f"{(r.persistent + r.peak) / (f.persistent + f.peak):.3g}",
                fmt(r.truncation_error),
                fmt(r.mix_error),
            ]
        )
    print_markdown_table(header, table)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,qwen2-0.5b", help=f"comma-separated, from {list(MODELS)}")
    p.add_argument("--repeats", type=int, default=7, help="timed syncs per method (median reported)")
    p.add_argument(
        "--repeats-large", type=int, default=3, help=f"timed syncs for models over {LARGE / 1e6:.0f} M params"
    )
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of the base weights")
    add_threads_argument(p, help="torch.set_num_threads (see the docstring before raising it)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    import peft
    import transformers

    print(
        f"# {environment(transformers, peft)}; base dtype {args.dtype}, adapters float32; lora_r {LORA_R}, "
        f"lora_alpha {LORA_ALPHA}, all-linear; policy step {POLICY_STEP} between syncs"
    )
    rows, notes = [], []
    for name in args.models.split(","):
        model_rows, note = benchmark_model(name.strip(), dtype, args.repeats, args.repeats_large)
        rows += model_rows
        notes.append(note)
    print_table(rows)
    for note in notes:
        print("# " + note)


if __name__ == "__main__":
    main()
