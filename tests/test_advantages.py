import math

import pytest
import torch

from lora_grpo.algo.advantages import (
    EPS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALES,
    group_advantages,
    multi_objective_advantages,
    zero_std_fraction,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_group_scale_hand_computed():
    a = group_advantages(REWARDS, group_size=4, scale="group")
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    v = 0.5 / (std + EPS)
    expected = torch.tensor([v, -v, -v, v, 0, 0, 0, 0])
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-6)


def test_batch_scale_hand_computed():
    a = group_advantages(REWARDS, group_size=4, scale="batch")
    mean = 6 / 8
    std = math.sqrt((2 * (0 - mean) ** 2 + 6 * (1 - mean) ** 2) / 7)
    v = 0.5 / (std + EPS)
    torch.testing.assert_close(a, torch.tensor([v, -v, -v, v, 0, 0, 0, 0]), rtol=0, atol=1e-6)


def test_none_scale_is_centered_only():
    a = group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0]), group_size=2, scale="none")
    assert a.tolist() == [1.0, -1.0, 0.0, 0.0]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_group_is_exactly_zero(scale):
    # 0.1 × 3 does not average back to 0.1 bit-exactly; the result must still be exactly 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, 0.9])
    a = group_advantages(rewards, group_size=3, scale=scale)
    assert torch.equal(a[:3], torch.zeros(3))
    assert not torch.isnan(a).any()
    assert (a[3:] != 0).all()


def test_an_unscored_row_is_left_out_of_its_group_and_gets_zero():
    # G = 3: row 1 is NaN (no function scored it); group 0's baseline is over [1, 4] only, as TRL's nanmean.
    rewards = torch.tensor([1.0, float("nan"), 4.0, 2.0, 0.0, 1.0])
    a = group_advantages(rewards, group_size=3)
    std0 = math.sqrt(4.5)  # unbiased std of [1, 4]
    expected = [-1.5 / (std0 + EPS), 0.0, 1.5 / (std0 + EPS), 1 / (1 + EPS), -1 / (1 + EPS), 0.0]
    torch.testing.assert_close(a, torch.tensor(expected), rtol=0, atol=1e-6)
    # batch scale: the std over the five scored rewards
    b = group_advantages(rewards, group_size=3, scale="batch")
    std = torch.tensor([1.0, 4.0, 2.0, 0.0, 1.0]).std().item()
    expected = [-1.5 / (std + EPS), 0.0, 1.5 / (std + EPS), 1 / (std + EPS), -1 / (std + EPS), 0.0]
    torch.testing.assert_close(b, torch.tensor(expected), rtol=0, atol=1e-6)
    # a group with one scored row, or none, has no signal: all 0, never NaN
    lone = group_advantages(torch.tensor([float("nan"), 3.0, float("nan"), float("nan")]), group_size=2)
    assert torch.equal(lone, torch.zeros(4))
    assert zero_std_fraction(torch.tensor([1.0, 1.0, float("nan"), 2.0]), 2) == 0.5


def test_bad_shapes_and_scale():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), group_size=2)
    with pytest.raises(ValueError, match="unknown advantage scale"):
        group_advantages(torch.zeros(4), group_size=2, scale="global")


def test_zero_std_fraction():
    assert zero_std_fraction(REWARDS, 4) == 0.5


# ---------------------------------------------------------------- several reward functions

NAN = float("nan")


def test_normalize_then_sum_is_gdpo_by_hand():
    # G = 2, two functions, weights [1, 0.5]. Group 0: f0 = [1, 0], f1 = [0, 0] (constant: 0).
    # Group 1: f0 = [1, 1] (constant: 0), f1 = [2, 4].
    per_func = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 2.0], [1.0, 4.0]])
    a = multi_objective_advantages(per_func, [1.0, 0.5], group_size=2, aggregation="normalize_then_sum")
    v0 = 0.5 / (math.sqrt(0.5) + EPS)  # f0 in group 0: mean 0.5, unbiased std √0.5
    v1 = 1.0 / (math.sqrt(2.0) + EPS)  # f1 in group 1: mean 3, unbiased std √2
    totals = [v0, -v0, -0.5 * v1, 0.5 * v1]  # weighted sums; their batch mean is 0
    std = math.sqrt(sum(t * t for t in totals) / 3)
    torch.testing.assert_close(a, torch.tensor([t / (std + EPS) for t in totals]), rtol=0, atol=1e-6)
    # Summing first instead (today's behaviour): group 0 rewards [1, 0], group 1 [2, 3].
    b = multi_objective_advantages(per_func, [1.0, 0.5], group_size=2)
    torch.testing.assert_close(b, group_advantages(torch.tensor([1.0, 0.0, 2.0, 3.0]), 2), rtol=0, atol=0)
    assert not torch.allclose(a, b)


def test_normalize_then_sum_skips_none_and_ignores_scale_rewards():
    # G = 3: f1 returned None for row 1; it is normalised over its two scored rows, and counts 0 in row 1's sum.
    per_func = torch.tensor([[1.0, 3.0], [0.0, NAN], [0.0, 5.0], [2.0, 1.0], [2.0, 1.0], [2.0, 1.0]])
    a = multi_objective_advantages(per_func, None, group_size=3, aggregation="normalize_then_sum")
    f0 = [(x - 1 / 3) / (math.sqrt(1 / 3) + EPS) for x in (1.0, 0.0, 0.0)]  # mean 1/3, unbiased std √(1/3)
    f1 = [(x - 4) / (math.sqrt(2.0) + EPS) for x in (3.0, 5.0)]
    totals = [f0[0] + f1[0], f0[1], f0[2] + f1[1], 0.0, 0.0, 0.0]  # group 1 is constant in both functions
    mean = sum(totals) / 6
    std = math.sqrt(sum((t - mean) ** 2 for t in totals) / 5)
    torch.testing.assert_close(a, torch.tensor([(t - mean) / (std + EPS) for t in totals]), rtol=0, atol=1e-6)
    for scale in ("batch", "none"):  # as TRL: scale_rewards plays no part in normalize_then_sum
        assert torch.equal(multi_objective_advantages(per_func, None, 3, scale, "normalize_then_sum"), a)


def test_sum_then_normalize_counts_none_as_zero_and_follows_scale():
    per_func = torch.tensor([[1.0, NAN], [0.0, 2.0], [1.0, 1.0], [3.0, NAN]])
    for scale in SCALES:
        a = multi_objective_advantages(per_func, [2.0, 1.0], 2, scale)
        assert torch.equal(a, group_advantages(torch.tensor([2.0, 2.0, 3.0, 6.0]), 2, scale))
    assert torch.equal(multi_objective_advantages(per_func, [2.0, 1.0], 2, "none")[:2], torch.zeros(2))


@pytest.mark.parametrize("aggregation", sorted(MULTI_OBJECTIVE_AGGREGATIONS))
def test_multi_objective_constant_batch_is_exactly_zero_and_errors(aggregation):
    const = torch.full((4, 2), 0.1)
    assert torch.equal(multi_objective_advantages(const, None, 2, aggregation=aggregation), torch.zeros(4))
    # a row that no function scored gets 0 and leaves the other rows as if it were absent
    unscored = torch.tensor([[1.0, 0.0], [NAN, NAN], [0.0, 1.0], [1.0, 1.0], [3.0, 0.0], [0.0, 0.0]])
    a = multi_objective_advantages(unscored, None, 2, aggregation=aggregation)
    assert a[1] == 0 and not a.isnan().any()
    if aggregation == "sum_then_normalize":
        torch.testing.assert_close(a[2:], group_advantages(torch.tensor([1.0, 2.0, 3.0, 0.0]), 2))
    with pytest.raises(ValueError, match="3 reward weights for 2 reward functions"):
        multi_objective_advantages(const, [1.0, 1.0, 1.0], 2, aggregation=aggregation)
    with pytest.raises(ValueError, match="groups of 3"):
        multi_objective_advantages(const, None, 3, aggregation=aggregation)


def test_unknown_multi_objective_aggregation():
    with pytest.raises(ValueError, match="unknown multi_objective_aggregation 'mean'"):
        multi_objective_advantages(torch.zeros(2, 1), None, 2, aggregation="mean")
