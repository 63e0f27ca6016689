"""The reference slot: adapters on one base, switching, and syncs checked against dense matrices."""

import math

import pytest
import torch

from lora_grpo.config import ConfigError, GRPOConfig
from lora_grpo.model.adapters import POLICY, REFERENCE, policy_parameters, reference_forward, use_adapter
from lora_grpo.model.load import load_model
from lora_grpo.model.reference import SyncSchedule, check_syncable, delta_weight, lora_layers, sync_reference
from lora_grpo.run.checkpoint import save_adapter

QUANT = ["none", "4bit"]


def make(tiny_base_dir, quantization="none", **overrides):
    kw = dict(
        model_name_or_path=tiny_base_dir,
        quantization=quantization,
        lora_r=4,
        lora_alpha=8,
        beta=0.04,
        gradient_checkpointing=False,
        seed=0,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    model, _ = load_model(GRPOConfig(**kw))
    return model


def randomize(model, adapter=POLICY, std=0.2, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_layers(model):
            for p in (m.lora_A[adapter].weight, m.lora_B[adapter].weight):
                p.copy_(torch.randn(p.shape, generator=g) * std)


def logits(model, adapter):
    x = torch.tensor([[5, 9, 14, 22, 7, 3], [11, 12, 13, 30, 31, 4]])
    with use_adapter(model, adapter), torch.no_grad():
        return model(input_ids=x).logits


def dense(model, adapter):
    return {n: delta_weight(m, adapter) for n, m in lora_layers(model)}


def non_adapter_state(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items() if "lora_" not in n}


@pytest.mark.parametrize("quantization", QUANT)
def test_fresh_reference_equals_policy_equals_base(tiny_base_dir, quantization):
    model = make(tiny_base_dir, quantization)
    with model.disable_adapter(), torch.no_grad():
        base = model(input_ids=torch.tensor([[5, 9, 14, 22, 7, 3], [11, 12, 13, 30, 31, 4]])).logits
    torch.testing.assert_close(logits(model, POLICY), base, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits(model, REFERENCE), base, rtol=0, atol=1e-6)


@pytest.mark.parametrize("quantization", ["none", "8bit", "4bit"])
def test_hard_sync_makes_reference_logits_equal_policy(tiny_base_dir, quantization):
    model = make(tiny_base_dir, quantization)
    randomize(model)
    assert (logits(model, POLICY) - logits(model, REFERENCE)).abs().max() > 1e-2
    metrics = sync_reference(model, alpha=1.0)
    torch.testing.assert_close(logits(model, REFERENCE), logits(model, POLICY), rtol=0, atol=1e-6)
    assert metrics["sync/truncation_error"] == 0.0


@pytest.mark.parametrize("quantization", QUANT)
@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("alpha", [0.3, 0.75])
def test_exact_sync_equals_dense_weight_space_mix(tiny_base_dir, quantization, use_rslora, alpha):
    # Policy rank 4, slot rank 8: reference holds an old policy (rank 4), the mix has rank ≤ 8: fits.
    model = make(tiny_base_dir, quantization, use_rslora=use_rslora)
    randomize(model, seed=1)
    sync_reference(model, alpha=1.0)
    randomize(model, seed=2)
    p, r = dense(model, POLICY), dense(model, REFERENCE)
    metrics = sync_reference(model, alpha=alpha, mode="exact")
    after = dense(model, REFERENCE)
    for name in p:
        expected = alpha * p[name] + (1 - alpha) * r[name]
        rel = (after[name] - expected).norm() / expected.norm()
        assert rel < 1e-5, (name, rel.item())
    assert metrics["sync/truncation_error"] < 1e-5


def test_exact_sync_truncation_error_equals_dense_error(tiny_base_dir):
    model = make(tiny_base_dir, ref_rank=8)
    randomize(model, POLICY, seed=3)
    randomize(model, REFERENCE, seed=4)  # a full rank-8 reference: the mix has rank 12 > 8
    alpha = 0.5
    p, r = dense(model, POLICY), dense(model, REFERENCE)
    metrics = sync_reference(model, alpha=alpha)
    after = dense(model, REFERENCE)
    dropped_sq, total_sq, worst = 0.0, 0.0, 0.0
    for name in p:
        mix = alpha * p[name] + (1 - alpha) * r[name]
        sv = torch.linalg.svdvals(mix.double())
        layer_dropped = sv[8:].square().sum().item()
        dropped_sq += layer_dropped
        total_sq += sv.square().sum().item()
        worst = max(worst, math.sqrt(layer_dropped / sv.square().sum().item()))
        # The stored reference is the best rank-8 approximation (Eckart–Young): its error is the dropped part.
        assert (after[name] - mix).norm().item() == pytest.approx(math.sqrt(layer_dropped), rel=1e-3)
    assert metrics["sync/truncation_error"] > 1e-3  # really truncated
    assert metrics["sync/truncation_error"] == pytest.approx(math.sqrt(dropped_sq / total_sq), rel=1e-4)
    assert metrics["sync/max_layer_error"] == pytest.approx(worst, rel=1e-4)


def test_factor_mode_is_refused_at_load_for_a_warm_start_of_several_ranks(tiny_base_dir, tmp_path):
    """A warm-start adapter with a rank_pattern has layers of several ranks: the factor blend, layer by layer,
    cannot fit them all to one slot rank, so it is refused when the model is built, not at the first sync."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, rank_pattern={"q_proj": 8}, target_modules=targets)
    ).save_pretrained(tmp_path / "sft")
    with pytest.raises(
        ValueError, match=r"layers have ranks \[4, 8\] \(a rank_pattern\)\. Use ref_sync_mode: exact"
    ):
        make(
            tiny_base_dir,
            init_adapter=str(tmp_path / "sft"),
            lora_r=8,
            ref_rank=8,
            lora_target_modules=targets,
            ref_sync_mode="factors",
        )


def test_factor_mode_is_the_name_wise_blend_not_the_weight_space_mix(tiny_base_dir):
    model = make(tiny_base_dir, ref_sync_mode="factors")  # ref_rank defaults to lora_r
    randomize(model, POLICY, seed=5)
    randomize(model, REFERENCE, seed=6)
    alpha = 0.4
    layers = lora_layers(model)
    before = {
        n: (
            m.lora_A[POLICY].weight.clone(),
            m.lora_B[POLICY].weight.clone(),
            m.scaling[POLICY],
            m.lora_A[REFERENCE].weight.clone(),
            m.lora_B[REFERENCE].weight.clone(),
            m.scaling[REFERENCE],
        )
        for n, m in layers
    }
    p, r = dense(model, POLICY), dense(model, REFERENCE)
    sync_reference(model, alpha=alpha, mode="factors")
    worst_gap = 0.0
    for n, m in layers:
        A_p, B_p, s_p, A_r, B_r, s_r = before[n]
        torch.testing.assert_close(m.lora_A[REFERENCE].weight, alpha * A_p + (1 - alpha) * A_r)
        torch.testing.assert_close(m.lora_B[REFERENCE].weight, alpha * (s_p / s_r) * B_p + (1 - alpha) * B_r)
        mix = alpha * p[n] + (1 - alpha) * r[n]
        worst_gap = max(worst_gap, ((delta_weight(m, REFERENCE) - mix).norm() / mix.norm()).item())
    assert worst_gap > 0.05  # the cross terms α(1−α)(B_p·A_r + B_r·A_p) make it differ


def test_factor_mode_starts_from_a_copy_of_the_policys_factors(tiny_base_dir):
    """A fresh run's slot is ΔW_ref = 0 either way; in factors mode its A is the policy's (its B 0), as a parameter
    EMA starts, so a first blend of a policy whose B moved is α·ΔW_policy. From A_ref = 0 it was α² (found in
    review)."""
    model = make(tiny_base_dir, ref_sync_mode="factors")
    for _, m in lora_layers(model):
        assert torch.equal(m.lora_A[REFERENCE].weight, m.lora_A[POLICY].weight)
        assert not m.lora_B[REFERENCE].weight.any()
    torch.testing.assert_close(logits(model, REFERENCE), logits(model, POLICY), rtol=0, atol=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, m in lora_layers(model):
            m.lora_B[POLICY].weight.copy_(torch.randn(m.lora_B[POLICY].weight.shape, generator=g))
    sync_reference(model, alpha=0.5, mode="factors")
    for _, m in lora_layers(model):
        torch.testing.assert_close(
            delta_weight(m, REFERENCE), 0.5 * delta_weight(m, POLICY), rtol=1e-5, atol=1e-7
        )


def test_factor_mode_hard_copy_is_exact(tiny_base_dir):
    model = make(tiny_base_dir, ref_sync_mode="factors")
    randomize(model, seed=7)
    sync_reference(model, alpha=1.0, mode="factors")
    torch.testing.assert_close(logits(model, REFERENCE), logits(model, POLICY), rtol=0, atol=1e-6)


@pytest.mark.parametrize("quantization", QUANT)
def test_training_moves_only_the_policy_and_syncs_move_only_the_reference(tiny_base_dir, quantization):
    model = make(tiny_base_dir, quantization, gradient_checkpointing=True)
    model.train()
    params = policy_parameters(model)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(f".{POLICY}." in n for n in names)
    assert {id(p) for p in params} == {id(p) for n, p in model.named_parameters() if f".{POLICY}." in n}
    opt = torch.optim.AdamW(params, lr=1e-2)
    ref_params = {n: p for n, p in model.named_parameters() if f".{REFERENCE}." in n}
    ref_before = {n: p.detach().clone() for n, p in ref_params.items()}
    base_before = non_adapter_state(model)
    policy_before = {n: p.detach().clone() for n, p in model.named_parameters() if f".{POLICY}." in n}
    x = torch.randint(3, 40, (2, 8))
    for _ in range(3):
        with reference_forward(model):
            ref_logits = model(input_ids=x).logits
        out = model(input_ids=x).logits
        loss = (out.log_softmax(-1) - ref_logits.log_softmax(-1)).pow(2).mean() + out[..., 5].mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.grad is None for p in ref_params.values())
    for n, p in ref_params.items():
        assert torch.equal(p, ref_before[n]), n
    moved = [
        n for n, p in model.named_parameters() if f".{POLICY}." in n and not torch.equal(p, policy_before[n])
    ]
    assert moved
    sync_reference(model, alpha=0.5)
    assert any(not torch.equal(p, ref_before[n]) for n, p in ref_params.items())
    base_after = non_adapter_state(model)
    assert base_before.keys() == base_after.keys()
    for n in base_before:
        assert torch.equal(base_before[n], base_after[n]), n  # includes the 4-bit uint8 weights


@pytest.mark.parametrize("quantization", QUANT)
def test_gradient_checkpointing_gives_the_same_gradients(tiny_base_dir, quantization):
    grads = []
    for gc in (False, True):
        model = make(tiny_base_dir, quantization, gradient_checkpointing=gc)
        randomize(model, seed=8, std=0.05)
        model.train()
        x = torch.randint(3, 40, (2, 8))
        model(input_ids=x).logits.logsumexp(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy_parameters(model)]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_switching_adapters_keeps_requires_grad_flags(tiny_base_dir):
    model = make(tiny_base_dir)
    # Freeze one policy tensor on purpose: a switch must not unfreeze it.
    frozen = next(p for n, p in model.named_parameters() if f".{POLICY}." in n)
    frozen.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with reference_forward(model):
        assert model.active_adapter == REFERENCE
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert model.active_adapter == POLICY
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    # Without the guard peft's own set_adapter flips them: the guard is needed.
    model.set_adapter(REFERENCE)
    model.set_adapter(POLICY)
    assert flags != {n: p.requires_grad for n, p in model.named_parameters()}


def test_switch_restores_flags_when_the_block_raises(tiny_base_dir):
    model = make(tiny_base_dir)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError):
        with reference_forward(model):
            raise RuntimeError("boom")
    assert model.active_adapter == POLICY
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("quantization", QUANT)
def test_warm_start_policy_and_reference_start_from_the_saved_adapter(tiny_base_dir, tmp_path, quantization):
    trained = make(tiny_base_dir, quantization)
    randomize(trained, seed=9)
    expected = logits(trained, POLICY)
    path = save_adapter(trained, tmp_path / "sft")
    assert (path / "adapter_config.json").exists() and (path / "adapter_model.safetensors").exists()
    warm = make(tiny_base_dir, quantization, init_adapter=str(path))
    torch.testing.assert_close(logits(warm, POLICY), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(warm, REFERENCE), expected, rtol=0, atol=1e-5)
    assert all(f".{POLICY}." in n for n, p in warm.named_parameters() if p.requires_grad)


def test_a_warm_starts_reference_slot_defaults_to_twice_the_adapters_own_rank(tiny_base_dir, tmp_path):
    """lora_r is ignored for an init_adapter, so ref_rank's default (2 × lora_r) follows the adapter's rank: a rank-16
    warm start under lora_r 4 was refused naming ref_rank, which the user never set, and a rank-8 one got a slot of
    its own rank, truncating soft syncs (found in review). A ref_rank given stays."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir),
        LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights="gaussian"),
    )
    adapter.save_pretrained(tmp_path / "r16")
    config = GRPOConfig(
        model_name_or_path=tiny_base_dir, quantization="none", lora_r=4, init_adapter=str(tmp_path / "r16")
    )
    model, _ = load_model(config)
    assert config.ref_rank == 32
    assert {m.lora_A[REFERENCE].weight.shape[0] for _, m in lora_layers(model)} == {32}
    given = GRPOConfig(
        model_name_or_path=tiny_base_dir,
        quantization="none",
        lora_r=4,
        ref_rank=24,
        init_adapter=str(tmp_path / "r16"),
    )
    load_model(given)
    assert given.ref_rank == 24


def test_saved_adapter_loads_with_plain_peft(tiny_base_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = make(tiny_base_dir)
    randomize(model, seed=10)
    path = save_adapter(model, tmp_path / "out")
    save_adapter(model, tmp_path / "out")  # overwriting an existing adapter dir works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dirs left behind
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(path))
    with torch.no_grad():
        got = plain(input_ids=torch.tensor([[5, 9, 14, 22, 7, 3], [11, 12, 13, 30, 31, 4]])).logits
    torch.testing.assert_close(got, logits(model, POLICY), rtol=0, atol=1e-5)


def test_dora_other_variants_and_modules_to_save_are_refused(tiny_base_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for kwargs, match in [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "biases"),
        # peft's other variants: aLoRA acts only after its invocation tokens (a hard sync left a reference 0.34 nats
        # from the policy, with reference_is_policy set), BD-LoRA's factors failed the first sync on their shapes
        ({"alora_invocation_tokens": [14]}, "peft's LoRA variant ALoraLinearVariant"),
    ]:
        base = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
        model = get_peft_model(
            base, LoraConfig(r=4, target_modules="all-linear", **kwargs), adapter_name=POLICY
        )
        model.add_adapter(REFERENCE, LoraConfig(r=8, target_modules="all-linear"))
        with pytest.raises(ValueError, match=match):
            check_syncable(model)


def test_config_errors_name_the_field():
    base = dict(model_name_or_path="x")
    with pytest.raises(ConfigError, match="beta = 0"):
        GRPOConfig(**base, beta=0.0, ref_sync_steps=10)
    with pytest.raises(ConfigError, match="beta = 0"):
        GRPOConfig(**base, beta=0.0, ref_sync_every_epoch=True)
    for alpha in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="ref_sync_alpha"):
            GRPOConfig(**base, ref_sync_alpha=alpha)
    with pytest.raises(ConfigError, match="ref_rank=4 < lora_r=8"):
        GRPOConfig(**base, lora_r=8, ref_rank=4, ref_sync_alpha=1.0)
    GRPOConfig(**base, lora_r=8, ref_rank=4, ref_sync_alpha=0.5)  # a lossy slot is allowed for soft syncs
    with pytest.raises(ConfigError, match="ref_sync_mode"):
        GRPOConfig(**base, ref_sync_mode="ema")
    with pytest.raises(ConfigError, match="ref_rank"):
        GRPOConfig(**base, ref_sync_mode="factors", lora_r=8, ref_rank=16)
    assert GRPOConfig(**base, lora_r=8).ref_rank == 16


def test_schedule():
    s = SyncSchedule(every_steps=3)
    assert [k for k in range(1, 10) if s.due(k)] == [3, 6, 9]
    assert SyncSchedule(every_epoch=True).due(5, epoch_ended=True) == "epoch"
    assert SyncSchedule(every_epoch=True).due(5) is None
    kl = SyncSchedule(kl_threshold=0.1)
    assert kl.due(1, kl=0.05) is None and kl.due(1, kl=0.2) == "kl"
    # Whether a sync is configured is GRPOConfig.sync_enabled; a schedule built from a config without one never fires.
    off = GRPOConfig(model_name_or_path="x")
    assert not off.sync_enabled and SyncSchedule.from_config(off) == SyncSchedule()
    assert all(SyncSchedule().due(k, epoch_ended=True, kl=1e9) is None for k in range(1, 10))


# Failed before the fix it guards (code review): the initial reference was copied from the policy by
# a sync, which a slot of lower rank than the policy could not take; a fresh policy's ΔW is 0.
def test_a_reference_slot_smaller_than_the_policy_builds_for_soft_syncs(tiny_base_dir):
    model, _ = load_model(
        GRPOConfig(
            model_name_or_path=tiny_base_dir,
            lora_r=8,
            ref_rank=4,
            ref_sync_alpha=0.5,
            gradient_checkpointing=False,
        )
    )
    for _, m in lora_layers(model):
        assert m.lora_A[REFERENCE].weight.shape[0] == 4
        assert not m.lora_B[REFERENCE].weight.any()  # ΔW_ref = 0 = ΔW_policy of a fresh LoRA
