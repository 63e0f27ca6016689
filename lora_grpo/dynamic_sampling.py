"""Dynamic sampling (DAPO, Yu et al. 2025, §3.2): a step trains on groups that carry a learning signal.

A group whose G rewards are all equal has zero advantage on every completion: no policy gradient,
only the KL pull, yet it costs its share of the reference forward and of the backward. With
``dynamic_sampling`` a step samples in rounds:

    round 1: prompts ─► rollout ─► rewards ─► informative groups kept, the others dropped
    round 2: the next prompts (the data position moves on) ─► ... until the step holds
             prompts_per_generation informative groups, or dynamic_sampling_max_rounds rounds (or the
             epochs' prompts) are spent
    the step: the first prompts_per_generation informative groups in sampling order; a step left short
             is filled with dropped groups, the earliest first

A group is informative when its rewards are not all equal: the weighted rewards for
multi_objective_aggregation "sum_then_normalize", at least one function's scores for
"normalize_then_sum" (GDPO normalises each function in its group, so one varying function is
signal). Equality is exact: a reward model's near-tie is signal. ``dynamic_sampling_min_std`` > 0
also drops groups whose (unbiased) std is below it.

Why a short step is filled rather than trained smaller: the step keeps its shape, so every process
runs the same micro-batches and optimizer steps (their collectives match) and the memory plan holds.
A filling group has zero advantage: with beta = 0 it adds nothing to the gradient (and the update
leaves it out, update.zero_gradient_rows), with beta > 0 only the KL pull, as in plain GRPO. The
metrics say how many groups filled the step.

Each process fills its own quota from its own share of the prompts; a group never splits across
processes. Nothing here is random: the rounds' sampling draws from the run's sampling generator and
the prompts from the data position, both saved in every checkpoint, so a resumed run samples the
same rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .algo.advantages import weighted_sum
from .rollout import Rollout
from .scorer import Scored

Tensor = torch.Tensor


def informative_groups(
    per_func: Tensor,
    weights: list[float] | None,
    group_size: int,
    aggregation: str = "sum_then_normalize",
    min_std: float = 0.0,
) -> Tensor:
    """(P,) bool: the groups whose rewards are not all equal (and, with min_std > 0, whose std is at
    least min_std). per_func (P·G, F), NaN where a function returned None; a group with NaN in its
    weighted rewards (a row no function scored) counts as informative, so TRL's warning about it is
    logged, not hidden."""
    w = torch.ones(per_func.shape[1]) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    if aggregation == "normalize_then_sum":
        # one table per function (P, G, F); a None is left out of that function's comparison
        groups = per_func.float().view(-1, group_size, per_func.shape[1])
        highest = groups.nan_to_num(nan=-torch.inf).amax(dim=1)
        lowest = groups.nan_to_num(nan=torch.inf).amin(dim=1)
        varies = (highest > lowest) & (w != 0)
        if min_std > 0:
            count = (~groups.isnan()).sum(dim=1)
            centred = groups - groups.nanmean(dim=1, keepdim=True)
            var = centred.pow(2).nansum(dim=1) / (count - 1).clamp(min=1)
            varies &= var.sqrt() >= min_std
        return varies.any(dim=1)
    total = weighted_sum(per_func.float(), w)
    groups = total.view(-1, group_size)
    unscored = groups.isnan().any(dim=1)
    varies = ~(groups == groups[:, :1]).all(dim=1)
    if min_std > 0 and group_size > 1:
        varies &= groups.std(dim=1) >= min_std
    return varies | unscored


def dropped_kinds(first_scores: Tensor, dropped: Tensor, group_size: int, threshold: float) -> dict[str, int]:
    """How many dropped groups were all correct, all wrong or neither, by the first reward function
    (first_scores (P·G,), NaN for None, which counts as wrong) against eval_correct_threshold, as
    pass@k counts a completion correct. dropped (P,) bool."""
    correct = (first_scores.nan_to_num(nan=-torch.inf) >= threshold).view(-1, group_size)
    all_correct = correct.all(dim=1) & dropped
    all_wrong = (~correct).all(dim=1) & dropped
    return {
        "dropped_all_correct": int(all_correct.sum()),
        "dropped_all_wrong": int(all_wrong.sum()),
        "dropped_other": int((dropped & ~all_correct & ~all_wrong).sum()),
    }


@dataclass
class Round:
    """One round of a step: prompts (rows: column → one value per prompt), their rollout, its rewards."""

    rows: dict[str, list]
    rollout: Rollout
    scored: Scored


@dataclass
class StepSample:
    """Every completion a step sampled, over its rounds, and which of them it trains on."""

    rows: dict[str, list]  # every round's prompts, in order: column → one value per prompt
    rollout: Rollout  # every round's completions, B_all = prompts drawn × G rows
    scored: Scored  # their rewards
    groups: Tensor  # (prompts_per_generation,) long: the groups trained on, in training order
    group_size: int
    counts: dict[str, float]  # this process's counts, for the metrics

    @property
    def trained_rows(self) -> Tensor:
        """(prompts_per_generation · G,) long: the rollout rows of the groups trained on."""
        return (self.groups[:, None] * self.group_size + torch.arange(self.group_size)).flatten()

    def trained(self, names: list[str]) -> tuple[dict[str, list], Rollout, Scored]:
        """The step's training batch: its prompts' rows, rollout and rewards (names: the reward functions')."""
        index = self.trained_rows
        rows = {k: [v[g] for g in self.groups.tolist()] for k, v in self.rows.items()}
        return rows, self.rollout.rows(index), self.scored.rows(index, names)


def sample_step(
    first: Round,
    more: Callable[[], Round | None],
    *,
    group_size: int,
    quota: int,
    max_rounds: int,
    informative: Callable[[Scored], Tensor],
    classify: Callable[[Scored, Tensor], dict[str, int]],
    pad_token_id: int,
    names: list[str],
) -> StepSample:
    """Rounds until `quota` informative groups of `group_size` completions or `max_rounds` rounds:
    `first` is round 1, `more()` samples and scores the next round (None when the prompts are spent).
    informative(scored) → (P,) bool; classify(scored, dropped (P,) bool) → dropped_kinds' counts."""
    rounds, keep = [first], [informative(first.scored)]
    while sum(int(k.sum()) for k in keep) < quota and len(rounds) < max_rounds:
        nxt = more()
        if nxt is None:
            break
        rounds.append(nxt)
        keep.append(informative(nxt.scored))
    flags = torch.cat(keep)
    found = flags.nonzero().flatten()
    chosen = found[:quota]
    filled = (~flags).nonzero().flatten()[: quota - len(chosen)]  # a short step: the earliest dropped groups
    groups = torch.cat([chosen, filled])
    counts = {"rounds": len(rounds), "prompts": len(flags), "informative": len(found), "filled": len(filled)}
    for r, k in zip(rounds, keep):
        for kind, n in classify(r.scored, ~k).items():
            counts[kind] = counts.get(kind, 0) + n
    rows = {c: [x for r in rounds for x in r.rows[c]] for c in first.rows}
    return StepSample(
        rows,
        Rollout.concat([r.rollout for r in rounds], pad_token_id),
        Scored.concat([r.scored for r in rounds], names),
        groups,
        group_size,
        counts,
    )


def step_metrics(counts: dict[str, float], num_processes: int) -> dict[str, float]:
    """dynamic_sampling/* metrics from the counts summed over every process."""
    prompts = max(counts["prompts"], 1)
    return {
        "dynamic_sampling/rounds": counts["rounds"] / num_processes,
        "dynamic_sampling/prompts_consumed": counts["prompts"],
        "dynamic_sampling/informative_groups": counts["informative"],
        "dynamic_sampling/informative_fraction": counts["informative"] / prompts,
        "dynamic_sampling/filled_groups": counts["filled"],
        **{
            f"dynamic_sampling/{k}": counts[k]
            for k in ("dropped_all_correct", "dropped_all_wrong", "dropped_other")
        },
    }
