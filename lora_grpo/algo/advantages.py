"""Group-relative advantages (Shao et al. 2024, "DeepSeekMath", §4.1.2).

Rewards arrive flat, (N,) with N = prompts × group_size, each prompt's group contiguous:
rows [g·G, (g+1)·G) belong to prompt g. Worked example, G = 4, scale "group":

    rewards  = [1, 0, 0, 1,   1, 1, 1, 1]
    group 0: mean 0.5, std 0.5774 (unbiased) → A = [0.866, -0.866, -0.866, 0.866]
    group 1: all equal                         → A = [0, 0, 0, 0]   (exactly 0, never NaN)

With several reward functions, MULTI_OBJECTIVE_AGGREGATIONS (TRL's multi_objective_aggregation)
says how their (N, F) table becomes one advantage per completion: "sum_then_normalize" weights and
sums the functions, then normalises as above; "normalize_then_sum" is GDPO (arXiv 2601.05242):
each function is normalised within its group first, then the weighted sum over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

EPS = 1e-4


def _check(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of {group_size}: "
            "N must be prompts × num_generations"
        )
    return rewards.view(-1, group_size)


def _constant(groups: torch.Tensor) -> torch.Tensor:
    # (P, 1): the group's scored (non-NaN) rewards are all equal; an unscored row is left out.
    highest = groups.nan_to_num(nan=-math.inf).amax(dim=1, keepdim=True)
    lowest = groups.nan_to_num(nan=math.inf).amin(dim=1, keepdim=True)
    return highest == lowest


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    # the unbiased std of the non-NaN values along dim (kept); NaN where fewer than two (TRL's nanstd).
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - torch.nanmean(x, dim=dim, keepdim=True)) ** 2, dim=dim, keepdim=True)
    return torch.where(count > 1, var * count / (count - 1), torch.full_like(var, math.nan)).sqrt()


def _scale_group(centered: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    std = _nanstd(groups, dim=1) if groups.shape[1] > 1 else torch.zeros_like(groups[:, :1])
    return centered / (std + EPS)


def _scale_batch(centered: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    std = _nanstd(groups.flatten(), dim=0) if groups.numel() > 1 else groups.new_zeros(())
    return centered / (std + EPS)


def _scale_none(centered: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return centered


@dataclass(frozen=True)
class AdvantageScale:
    """One scale_rewards option: what the centred rewards are divided by."""

    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (centered (P, G), rewards (P, G)) → (P, G)
    help: str
    whole_batch: bool = False  # reads every row of the step (every process's), not only each group's


SCALES: dict[str, AdvantageScale] = {
    "group": AdvantageScale(_scale_group, "divide by the group's std (unbiased)"),
    "batch": AdvantageScale(
        _scale_batch, "divide by the std of the whole batch (every process's rows, as TRL)", whole_batch=True
    ),
    "none": AdvantageScale(_scale_none, "do not divide (Dr. GRPO, Liu et al. 2025)"),
}


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """A_i = (r_i − mean_group(r)) / (std + 1e-4), (N,) → (N,).

    scale: a key of SCALES. "group" divides by the group's std (unbiased), "batch" by the std of
    the whole batch, "none" does not divide (Dr. GRPO, Liu et al. 2025). A group whose rewards are
    all equal gets exactly 0 in every scale.

    A NaN reward (a row that no reward function scored) is left out of its group's mean and std and
    gets advantage 0, as TRL 1.16 does: it carries no learning signal and does not bias the baseline.
    """
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; choose one of {list(SCALES)}")
    groups = _check(rewards, group_size).float()
    advantages = SCALES[scale].apply(groups - torch.nanmean(groups, dim=1, keepdim=True), groups)
    # mean() of equal floats need not return the value bit-exactly, so force the zero.
    advantages = torch.where(_constant(groups), torch.zeros_like(advantages), advantages)
    return advantages.nan_to_num(nan=0.0).flatten()


def zero_std_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose scored rewards (two or more, NaN left out) are all equal: they carry
    no learning signal. A group with fewer than two scored rows has no std (TRL's NaN) and is not counted."""
    groups = _check(rewards, group_size)
    scored = (~torch.isnan(groups)).sum(dim=1, keepdim=True)
    return (_constant(groups) & (scored > 1)).float().mean().item()


def weighted_sum(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, F) rewards per function, NaN where one returned None → (N,) the weighted sum: a None counts as 0
    (TRL's nansum), and a row that every function skipped stays NaN (left out of means, as in TRL)."""
    total = (per_func * weights).nansum(dim=1)
    return torch.where(torch.isnan(per_func).all(dim=1), torch.full_like(total, float("nan")), total)


def _sum_then_normalize(per_func, weights, group_size, scale):
    return group_advantages(weighted_sum(per_func, weights), group_size, scale)


def _normalize_then_sum(per_func, weights, group_size, scale):
    # GDPO as TRL 1.16 has it: each function's rewards normalised within the group (unbiased std
    # over its non-None values, + 1e-4), weighted and summed (None → 0), then the sum normalised
    # over the whole batch. scale_rewards plays no part, as in TRL. A row that no function scored
    # is left out of the batch's mean and std and gets advantage 0 (TRL).
    unscored = _check(weighted_sum(per_func, weights), group_size).isnan().flatten()
    groups = per_func.view(-1, group_size, per_func.shape[1])
    centered = groups - torch.nanmean(groups, dim=1, keepdim=True)
    std = _nanstd(groups, dim=1) if group_size > 1 else torch.zeros_like(centered[:, :1])
    normalized = centered / (std + EPS)
    # a function constant over its group's scored rows carries no signal: exactly 0 (as group_advantages)
    highest = groups.nan_to_num(nan=-math.inf).amax(dim=1, keepdim=True)
    lowest = groups.nan_to_num(nan=math.inf).amin(dim=1, keepdim=True)
    normalized = torch.where(highest == lowest, torch.zeros_like(normalized), normalized)
    total = (normalized.reshape(-1, per_func.shape[1]) * weights).nansum(dim=1)
    total[unscored] = math.nan
    std_total = _nanstd(total, dim=0) if total.numel() > 1 else total.new_zeros(1)
    out = (total - torch.nanmean(total)) / (std_total + EPS)
    out = torch.where(_constant(total.view(1, -1)).flatten(), torch.zeros_like(out), out)
    return out.nan_to_num(nan=0.0)


@dataclass(frozen=True)
class MultiObjective:
    """One multi_objective_aggregation: (N, F) rewards per function → (N,) advantages."""

    apply: Callable[
        [torch.Tensor, torch.Tensor, int, str], torch.Tensor
    ]  # (per_func, weights (F,), G, scale)
    help: str
    whole_batch: bool = False  # reads every row of the step (every process's), not only each group's


MULTI_OBJECTIVE_AGGREGATIONS: dict[str, MultiObjective] = {
    "sum_then_normalize": MultiObjective(
        _sum_then_normalize, "weighted sum of the functions, then scale_rewards"
    ),
    "normalize_then_sum": MultiObjective(
        _normalize_then_sum,
        "each function normalised in its group, weighted sum normalised over the batch (GDPO)",
        whole_batch=True,
    ),
}


def reads_whole_batch(scale: str, aggregation: str) -> bool:
    """Whether the advantages of a row depend on rows outside its group (the batch's std): then they are
    computed over every process's rows, as TRL gathers the rewards first."""
    return SCALES[scale].whole_batch or MULTI_OBJECTIVE_AGGREGATIONS[aggregation].whole_batch


def multi_objective_advantages(
    per_func: torch.Tensor,
    weights: torch.Tensor | list[float] | None,
    group_size: int,
    scale: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Advantages (N,) from the (N, F) table of F reward functions' scores (NaN where one returned None).

    weights: F weights (None: all 1). scale: a key of SCALES (used by "sum_then_normalize" only, as
    TRL). aggregation: a key of MULTI_OBJECTIVE_AGGREGATIONS. A row no function scored gets 0 (TRL).
    """
    if aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"unknown multi_objective_aggregation {aggregation!r}; choose one of {list(MULTI_OBJECTIVE_AGGREGATIONS)}"
        )
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; choose one of {list(SCALES)}")
    if per_func.ndim != 2:
        raise ValueError(f"per_func must be 2-D (N, F), got shape {tuple(per_func.shape)}")
    per_func = per_func.float()
    n_funcs = per_func.shape[1]
    w = torch.ones(n_funcs) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    if w.shape != (n_funcs,):
        raise ValueError(
            f"{w.numel()} reward weights for {n_funcs} reward functions; give one weight per function"
        )
    return MULTI_OBJECTIVE_AGGREGATIONS[aggregation].apply(per_func, w.to(per_func.device), group_size, scale)
