"""Sampling one token: the logit transforms and the draw, as small pure functions over (N, V) logits.

The transforms (repetition penalty, temperature, top-k, top-p, min-p) are applied in the order
transformers' ``generate`` uses; removed tokens get -inf.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# What a rollout over logits that were not finite says (rollout/generate.py; the trainer adds the fix).
NONFINITE_LOGITS = "the model's logits were inf or NaN"


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL penalty (Keskar et al. 2019, as in transformers): for tokens already in the sequence
    (``seen``: (N, V) bool), divide a positive logit by ``penalty`` and multiply a negative one."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_top_k(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits per row (ties with the k-th are kept); k = 0 is off."""
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter (Holtzman et al. 2020): keep the smallest set of most likely tokens whose probability
    reaches p. Computed as transformers' TopPLogitsWarper computes it (ascending sort, drop while the mass up to
    and including a token is <= 1 - p, keep the most likely), so that tokens tied at the cut, frequent with
    bfloat16 logits, are kept or dropped as `generate` (TRL's sampler) keeps or drops them."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False)
    drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - p
    drop_sorted[..., -1:] = False  # always keep the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Min-p filter (Nguyen et al. 2024): drop tokens whose probability is below
    ``min_p · max_prob``; min_p = 0 is off."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    threshold = min_p * probs.max(-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def warp_logits(logits: Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float) -> Tensor:
    """Temperature, then top-k, top-p, min-p (transformers' order). (N, V) -> (N, V) float32.
    Use this on full-forward logits to get the exact distribution the sampler drew from."""
    logits = logits.float() / temperature
    logits = apply_top_k(logits, top_k)
    logits = apply_top_p(logits, top_p)
    return apply_min_p(logits, min_p)


def sample_next(
    logits: Tensor,
    seen: Tensor | None,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repetition_penalty: float,
    generator: torch.Generator | None,
    overwrite: bool = False,
) -> tuple[Tensor, Tensor]:
    """One decoding step. logits (N, V) -> (tokens (N,) long, log-probs of those tokens (N,)).
    temperature == 0 is greedy (log-prob 0: the draw was deterministic; NaN for a row whose logits were not
    finite).

    Without top-k, top-p and min-p (the default), the (N, V) work reuses a buffer the function owns
    (a float32 copy of bf16 logits, the penalised logits) or, with ``overwrite``, the caller's
    logits: temperature and exp run in place, so one new (N, V) float32 tensor (the log-probs) is
    made instead of three (at Qwen2.5's 151,936-token vocabulary, 0.6 MB a row each). The values
    are the same operations on the same numbers, so the draws are the same bits either way."""
    own = overwrite or logits.dtype != torch.float32  # .float() of bf16 logits is a copy
    logits = logits.float()
    if seen is not None and repetition_penalty != 1.0:
        logits, own = apply_repetition_penalty(logits, seen, repetition_penalty), True
    if temperature == 0:
        tokens = logits.argmax(-1)
        # A row of overflowed logits (inf / NaN: a float16 model's activations past ±65504) has no argmax to speak
        # of (token 0 came out, quietly): its log-prob is NaN, which the rollout refuses (generate_rollout).
        finite = torch.isfinite(logits).all(-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device).masked_fill(
            ~finite, math.nan
        )
    if 0 < top_k < logits.size(-1) or top_p < 1.0 or min_p > 0.0:
        logprobs = warp_logits(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        ).log_softmax(-1)
        probs = logprobs.exp()
    else:  # x / 1.0 == x exactly, so temperature 1 skips the division
        if temperature != 1.0:
            logits, own = (logits.div_(temperature) if own else logits / temperature), True
        logprobs = logits.log_softmax(-1)
        probs = torch.exp(logprobs, out=logits) if own else logprobs.exp()
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
