"""What each loss_type is, as facts that need no torch: how its loss is normalised, which
importance_sampling level it is meant for, and the warnings TRL 1.16 gives about it.

loss.LOSS_TYPES pairs each entry with its tensor functions (aggregation, objective); the config
checks (which load before torch), the update and the TRL front door read these facts, never the
loss type's name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossTypeFacts:
    """One loss_type's properties.

    per_micro_batch: normalised by the micro-batch's own token count (bnpo), so its value depends on
        which rows share a micro-batch; the others are normalised by the whole step's tokens or
        sequences, so rows that add nothing (zero advantage) can be left out of the update.
    sums_tokens: the policy term sums per-token contributions over the batch, so a sequence-level
        importance ratio weights each sequence by its length (TRL warns with importance_sampling
        'sequence').
    meant_for: the importance_sampling level its paper uses (None: either); with another one,
        `warning` (ours) and `trl_warning` (TRL's sentence) are given.
    ratio_cap: epsilon_high caps the ratio itself (cispo's ε_max), not 1 + epsilon_high.
    """

    per_micro_batch: bool = False
    sums_tokens: bool = False
    meant_for: str | None = None
    warning: str = ""
    trl_warning: str = ""
    ratio_cap: bool = False

    @property
    def zero_advantage_rows_skippable(self) -> bool:
        """Rows with zero advantage may be left out of the update without changing it."""
        return not self.per_micro_batch


LOSS_TYPE_FACTS: dict[str, LossTypeFacts] = {
    "grpo": LossTypeFacts(),
    "bnpo": LossTypeFacts(per_micro_batch=True, sums_tokens=True),
    "dapo": LossTypeFacts(sums_tokens=True),
    "dr_grpo": LossTypeFacts(sums_tokens=True),
    "cispo": LossTypeFacts(sums_tokens=True, ratio_cap=True),
    "sapo": LossTypeFacts(),
    "vespo": LossTypeFacts(
        meant_for="token",
        warning="loss_type='vespo' computes its own sequence weights from the token ratios; importance_sampling "
        "'sequence' has no effect on it",
        trl_warning="VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
        "should be set to `'token'` (the default).",
    ),
    "luspo": LossTypeFacts(
        meant_for="sequence",
        warning="loss_type='luspo' is meant for importance_sampling='sequence' (its paper's setup)",
        trl_warning="When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
        "mirror the paper's setup.",
    ),
}
