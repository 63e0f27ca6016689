"""The GRPO loss and its variants, as pure functions of tensors.

Per completion token t of sequence i (Shao et al. 2024, "DeepSeekMath", eq. 3):

    ℓ_{i,t} = −min(ρ_{i,t}·A_i, clip(ρ_{i,t}, 1−ε_low, 1+ε_high)·A_i) + β·k3_{i,t}

    ρ     = exp(logp − logp_old)                                   importance_sampling="token"
          = exp(masked mean over the sequence of (logp − logp_old))  "sequence" (GSPO, Zheng et al. 2025)
    k3    = exp(ref − logp) − (ref − logp) − 1                     (Schulman 2020, "Approximating KL")
    ε_high > ε_low is DAPO's clip-higher (Yu et al. 2025).

The policy term −min(...) is the clipped objective; a loss type may use another (loss_types.Objective:
OBJECTIVES here), and each loss type aggregates the token grid its own way (loss_types.Aggregation:
AGGREGATIONS here). Which loss type uses which, with its paper and formula, is loss_types.LOSS_TYPES.

delta caps the first ρ of the clipped term from above (INTELLECT-2, Prime Intellect 2025): a
negative-advantage token with ρ ≫ 1 no longer has an unbounded loss. The policy term (not the KL)
can be restricted to high-entropy tokens (top_entropy_quantile; Wang et al. 2025, "Beyond the 80/20
rule") and to on-policy sequences (off_policy_mask_threshold; DeepSeek-AI 2025, "DeepSeek-V3.2",
eq. 9); entropy_coef subtracts coef × the mean token entropy (Skywork-OR1, He et al. 2025, whose
adaptive coefficient is AdaptiveEntropy). Each option sits where TRL 1.16's _compute_loss puts it.

With kl_ratio_correction the k3 term is multiplied by the per-token ratio π_θ/π_old (DeepSeek-AI
2025, "DeepSeek-V3.2", unbiased KL estimate): E_{π_old}[ρ·∇k3 + k3·∇ρ] is the exact gradient of
KL(π_θ ‖ π_ref), which k3 alone is not once the batch is off-policy. On-policy ρ = 1, so the
value is unchanged; the gradient is not (k3·∇ρ is added). Deliberate deviation: TRL multiplies by
its importance weight, which is the sequence ratio under importance_sampling="sequence"; the
per-token ratio here keeps the estimate unbiased at both levels.

Each loss_type is one record of the registry loss_types.LOSS_TYPES (its objective, its aggregation
over the (B, T) token grid, mask 1 on tokens that count, and so its gradient-accumulation scale; the
importance_sampling it is meant for, TRL's warnings); each importance_sampling level is one record in
IMPORTANCE_SAMPLING. grpo_loss's options are one LossSettings, built once from a run's config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .loss_types import DEFAULT_LOSS_TYPE, LOSS_TYPES, Aggregation, Objective

__all__ = ["LOSS_TYPES", "LossSettings", "grpo_loss"]

Tensor = torch.Tensor


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref); ≥ 0, exactly 0 where logp == ref_logp."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def _sequence_mean(x, mask, *, num_tokens, max_completion_length):
    # mean over each sequence's tokens, then over sequences (DeepSeekMath).
    per_seq = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.mean()


def _micro_batch_token_mean(x, mask, *, num_tokens, max_completion_length):
    # every token of the micro-batch weighs the same.
    return _masked_sum(x, mask) / mask.sum().clamp(min=1)


def _step_token_mean(x, mask, *, num_tokens, max_completion_length):
    # every token of the whole generation batch weighs the same: a fixed denominator, so summing
    # micro-batch losses gives the full-batch loss exactly (DAPO's token-level loss).
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=x.dtype)
    return _masked_sum(x, mask) / denom.clamp(min=1)


def _length_budget(x, mask, *, num_tokens, max_completion_length):
    # a constant denominator removes the length bias (Liu et al. 2025, "Dr. GRPO").
    if max_completion_length is None:
        raise ValueError(
            f"a loss type aggregated as {Aggregation.LENGTH_BUDGET.value!r} needs max_completion_length "
            "(the generation limit)"
        )
    return _masked_sum(x, mask) / (x.shape[0] * max_completion_length)


def _sequence_sum_mean(x, mask, *, num_tokens, max_completion_length):
    # a sum over each sequence's tokens: a sequence weighs by its length (LUSPO).
    return (x * mask).sum(dim=1).mean()


# Accumulation scales, (micro_sequences, total_sequences, num_micro_batches) → the factor that
# makes the sum of a step's micro-batch losses equal the loss of the whole step. TRL divides the
# per-sequence means (the aggregations over sequences) by the number of micro-batches; the sequence
# share is the same when micro-batches hold equal numbers of sequences, and exact when they do not.
def _scale_one(micro_sequences: int, total_sequences: int, num_micro_batches: int) -> float:
    return 1.0  # already normalised by the step's token count


def _scale_per_micro_batch(micro_sequences: int, total_sequences: int, num_micro_batches: int) -> float:
    return 1.0 / num_micro_batches  # a mean per micro-batch: average the micro-batches


def _scale_sequence_share(micro_sequences: int, total_sequences: int, num_micro_batches: int) -> float:
    return micro_sequences / total_sequences  # an average over sequences: weight by the share of sequences


def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)


@dataclass(frozen=True)
class LossSettings:
    """grpo_loss's options (TRL 1.16's, under their names), built once from a run's config
    (from_config); every field is the config field of the same name."""

    loss_type: str = DEFAULT_LOSS_TYPE
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    max_completion_length: int | None = None
    importance_sampling: str = "token"
    kl_ratio_correction: bool = True
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0

    @classmethod
    def from_config(cls, config) -> LossSettings:
        """The settings of a config (any object with these fields: GRPOConfig)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class PolicyInputs:
    """What an objective sees: ratio (B, T) at the importance_sampling level, token_log_ratio (B, T)
    (logp − old_logp), logp (B, T) with grad, advantages (B, 1), mask (B, T), and the settings."""

    ratio: Tensor
    token_log_ratio: Tensor
    logp: Tensor
    adv: Tensor
    mask: Tensor
    settings: LossSettings


def _clipped(p: PolicyInputs):
    s = p.settings
    clipped = torch.clamp(p.ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    ratio = p.ratio if s.delta is None else torch.clamp(p.ratio, max=s.delta)  # INTELLECT-2
    per_token = -torch.minimum(ratio * p.adv, clipped * p.adv)
    # As TRL, the clip fractions look at the delta-capped ratio.
    low = (ratio < 1 - s.epsilon_low) & (p.adv < 0)
    high = (ratio > 1 + s.epsilon_high) & (p.adv > 0)
    sequence_level = s.importance_sampling == "sequence"
    return per_token, {
        **{
            name: _token_mean(x, p.mask)
            for name, x in [
                ("clip_ratio/low", low),
                ("clip_ratio/high", high),
                ("clip_ratio/region", low | high),
            ]
        },
        SEQUENCE_LOW_CLIP: sequence_clip_fraction(low, p.mask, sequence_level),
        SEQUENCE_HIGH_CLIP: sequence_clip_fraction(high, p.mask, sequence_level),
    }


# grpo_loss's (B,) metrics (every other metric is 0-d): each completion's share of clipped tokens, which
# the update turns into clip_ratio/low_min and clip_ratio/high_max (clip_fraction_extremes).
SEQUENCE_LOW_CLIP = "clip_ratio/low_per_sequence"
SEQUENCE_HIGH_CLIP = "clip_ratio/high_per_sequence"


def sequence_clip_fraction(clipped: Tensor, mask: Tensor, sequence_level: bool) -> Tensor:
    """(B,) float: each sequence's share of its mask's tokens that are clipped; NaN for a sequence
    without tokens. clipped, mask (B, T). sequence_level (importance_sampling="sequence"): one ratio
    per sequence, so its one indicator, as TRL's masked_seq_mean (0, not NaN, for a sequence
    without tokens, whose ratio is 1)."""
    if sequence_level:
        return clipped[:, 0].to(mask.dtype)
    return (clipped.to(mask.dtype) * mask).sum(dim=1) / mask.sum(dim=1)


def _nan_extreme(x: Tensor, largest: bool, dim: int) -> Tensor:
    """min (largest False) or max of x along dim, NaN left out; NaN where every value is NaN (TRL's nanmin/nanmax)."""
    fill = torch.full_like(x, -math.inf if largest else math.inf)
    filled = torch.where(torch.isnan(x), fill, x)
    out = filled.amax(dim=dim) if largest else filled.amin(dim=dim)
    return torch.where(torch.isnan(x).all(dim=dim), torch.full_like(out, math.nan), out)


def clip_fraction_extremes(
    low: Tensor, high: Tensor, group_size: int, gather: Callable[[Tensor], Tensor] | None = None
) -> dict[str, float]:
    """TRL 1.16's clip_ratio/low_min and clip_ratio/high_max of one optimizer step.

    low, high (N,): the step's per-completion clip fractions on this process (sequence_clip_fraction,
    NaN for a completion without loss tokens), in batch order. TRL takes, per micro-step (group_size
    completions on each process, gathered over the processes), the min of the low fractions and the
    max of the high ones, NaN left out, and logs their mean over the micro-steps: so here, cut into
    consecutive groups of group_size (the last may be shorter), each group's extreme over every
    process's same group (gather: a (G,) tensor → (processes · G,) concatenated; None for one
    process), mean over the groups that have a value (NaN when none has)."""
    n = low.shape[0]
    starts = range(0, n, group_size)
    mins = torch.stack([_nan_extreme(low[i : i + group_size], False, 0) for i in starts])
    maxs = torch.stack([_nan_extreme(high[i : i + group_size], True, 0) for i in starts])
    if gather is not None:
        mins = _nan_extreme(gather(mins).reshape(-1, mins.shape[0]), False, 0)
        maxs = _nan_extreme(gather(maxs).reshape(-1, maxs.shape[0]), True, 0)
    return {
        "clip_ratio/low_min": _nan_mean(mins),
        "clip_ratio/high_max": _nan_mean(maxs),
    }


def _nan_mean(x: Tensor) -> float:
    kept = x[~torch.isnan(x)]
    return kept.mean().item() if kept.numel() else math.nan


def _capped_ratio(p: PolicyInputs):
    # The ratio only weighs the REINFORCE gradient A·∇logp, so clipped tokens still carry gradient.
    eps = p.settings.epsilon_high
    weight = torch.clamp(p.ratio, max=eps).detach()
    return -weight * p.adv * p.logp, {"cispo_clip_ratio": _token_mean((p.ratio > eps) & (p.adv > 0), p.mask)}


def _soft_gate(p: PolicyInputs):
    # A smooth gate instead of a hard clip: d/dρ = 4σ(1−σ) is 1 at ρ = 1 and decays off-policy.
    s = p.settings
    tau = torch.where(
        p.adv > 0,
        torch.full_like(p.adv, s.sapo_temperature_pos),
        torch.full_like(p.adv, s.sapo_temperature_neg),
    )
    return -torch.sigmoid(tau * (p.ratio - 1)) * 4 / tau * p.adv, {}


@torch.no_grad()
def vespo_weights(
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> Tensor:
    """VESPO's gamma weights φ(w) = exp(λ + k·log w − λ·w), (B, 1), no grad. token_log_ratio (B, T):
    logp − old_logp; advantages (B,) pick (k, λ) by A ≥ 0 or not; mask (B, T). As TRL: log w =
    Σ_t clamp(log ρ_t, ±20), clamped to [log 1e-8, 20]; a non-finite φ becomes 0."""
    adv = advantages.reshape(-1, 1)
    log_w = (token_log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=-1, keepdim=True).clamp(math.log(1e-8), 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(nonneg, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg)).clamp(
        min=1e-4
    )
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _gamma_weight(p: PolicyInputs):
    s = p.settings
    phi = vespo_weights(
        p.token_log_ratio,
        p.adv,
        p.mask,
        k_pos=s.vespo_k_pos,
        lambda_pos=s.vespo_lambda_pos,
        k_neg=s.vespo_k_neg,
        lambda_neg=s.vespo_lambda_neg,
    )
    return -phi * p.adv * p.logp, {"vespo/phi_seq_mean": phi.mean()}  # over sequences, as TRL


@dataclass(frozen=True)
class AggregationFunctions:
    """One loss_types.Aggregation's tensor functions: how it reduces the token grid, and how its
    micro-batch losses add up to the step's."""

    aggregate: Callable[
        ..., Tensor
    ]  # (per_token (B, T), mask (B, T), *, num_tokens, max_completion_length) → ()
    accumulation_scale: Callable[
        [int, int, int], float
    ]  # (micro_sequences, total_sequences, num_micro_batches)


AGGREGATIONS: dict[Aggregation, AggregationFunctions] = {
    Aggregation.SEQUENCE_MEAN: AggregationFunctions(_sequence_mean, _scale_sequence_share),
    Aggregation.MICRO_BATCH_TOKEN_MEAN: AggregationFunctions(_micro_batch_token_mean, _scale_per_micro_batch),
    Aggregation.STEP_TOKEN_MEAN: AggregationFunctions(_step_token_mean, _scale_one),
    Aggregation.LENGTH_BUDGET: AggregationFunctions(_length_budget, _scale_sequence_share),
    Aggregation.SEQUENCE_SUM_MEAN: AggregationFunctions(_sequence_sum_mean, _scale_sequence_share),
}
# Each loss_types.Objective's per-token policy term: PolicyInputs → (loss (B, T), 0-d metrics).
OBJECTIVES: dict[Objective, Callable[[PolicyInputs], tuple[Tensor, dict[str, Tensor]]]] = {
    Objective.CLIPPED: _clipped,
    Objective.CAPPED_RATIO: _capped_ratio,
    Objective.SOFT_GATE: _soft_gate,
    Objective.GAMMA_WEIGHT: _gamma_weight,
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


def accumulation_scale(
    loss_type: str, micro_sequences: int, total_sequences: int, num_micro_batches: int
) -> float:
    """Factor that makes the sum of micro-batch losses equal the loss of the whole step (the loss
    type's aggregation's, AGGREGATIONS)."""
    scale = AGGREGATIONS[_variant(LOSS_TYPES, "loss_type", loss_type).aggregation].accumulation_scale
    return scale(micro_sequences, total_sequences, num_micro_batches)


QUANTILE_LIMIT = 2**24  # torch.quantile refuses larger inputs ("input tensor is too large")


def _linear_quantile(values: Tensor, q: float, limit: int = QUANTILE_LIMIT) -> Tensor:
    """torch.quantile(values, q) (linear interpolation); beyond its size limit the same formula on a sort."""
    if values.numel() <= limit:
        return torch.quantile(values, q)
    ordered = values.sort().values
    rank = torch.tensor(q, dtype=values.dtype, device=values.device) * (values.numel() - 1)
    below, above = rank.floor().long(), rank.ceil().long()
    return torch.lerp(ordered[below], ordered[above], rank - below)


def entropy_threshold(
    entropies: Tensor, mask: Tensor, quantile: float, gather: Callable[[Tensor], Tensor] | None = None
) -> Tensor | None:
    """The entropy above which a token is in the top ``quantile`` of every process's tokens, or None
    when there are no tokens anywhere.

    entropies, mask (B, T). gather: concatenates a 1-D tensor over processes (sizes may differ); None
    for one process (``padded_gather`` adapts accelerate). As TRL: torch.quantile (linear
    interpolation) at 1 − quantile over the float32 entropies of the masked tokens.
    """
    local = entropies.detach()[mask.bool()].float()
    values = gather(local) if gather is not None else local
    return None if values.numel() == 0 else _linear_quantile(values, 1 - quantile)


def high_entropy_mask(
    entropies: Tensor, mask: Tensor, quantile: float, gather: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """(B, T) bool: masked tokens whose entropy is ≥ the threshold (ties at it are kept), as TRL."""
    threshold = entropy_threshold(entropies, mask, quantile, gather)
    if threshold is None:
        return torch.zeros_like(mask, dtype=torch.bool)
    return (entropies.detach() * mask >= threshold) & mask.bool()


def padded_gather(accelerator) -> Callable[[Tensor], Tensor]:
    """entropy_threshold's gather over accelerate's processes: pad to the longest, gather, drop the
    padding (entropies are ≥ 0, so the pad value −1 is never an entropy). Every process must call it."""

    def gather(x: Tensor) -> Tensor:
        out = accelerator.gather(accelerator.pad_across_processes(x, dim=0, pad_index=-1.0))
        return out[out != -1.0]

    return gather


def off_policy_mask(
    advantages: Tensor, logp: Tensor, sampling_logp: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """(B, 1) float, 0 for a sequence to drop: A < 0 and mean_t(sampling_logp − logp) > threshold
    (DeepSeek-V3.2's off-policy sequence mask, eq. 9). Tokens whose sampling log-prob is NaN count as 0 KL."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return ((advantages.reshape(-1, 1) >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def mean_entropy(entropies: Tensor, mask: Tensor) -> Tensor:
    """H of L = L_policy − coef·H: the token mean over mask, whatever the loss type (TRL); with grad."""
    return (entropies * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings | None = None,
    *,
    num_tokens: int | float | None = None,
    sampling_logp: Tensor | None = None,
    entropies: Tensor | None = None,
    entropy_gather: Callable[[Tensor], Tensor] | None = None,
    entropy_coef: float = 0.0,
    entropy_bonus: bool | None = None,
    accumulation: tuple[int, int, int] | None = None,
    tensor_metrics: bool = False,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO loss of one micro-batch.

    settings: the loss type and its options (LossSettings; None: its defaults); options: LossSettings
    fields by name, over those of `settings` (beta=0.04, epsilon_high=0.28, ...).

    logp (B, T): per-token log-probs under the policy, with grad. old_logp (B, T) or None
    (on-policy: logp.detach()). ref_logp (B, T) or None (only when beta == 0). advantages (B,).
    mask (B, T): 1 on completion tokens that count. Returns (scalar loss, metrics of plain floats;
    with tensor_metrics, detached 0-d tensors, read without a device sync here, and for the clipped
    loss types two (B,) ones: SEQUENCE_LOW_CLIP and SEQUENCE_HIGH_CLIP, each completion's clipped share).

    sampling_logp (B, T): the sampler's log-probs, for off_policy_mask_threshold (default old_logp).
    entropies (B, T): per-token entropies, needed by top_entropy_quantile < 1 (entropy_gather: see
    entropy_threshold) and by entropy_coef != 0, where they must carry grad. entropy_bonus: the run has an
    entropy bonus, so the policy term is logged apart (policy_loss), as TRL logs it, also at a step whose
    adaptive coefficient is 0 (None: entropy_coef != 0). accumulation:
    (micro_sequences, total_sequences, num_micro_batches); when given, the returned loss is this
    micro-batch's share of the step (the policy and KL terms scaled by the loss type's
    accumulation_scale, the entropy bonus, a mean per micro-batch, by 1 / num_micro_batches), so
    do not scale it again; None: this micro-batch is the whole step.
    """
    s = dataclasses.replace(settings or LossSettings(), **options)
    spec = _variant(LOSS_TYPES, "loss_type", s.loss_type)
    aggregation = AGGREGATIONS[spec.aggregation]
    ratio_log = _variant(IMPORTANCE_SAMPLING, "importance_sampling", s.importance_sampling).log_ratio
    beta, top_entropy_quantile = s.beta, s.top_entropy_quantile
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp (reference log-probs); pass them or set beta = 0")
    if (top_entropy_quantile < 1.0 or entropy_coef != 0.0) and entropies is None:
        raise ValueError(
            "top_entropy_quantile < 1 or entropy_coef != 0 needs entropies= (B, T) per-token entropies"
        )
    if entropy_coef != 0.0 and logp.requires_grad and not entropies.requires_grad:
        raise ValueError(
            "entropy_coef != 0 needs entropies with grad (they carry none, so the bonus would not train); "
            "compute them differentiably or set entropy_coef = 0"
        )
    mask = mask.to(logp.dtype)
    if old_logp is None:
        old_logp = logp.detach()
    token_log_ratio = logp - old_logp
    ratio = torch.exp(ratio_log(token_log_ratio, mask))
    adv = advantages.to(logp.dtype).unsqueeze(1)
    objective = OBJECTIVES[spec.objective]
    per_token, extra = objective(PolicyInputs(ratio, token_log_ratio, logp, adv, mask, s))

    # The masks act on the policy term only; the KL below still counts on every token (TRL).
    if s.off_policy_mask_threshold is not None:
        sampled = old_logp if sampling_logp is None else sampling_logp
        per_token = per_token * off_policy_mask(advantages, logp, sampled, mask, s.off_policy_mask_threshold)
    bonus_mask = mask
    if top_entropy_quantile < 1.0:  # bonus_mask: the tokens the policy term acts on (TRL's effective mask)
        bonus_mask = mask * high_entropy_mask(entropies, mask, top_entropy_quantile, entropy_gather).to(
            mask.dtype
        )
        per_token = per_token * bonus_mask

    kl = None
    if beta != 0.0:
        kl = k3_kl(logp, ref_logp)
        kl_term = kl * torch.exp(token_log_ratio) if s.kl_ratio_correction else kl
        per_token = per_token + beta * kl_term

    loss = aggregation.aggregate(
        per_token, mask, num_tokens=num_tokens, max_completion_length=s.max_completion_length
    )
    policy_loss, num_micro_batches = loss.detach(), (accumulation or (1, 1, 1))[2]
    if accumulation is not None:
        loss = loss * aggregation.accumulation_scale(*accumulation)
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * mean_entropy(entropies, bonus_mask) / num_micro_batches

    with torch.no_grad():
        metrics = {
            "kl": _token_mean(kl, mask) if kl is not None else torch.zeros((), device=mask.device),
            "ratio": _token_mean(ratio, mask),
            **extra,
        }
        if entropy_coef != 0.0 if entropy_bonus is None else entropy_bonus:
            metrics["policy_loss"] = policy_loss
    if tensor_metrics:
        return loss, metrics
    return loss, {name: x.item() for name, x in metrics.items() if x.dim() == 0}


@dataclass
class AdaptiveEntropy:
    """Skywork-OR1's adaptive entropy coefficient (He et al. 2025, arXiv 2505.22312), as TRL 1.16 runs it.

    Per optimizer step: every micro-batch's loss uses ``applied_coef`` (coefficient and gate from
    the end of the previous step, so the step applies one bonus; 0 before a first measurement and
    while the last one is above ``target``) and ``accumulate`` gets its entropies; after the last
    micro-batch ``step`` measures the token-mean entropy over every process and moves ``coef`` by
    ``delta``: up when entropy ≤ target, down otherwise, within [coef_min, coef_max].
    """

    coef: float = 0.0
    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0
    last_world_entropy: float = math.inf
    _window: Tensor | None = field(default=None, repr=False, compare=False)  # (entropy sum, tokens) so far

    @property
    def applied_coef(self) -> float:
        """The entropy_coef for grpo_loss during this step."""
        return self.coef if self.last_world_entropy <= self.target else 0.0

    def accumulate(
        self,
        entropies: Tensor,
        mask: Tensor,
        top_entropy_quantile: float = 1.0,
        gather: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """Add one micro-batch's entropies (B, T) over mask (B, T), restricted as grpo_loss does by
        top_entropy_quantile (every process must then call it, as entropy_threshold gathers)."""
        mask = mask.to(entropies.dtype)
        if top_entropy_quantile < 1.0:
            mask = mask * high_entropy_mask(entropies, mask, top_entropy_quantile, gather).to(mask.dtype)
        stats = torch.stack([(entropies.detach().double() * mask).sum(), mask.double().sum()])
        self._window = stats if self._window is None else self._window + stats

    def step(self, reduce: Callable[[Tensor], Tensor] | None = None) -> float:
        """End of an optimizer step: ``reduce`` sums a tensor over processes (e.g. accelerator.reduce
        with reduction="sum"; None for one process). Updates the coefficient; returns the entropy."""
        if self._window is None:
            raise ValueError("AdaptiveEntropy.step before any accumulate: no entropies measured this step")
        totals, self._window = (reduce(self._window) if reduce is not None else self._window), None
        self.update(world := (totals[0] / totals[1].clamp(min=1)).item())
        return world

    def update(self, world_mean_entropy: float) -> None:
        """The controller's rule, given the step's token-mean entropy over every process."""
        if world_mean_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_world_entropy = float(world_mean_entropy)

    def state_dict(self) -> dict[str, float]:
        """The state a checkpoint needs (TRL's entropy_ctrl_state.json keys; inf before a first step)."""
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_world_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_world_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
        self._window = None
