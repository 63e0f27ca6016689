import math

import pytest
import torch

from lora_grpo.advantages import EPS, group_advantages, zero_std_fraction

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


def test_nan_reward_is_a_clear_error():
    with pytest.raises(ValueError, match=r"NaN for completions \[2\].*returned None"):
        group_advantages(torch.tensor([1.0, 0.0, float("nan"), 1.0]), group_size=2)


def test_bad_shapes_and_scale():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), group_size=2)
    with pytest.raises(ValueError, match="unknown advantage scale"):
        group_advantages(torch.zeros(4), group_size=2, scale="global")


def test_zero_std_fraction():
    assert zero_std_fraction(REWARDS, 4) == 0.5
