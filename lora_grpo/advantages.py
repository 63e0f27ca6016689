"""Group-relative advantages (Shao et al. 2024, "DeepSeekMath", §4.1.2).

Rewards arrive flat, (N,) with N = prompts × group_size, each prompt's group contiguous:
rows [g·G, (g+1)·G) belong to prompt g. Worked example, G = 4, scale "group":

    rewards  = [1, 0, 0, 1,   1, 1, 1, 1]
    group 0: mean 0.5, std 0.5774 (unbiased) → A = [0.866, -0.866, -0.866, 0.866]
    group 1: all equal                         → A = [0, 0, 0, 0]   (exactly 0, never NaN)
"""

from __future__ import annotations

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
    nan = torch.isnan(rewards)
    if nan.any():
        rows = nan.nonzero().flatten().tolist()
        raise ValueError(
            f"reward is NaN for completions {rows[:10]}{' ...' if len(rows) > 10 else ''}: every reward "
            "function returned None for them. Make at least one reward function score every completion."
        )
    return rewards.view(-1, group_size)


def _scale_group(centered: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    std = groups.std(dim=1, keepdim=True) if groups.shape[1] > 1 else torch.zeros_like(groups[:, :1])
    return centered / (std + EPS)


def _scale_batch(centered: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    std = groups.std() if groups.numel() > 1 else groups.new_zeros(())
    return centered / (std + EPS)


def _scale_none(centered: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return centered


@dataclass(frozen=True)
class AdvantageScale:
    """One scale_rewards option: what the centred rewards are divided by."""

    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (centered (P, G), rewards (P, G)) → (P, G)
    help: str


SCALES: dict[str, AdvantageScale] = {
    "group": AdvantageScale(_scale_group, "divide by the group's std (unbiased)"),
    "batch": AdvantageScale(_scale_batch, "divide by the std of the whole batch (this process's)"),
    "none": AdvantageScale(_scale_none, "do not divide (Dr. GRPO, Liu et al. 2025)"),
}


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """A_i = (r_i − mean_group(r)) / (std + 1e-4), (N,) → (N,).

    scale: a key of SCALES. "group" divides by the group's std (unbiased), "batch" by the std of
    the whole batch, "none" does not divide (Dr. GRPO, Liu et al. 2025). A group whose rewards are
    all equal gets exactly 0 in every scale.
    """
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; choose one of {list(SCALES)}")
    groups = _check(rewards, group_size).float()
    advantages = SCALES[scale].apply(groups - groups.mean(dim=1, keepdim=True), groups)
    # mean() of equal floats need not return the value bit-exactly, so force the zero.
    constant = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(advantages), advantages).flatten()


def zero_std_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (they carry no learning signal)."""
    groups = _check(rewards, group_size)
    return (groups == groups[:, :1]).all(dim=1).float().mean().item()
