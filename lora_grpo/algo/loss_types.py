"""Every loss_type in one registry (LOSS_TYPES): each one's objective, aggregation and facts, as
records that need no torch. The names are TRL 1.16's; so are the formulas.

    grpo     the clipped objective; mean over each sequence's tokens, then over sequences (DeepSeekMath)
    bnpo     the clipped objective; mean over the micro-batch's tokens
    dapo     the clipped objective; sum over tokens / the step's token count (DAPO's token-level loss,
             Yu et al. 2025; with several steps to a generation, the generation's tokens per step, as TRL)
    dr_grpo  the clipped objective; sum over tokens / (sequences × max_completion_length) (Liu et al.
             2025, "Dr. GRPO": a constant denominator removes the length bias)
    cispo    −sg(min(ρ, ε_high))·A·logp (MiniMax 2025, "MiniMax-M1"; ε_high is ScaleRL's ε_max, about 5,
             a cap on ρ itself, not 1 + ε_high); aggregated as dapo
    sapo     −σ(τ·(ρ − 1))·(4/τ)·A, τ = τ_pos where A > 0, else τ_neg ("Soft Adaptive Policy
             Optimization", arXiv 2511.20347); aggregated as grpo
    vespo    −sg(φ(w))·A·logp, w = exp(Σ_t log ρ_t) per sequence (a sum, not GSPO's mean),
             φ(w) = e^λ·w^k·e^{−λw} ("VESPO", arXiv 2602.10693); aggregated as dapo
    luspo    the clipped objective, summed over each sequence's tokens, mean over sequences ("LUSPO",
             arXiv 2602.05261: GSPO scaled by length; meant for importance_sampling="sequence")

loss.py holds the tensor functions of each Objective and Aggregation; the config (its choices, its
default, its help text), the config checks, the update and the TRL front door read this registry,
never a loss type's name. The config loads without torch, so nothing here imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Objective(Enum):
    """A loss type's per-token policy term (loss.OBJECTIVES holds each one's tensor function)."""

    CLIPPED = "min(ρ·A, clip(ρ, 1 − epsilon_low, 1 + epsilon_high)·A)"
    CAPPED_RATIO = "detached ratio capped at epsilon_high × A × logp"
    SOFT_GATE = "sigmoid soft gate for the clip"
    GAMMA_WEIGHT = "detached gamma weight of the sequence ratio × A × logp"


class Aggregation(Enum):
    """How a loss type reduces the per-token losses (B, T) over the mask, which also fixes how its
    micro-batch losses add up to the step's (loss.AGGREGATIONS holds both functions of each)."""

    SEQUENCE_MEAN = "mean over each sequence's tokens, then over sequences"
    MICRO_BATCH_TOKEN_MEAN = "mean over the micro-batch's tokens"
    STEP_TOKEN_MEAN = "sum over tokens / the step's token count"
    LENGTH_BUDGET = "sum over tokens / (sequences × max_completion_length)"
    SEQUENCE_SUM_MEAN = "sum over each sequence's tokens, mean of those"


@dataclass(frozen=True)
class LossType:
    """One loss_type: everything about it.

    aggregation, objective: its tensor math, by what it does (loss.AGGREGATIONS, loss.OBJECTIVES).
    sums_tokens: the policy term sums per-token contributions over the batch, so a sequence-level
        importance ratio weights each sequence by its length (TRL warns with importance_sampling
        'sequence': trl_sequence_level_warning).
    meant_for: the importance_sampling level its paper uses (None: either); with another one,
        `warning` (ours) and `trl_warning` (TRL's sentence) are given.
    ratio_cap: epsilon_high caps the ratio itself (cispo's ε_max), not 1 + epsilon_high.
    trl_vllm_error: TRL's error when it runs with use_vllm and a sequence-level vllm_importance_sampling_mode
        (the TRL front door raises it too: trl/checks.py).
    """

    aggregation: Aggregation
    objective: Objective = Objective.CLIPPED
    sums_tokens: bool = False
    meant_for: str | None = None
    warning: str = ""
    trl_warning: str = ""
    ratio_cap: bool = False
    trl_vllm_error: str = ""

    @property
    def help(self) -> str:
        """One line: its objective (when not the clipped one) and its aggregation."""
        if self.objective is Objective.CLIPPED:
            return self.aggregation.value
        return f"{self.objective.value}; {self.aggregation.value}"

    @property
    def per_micro_batch(self) -> bool:
        """Normalised by the micro-batch's own token count, so its value depends on which rows share
        a micro-batch; the others are normalised by the whole step's tokens or sequences."""
        return self.aggregation is Aggregation.MICRO_BATCH_TOKEN_MEAN

    @property
    def zero_advantage_rows_skippable(self) -> bool:
        """Rows with zero advantage may be left out of the update without changing it."""
        return not self.per_micro_batch


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(Aggregation.SEQUENCE_MEAN),
    "bnpo": LossType(Aggregation.MICRO_BATCH_TOKEN_MEAN, sums_tokens=True),
    "dapo": LossType(Aggregation.STEP_TOKEN_MEAN, sums_tokens=True),
    "dr_grpo": LossType(Aggregation.LENGTH_BUDGET, sums_tokens=True),
    "cispo": LossType(Aggregation.STEP_TOKEN_MEAN, Objective.CAPPED_RATIO, sums_tokens=True, ratio_cap=True),
    "sapo": LossType(Aggregation.SEQUENCE_MEAN, Objective.SOFT_GATE),
    "vespo": LossType(
        Aggregation.STEP_TOKEN_MEAN,
        Objective.GAMMA_WEIGHT,
        meant_for="token",
        warning="loss_type='vespo' computes its own sequence weights from the token ratios; importance_sampling "
        "'sequence' has no effect on it",
        trl_warning="VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
        "should be set to `'token'` (the default).",
        trl_vllm_error="VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
        "'token_mask'.",
    ),
    "luspo": LossType(
        Aggregation.SEQUENCE_SUM_MEAN,
        meant_for="sequence",
        warning="loss_type='luspo' is meant for importance_sampling='sequence' (its paper's setup)",
        trl_warning="When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
        "mirror the paper's setup.",
    ),
}

# lora_grpo's default (TRL 1.16's too).
DEFAULT_LOSS_TYPE = "dapo"
# What TRL's sequence-level warning recommends instead of a loss type that sums_tokens (GSPO's setup).
SEQUENCE_LEVEL_LOSS_TYPE = "grpo"


def loss_types_using(objective: Objective) -> str:
    """The names of the loss types with this objective ("a / b"), for the help of its options."""
    return " / ".join(name for name, entry in LOSS_TYPES.items() if entry.objective is objective)


def loss_type_help() -> str:
    """The loss_type field's help (lora_grpo's config and the TRL front door's): every name."""
    return f"objective and token aggregation: {' | '.join(LOSS_TYPES)} (TRL's names and formulas)"


def trl_sequence_level_warning(loss_type: str) -> str:
    """TRL 1.16's warning for a loss type that sums_tokens under importance_sampling 'sequence'."""
    return (
        f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token "
        "contributions, which effectively weights each sequence by its completion length instead of "
        "optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set "
        f"`loss_type='{SEQUENCE_LEVEL_LOSS_TYPE}'`."
    )
