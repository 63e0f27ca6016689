"""TRL 1.16's GRPO objective options (cispo, sapo, vespo, luspo, delta, the entropy and off-policy masks, the
entropy bonus and its controller) against values and gradients derived by hand, token by token in plain Python."""

import json
import math

import pytest
import torch

from lora_grpo.algo.loss import (
    LOSS_TYPES,
    AdaptiveEntropy,
    _linear_quantile,
    accumulation_scale,
    entropy_threshold,
    grpo_loss,
    high_entropy_mask,
    padded_gather,
)

# A ragged batch: sequence 0 has 3 tokens, sequence 1 has 2 (its third is padding, with values
# that would change every result if they leaked in).
MASK = [[1, 1, 1], [1, 1, 0]]
OLD = [[-1.0, -0.5, -2.0], [-0.7, -1.2, -9.0]]
LOGP = [[-0.8, -0.9, -1.1], [-0.2, -1.3, 3.0]]  # log-ratios 0.2, −0.4, 0.9 | 0.5, −0.1
REF = [[-1.1, -0.6, -1.5], [-0.4, -1.0, -4.0]]
ADV = [1.5, -0.8]
TOKENS = [(i, t) for i in range(2) for t in range(3) if MASK[i][t]]
N_TOKENS = len(TOKENS)  # 5
LENGTHS = [3, 2]


def tensors(**overrides):
    d = dict(logp=LOGP, old=OLD, ref=REF, adv=ADV, mask=MASK) | overrides
    logp = torch.tensor(d["logp"], dtype=torch.float64, requires_grad=True)
    return (
        logp,
        torch.tensor(d["old"], dtype=torch.float64),
        torch.tensor(d["ref"], dtype=torch.float64),
        torch.tensor(d["adv"], dtype=torch.float64),
        torch.tensor(d["mask"], dtype=torch.float64),
    )


def log_ratio(i, t):
    return LOGP[i][t] - OLD[i][t]


def ratio(i, t, level):  # GSPO's sequence ratio: exp of the mean log-ratio over the sequence's tokens
    n = LENGTHS[i]
    return math.exp(log_ratio(i, t) if level == "token" else sum(log_ratio(i, s) for s in range(n)) / n)


def kl_value_and_grad(i, t):
    """β-free KL term with the per-token ratio correction, and its derivative in logp."""
    d = REF[i][t] - LOGP[i][t]
    k3, dk3 = math.exp(d) - d - 1, 1 - math.exp(d)
    rho = math.exp(log_ratio(i, t))
    return rho * k3, rho * dk3 + rho * k3


def grad_grid(values: dict) -> torch.Tensor:
    return torch.tensor([[values.get((i, t), 0.0) for t in range(3)] for i in range(2)], dtype=torch.float64)


# ---------------------------------------------------------------- cispo
@pytest.mark.parametrize("level, beta", [(lv, b) for lv in ("token", "sequence") for b in (0.0, 0.3)])
def test_cispo_value_gradient_and_clip_metric(level, beta):
    eps = 1.3  # caps the token ratios exp(0.9) = 2.46 and exp(0.5) = 1.65
    logp, old, ref, adv, mask = tensors()
    loss, m = grpo_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        loss_type="cispo",
        epsilon_high=eps,
        beta=beta,
        num_tokens=N_TOKENS,
        importance_sampling=level,
    )
    value, grads, clipped = 0.0, {}, 0
    for i, t in TOKENS:
        w = min(ratio(i, t, level), eps)  # detached: the gradient is w·A·∇logp, whatever w's own slope
        kl, dkl = kl_value_and_grad(i, t)
        value += -w * ADV[i] * LOGP[i][t] + beta * kl
        grads[i, t] = (-w * ADV[i] + beta * dkl) / N_TOKENS
        clipped += ratio(i, t, level) > eps and ADV[i] > 0
    assert loss.item() == pytest.approx(value / N_TOKENS, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, grad_grid(grads), rtol=0, atol=1e-12)
    assert m["cispo_clip_ratio"] == pytest.approx(clipped / N_TOKENS)
    assert "clip_ratio/low" not in m  # TRL logs cispo's own clip fraction only
    assert clipped == (1 if level == "token" else 0)  # the case the metric is meant to see
    # On-policy ρ = 1, and epsilon_high = 0.2 caps it at 0.2: the cap is ε_high itself, not 1 + ε_high (TRL).
    loss, _ = grpo_loss(logp, None, None, adv, mask, loss_type="cispo", epsilon_high=0.2, num_tokens=N_TOKENS)
    assert loss.item() == pytest.approx(
        sum(-0.2 * ADV[i] * LOGP[i][t] for i, t in TOKENS) / N_TOKENS, abs=1e-12
    )


# ---------------------------------------------------------------- sapo
@pytest.mark.parametrize("level, beta", [(lv, b) for lv in ("token", "sequence") for b in (0.0, 0.3)])
def test_sapo_value_and_gradient(level, beta):
    tau_pos, tau_neg = 1.0, 1.05  # TRL's defaults, also grpo_loss's
    logp, old, ref, adv, mask = tensors()
    loss, _ = grpo_loss(logp, old, ref, adv, mask, loss_type="sapo", beta=beta, importance_sampling=level)
    value, grads = 0.0, {}
    for i, t in TOKENS:
        tau = tau_pos if ADV[i] > 0 else tau_neg
        rho = ratio(i, t, level)
        sig = 1 / (1 + math.exp(-tau * (rho - 1)))
        kl, dkl = kl_value_and_grad(i, t)
        value += (
            (-sig * 4 / tau * ADV[i] + beta * kl) / LENGTHS[i] / 2
        )  # grpo: per-sequence means, then their mean
        # d/dρ [σ(τ(ρ−1))·4/τ] = 4σ(1−σ). Token level dρ/dlogp_t = ρ; sequence level every token of
        # the sequence carries the same ρ_i with dρ_i/dlogp_t = ρ_i / L_i, summed over its L_i tokens.
        dpolicy = -4 * sig * (1 - sig) * ADV[i] * rho
        grads[i, t] = (dpolicy + beta * dkl) / LENGTHS[i] / 2
    assert loss.item() == pytest.approx(value, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, grad_grid(grads), rtol=0, atol=1e-12)


def test_sapo_on_policy_value_is_two_over_tau_and_negative_temperature_applies():
    logp, _, _, adv, mask = tensors()
    loss, _ = grpo_loss(logp, None, None, adv, mask, loss_type="sapo", sapo_temperature_neg=2.0)
    # σ(0)·4/τ = 2/τ per token: sequence 0 (A > 0, τ = 1) → −2·1.5, sequence 1 (τ = 2) → −1·(−0.8).
    assert loss.item() == pytest.approx((-3.0 + 0.8) / 2, abs=1e-12)


# ---------------------------------------------------------------- vespo
def phi(i, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    log_w = sum(log_ratio(i, t) for t in range(3) if MASK[i][t])  # a sum over the sequence, not a mean
    k, lam = (k_pos, lam_pos) if ADV[i] >= 0 else (k_neg, lam_neg)
    return math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_vespo_value_gradient_and_phi_metric(beta):
    logp, old, ref, adv, mask = tensors()
    loss, m = grpo_loss(logp, old, ref, adv, mask, loss_type="vespo", beta=beta, num_tokens=N_TOKENS)
    value, grads = 0.0, {}
    for i, t in TOKENS:
        kl, dkl = kl_value_and_grad(i, t)
        value += -phi(i) * ADV[i] * LOGP[i][t] + beta * kl
        grads[i, t] = (-phi(i) * ADV[i] + beta * dkl) / N_TOKENS  # φ is detached
    assert loss.item() == pytest.approx(value / N_TOKENS, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, grad_grid(grads), rtol=0, atol=1e-12)
    assert m["vespo/phi_seq_mean"] == pytest.approx((phi(0) + phi(1)) / 2, abs=1e-12)
    assert phi(0) != pytest.approx(phi(1))


def test_vespo_settings_on_policy_weight_and_extreme_ratio():
    logp, old, ref, adv, mask = tensors()
    kw = dict(
        vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=1.5, num_tokens=N_TOKENS
    )
    _, m = grpo_loss(logp, old, None, adv, mask, loss_type="vespo", **kw)
    assert m["vespo/phi_seq_mean"] == pytest.approx(
        (phi(0, 1.0, 0.5, 4.0, 1.5) + phi(1, 1.0, 0.5, 4.0, 1.5)) / 2
    )
    _, m = grpo_loss(logp, None, None, adv, mask, loss_type="vespo")
    assert m["vespo/phi_seq_mean"] == pytest.approx(1.0)  # φ(1) = 1 on-policy
    # A sequence ratio of e^60 is clamped to e^20, where φ underflows to 0: finite, no gradient.
    far = torch.tensor([[30.0, 30.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss, m = grpo_loss(
        far,
        torch.zeros(1, 3, dtype=torch.float64),
        None,
        torch.ones(1, dtype=torch.float64),
        torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64),
        loss_type="vespo",
    )
    loss.backward()
    assert math.isfinite(loss.item()) and m["vespo/phi_seq_mean"] == 0.0 and far.grad.abs().sum() == 0


# ---------------------------------------------------------------- luspo
@pytest.mark.parametrize("level, beta", [(lv, b) for lv in ("token", "sequence") for b in (0.0, 0.3)])
def test_luspo_value_and_gradient(level, beta):
    eps = 10.0  # no clipping: the objective is −ρA everywhere
    logp, old, ref, adv, mask = tensors()
    loss, m = grpo_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        loss_type="luspo",
        beta=beta,
        importance_sampling=level,
        epsilon_low=0.99,
        epsilon_high=eps,
    )
    value, grads = 0.0, {}
    for i, t in TOKENS:
        rho = ratio(i, t, level)
        kl, dkl = kl_value_and_grad(i, t)
        value += (
            -rho * ADV[i] + beta * kl
        ) / 2  # a sum over the sequence's tokens, mean over the 2 sequences
        # sequence level: L_i tokens each −ρ_i·A with dρ_i/dlogp_t = ρ_i/L_i, so again −ρ_i·A per token.
        grads[i, t] = (-rho * ADV[i] + beta * dkl) / 2
    assert loss.item() == pytest.approx(value, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, grad_grid(grads), rtol=0, atol=1e-12)
    assert m["clip_ratio/region"] == 0.0
    # On-policy: luspo weighs each sequence by its length, grpo does not.
    on_policy = {
        lt: grpo_loss(logp, None, None, adv, mask, loss_type=lt)[0].item() for lt in ("luspo", "grpo")
    }
    assert on_policy == pytest.approx({"luspo": (-1.5 * 3 + 0.8 * 2) / 2, "grpo": (-1.5 + 0.8) / 2})


@pytest.mark.parametrize("loss_type", ["luspo", "sapo", "cispo", "vespo"])
def test_accumulation_scale_makes_micro_batches_sum_to_the_full_loss(loss_type):
    g = torch.Generator().manual_seed(3)
    B, T = 4, 5
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64
    )
    kw = dict(loss_type=loss_type, num_tokens=mask.sum().item(), epsilon_high=1.1)
    full = grpo_loss(logp, old, None, adv, mask, **kw)[0]
    parts = sum(
        grpo_loss(logp[i : i + 2], old[i : i + 2], None, adv[i : i + 2], mask[i : i + 2], **kw)[0]
        * accumulation_scale(loss_type, 2, B, 2)
        for i in (0, 2)
    )
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)
    # accumulation= does the same scaling inside grpo_loss.
    inside = sum(
        grpo_loss(
            logp[i : i + 2],
            old[i : i + 2],
            None,
            adv[i : i + 2],
            mask[i : i + 2],
            accumulation=(2, B, 2),
            **kw,
        )[0]
        for i in (0, 2)
    )
    assert inside.item() == pytest.approx(full.item(), abs=1e-12)


# ---------------------------------------------------------------- delta (two-sided clipping)
BIG = [[-1.0 + math.log(3.0), -0.5, -2.0], [-0.7, -1.2, -9.0]]  # token (0, 0): ρ = 3; every other ρ = 1


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "luspo"])
def test_delta_caps_the_ratio_of_negative_advantages(loss_type):
    adv = [-1.0, 0.5]
    kw = dict(loss_type=loss_type, max_completion_length=3, num_tokens=N_TOKENS, epsilon_high=0.2)
    lp, old, _, a, mask = tensors(logp=BIG, adv=adv)
    plain, _ = grpo_loss(lp, old, None, a, mask, **kw)
    plain.backward()
    lp2, *_ = tensors(logp=BIG, adv=adv)
    capped, _ = grpo_loss(lp2, old, None, a, mask, delta=2.0, **kw)
    capped.backward()
    # Token (0, 0): ρ = 3, A = −1. Without delta −min(−3, −1.2) = 3 with slope ρ·|A| = 3 in logp;
    # with delta 2: −min(−2, −1.2) = 2, constant, so no gradient. Every other token: ρ = 1, unchanged.
    diff = plain.item() - capped.item()
    assert diff > 0
    assert lp.grad[0, 0] != 0 and lp2.grad[0, 0] == 0
    torch.testing.assert_close(lp.grad[mask.bool()][1:], lp2.grad[mask.bool()][1:], rtol=0, atol=1e-12)
    per_token_weight = {"grpo": 1 / 3 / 2, "bnpo": 1 / 5, "dapo": 1 / 5, "dr_grpo": 1 / 6, "luspo": 1 / 2}[
        loss_type
    ]
    assert diff == pytest.approx((3 - 2) * per_token_weight, abs=1e-12)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_delta_is_not_applied_where_trl_does_not(loss_type):
    lp, old, _, a, mask = tensors(logp=BIG, adv=[-1.0, 0.5])
    kw = dict(loss_type=loss_type, num_tokens=N_TOKENS, epsilon_high=5.0)
    with_delta = grpo_loss(lp, old, None, a, mask, delta=1.1, **kw)[0].item()
    assert with_delta == grpo_loss(lp, old, None, a, mask, **kw)[0].item()
    # while the clipped loss types do see a delta of 1.1 on this batch
    assert (
        grpo_loss(lp, old, None, a, mask, loss_type="dapo", delta=1.1)[0].item()
        != grpo_loss(lp, old, None, a, mask, loss_type="dapo")[0].item()
    )


# ---------------------------------------------------------------- the high-entropy token mask

ENT = torch.tensor([[0.1, 0.5, 0.3], [0.9, 0.7, 5.0]])  # 5.0 is padding
EMASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_entropy_threshold_is_linear_interpolation_and_ties_are_kept():
    # top 40% → the 0.6-quantile of [0.1, 0.3, 0.5, 0.7, 0.9]: rank 0.6·4 = 2.4 → 0.5 + 0.4·0.2 = 0.58.
    assert entropy_threshold(ENT, EMASK, 0.4).item() == pytest.approx(0.58, abs=1e-6)
    assert high_entropy_mask(ENT, EMASK, 0.4).tolist() == [[False, False, False], [True, True, False]]
    # Ties: at quantile 0.5 the threshold is the median 0.5 itself, which is kept (≥).
    assert high_entropy_mask(ENT, EMASK, 0.5).tolist() == [[False, True, False], [True, True, False]]
    # quantile 0 keeps only the highest-entropy real token (never the padding's 5.0).
    assert high_entropy_mask(ENT, EMASK, 0.0).tolist() == [[False, False, False], [True, False, False]]
    assert high_entropy_mask(ENT, EMASK, 1.0)[EMASK.bool()].all()
    none = torch.zeros(2, 3)
    assert entropy_threshold(ENT, none, 0.2) is None and not high_entropy_mask(ENT, none, 0.2).any()


def test_entropy_threshold_over_two_processes_equals_one_process_over_the_union():
    g = torch.Generator().manual_seed(0)
    ent_a, ent_b = torch.rand(3, 4, generator=g) * 3, torch.rand(2, 6, generator=g) * 3
    mask_a = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    mask_b = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    local = {"a": ent_a[mask_a.bool()], "b": ent_b[mask_b.bool()]}  # 7 and 9 tokens: variable sizes

    def gather(x):  # what every process gets back: the processes' tensors in rank order
        assert any(torch.equal(x, v) for v in local.values())
        return torch.cat([local["a"], local["b"]])

    union_ent = torch.zeros(5, 6)
    union_ent[:3, :4], union_ent[3:] = ent_a, ent_b
    union_mask = torch.zeros(5, 6)
    union_mask[:3, :4], union_mask[3:] = mask_a, mask_b
    for q in (0.2, 0.5, 0.8):
        single = entropy_threshold(union_ent, union_mask, q)
        assert (
            entropy_threshold(ent_a, mask_a, q, gather)
            == single
            == entropy_threshold(ent_b, mask_b, q, gather)
        )
        assert (
            entropy_threshold(ent_a, mask_a, q) != single
        )  # the local threshold differs: the gather matters
        whole = high_entropy_mask(union_ent, union_mask, q)
        assert torch.equal(high_entropy_mask(ent_a, mask_a, q, gather), whole[:3, :4])
        assert torch.equal(high_entropy_mask(ent_b, mask_b, q, gather), whole[3:])


def test_padded_gather_drops_the_padding():
    def pad(x, dim, pad_index):  # to the longest process's 5 values
        return torch.cat([x, torch.full((5 - len(x),), pad_index)])

    other = torch.tensor([0.4, 0.0, 2.5])  # the other process's entropies
    accelerator = type(
        "TwoProcesses",
        (),
        {
            "pad_across_processes": staticmethod(pad),
            "gather": staticmethod(lambda x: torch.cat([x, pad(other, 0, -1.0)])),
        },
    )
    out = padded_gather(accelerator())(torch.tensor([1.0, 0.0, 3.0, 0.5, 0.2]))
    assert out.tolist() == pytest.approx([1.0, 0.0, 3.0, 0.5, 0.2, 0.4, 0.0, 2.5])  # zeros are entropies too


def test_quantile_fallback_beyond_torch_limit_matches_torch_quantile():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(1))
    for q in (0.0, 0.13, 0.5, 0.8, 1.0):
        assert _linear_quantile(values, q, limit=0).item() == pytest.approx(
            torch.quantile(values, q).item(), abs=1e-7
        )


def test_entropy_mask_applies_to_the_policy_term_not_the_kl():
    logp, old, ref, adv, mask = tensors()
    ent = torch.tensor([[0.1, 2.0, 0.3], [0.2, 1.5, 9.0]], dtype=torch.float64)  # top 40%: (0, 1) and (1, 1)
    beta = 0.3
    loss, _ = grpo_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        loss_type="bnpo",
        beta=beta,
        epsilon_low=0.99,
        epsilon_high=10,
        entropies=ent,
        top_entropy_quantile=0.4,
    )
    kept = {(0, 1), (1, 1)}
    value = (
        sum(
            (-ratio(i, t, "token") * ADV[i] if (i, t) in kept else 0.0) + beta * kl_value_and_grad(i, t)[0]
            for i, t in TOKENS
        )
        / N_TOKENS
    )  # the denominator still counts every token
    assert loss.item() == pytest.approx(value, abs=1e-12)
    loss.backward()
    grads = {
        (i, t): (
            (-ratio(i, t, "token") * ADV[i] if (i, t) in kept else 0.0) + beta * kl_value_and_grad(i, t)[1]
        )
        / N_TOKENS
        for i, t in TOKENS
    }
    torch.testing.assert_close(logp.grad, grad_grid(grads), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="entropies"):
        grpo_loss(logp, old, ref, adv, mask, top_entropy_quantile=0.4)


# ---------------------------------------------------------------- the off-policy sequence mask
def test_off_policy_mask_drops_negative_advantage_sequences_far_from_the_sampler():
    # Three sequences of one token each plus a padded one: mean KL = sampling_logp − logp.
    logp = torch.tensor(
        [[-1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True
    )
    sampling = torch.tensor(
        [[-0.2, 50.0], [-0.9, 50.0], [-0.2, 50.0], [-0.2, float("nan")]], dtype=torch.float64
    )
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    ref = torch.full((4, 2), -1.5, dtype=torch.float64)
    # KL 0.8 (A < 0: dropped), 0.1 (kept), 0.8 (A > 0: kept), (0.8 + NaN→0)/2 = 0.4 (kept at 0.5).
    beta = 0.2
    loss, _ = grpo_loss(
        logp,
        None,
        ref,
        adv,
        mask,
        loss_type="bnpo",
        beta=beta,
        off_policy_mask_threshold=0.5,
        sampling_logp=sampling,
    )
    d = -0.5
    k3 = math.exp(d) - d - 1
    policy = [0.0, 1.0, -1.0, 1.0, 1.0]  # −ρA with ρ = 1 on the 5 tokens; the first sequence's is dropped
    assert loss.item() == pytest.approx((sum(policy) + 5 * beta * k3) / 5, abs=1e-12)  # its KL still counts
    loss.backward()
    dkl = 1 - math.exp(d) + k3  # ρ·dk3 + k3·dρ at ρ = 1
    expected = [[beta * dkl, 0], [1 + beta * dkl, 0], [-1 + beta * dkl, 0], [1 + beta * dkl, 1 + beta * dkl]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected, dtype=torch.float64) / 5, rtol=0, atol=1e-12)


def test_off_policy_mask_defaults_to_old_logp():
    logp, old, _, adv, mask = tensors()
    # Mean (old − logp): sequence 0 −0.233, sequence 1 (A < 0) −0.2: both kept at 0, sequence 1 dropped at −0.3.
    kw = dict(loss_type="dapo", num_tokens=N_TOKENS)
    base = grpo_loss(logp, old, None, adv, mask, **kw)[0].item()
    assert grpo_loss(logp, old, None, adv, mask, off_policy_mask_threshold=0.0, **kw)[0].item() == base
    dropped = grpo_loss(logp, old, None, adv, mask, off_policy_mask_threshold=-0.3, **kw)[0].item()
    seq0 = sum(
        -min(ratio(0, t, "token") * ADV[0], min(max(ratio(0, t, "token"), 0.8), 1.2) * ADV[0])
        for t in range(3)
    )
    assert dropped == pytest.approx(seq0 / N_TOKENS, abs=1e-12)


# ---------------------------------------------------------------- the entropy bonus
def test_entropy_bonus_value_gradient_accumulation_tokens_and_grad():
    logp, old, _, adv, mask = tensors()
    ent = torch.tensor([[0.4, 1.0, 2.2], [0.6, 1.8, 7.0]], dtype=torch.float64, requires_grad=True)
    coef = 0.05
    policy, _ = grpo_loss(logp, old, None, adv, mask, loss_type="grpo")
    loss, m = grpo_loss(logp, old, None, adv, mask, loss_type="grpo", entropies=ent, entropy_coef=coef)
    h = (0.4 + 1.0 + 2.2 + 0.6 + 1.8) / 5
    assert loss.item() == pytest.approx(policy.item() - coef * h, abs=1e-12)
    assert m["policy_loss"] == pytest.approx(policy.item(), abs=1e-12)
    loss.backward()
    torch.testing.assert_close(ent.grad, -coef * mask / 5, rtol=0, atol=1e-12)
    # With accumulation: the policy term by grpo's sequence share (2 of 8), the bonus (a mean per
    # micro-batch) by 1 / num_micro_batches (4), whatever the loss type (TRL).
    for loss_type, share in [("grpo", 2 / 8), ("dapo", 1.0)]:
        pol = grpo_loss(logp, old, None, adv, mask, loss_type=loss_type, num_tokens=20)[0].item()
        acc = grpo_loss(
            logp,
            old,
            None,
            adv,
            mask,
            loss_type=loss_type,
            num_tokens=20,
            entropies=ent,
            entropy_coef=coef,
            accumulation=(2, 8, 4),
        )[0].item()
        assert acc == pytest.approx(pol * share - coef * h / 4, abs=1e-12)
    # With top_entropy_quantile the bonus is the mean over the tokens the policy term keeps.
    plain, _ = grpo_loss(logp, old, None, adv, mask, entropies=ent, top_entropy_quantile=0.4, num_tokens=5)
    loss, _ = grpo_loss(
        logp, old, None, adv, mask, entropies=ent, top_entropy_quantile=0.4, num_tokens=5, entropy_coef=0.1
    )
    assert loss.item() == pytest.approx(
        plain.item() - 0.1 * (2.2 + 1.8) / 2, abs=1e-12
    )  # over the 2 kept tokens
    with pytest.raises(ValueError, match="entropies with grad"):
        grpo_loss(logp, old, None, adv, mask, entropies=ent.detach(), entropy_coef=0.1)
    with pytest.raises(ValueError, match="entropies"):
        grpo_loss(logp, old, None, adv, mask, entropy_coef=0.1)


# ---------------------------------------------------------------- the adaptive entropy controller
def test_adaptive_entropy_moves_the_coefficient_towards_the_target():
    ctl = AdaptiveEntropy(coef=0.01, target=1.0, delta=0.004, coef_min=0.0, coef_max=0.015)
    assert ctl.applied_coef == 0.0  # no measurement yet: no bonus in the first step
    ctl.update(0.5)  # entropy below the target: raise, and apply it
    assert ctl.coef == pytest.approx(0.014) and ctl.applied_coef == pytest.approx(0.014)
    ctl.update(0.9)
    assert ctl.coef == 0.015  # capped at coef_max
    ctl.update(1.5)  # above the target: lower, and apply nothing
    assert ctl.coef == pytest.approx(0.011) and ctl.applied_coef == 0.0
    for _ in range(5):
        ctl.update(2.0)
    assert ctl.coef == 0.0  # floored at coef_min
    ctl.update(1.0)  # at the target counts as below (≤)
    assert ctl.coef == pytest.approx(0.004) and ctl.applied_coef == pytest.approx(0.004)


def test_adaptive_entropy_measures_the_token_weighted_mean_over_micro_batches_and_processes():
    ctl = AdaptiveEntropy(coef=0.1, target=1.0, delta=0.01)
    ctl.accumulate(torch.tensor([[0.5, 0.7, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]]))  # 2 tokens, sum 1.2
    ctl.accumulate(torch.tensor([[1.0, 1.0, 1.6]]), torch.ones(1, 3))  # 3 tokens, sum 3.6
    other = torch.tensor([0.2, 1.0], dtype=torch.float64)  # another process: 1 token of entropy 0.2
    world = ctl.step(reduce=lambda t: t + other)
    assert world == pytest.approx((1.2 + 3.6 + 0.2) / 6)
    assert ctl.last_world_entropy == world and ctl.coef == pytest.approx(0.11)  # 0.833 ≤ 1: raised
    with pytest.raises(ValueError, match="before any accumulate"):
        ctl.step()  # the window was reset
    # With top_entropy_quantile the measured tokens are the ones grpo_loss keeps.
    ctl.accumulate(ENT, EMASK, top_entropy_quantile=0.4)
    assert ctl.step() == pytest.approx((0.9 + 0.7) / 2)


def test_adaptive_entropy_state_dict_resumes_exactly():
    entropies = [0.3, 0.1, 0.5, 0.15, 0.25, 0.05, 0.4]
    run = AdaptiveEntropy(coef=0.002, target=0.2, delta=0.005)
    fresh = AdaptiveEntropy(coef=0.002, target=0.2, delta=0.005)
    assert json.loads(json.dumps(run.state_dict()))["last_world_entropy"] == math.inf  # inf survives JSON
    for h in entropies[:3]:
        run.update(h)
    resumed = AdaptiveEntropy(coef=0.002, target=0.2, delta=0.005)
    resumed.load_state_dict(json.loads(json.dumps(run.state_dict())))
    assert resumed.state_dict() == run.state_dict() != fresh.state_dict()
    trace_run = [(run.applied_coef, run.update(h))[0] for h in entropies[3:]]
    trace_resumed = [(resumed.applied_coef, resumed.update(h))[0] for h in entropies[3:]]
    assert trace_run == trace_resumed and run.coef == resumed.coef
    assert len(set(trace_run)) > 1  # the replayed steps did move it


# ---------------------------------------------------------------- the per-token KL correction (a deviation)
def test_kl_correction_uses_the_token_ratio_even_at_sequence_level():
    logp, old, ref, adv, mask = tensors()
    loss, _ = grpo_loss(
        logp,
        old,
        ref,
        torch.zeros(2, dtype=torch.float64),
        mask,
        loss_type="bnpo",
        beta=1.0,
        importance_sampling="sequence",
    )
    assert loss.item() == pytest.approx(
        sum(kl_value_and_grad(i, t)[0] for i, t in TOKENS) / N_TOKENS, abs=1e-12
    )


# ---------------------------------------------------------------- every loss type
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_every_loss_type_gives_a_finite_loss_and_gradient(loss_type, level, beta):
    g = torch.Generator().manual_seed(2)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(True)
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    ent = (torch.rand(B, T, generator=g) * 2).requires_grad_(True)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    loss, m = grpo_loss(
        logp,
        old,
        ref,
        torch.randn(B, generator=g),
        mask,
        loss_type=loss_type,
        beta=beta,
        importance_sampling=level,
        max_completion_length=T,
        num_tokens=mask.sum().item(),
        delta=1.5,
        off_policy_mask_threshold=0.1,
        sampling_logp=old,
        entropies=ent,
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
        accumulation=(B, 2 * B, 2),
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and torch.isfinite(ent.grad).all()
    assert logp.grad.abs().sum() > 0 and all(math.isfinite(v) for v in m.values())
    assert (logp.grad[mask == 0] == 0).all()  # padding never gets gradient


def test_eight_loss_types_give_eight_numbers():
    logp, old, ref, adv, mask = tensors()
    values = {
        lt: grpo_loss(
            logp,
            old,
            ref,
            adv,
            mask,
            loss_type=lt,
            beta=0.1,
            epsilon_high=1.3,
            num_tokens=8,
            max_completion_length=3,
        )[0].item()
        for lt in LOSS_TYPES
    }
    assert len(values) == 8 and len({round(v, 9) for v in values.values()}) == 8, values
