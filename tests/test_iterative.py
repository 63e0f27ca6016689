"""Iterative GRPO beyond the sync itself: eval/kl_to_base (drift from the model the run started
from), ProRL's optimizer reset and warmup restart at each sync, and the plateau trigger."""

import json

import pytest
import torch
from helpers import PROMPTS, adapter_state, assert_same_adapters, make_trainer

from lora_grpo import GRPOConfig
from lora_grpo.config import ConfigError
from lora_grpo.evaluation import chunk_generator
from lora_grpo.model.adapters import BASE, POLICY, REFERENCE
from lora_grpo.model.reference import SyncSchedule
from lora_grpo.optim import WarmupRestarts, build_optimizer, build_scheduler, reset_optimizer_state
from lora_grpo.run.checkpoint import save_adapter
from lora_grpo.run.plots import metrics_figure

# make_trainer's run without quantization, in one micro-batch; 6 eval prompts.
PLAIN = dict(quantization="none", micro_batch_size=8, gradient_checkpointing=False, eval_dataset=PROMPTS[:6])


def randomize_policy(model, seed: int = 7, std: float = 0.3) -> None:
    """A non-trivial policy adapter (a fresh one has B = 0, the base itself)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"lora_B.{POLICY}" in name:
                p.normal_(0, std)


# ------------------------------------------------------------------------- eval/kl_to_base


def dense_kl_sums(model, rollout, temperature: float) -> tuple[float, float]:
    """(Σ k3, tokens) of KL(policy ‖ base) on a rollout's completions, from the model's own dense
    logits with the adapters on and off (no chunking, no lora_grpo log-prob code)."""
    ids, mask = rollout.input_ids, rollout.attention_mask
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    T = rollout.completion_ids.shape[1]

    def log_probs():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        logits = logits[:, -T - 1 : -1].double() / temperature
        return torch.log_softmax(logits, -1).gather(-1, ids[:, -T:, None])[..., 0]

    model.eval()
    with torch.no_grad():
        policy = log_probs()
        with model.disable_adapter():
            base = log_probs()
    delta = base - policy
    cmask = rollout.completion_mask.double()
    return float(((delta.exp() - delta - 1) * cmask).sum()), float(cmask.sum())


@pytest.mark.parametrize("pass_k", [[], [2]], ids=["own-sample", "pass@k-samples"])
def test_kl_to_base_matches_a_dense_computation(tiny_base_dir, tmp_path, pass_k):
    trainer = make_trainer(tiny_base_dir, tmp_path, **PLAIN, temperature=0.8, eval_pass_k=pass_k)
    randomize_policy(trainer.model)
    cfg, prompts = trainer.config, [row["prompt"] for row in PROMPTS[:6]]
    kl = trainer.evaluate(batch_prompts=6)["eval/kl_to_base"]  # one chunk: chunk 0
    # The same samples, drawn as evaluate() draws them: pass@k's decodes (stream 0, per_decode prompts
    # each) when they are at the training temperature, else one per prompt from stream 1.
    if pass_k:
        generator, per_decode, n = chunk_generator(cfg.seed, 0, trainer.accelerator.device), 8 // 2, 2
        rollouts = [
            trainer.generate(
                prompts[s : s + per_decode], num_generations=n, temperature=0.8, generator=generator
            )
            for s in range(0, 6, per_decode)
        ]
    else:
        generator = chunk_generator(cfg.seed, 0, trainer.accelerator.device, stream=1)
        rollouts = [trainer.generate(prompts, num_generations=1, temperature=0.8, generator=generator)]
    sums = [dense_kl_sums(trainer.model, r, 0.8) for r in rollouts]
    expected = sum(s for s, _ in sums) / sum(t for _, t in sums)
    assert expected > 1e-3
    assert kl == pytest.approx(expected, rel=1e-5)
    assert {p.requires_grad for n, p in trainer.model.named_parameters() if f".{POLICY}." in n} == {True}
    assert {p.requires_grad for n, p in trainer.model.named_parameters() if f".{REFERENCE}." in n} == {False}


def test_kl_to_base_uses_its_own_sample_when_pass_at_k_runs_at_another_temperature(tiny_base_dir, tmp_path):
    trainer = make_trainer(tiny_base_dir, tmp_path, **PLAIN)
    randomize_policy(trainer.model)
    plain = trainer.evaluate()["eval/kl_to_base"]
    trainer.config.eval_pass_k, trainer.config.eval_temperature = [2], 1.5
    assert trainer.evaluate()["eval/kl_to_base"] == plain  # the stream-1 sample, not pass@k's hotter ones
    trainer.config.eval_kl_to_base = False
    assert "eval/kl_to_base" not in trainer.evaluate()


def test_kl_to_base_is_zero_at_the_start_grows_with_training_and_ignores_syncs(tiny_base_dir, tmp_path):
    trainer = make_trainer(tiny_base_dir, tmp_path, **PLAIN, max_steps=4, eval_steps=2, ref_sync_steps=2)
    summary = trainer.train()
    assert summary["kl_to_base_before"] == 0.0  # a fresh policy is the base, exactly
    assert summary["kl_to_base_after"] > 0
    assert summary["eval_after"]["eval/kl_to_base"] == summary["kl_to_base_after"]
    # In the step's metrics beside the training KL to the (just synced) reference; in metrics.jsonl.
    assert (
        trainer.state.log_history[1]["sync/reason"] == "steps"
        and trainer.state.log_history[1]["eval/kl_to_base"] > 0
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/kl_to_base" in r] == [0, 2, 4]
    # A sync moves the reference, never the policy or the start: the KL to the base stays.
    before = trainer.evaluate()
    trainer.sync_reference()
    assert trainer.evaluate() == before
    # The plot gives it a panel of its own, beside the KL to the reference.
    _, info = metrics_figure(records)
    assert info.panels["KL to base"] == ["eval/kl_to_base"] and "eval/kl_to_base" not in info.panels["eval"]


def test_kl_to_base_of_a_warm_start_is_measured_from_the_warm_start_adapter(tiny_base_dir, tmp_path):
    first = make_trainer(tiny_base_dir, tmp_path / "sft", **PLAIN)
    randomize_policy(first.model)
    assert first.evaluate()["eval/kl_to_base"] > 1e-3  # this adapter is far from the bare base
    save_adapter(first.model, tmp_path / "sft-adapter", POLICY)

    trainer = make_trainer(
        tiny_base_dir, tmp_path / "rl", **PLAIN, init_adapter=str(tmp_path / "sft-adapter"), max_steps=3
    )
    assert BASE in trainer.model.peft_config
    start = adapter_state(trainer.model, BASE)
    assert trainer.evaluate()["eval/kl_to_base"] == 0.0  # the policy is the warm start, bit for bit
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(
        id(p) in optimized or p.requires_grad for n, p in trainer.model.named_parameters() if f".{BASE}." in n
    )
    summary = trainer.train()
    assert summary["kl_to_base_before"] == 0.0 and summary["kl_to_base_after"] > 0
    after = adapter_state(trainer.model, BASE)
    assert all(torch.equal(start[k], after[k]) for k in start)  # the start never moves


# ------------------------------------------------------------------- ProRL reset and warmup


def _step(optimizer, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "paged_adamw_8bit"])
def test_a_reset_optimizer_steps_exactly_like_a_fresh_one(name):
    if name != "adamw":
        bnb = pytest.importorskip("bitsandbytes")
        try:  # bitsandbytes' 8-bit optimizers need its CPU backend (bitsandbytes ≥ 0.45) on a machine without CUDA
            probe = torch.nn.Parameter(torch.ones(4096))
            _step(bnb.optim.AdamW8bit([probe]), [probe], [torch.ones(4096)])
        except Exception as e:  # noqa: BLE001 - any failure means: not available here
            pytest.skip(f"bitsandbytes' 8-bit AdamW does not run on this machine: {type(e).__name__}: {e}")
    config = GRPOConfig(model_name_or_path="toy", optimizer=name, learning_rate=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    # 8192 elements get bitsandbytes' 8-bit blockwise state (≥ its 4096 minimum); 128 get float32 state.
    shapes = [(64, 128), (8, 16)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    optimizer = build_optimizer(params, config)
    _step(optimizer, params, grads[0])
    _step(optimizer, params, grads[1])
    reset_optimizer_state(optimizer)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = build_optimizer(fresh_params, config)
    for g in grads[2:]:
        _step(optimizer, params, g)
        _step(fresh, fresh_params, g)
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)
    # and so is the state
    for ours, theirs in zip(optimizer.state.values(), fresh.state.values(), strict=True):
        assert ours.keys() == theirs.keys()
        for key, value in ours.items():
            same = (
                torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key]
            )
            assert same, key


def test_warmup_restarts_multiply_the_schedule():
    config = GRPOConfig(model_name_or_path="toy", lr_scheduler="linear", warmup_steps=2, learning_rate=1.0)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    restarts = WarmupRestarts(2)
    scheduler = build_scheduler(optimizer, config, total_steps=10, restarts=restarts)
    lrs = []
    for update in range(8):
        if update == 4:
            restarts.restart(optimizer, scheduler)
        lrs.append(optimizer.param_groups[0]["lr"])
        assert scheduler.get_last_lr() == [lrs[-1]]
        optimizer.step()
        scheduler.step()
    linear = [u / 2 if u < 2 else (10 - u) / 8 for u in range(8)]  # transformers' warmup, then linear decay
    restart = [1, 1, 1, 1, 0, 0.5, 1, 1]
    assert lrs == pytest.approx([a * b for a, b in zip(linear, restart)])


def test_reset_and_warmup_restart_at_each_sync(tiny_base_dir, tmp_path):
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **PLAIN,
        max_steps=6,
        ref_sync_steps=3,
        warmup_steps=2,
        ref_sync_reset_optimizer=True,
        ref_sync_restart_warmup=True,
    )
    trainer.train()
    lr = trainer.config.learning_rate
    assert [m["lr"] for m in trainer.state.log_history] == pytest.approx([0, lr / 2, lr, 0, lr / 2, lr])
    synced = [m for m in trainer.state.log_history if m.get("sync/event")]
    assert len(synced) == 2 and all(
        m["sync/optimizer_reset"] == m["sync/warmup_restart"] == 1.0 for m in synced
    )
    # The last sync (after step 6) left the state as a fresh optimizer's: zeros everywhere.
    states = list(trainer.optimizer.state.values())
    assert states and all(not v.any() for s in states for v in s.values())


def test_resume_is_exact_with_resets_restarts_and_the_plateau_trigger(tiny_base_dir, tmp_path):
    # min_delta 10: no eval ever improves, so the plateau is due at every second eval (steps 2 and 4);
    # the step trigger fires at 3. checkpoint-3 holds a plateau count of 1, a warmup restarted at
    # step 2 and an optimizer reset then.
    kw = dict(
        PLAIN,
        eval_dataset=PROMPTS[:4],
        max_steps=5,
        eval_steps=1,
        ref_sync_on_plateau=True,
        ref_sync_plateau_min_delta=10.0,
        ref_sync_plateau_patience=2,
        ref_sync_steps=3,
        ref_sync_reset_optimizer=True,
        ref_sync_restart_warmup=True,
        warmup_steps=2,
        lr_scheduler="cosine",
    )
    full = make_trainer(tiny_base_dir, tmp_path / "a", save_steps=3, **kw)
    full.train()
    assert [m.get("sync/reason") for m in full.state.log_history] == [
        None,
        "plateau",
        "steps",
        "plateau",
        None,
    ]
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path / "b",
        resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-3"),
        **kw,
    )
    resumed.train()
    assert_same_adapters(full.model, resumed.model)
    assert [m["lr"] for m in full.state.log_history] == [m["lr"] for m in resumed.state.log_history]
    assert [m.get("sync/reason") for m in resumed.state.log_history] == [
        m.get("sync/reason") for m in full.state.log_history
    ]
    assert resumed.state.sync_schedule.state_dict() == full.state.sync_schedule.state_dict()


# ------------------------------------------------------------------------------- plateau


def test_plateau_schedule_counts_evals_without_improvement():
    s = SyncSchedule(plateau_patience=2, plateau_min_delta=0.01)
    assert s.due(1) is None
    for score, due in [(0.5, None), (0.505, None), (0.51, "plateau")]:  # +0.005, +0.01: not above min_delta
        s.observe_eval(score)
        assert s.due(1) == due
    s.synced()  # the plateau sync restarts the count, keeps the best
    assert s.due(2) is None and s.state_dict() == {"best_eval": 0.5, "evals_without_improvement": 0}
    s.observe_eval(float("nan"))  # a NaN never improves
    s.observe_eval(0.6)  # an improvement restarts the count
    assert s.state_dict() == {"best_eval": 0.6, "evals_without_improvement": 0}
    # A sync names every trigger that fired; it consumes a plateau that was due, and another trigger's
    # sync at a step where none was leaves the count alone.
    both = SyncSchedule(every_steps=3, every_epoch=True, plateau_patience=1)
    assert both.due(3, epoch_ended=True) == "steps+epoch"
    both.observe_eval(1.0)
    both.observe_eval(1.0)
    assert both.due(3) == "steps+plateau" and both.due(4) == "plateau"
    both.synced()
    assert both.due(4) is None
    both.observe_eval(1.0)
    restored = SyncSchedule(plateau_patience=1)
    restored.load_state_dict(both.state_dict())
    assert restored.due(5) == "plateau"  # the count travels in checkpoints
    patient = SyncSchedule(every_steps=3, plateau_patience=2)
    patient.observe_eval(1.0)
    patient.observe_eval(1.0)
    assert patient.due(3) == "steps"
    patient.synced()  # a step sync while the plateau is not due yet
    assert patient.evals_without_improvement == 1
    # Off: nothing counts.
    off = SyncSchedule()
    off.observe_eval(0.0)
    assert off.due(1) is None and off.state_dict() == {"best_eval": None, "evals_without_improvement": 0}


def test_config_refuses_resets_and_plateaus_that_cannot_act(tiny_base_dir, tmp_path):
    base = dict(model_name_or_path="toy")
    with pytest.raises(
        ConfigError, match="ref_sync_reset_optimizer=true acts at each reference sync, but no sync"
    ):
        GRPOConfig(**base, ref_sync_reset_optimizer=True)
    with pytest.raises(ConfigError, match="ref_sync_restart_warmup=true acts at each"):
        GRPOConfig(**base, ref_sync_restart_warmup=True)
    with pytest.raises(ConfigError, match="warmup_steps=0"):
        GRPOConfig(**base, ref_sync_steps=4, ref_sync_restart_warmup=True)
    with pytest.raises(ConfigError, match="eval_steps=0"):
        GRPOConfig(**base, ref_sync_on_plateau=True)
    with pytest.raises(ConfigError, match="ref_sync_plateau_patience=0"):
        GRPOConfig(**base, ref_sync_on_plateau=True, eval_steps=5, ref_sync_plateau_patience=0)
    with pytest.raises(ConfigError, match="ref_sync_on_plateau.*beta = 0"):
        GRPOConfig(**base, ref_sync_on_plateau=True, eval_steps=5, beta=0.0)
    plateau = GRPOConfig(**base, ref_sync_on_plateau=True, eval_steps=5, ref_sync_reset_optimizer=True)
    assert plateau.sync_enabled and SyncSchedule.from_config(plateau).plateau_patience == 2
    with pytest.raises(ConfigError, match="no eval prompts"):
        make_trainer(tiny_base_dir, tmp_path, quantization="none", ref_sync_on_plateau=True, eval_steps=2)


def test_the_kl_trigger_reads_no_kl_measured_against_a_reference_synced_since(tiny_base_dir, tmp_path):
    """steps_per_generation 4: a rollout's reference log-probs are taken once, so after a sync at one of its steps
    the steps left measure their KL to the reference before it (0.035 logged where the slot, hard-synced, was 0),
    and the trigger fired again at each of them (found in review). It waits for the next rollout now."""
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        quantization="none",
        num_generations=2,
        prompts_per_step=2,
        steps_per_generation=4,
        max_completion_length=4,
        max_steps=8,
        beta=0.04,
        learning_rate=3e-2,
        ref_sync_kl=0.02,
        ref_sync_alpha=1.0,
        save_steps=0,
        train_dataset=PROMPTS[:16],
    )
    trainer.train()
    synced = [step for step, m in enumerate(trainer.state.log_history, 1) if m.get("sync/reason") == "kl"]
    assert synced  # the threshold is passed in this run
    rollouts = [(step - 1) // 4 for step in synced]
    assert len(rollouts) == len(set(rollouts)), synced  # at most one KL-triggered sync a rollout


def test_a_schedule_missing_a_keyword_or_given_a_wrong_one_is_refused_naming_them():
    """warmup_stable_decay is a listed schedule and needs num_decay_steps: transformers' TypeError reached the
    user as a traceback, as did a power given as text (found in review)."""
    from lora_grpo.config import ConfigError
    from lora_grpo.optim import build_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    with pytest.raises(
        ConfigError,
        match=r"lr_scheduler='warmup_stable_decay' with lr_scheduler_kwargs=\{\}: .*'num_decay_steps'\. Its "
        r"keywords: num_decay_steps, num_stable_steps",
    ):
        build_scheduler(
            optimizer, GRPOConfig(model_name_or_path="toy", lr_scheduler="warmup_stable_decay"), 10
        )
    with pytest.raises(ConfigError, match=r"lr_scheduler='polynomial' .*Its keywords: lr_end, power"):
        build_scheduler(
            optimizer,
            GRPOConfig(
                model_name_or_path="toy", lr_scheduler="polynomial", lr_scheduler_kwargs={"power": "x"}
            ),
            10,
        )
    build_scheduler(
        optimizer,
        GRPOConfig(
            model_name_or_path="toy",
            lr_scheduler="warmup_stable_decay",
            lr_scheduler_kwargs={"num_decay_steps": 3},
        ),
        10,
    )
