"""The GRPO loss and its variants, as pure functions of tensors.

Per completion token t of sequence i (Shao et al. 2024, "DeepSeekMath", eq. 3):

    ℓ_{i,t} = −min(ρ_{i,t}·A_i, clip(ρ_{i,t}, 1−ε_low, 1+ε_high)·A_i) + β·k3_{i,t}

    ρ     = exp(logp − logp_old)                                   importance_sampling="token"
          = exp(masked mean over the sequence of (logp − logp_old))  "sequence" (GSPO, Zheng et al. 2025)
    k3    = exp(ref − logp) − (ref − logp) − 1                     (Schulman 2020, "Approximating KL")
    ε_high > ε_low is DAPO's clip-higher (Yu et al. 2025).

With kl_ratio_correction the k3 term is multiplied by the per-token ratio π_θ/π_old (DeepSeek-AI
2025, "DeepSeek-V3.2", unbiased KL estimate): E_{π_old}[ρ·∇k3 + k3·∇ρ] is the exact gradient of
KL(π_θ ‖ π_ref), which k3 alone is not once the batch is off-policy. On-policy ρ = 1, so the
value is unchanged; the gradient is not (k3·∇ρ is added).

Each loss_type is one record in LOSS_TYPES (its aggregation over the (B, T) token grid, mask 1
on tokens that count, and its gradient-accumulation scale); each importance_sampling level is one
record in IMPORTANCE_SAMPLING. config.py names the same keys (a test checks they agree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref); ≥ 0, exactly 0 where logp == ref_logp."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def _agg_grpo(x, mask, *, num_tokens, max_completion_length):
    # mean over each sequence's tokens, then over sequences (DeepSeekMath).
    per_seq = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.mean()


def _agg_bnpo(x, mask, *, num_tokens, max_completion_length):
    # every token of the micro-batch weighs the same.
    return _masked_sum(x, mask) / mask.sum().clamp(min=1)


def _agg_dapo(x, mask, *, num_tokens, max_completion_length):
    # every token of the whole generation batch weighs the same: a fixed denominator, so summing
    # micro-batch losses gives the full-batch loss exactly (DAPO's token-level loss).
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=x.dtype)
    return _masked_sum(x, mask) / denom.clamp(min=1)


def _agg_dr_grpo(x, mask, *, num_tokens, max_completion_length):
    # a constant denominator removes the length bias (Liu et al. 2025, "Dr. GRPO").
    if max_completion_length is None:
        raise ValueError("loss_type 'dr_grpo' needs max_completion_length (the generation limit)")
    return _masked_sum(x, mask) / (x.shape[0] * max_completion_length)


# Accumulation scales, (micro_sequences, total_sequences, num_micro_batches) → the factor that
# makes the sum of a step's micro-batch losses equal the loss of the whole step.
def _scale_one(micro_sequences: int, total_sequences: int, num_micro_batches: int) -> float:
    return 1.0  # already normalised by the step's token count


def _scale_per_micro_batch(micro_sequences: int, total_sequences: int, num_micro_batches: int) -> float:
    return 1.0 / num_micro_batches  # a mean per micro-batch: average the micro-batches


def _scale_sequence_share(micro_sequences: int, total_sequences: int, num_micro_batches: int) -> float:
    return micro_sequences / total_sequences  # an average over sequences: weight by the share of sequences


@dataclass(frozen=True)
class LossType:
    """One loss_type: how it aggregates the token grid and how its micro-batch losses add up."""

    aggregate: Callable[..., Tensor]  # (per_token (B, T), mask (B, T), *, num_tokens, max_completion_length) → ()
    accumulation_scale: Callable[[int, int, int], float]  # (micro_sequences, total_sequences, num_micro_batches)
    help: str


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(_agg_grpo, _scale_sequence_share, "mean over each sequence's tokens, then over sequences"),
    "bnpo": LossType(_agg_bnpo, _scale_per_micro_batch, "mean over the micro-batch's tokens"),
    "dapo": LossType(_agg_dapo, _scale_one, "sum over tokens / the step's token count (DAPO token-level loss)"),
    "dr_grpo": LossType(_agg_dr_grpo, _scale_sequence_share, "sum over tokens / (sequences × max_completion_length)"),
}


def _token_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    # GSPO: the length-normalised sequence log-ratio, broadcast back over the tokens.
    per_seq = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return per_seq.expand_as(log_ratio)


@dataclass(frozen=True)
class ImportanceSampling:
    """One importance_sampling level: the log-ratio the clipped ratio is built from."""

    log_ratio: Callable[[Tensor, Tensor], Tensor]  # (token log-ratio (B, T), mask (B, T)) → (B, T)
    help: str


IMPORTANCE_SAMPLING: dict[str, ImportanceSampling] = {
    "token": ImportanceSampling(_token_log_ratio, "one ratio per token"),
    "sequence": ImportanceSampling(_sequence_log_ratio, "one length-normalised ratio per sequence (GSPO)"),
}


def _variant(table: dict, kind: str, name: str):
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(table)}")
    return table[name]


def accumulation_scale(loss_type: str, micro_sequences: int, total_sequences: int, num_micro_batches: int) -> float:
    """Factor that makes the sum of micro-batch losses equal the loss of the whole step (LOSS_TYPES)."""
    scale = _variant(LOSS_TYPES, "loss_type", loss_type).accumulation_scale
    return scale(micro_sequences, total_sequences, num_micro_batches)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    num_tokens: int | float | None = None,
    importance_sampling: str = "token",
    kl_ratio_correction: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO loss of one micro-batch.

    logp (B, T): per-token log-probs under the policy, with grad. old_logp (B, T) or None
    (on-policy: logp.detach()). ref_logp (B, T) or None (only when beta == 0). advantages (B,).
    mask (B, T): 1 on completion tokens that count. Returns (scalar loss, metrics of plain floats).
    """
    aggregate = _variant(LOSS_TYPES, "loss_type", loss_type).aggregate
    ratio_log = _variant(IMPORTANCE_SAMPLING, "importance_sampling", importance_sampling).log_ratio
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp (reference log-probs); pass them or set beta = 0")
    mask = mask.to(logp.dtype)
    if old_logp is None:
        old_logp = logp.detach()
    token_log_ratio = logp - old_logp
    ratio = torch.exp(ratio_log(token_log_ratio, mask))
    adv = advantages.to(logp.dtype).unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)

    kl = None
    if beta != 0.0:
        kl = k3_kl(logp, ref_logp)
        kl_term = kl * torch.exp(token_log_ratio) if kl_ratio_correction else kl
        per_token = per_token + beta * kl_term

    loss = aggregate(per_token, mask, num_tokens=num_tokens, max_completion_length=max_completion_length)

    with torch.no_grad():
        count = mask.sum().clamp(min=1)

        def masked_mean(x: Tensor) -> float:
            return ((x * mask).sum() / count).item()

        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        metrics = {
            "kl": masked_mean(kl) if kl is not None else 0.0,
            "clip_ratio/low": masked_mean(low.to(mask.dtype)),
            "clip_ratio/high": masked_mean(high.to(mask.dtype)),
            "clip_ratio/region": masked_mean((low | high).to(mask.dtype)),
            "ratio": masked_mean(ratio),
        }
    return loss, metrics
