"""Per-token log-probs for the loss: chunked through the LM head vs the full logits tensor.

What is measured, per token count N = B × T, for one forward + backward of a loss built on the
per-token log-probs of N target tokens, through a Qwen2.5-like LM head (hidden 896, vocab 151936,
no bias; 544 MiB of float32 weight):

- ours   `lora_grpo.algo.logprobs.chunked_log_probs(hidden, head, targets, chunk_size=C)` with C in
          --chunks (default 256, 1024, 4096): the head runs on C tokens at a time, only each
          token's log-prob and log-sum-exp are kept, and the backward recomputes each chunk's logits.
- peer   `torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[..., None]).squeeze(-1)`:
          the full (B, T, V) logits, with autograd keeping the (B, T, V) log-softmax output for the
          backward. (TRL's selective_log_softmax saves some of this by taking the log-sum-exp row by
          row, but still materialises the full logits from the model's forward.)

The loss is (logp · w).sum() with a fixed random (B, T) weight w (as advantages × mask would be),
and `.backward()`. As in LoRA training, the head's weight is frozen (lm_head and the tied embedding
are not LoRA targets), so the backward computes the gradient for the hidden states only; hidden
(B, T, 896) is a leaf that requires grad, standing in for the decoder body's output.

Columns:
- time fwd+bwd: median wall time (time.perf_counter) of `repeats` forward + backward passes, after
  one untimed, profiled warm-up of every method at 64 tokens (kernels, allocator, and the
  profiler's own start-up, which costs 1–2 s the first time in a process). The first timed pass
  is also the profiled one (below): at these sizes every op takes milliseconds to seconds and a
  pass has at most a few hundred ops, so the profiler's bookkeeping is far below the noise
  (checked while writing this: after the warm-up, profiled and plain passes agreed within
  run-to-run variation).
- peak extra: the largest amount of memory the pass allocates on top of what existed before it
  (hidden, head weight, targets, w), at any moment during forward + backward, including the
  (B, T, 896) gradient of hidden that it leaves behind. Measured with torch.profiler
  (profile_memory=True), which records every allocation and free of torch's CPU allocator with a
  timestamp, including tensors an op allocates inside its kernel (e.g. logsumexp's temporaries)
  and the tensors autograd saves for the backward; the running sum of those events from the start
  of the pass, at its maximum, is the peak. It cannot see memory a BLAS library mallocs by itself
  (small, per call), nor Python objects.
- peak / block: the peak in units of one float32 logits block of the rows a method holds at once,
  min(C, N) × V × 4 bytes (N × V × 4 for the peer): how many such blocks are live at the peak.
- time vs full, memory vs full: ours / the peer's at the same N, in the same run.
A note line per N gives the size of one float32 (N, V) logits tensor.

Threads: the default is ONE torch thread (--threads to change it); on a machine whose cores are
shared with other busy processes, more threads wait at barriers for descheduled siblings. The
header prints the load average. On the 2-core machine this was written on, one (2048 × 896) @
(896 × 151936) float32 matmul takes about 7 s with one thread, so the defaults stay at
2 × 256 and 8 × 256 tokens (about 1.5–2 minutes); --shapes 16x512 needs about 14 GB for the peer
(3 float32 (N, V) tensors of 4.6 GiB) and minutes per pass.

    python benchmarks/logprob_memory.py [--shapes 2x256,8x256] [--chunks 256,1024,4096]
                                        [--repeats 1] [--dtype float32|bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from _common import (
    DTYPES,
    MiB,
    add_threads_argument,
    environment,
    load_average,
    parse_pairs,
    peak_temporary_bytes,
    print_markdown_table,
)
from torch import nn

HIDDEN = 896  # Qwen2.5-0.5B
VOCAB = 151936
WARMUP_TOKENS = 64


@dataclass
class Row:
    tokens: str  # "B×T"
    n: int  # B·T
    method: str
    chunk: int | None
    seconds: float
    peak: int  # bytes


# ------------------------------------------------------------------ inputs


def build_head(dtype: torch.dtype) -> nn.Linear:
    """A Qwen2.5-like LM head, random-init (N(0, 0.02²), as in Qwen2's init), frozen."""
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02)
    head.requires_grad_(False)
    return head


def make_inputs(B: int, T: int, dtype: torch.dtype, seed: int):
    """hidden (B, T, H) leaf requiring grad, targets (B, T), loss weights w (B, T) float32."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, HIDDEN, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (B, T), generator=g)
    w = torch.randn(B, T, generator=g)
    return hidden, targets, w


# ------------------------------------------------------------------ the two methods


def full_log_probs(hidden, head, targets):
    """The peer: the whole (B, T, V) logits, log-softmax, gather."""
    return torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[..., None]).squeeze(-1)


def ours_log_probs(chunk_size: int):
    from lora_grpo.algo.logprobs import chunked_log_probs

    def fn(hidden, head, targets):
        return chunked_log_probs(hidden, head, targets, chunk_size=chunk_size)[0]

    return fn


def forward_backward(method, hidden, head, targets, w) -> None:
    """One loss forward + backward; hidden.grad is left set (the caller clears it)."""
    loss = (method(hidden, head, targets) * w).sum()
    loss.backward()


# ------------------------------------------------------------------ measurements


def measure(method, hidden, head, targets, w, repeats: int) -> tuple[float, int]:
    """(median seconds over `repeats` passes, the first of them profiled; peak extra bytes)."""

    def one_pass():
        forward_backward(method, hidden, head, targets, w)

    times = []
    start = time.perf_counter()
    peak = peak_temporary_bytes(one_pass)
    times.append(time.perf_counter() - start)
    hidden.grad = None
    for _ in range(repeats - 1):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
        hidden.grad = None
    return statistics.median(times), peak


def methods(chunks: list[int]):
    return [("full logits (peer)", None, full_log_probs)] + [
        ("ours chunked", c, ours_log_probs(c)) for c in chunks
    ]


def warm_up(head, dtype, chunks) -> None:
    """Every method once at WARMUP_TOKENS, under the profiler: its first use in a process costs 1–2 s."""
    hidden, targets, w = make_inputs(1, WARMUP_TOKENS, dtype, seed=0)
    for _, _, method in methods(chunks):
        peak_temporary_bytes(lambda: forward_backward(method, hidden, head, targets, w))
        hidden.grad = None


def benchmark_shape(head, B: int, T: int, dtype, chunks: list[int], repeats: int) -> list[Row]:
    hidden, targets, w = make_inputs(B, T, dtype, seed=B * 10_000 + T)
    rows = []
    reference = None
    for name, chunk, method in methods(chunks):
        seconds, peak = measure(method, hidden, head, targets, w, repeats)
        rows.append(Row(f"{B}×{T}", B * T, name, chunk, seconds, peak))
        # Same numbers from every method (checked on a slice: a full recompute would double the runtime).
        with torch.no_grad():
            logp = method(hidden[:1, :64], head, targets[:1, :64]).float()
        if reference is None:
            reference = logp
        elif not torch.allclose(logp, reference, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"{name} (chunk {chunk}) disagrees with the full log-softmax")
    return rows


# ------------------------------------------------------------------ report


def print_table(rows: list[Row]) -> None:
    header = [
        "tokens",
        "method",
        "chunk",
        "time fwd+bwd (ms)",
        "peak extra (MiB)",
        "peak / block",
        "time vs full",
        "memory vs full",
    ]
    full = {r.tokens: r for r in rows if r.chunk is None}
    table = []
    for r in rows:
        f = full[r.tokens]
        table.append(
            [
                r.tokens,
                r.method,
                "-" if r.chunk is None else str(r.chunk),
                f"{r.seconds * 1e3:.0f}",
                f"{r.peak / MiB:.1f}",
                f"{r.peak / (min(r.chunk or r.n, r.n) * VOCAB * 4):.2f}",
                f"{r.seconds / f.seconds:.3g}",
                f"{r.peak / f.peak:.3g}",
            ]
        )
    print_markdown_table(header, table)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="2x256,8x256", help="comma-separated BATCHxLENGTH token shapes")
    p.add_argument("--chunks", default="256,1024,4096", help="comma-separated chunk sizes for ours")
    p.add_argument(
        "--repeats", type=int, default=1, help="timed passes per method (median; the first is profiled)"
    )
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of hidden and head")
    add_threads_argument(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    chunks = [int(c) for c in args.chunks.split(",")]
    shapes = parse_pairs(args.shapes)  # batch x length

    print(
        f"# {environment()}; head {HIDDEN} → {VOCAB}, {args.dtype}, frozen; grad for hidden only; "
        f"{args.repeats} timed pass(es), the first profiled, after a {WARMUP_TOKENS}-token warm-up"
    )
    start = time.perf_counter()
    head = build_head(dtype)
    warm_up(head, dtype, chunks)
    rows = []
    for B, T in shapes:
        rows += benchmark_shape(head, B, T, dtype, chunks, args.repeats)
    print_table(rows)
    for B, T in shapes:
        print(
            f"# {B}×{T} = {B * T} tokens: one float32 (N, V) logits tensor is {B * T * VOCAB * 4 / MiB:.0f} MiB; "
            f"one chunk of C tokens is C × {VOCAB * 4 / MiB:.3f} MiB"
        )
    print(f"# total {time.perf_counter() - start:.0f} s; load average at the end {load_average():.1f}")


if __name__ == "__main__":
    main()
