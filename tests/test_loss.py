"""The GRPO loss against hand-computed values."""

import math

import pytest
import torch

from lora_grpo.algo.loss import LOSS_TYPES, accumulation_scale, grpo_loss, k3_kl

# Two sequences of different lengths: 3 tokens and 1 token, on-policy, beta = 0.
# Per-token objective is −A: sequence 0 contributes −1 per token, sequence 1 +0.5.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ADV = torch.tensor([1.0, -0.5])


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("grpo", {}, (-1.0 + 0.5) / 2),  # per-sequence means −1 and 0.5, then their mean
        ("bnpo", {}, (-3.0 + 0.5) / 4),  # token sum over the 4 tokens of the micro-batch
        ("dapo", {"num_tokens": 8}, (-3.0 + 0.5) / 8),  # token sum over the generation batch's 8 tokens
        ("dr_grpo", {"max_completion_length": 3}, (-3.0 + 0.5) / (2 * 3)),  # sequences × max length
    ],
)
def test_loss_types_hand_computed(loss_type, kwargs, expected):
    logp = torch.log(torch.full((2, 3), 0.5))
    loss, _ = grpo_loss(logp, None, None, ADV, MASK, loss_type=loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-7)


def test_four_loss_types_give_four_numbers():
    # The four aggregations of the clipped objective (the others: tests/test_loss_variants.py).
    logp = torch.zeros(2, 3)
    values = {
        lt: grpo_loss(logp, None, None, ADV, MASK, loss_type=lt, num_tokens=8, max_completion_length=3)[
            0
        ].item()
        for lt in ("grpo", "bnpo", "dapo", "dr_grpo")
    }
    assert len({round(v, 6) for v in values.values()}) == 4, values


def test_dapo_defaults_to_micro_batch_token_count():
    logp = torch.zeros(2, 3)
    loss, _ = grpo_loss(logp, None, None, ADV, MASK, loss_type="dapo")
    assert loss.item() == pytest.approx(-2.5 / 4)


def test_dr_grpo_requires_max_completion_length():
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(torch.zeros(2, 3), None, None, ADV, MASK, loss_type="dr_grpo")


def test_clipping_both_sides_with_clip_higher():
    # One token per sequence; bnpo = plain mean over the five tokens.
    eps_low, eps_high = 0.2, 0.28
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.2])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    old = torch.zeros(5, 1)
    logp = torch.log(ratios).unsqueeze(1).requires_grad_(True)
    mask = torch.ones(5, 1)
    loss, m = grpo_loss(
        logp, old, None, adv, mask, loss_type="bnpo", epsilon_low=eps_low, epsilon_high=eps_high
    )
    # Token objectives −min(ρA, clip(ρ)A):
    #   ρ=1.5, A=+1 → −min(1.5, 1.28) = −1.28  (clipped high)
    #   ρ=0.5, A=−1 → −min(−0.5, −0.8) = 0.8   (clipped low)
    #   ρ=0.5, A=+1 → −min(0.5, 0.8)   = −0.5  (not clipped: the pessimistic branch)
    #   ρ=1.5, A=−1 → −min(−1.5, −1.28) = 1.5  (not clipped)
    #   ρ=1.2, A=+1 → −1.2                    (inside the region)
    per_token = [-1.28, 0.8, -0.5, 1.5, -1.2]
    assert loss.item() == pytest.approx(sum(per_token) / 5, abs=1e-6)
    loss.backward()
    # Clipped tokens carry no gradient; the others −ρA/5 (d ρ / d logp = ρ).
    expected_grad = torch.tensor([0.0, 0.0, -0.5, 1.5, -1.2]).unsqueeze(1) / 5
    torch.testing.assert_close(logp.grad, expected_grad, rtol=0, atol=1e-6)
    assert m["clip_ratio/high"] == pytest.approx(1 / 5)
    assert m["clip_ratio/low"] == pytest.approx(1 / 5)
    assert m["clip_ratio/region"] == pytest.approx(2 / 5)
    assert m["ratio"] == pytest.approx(ratios.mean().item(), abs=1e-6)


def test_k3_against_formula():
    logp = torch.tensor([-1.0, -0.5, -2.0])
    ref = torch.tensor([-2.0, -0.5, -1.0])
    expected = [math.exp(-1) + 1 - 1, 0.0, math.exp(1) - 1 - 1]
    torch.testing.assert_close(k3_kl(logp, ref), torch.tensor(expected), rtol=0, atol=1e-6)


def test_kl_term_value_and_metric():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    mask = torch.ones(1, 2)
    beta = 0.1
    loss, m = grpo_loss(logp, None, ref, torch.zeros(1), mask, beta=beta, loss_type="bnpo")
    k = [math.exp(-1), math.exp(1) - 2]
    assert m["kl"] == pytest.approx(sum(k) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(beta * sum(k) / 2, abs=1e-6)


def test_kl_ratio_correction_off_policy_value_and_on_policy_gradient():
    ref = torch.tensor([[-2.0]])
    old = torch.tensor([[-1.3]])
    logp = torch.tensor([[-1.0]], requires_grad=True)
    mask = torch.ones(1, 1)
    # Off-policy: value is ρ·k3 with ρ = exp(−1 − (−1.3)).
    rho, k3 = math.exp(0.3), math.exp(-1) + 1 - 1
    loss, _ = grpo_loss(logp, old, ref, torch.zeros(1), mask, beta=1.0, loss_type="bnpo")
    assert loss.item() == pytest.approx(rho * k3, abs=1e-6)
    loss, _ = grpo_loss(
        logp, old, ref, torch.zeros(1), mask, beta=1.0, loss_type="bnpo", kl_ratio_correction=False
    )
    assert loss.item() == pytest.approx(k3, abs=1e-6)
    # On-policy: same value as plain k3, gradient gains k3 (d/dlogp of ρ·k3 at ρ = 1 is dk3 + k3).
    grads = {}
    for corr in (True, False):
        lp = torch.tensor([[-1.0]], requires_grad=True)
        loss, _ = grpo_loss(
            lp, None, ref, torch.zeros(1), mask, beta=1.0, loss_type="bnpo", kl_ratio_correction=corr
        )
        assert loss.item() == pytest.approx(k3, abs=1e-6)
        loss.backward()
        grads[corr] = lp.grad.item()
    dk3 = 1 - math.exp(-1)  # d/dlogp [exp(ref−logp) − (ref−logp) − 1]
    assert grads[False] == pytest.approx(dk3, abs=1e-6)
    assert grads[True] == pytest.approx(dk3 + k3, abs=1e-6)


def test_sequence_importance_sampling_gspo():
    # Sequence 0: log-ratios 0.1 and 0.3 → ρ = exp(0.2) on both tokens; padding token ignored.
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.1, 0.3, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = grpo_loss(
        logp,
        old,
        None,
        torch.tensor([1.0]),
        mask,
        loss_type="bnpo",
        importance_sampling="sequence",
        epsilon_low=0.5,
        epsilon_high=0.5,
    )
    assert loss.item() == pytest.approx(-math.exp(0.2), abs=1e-6)
    assert m["ratio"] == pytest.approx(math.exp(0.2), abs=1e-6)
    tok_loss, _ = grpo_loss(
        logp, old, None, torch.tensor([1.0]), mask, loss_type="bnpo", epsilon_low=0.5, epsilon_high=0.5
    )
    assert tok_loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.3)) / 2, abs=1e-6)


def test_beta_zero_accepts_no_reference_and_nonzero_requires_it():
    loss, m = grpo_loss(torch.zeros(2, 3), None, None, ADV, MASK, beta=0.0)
    assert m["kl"] == 0.0 and torch.isfinite(loss)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(torch.zeros(2, 3), None, None, ADV, MASK, beta=0.04)


def test_unknown_variants_rejected():
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        grpo_loss(torch.zeros(2, 3), None, None, ADV, MASK, loss_type="ppo")
    with pytest.raises(ValueError, match="unknown importance_sampling"):
        grpo_loss(torch.zeros(2, 3), None, None, ADV, MASK, importance_sampling="seq")


# vespo's weight is detached by design (as TRL's), so its autograd is not the derivative of its value.
@pytest.mark.parametrize("loss_type", sorted(set(LOSS_TYPES) - {"vespo"}))
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("kl_ratio_correction", [True, False])
def test_gradient_matches_finite_differences(loss_type, importance_sampling, kl_ratio_correction):
    g = torch.Generator().manual_seed(0)
    B, T = 3, 4
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    # Stay strictly inside the clip region so the objective is smooth where it is probed.
    logp = (old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.1).requires_grad_(True)
    ref = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)

    def f(lp):
        return grpo_loss(
            lp,
            old,
            ref,
            adv,
            mask,
            loss_type=loss_type,
            beta=0.3,
            max_completion_length=T,
            num_tokens=9,
            importance_sampling=importance_sampling,
            kl_ratio_correction=kl_ratio_correction,
        )[0]

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-6, atol=1e-7)


def test_accumulation_scale_makes_micro_batches_sum_to_the_full_loss():
    g = torch.Generator().manual_seed(1)
    B, T = 4, 5
    logp = -torch.rand(B, T, generator=g)
    old = logp + 0.05 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    for lt in ["grpo", "dapo", "dr_grpo"]:  # bnpo is per-micro-batch by definition
        kw = dict(loss_type=lt, max_completion_length=T, num_tokens=mask.sum().item())
        full = grpo_loss(logp, old, None, adv, mask, **kw)[0]
        parts = sum(
            grpo_loss(logp[i : i + 2], old[i : i + 2], None, adv[i : i + 2], mask[i : i + 2], **kw)[0]
            * accumulation_scale(lt, 2, B, 2)
            for i in (0, 2)
        )
        assert parts.item() == pytest.approx(full.item(), abs=1e-6), lt


def test_accumulation_scale_is_each_loss_types_own():
    # A step of 5 sequences in 3 micro-batches; this micro-batch holds 1 of them.
    scales = {lt: accumulation_scale(lt, 1, 5, 3) for lt in LOSS_TYPES}
    assert scales == {
        "grpo": 1 / 5,
        "bnpo": 1 / 3,
        "dapo": 1.0,
        "dr_grpo": 1 / 5,
        "cispo": 1.0,
        "sapo": 1 / 5,
        "vespo": 1.0,
        "luspo": 1 / 5,
    }
    with pytest.raises(
        ValueError,
        match=r"unknown loss_type 'ppo'; choose one of \['bnpo', 'cispo', 'dapo', 'dr_grpo', "
        r"'grpo', 'luspo', 'sapo', 'vespo'\]",
    ):
        accumulation_scale("ppo", 1, 5, 3)


def test_an_epsilon_low_of_one_or_more_never_clips_low():
    # DeepSeekMath's epsilon = 10: the lower clip 1 − 10 = −9 is below every ratio, so a negative-
    # advantage token with ρ = 0.5 is not clipped (its loss −min(−0.5, −max(0.5, −9)) = 0.5, gradient
    # flows); the upper clip 1 + 0.28 still binds.
    ratios = torch.tensor([0.5, 0.05, 1.5])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    logp = torch.log(ratios).unsqueeze(1).requires_grad_(True)
    loss, m = grpo_loss(
        logp,
        torch.zeros(3, 1),
        None,
        adv,
        torch.ones(3, 1),
        loss_type="bnpo",
        epsilon_low=10.0,
        epsilon_high=0.28,
    )
    assert loss.item() == pytest.approx((0.5 + 0.05 - 1.28) / 3, abs=1e-6)
    assert m["clip_ratio/low"] == 0 and m["clip_ratio/high"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5], [0.05], [0.0]]) / 3)


def test_every_epsilon_trl_accepts_is_accepted():
    from lora_grpo import GRPOConfig

    for eps in (10.0, 1.0, 0.0, -0.1):
        assert GRPOConfig(model_name_or_path="toy", epsilon_low=eps, epsilon_high=eps).epsilon_low == eps


def test_per_sequence_clip_shares_and_their_extremes_per_group():
    from lora_grpo.algo.loss import SEQUENCE_HIGH_CLIP, SEQUENCE_LOW_CLIP, clip_fraction_extremes

    # 3 sequences of 4 tokens, the third without loss tokens; eps 0.2 → clipped low below 0.8 with A < 0,
    # high above 1.2 with A > 0.
    ratios = torch.tensor([[0.5, 0.5, 1.0, 1.0], [1.5, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = torch.zeros(3, 4)
    adv = torch.tensor([-1.0, 1.0, -1.0])
    _, m = grpo_loss(torch.log(ratios), old, None, adv, mask, loss_type="bnpo", tensor_metrics=True)
    # sequence 0: 2 of its 3 tokens clip low; sequence 1: 1 of 2 high; sequence 2: 0 / 0
    torch.testing.assert_close(m[SEQUENCE_LOW_CLIP], torch.tensor([2 / 3, 0.0, math.nan]), equal_nan=True)
    torch.testing.assert_close(m[SEQUENCE_HIGH_CLIP], torch.tensor([0.0, 0.5, math.nan]), equal_nan=True)
    # the plain-float metrics leave the (B,) ones out
    _, plain = grpo_loss(torch.log(ratios), old, None, adv, mask, loss_type="bnpo")
    assert SEQUENCE_LOW_CLIP not in plain and all(isinstance(v, float) for v in plain.values())

    low = torch.tensor([0.5, 0.25, math.nan, 0.75, math.nan, math.nan])
    high = torch.tensor([0.0, 0.5, 1.0, math.nan, math.nan, math.nan])
    # groups of 2: low mins 0.25, 0.75, NaN (left out) → 0.5; high maxes 0.5, 1.0, NaN → 0.75
    out = clip_fraction_extremes(low, high, 2)
    assert out == {"clip_ratio/low_min": pytest.approx(0.5), "clip_ratio/high_max": pytest.approx(0.75)}
    # one group: the step's min and max; groups of 4: [0.5, 0.25, NaN, 0.75] and [NaN, NaN] (left out)
    assert clip_fraction_extremes(low, high, 6)["clip_ratio/low_min"] == pytest.approx(0.25)
    assert clip_fraction_extremes(low, high, 4)["clip_ratio/high_max"] == pytest.approx(1.0)
    assert math.isnan(clip_fraction_extremes(low[4:], high[4:], 2)["clip_ratio/low_min"])
    # two processes: each group's extreme over both processes' same group, then the mean over groups
    theirs = iter(
        [torch.tensor([0.1, 0.8, 0.0]), torch.tensor([0.0, 2.0, math.nan])]
    )  # their mins, then maxes

    def gather(x):  # accelerate's gather: every process's tensor, concatenated in rank order
        return torch.cat([x, next(theirs)])

    out = clip_fraction_extremes(low, high, 2, gather)
    # low: min(0.25, 0.1), min(0.75, 0.8), min(NaN, 0.0) → (0.1 + 0.75 + 0) / 3; high: 0.5, 2.0, NaN → 1.25
    assert out["clip_ratio/low_min"] == pytest.approx(0.85 / 3)
    assert out["clip_ratio/high_max"] == pytest.approx(1.25)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rows_left_out_of_the_update_count_in_the_clip_extremes_as_trl_sees_them(level):
    from types import SimpleNamespace

    from lora_grpo.update import _whole_batch

    # rows 1 and 3 were left out (zero advantage; row 3 has no loss tokens either)
    idle = torch.tensor([False, True, False, True])
    completion_mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    parts = [torch.tensor([0.5]), torch.tensor([1.0])]  # the trained rows' micro-batches, in order
    whole = _whole_batch(parts, idle, completion_mask, SimpleNamespace(importance_sampling=level))
    # nothing of a zero-advantage row clips: 0; a row without tokens is 0 / 0 at the token level (TRL's NaN)
    expected = [0.5, 0.0, 1.0, math.nan if level == "token" else 0.0]
    torch.testing.assert_close(whole, torch.tensor(expected), equal_nan=True)
    assert _whole_batch(parts, None, completion_mask[:2], None).tolist() == [0.5, 1.0]
