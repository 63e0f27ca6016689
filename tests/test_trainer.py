"""End-to-end trainer runs on a tiny random model (CPU, offline, a few steps each)."""

import json

import pytest
import torch
from helpers import (
    PROMPTS,
    SMALL_RUN,
    adapter_state,
    assert_same_adapters,
    base_state,
    changed,
    digit_share,
    make_trainer,
)

import lora_grpo.trainer as trainer_module
import lora_grpo.update as update_module
from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.batch import Batch
from lora_grpo.config import ConfigError
from lora_grpo.model.load import POLICY, REFERENCE
from lora_grpo.run.failures import StepFailed
from lora_grpo.run.stopping import NonFiniteError, TrainingInterrupted


def test_end_to_end_policy_moves_base_frozen_reference_synced_on_schedule(tiny_base_dir, tmp_path):
    trainer = make_trainer(tiny_base_dir, tmp_path, max_steps=5, ref_sync_steps=2, ref_sync_alpha=0.5)
    model = trainer.model
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if f".{POLICY}." in n
    }
    base0, policy0 = base_state(model), adapter_state(model, POLICY)
    ref_snapshots = []
    original = trainer.generation_round

    def recording_step(rows):
        ref_snapshots.append(adapter_state(model, REFERENCE))  # the reference the step trains against
        return original(rows)

    trainer.generation_round = recording_step
    summary = trainer.train()
    ref_snapshots.append(adapter_state(model, REFERENCE))
    # Reference changes exactly after the scheduled sync steps 2 and 4.
    moved_after = [s for s in range(1, 6) if changed(ref_snapshots[s - 1], ref_snapshots[s])]
    assert moved_after == [2, 4]
    assert summary["syncs"] == 2
    assert [m.get("sync/event", 0) for m in trainer.state.log_history] == [0, 1.0, 0, 1.0, 0]
    assert changed(policy0, adapter_state(model, POLICY))
    base1 = base_state(model)
    assert all(torch.equal(base0[k], base1[k]) for k in base0)  # including the 4-bit weights
    # The policy moved away from a reference that was the initial policy: KL > 0 after a step.
    assert trainer.state.log_history[1]["kl"] > 0
    # Outputs on disk.
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]
    assert (run / "adapter" / "adapter_model.safetensors").exists()
    assert (run / "config.yaml").exists() and (run / "summary.json").exists()
    for key in [
        "reward/mean",
        "reward/std",
        "rewards/digit_share/mean",
        "frac_reward_zero_std",
        "completion_length/mean",
        "completion_length/max",
        "truncated_fraction",
        "kl",
        "clip_ratio/low",
        "clip_ratio/high",
        "entropy",
        "grad_norm",
        "lr",
        "tokens_per_second",
        "time/step",
    ]:
        assert key in lines[0], key
    assert "sync/truncation_error" in lines[1]


def test_beta_zero_skips_the_reference_forward(tiny_base_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_base_dir, tmp_path, beta=0.0, max_steps=1)
    seen = []
    real = update_module.grpo_loss
    monkeypatch.setattr(update_module, "grpo_loss", lambda *a, **k: seen.append(a[2]) or real(*a, **k))
    trainer.train()
    assert seen and all(ref is None for ref in seen)
    assert trainer.state.log_history[0]["kl"] == 0.0


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_num_iterations_uses_old_log_probs_only_when_reusing_the_batch(
    tiny_base_dir, tmp_path, monkeypatch, num_iterations
):
    # One rollout trained on num_iterations times: that many optimizer steps (each update is a step, as TRL counts).
    trainer = make_trainer(
        tiny_base_dir, tmp_path, num_iterations=num_iterations, max_steps=num_iterations, micro_batch_size=8
    )
    calls = []
    real = update_module.grpo_loss

    def spy(logp, old_logp, *a, **k):
        loss, m = real(logp, old_logp, *a, **k)
        calls.append((old_logp, m["ratio"]))
        return loss, m

    monkeypatch.setattr(update_module, "grpo_loss", spy)
    trainer.train()
    assert len(calls) == num_iterations
    if num_iterations == 1:
        assert calls[0][0] is None
    else:
        assert all(old is not None for old, _ in calls)
        assert calls[0][1] == pytest.approx(1.0, abs=1e-5)  # first pass: policy == old policy
        assert abs(calls[1][1] - 1.0) > 1e-6  # second pass: the policy moved, the ratio is off 1


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_every_loss_type_trains(tiny_base_dir, tmp_path, loss_type):
    trainer = make_trainer(tiny_base_dir, tmp_path, loss_type=loss_type, max_steps=1, quantization="none")
    before = adapter_state(trainer.model, POLICY)
    trainer.train()
    assert changed(before, adapter_state(trainer.model, POLICY))
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


def test_micro_batching_gives_the_same_gradient_as_one_batch(tiny_base_dir, tmp_path):
    grads = []
    for micro in (8, 3):
        trainer = make_trainer(
            tiny_base_dir, tmp_path, micro_batch_size=micro, quantization="none", max_grad_norm=0.0
        )
        torch.manual_seed(0)
        rollout = trainer.generate([PROMPTS[0]["prompt"], PROMPTS[1]["prompt"]])
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.2, 0.3, -0.1, -0.4])
        batch = Batch(rollout.input_ids, rollout.attention_mask, rollout.completion_mask, adv)
        batch.ref_logp = trainer.log_probs(batch)
        trainer.optimizer.step = lambda: None  # keep the weights; we compare gradients
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        trainer.optimize(batch)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.params]))
        rollout_ids = rollout.completion_ids
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    assert rollout_ids.shape[0] == 8


def test_resume_from_checkpoint_continues_exactly(tiny_base_dir, tmp_path):
    full = make_trainer(
        tiny_base_dir, tmp_path / "a", max_steps=4, save_steps=2, ref_sync_steps=3, quantization="none"
    )
    full.train()
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path / "b",
        max_steps=4,
        ref_sync_steps=3,
        quantization="none",
        resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-2"),
    )
    resumed.train()
    assert resumed.state.global_step == 4
    for adapter in (POLICY, REFERENCE):
        a, b = adapter_state(full.model, adapter), adapter_state(resumed.model, adapter)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert [m["reward/mean"] for m in full.state.log_history] == pytest.approx(
        [m["reward/mean"] for m in resumed.state.log_history]
    )


# Failed before the fix it guards (code review): the schedule ran over steps, not updates, so with
# num_iterations=3 the lr reached 0 a third of the way through the run.
def test_lr_schedule_spans_every_update_when_the_batch_is_reused(tiny_base_dir, tmp_path):
    trainer = make_trainer(
        tiny_base_dir, tmp_path, **SMALL_RUN, num_iterations=3, max_steps=12, lr_scheduler="linear"
    )
    trainer.train()
    lrs = [m["lr"] for m in trainer.state.log_history]  # lr of each update (each is a step)
    assert all(lr > 0 for lr in lrs) and len(lrs) == 12
    # 12 updates from 4 rollouts, linear to 0: the last update runs at lr·1/12.
    assert lrs[-1] == pytest.approx(1e-2 / 12)


def test_checkpoints_rotate_and_leave_no_temp_dirs(tiny_base_dir, tmp_path):
    trainer = make_trainer(
        tiny_base_dir, tmp_path, max_steps=4, save_steps=1, save_total_limit=2, quantization="none"
    )
    trainer.train()
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == [
        "adapter",
        "checkpoint-3",
        "checkpoint-4",
        "config.yaml",
        "metrics.jsonl",
        "metrics.png",
        "summary.json",
    ]


def test_eval_and_summary(tiny_base_dir, tmp_path):
    trainer = GRPOTrainer(
        GRPOConfig(
            model_name_or_path=tiny_base_dir,
            num_generations=2,
            prompts_per_step=2,
            max_completion_length=4,
            max_steps=2,
            output_dir=str(tmp_path / "run"),
            save_steps=0,
            gradient_checkpointing=False,
        ),
        reward_funcs=[digit_share],
        train_dataset=PROMPTS,
        eval_dataset=PROMPTS[:5],
    )
    summary = trainer.train()
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert summary["reward_first"] == pytest.approx(trainer.state.log_history[0]["reward/mean"])
    assert summary["steps"] == 2 and summary["seconds"] > 0
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["accuracy_after"] == summary["accuracy_after"]


def test_trainer_errors(tiny_base_dir, tmp_path):
    cfg = GRPOConfig(model_name_or_path=tiny_base_dir, output_dir=str(tmp_path), gradient_checkpointing=False)
    with pytest.raises(ValueError, match="no reward functions"):
        GRPOTrainer(cfg, reward_funcs=[], train_dataset=PROMPTS)
    with pytest.raises(ValueError, match="no training prompts"):
        GRPOTrainer(cfg, reward_funcs=[digit_share])
    with pytest.raises(ValueError, match="fewer than one batch"):
        GRPOTrainer(cfg, reward_funcs=[digit_share], train_dataset=PROMPTS[:3])


# Failed before the fix it guards (code review): these values were accepted. (Config validation:
# its home is test_config.py.)
@pytest.mark.parametrize("kwargs", [{"logging_steps": 0}, {"min_p": 1.5}, {"repetition_penalty": 0.0}])
def test_more_config_validation(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        GRPOConfig(model_name_or_path="m", **kwargs)


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit"])
def test_bitsandbytes_optimizers(tiny_base_dir, tmp_path, optimizer):
    trainer = make_trainer(tiny_base_dir, tmp_path, optimizer=optimizer, max_steps=1, quantization="none")
    before = adapter_state(trainer.model, POLICY)
    trainer.train()
    assert changed(before, adapter_state(trainer.model, POLICY))


def test_epoch_and_kl_schedules_in_the_loop(tiny_base_dir, tmp_path):
    # 4 prompts, 2 per step: an epoch is 2 steps, so epoch syncs land after steps 2 and 4.
    epoch = GRPOTrainer(
        GRPOConfig(
            model_name_or_path=tiny_base_dir,
            lora_r=4,
            num_generations=2,
            prompts_per_step=2,
            max_completion_length=4,
            max_steps=5,
            beta=0.04,
            ref_sync_every_epoch=True,
            learning_rate=5e-3,
            output_dir=str(tmp_path / "e"),
            save_steps=0,
            gradient_checkpointing=False,
        ),
        reward_funcs=[digit_share],
        train_dataset=PROMPTS[:4],
    )
    epoch.train()
    assert [m.get("sync/reason") for m in epoch.state.log_history] == [None, "epoch", None, "epoch", None]
    assert [m["epoch"] for m in epoch.state.log_history] == [0, 0, 1, 1, 2]
    # Adaptive, hard copy: a step that trains against a reference equal to the policy measures
    # KL exactly 0 (no sync); the next one, after an update, passes the tiny threshold and syncs.
    kl = make_trainer(tiny_base_dir, tmp_path / "k", ref_sync_kl=1e-12, max_steps=4, quantization="none")
    kl.train()
    assert [m["kl"] == 0.0 for m in kl.state.log_history] == [True, False, True, False]
    assert [m.get("sync/reason") for m in kl.state.log_history] == [None, "kl", None, "kl"]


def test_a_nonfinite_loss_skips_the_update_and_training_goes_on(tiny_base_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", max_steps=3, save_steps=1)
    real = update_module.grpo_loss
    calls = {"n": 0}

    def nan_on_second_step(*a, **k):
        loss, m = real(*a, **k)
        calls["n"] += 1
        return (loss * float("nan") if trainer.state.global_step == 1 else loss), m

    monkeypatch.setattr(update_module, "grpo_loss", nan_on_second_step)
    snapshots = []
    original = trainer.generation_round
    trainer.generation_round = lambda rows: (
        snapshots.append(adapter_state(trainer.model, POLICY)) or original(rows)
    )
    trainer.train()
    snapshots.append(adapter_state(trainer.model, POLICY))
    assert [m["skipped_nonfinite"] for m in trainer.state.log_history] == [0.0, 1.0, 0.0]
    assert not changed(snapshots[1], snapshots[2])  # step 2's update was skipped
    assert changed(snapshots[2], snapshots[3])  # step 3 trained again
    assert all(torch.isfinite(p).all() for p in trainer.params)


def test_nonfinite_updates_in_a_row_stop_with_a_clear_error(tiny_base_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", max_steps=5, max_nonfinite_updates=2)
    real = update_module.grpo_loss
    monkeypatch.setattr(
        update_module, "grpo_loss", lambda *a, **k: (lambda loss, m: (loss * float("inf"), m))(*real(*a, **k))
    )
    before = adapter_state(trainer.model, POLICY)
    with pytest.raises(
        StepFailed,
        match=r"the update raised NonFiniteError: .*NaN/inf for 2 updates in a row .*learning_rate",
    ) as info:
        trainer.train()
    assert isinstance(info.value.__cause__, NonFiniteError)
    assert not changed(before, adapter_state(trainer.model, POLICY))


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_signal_finishes_the_step_writes_a_checkpoint_and_says_how_to_resume(
    tiny_base_dir, tmp_path, signame, code, capsys
):
    import os
    import signal

    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", max_steps=5, save_steps=0)
    original = trainer.generation_round

    def step_then_signal(rows):
        out = original(rows)
        if trainer.state.global_step == 1:  # arrives during the second step
            os.kill(os.getpid(), getattr(signal, signame))
        return out

    trainer.generation_round = step_then_signal
    handler_before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.train()
    assert info.value.exit_code == code
    assert (
        trainer.state.global_step == 2 and len(trainer.state.log_history) == 2
    )  # the step in flight finished
    assert info.value.checkpoint == tmp_path / "run" / "checkpoint-2"
    assert "resume_from_checkpoint='latest'" in str(info.value) and signame in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is handler_before  # handlers restored
    resumed = make_trainer(
        tiny_base_dir, tmp_path, quantization="none", max_steps=5, resume_from_checkpoint="latest"
    )
    assert resumed.train()["steps"] == 5


def test_sampling_filters_with_a_reference_warn_once_at_start(tiny_base_dir, tmp_path):
    with pytest.warns(UserWarning, match=r"top_k=5.*unfiltered"):
        make_trainer(tiny_base_dir, tmp_path, quantization="none", top_k=5)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(
            tiny_base_dir, tmp_path, quantization="none", top_k=5, beta=0.0
        )  # on-policy, no KL: exact
    assert not [w for w in caught if "unfiltered" in str(w.message)]


def test_with_no_prompt_limit_a_prompt_over_the_context_fails_at_start(tiny_base_dir, tmp_path):
    # max_prompt_length=None cuts nothing: every prompt is checked before training, not when sampled.
    long_prompt = {"prompt": "1+2=" * 300, "answer": "3"}  # 1200 tokens, context 1024
    with pytest.raises(
        ValueError, match=r"1 of 25 prompts do not fit the model's context of 1024 tokens.*prompt 24"
    ):
        GRPOTrainer(
            GRPOConfig(
                model_name_or_path=tiny_base_dir,
                max_prompt_length=None,
                max_completion_length=4,
                num_generations=2,
                prompts_per_step=2,
                output_dir=str(tmp_path),
                gradient_checkpointing=False,
            ),
            reward_funcs=[digit_share],
            train_dataset=PROMPTS + [long_prompt],
        )


def always_run_the_reference_forward(trainer) -> None:
    """Make every rollout of `trainer` run the reference forward, as if its slot never equalled the policy."""
    original = trainer.generation_round

    def with_the_forward(rows):
        trainer.state.reference_is_policy = False
        return original(rows)

    trainer.generation_round = with_the_forward


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_a_reference_equal_to_the_policy_costs_no_forward(
    tiny_base_dir, tmp_path, monkeypatch, num_iterations
):
    # Hard sync after every step: the reference always equals the policy, so no step runs the
    # reference forward; the result equals a run that does run it.
    kw = dict(
        quantization="none", max_steps=3, ref_sync_steps=1, ref_sync_alpha=1.0, num_iterations=num_iterations
    )
    calls = []
    real = trainer_module.reference_forward
    monkeypatch.setattr(trainer_module, "reference_forward", lambda model: calls.append(1) or real(model))
    reused = make_trainer(tiny_base_dir, tmp_path / "a", **kw)
    reused.train()
    rounds = [m for m in reused.state.log_history if "reference_reused_policy" in m]  # a rollout's first step
    assert calls == [] and [m["reference_reused_policy"] for m in rounds] == [1.0] * -(-3 // num_iterations)
    if num_iterations == 1:  # on-policy: the KL to a reference equal to the policy is exactly 0
        assert all(m["kl"] == 0.0 for m in reused.state.log_history)
    forward = make_trainer(tiny_base_dir, tmp_path / "b", **kw)
    always_run_the_reference_forward(forward)
    forward.train()
    assert len(calls) == -(
        -3 // num_iterations
    )  # one reference forward per rollout (a rollout feeds num_iterations steps)
    for k, v in adapter_state(reused.model, POLICY).items():
        torch.testing.assert_close(v, adapter_state(forward.model, POLICY)[k], rtol=1e-5, atol=1e-6)


def test_a_reference_equal_to_a_policy_with_lora_dropout_is_its_forward_without_dropout(
    tiny_base_dir, tmp_path
):
    """The update's forward drops LoRA inputs; the reference's, in eval mode, does not. Reusing the update's own
    log-probs as the reference made the KL and its gradient 0 after every hard sync (found in review): the
    policy's log-probs without dropout stand in for it, equal to the reference forward's."""
    kw = dict(
        quantization="none", max_steps=2, ref_sync_steps=1, ref_sync_alpha=1.0, beta=0.04, lora_dropout=0.3
    )
    reused = make_trainer(tiny_base_dir, tmp_path / "a", **kw)
    reused.train()
    forward = make_trainer(tiny_base_dir, tmp_path / "b", **kw)
    always_run_the_reference_forward(forward)
    forward.train()
    kls = [m["kl"] for m in reused.state.log_history]
    assert kls[0] == 0.0 and kls[1] > 0, kls  # step 1: B = 0, so dropout changes nothing yet
    assert kls == pytest.approx([m["kl"] for m in forward.state.log_history], rel=1e-5, abs=1e-9)
    assert [m["reference_reused_policy"] for m in reused.state.log_history] == [1.0, 1.0]


def test_a_soft_sync_runs_the_reference_forward_after_the_first_update(tiny_base_dir, tmp_path):
    trainer = make_trainer(
        tiny_base_dir, tmp_path, quantization="none", max_steps=3, ref_sync_steps=1, ref_sync_alpha=0.5
    )
    trainer.train()
    assert [m["reference_reused_policy"] for m in trainer.state.log_history] == [1.0, 0.0, 0.0]


def test_a_second_train_is_refused_and_leaves_the_finished_run_as_it_is(tiny_base_dir, tmp_path):
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", max_steps=2, save_steps=1)
    trainer.train()
    run = tmp_path / "run"
    files, summary = sorted(p.name for p in run.iterdir()), (run / "summary.json").read_text()
    with pytest.raises(
        RuntimeError,
        match=r"^train\(\) was already called on this GRPOTrainer: it trained .*run to step 2/2, so a second call "
        r"would train nothing\. To train further, raise max_steps: build a new GRPOTrainer with max_steps=4 and "
        r"resume_from_checkpoint='latest' in its GRPOConfig",
    ):
        trainer.train()
    assert sorted(p.name for p in run.iterdir()) == files and (run / "summary.json").read_text() == summary
    assert trainer.state.global_step == 2 and len(trainer.state.log_history) == 2
    further = make_trainer(
        tiny_base_dir, tmp_path, quantization="none", max_steps=4, resume_from_checkpoint="latest"
    )
    assert further.train()["steps"] == 4  # what the message says to do


def test_a_stop_signal_in_an_epochs_last_step_ends_that_epoch_before_it_stops(tiny_base_dir, tmp_path):
    """The stop's checkpoint was written before the step's epoch end, so the resumed run began after that step
    and never ended the epoch: the TRL front door's epoch eval, epoch save and on_epoch_end were lost (found in
    review). The epoch ends first now, and a save of the step's end is the stop's checkpoint."""
    import os
    import signal

    kw = dict(quantization="none", max_steps=0, num_epochs=2, save_steps=0, train_dataset=PROMPTS[:4])

    def run(out, stop_at=None):
        trainer = make_trainer(tiny_base_dir, out, **kw)
        ended = []
        trainer.hooks.append(
            lambda name, t, **_: ended.append(t.state.global_step) if name == "epoch_end" else 0
        )
        original = trainer.timed_update

        def update(batch):
            if trainer.state.global_step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # in the epoch's last step (2 steps an epoch)
            return original(batch)

        trainer.timed_update = update
        return trainer, ended

    full, ended = run(tmp_path / "full")
    full.train()
    assert ended == [2, 4]
    stopped, ended_before = run(tmp_path / "stopped", stop_at=1)
    with pytest.raises(TrainingInterrupted):
        stopped.train()
    assert ended_before == [2] and (tmp_path / "stopped" / "run" / "checkpoint-2").is_dir()
    resumed, ended_after = run(tmp_path / "stopped")
    resumed.config.resume_from_checkpoint = "latest"
    resumed.train()
    assert ended_before + ended_after == [2, 4]
    assert_same_adapters(resumed.model, full.model)


def test_a_stopped_trainer_refuses_a_fresh_train_but_resumes_on_the_same_object(tiny_base_dir, tmp_path):
    import os
    import signal

    kw = dict(quantization="none", max_steps=3, save_steps=0)
    trainer = make_trainer(tiny_base_dir, tmp_path / "stopped", **kw)
    original = trainer.timed_update

    def update_then_signal(batch):
        out = original(batch)
        if trainer.state.global_step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.timed_update = update_then_signal
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    trainer.timed_update = original
    with pytest.raises(
        RuntimeError,
        match=r"to step 1/3 and stopped there\. To continue it: set resume_from_checkpoint='latest' in the "
        r"GRPOConfig .* and call train\(\) again",
    ):
        trainer.train()
    trainer.config.resume_from_checkpoint = "latest"  # what the message says
    trainer.train()
    uninterrupted = make_trainer(tiny_base_dir, tmp_path / "full", **kw)
    uninterrupted.train()
    assert trainer.state.global_step == 3
    assert_same_adapters(trainer.model, uninterrupted.model)


def test_the_sampler_never_draws_the_numbers_that_initialised_the_adapters(tiny_base_dir, tmp_path):
    """seed_everything(seed) starts torch's global stream, and LoRA A's kaiming-uniform init draws from
    it. A sampler seeded with the same number replays those uniforms: its first rollouts' tokens are a
    function of A (on SmolLM2-135M that cost 5–43 points of held-out accuracy after 10 steps). Each policy
    A entry maps back to the uniform u = (A / bound + 1) / 2 that made it; a run of consecutive A
    entries found as consecutive draws of the sampling stream is that replay."""
    import math

    trainer = make_trainer(tiny_base_dir, tmp_path, seed=3, quantization="none")
    name, a = next((n, p) for n, p in trainer.model.named_parameters() if f"lora_A.{POLICY}." in n)
    made = (a.detach().flatten()[:8] * math.sqrt(a.shape[1]) + 1) / 2

    def replays(generator) -> bool:
        draws = torch.rand(400_000, generator=generator)  # float32, as the init drew them
        first = int((draws - made[0]).abs().argmin())
        return (
            bool((draws[first : first + 8] - made).abs().max() < 1e-6) if first + 8 <= len(draws) else False
        )

    # the check finds the replay where there is one: the seed's own stream holds A's uniforms
    assert replays(torch.Generator().manual_seed(3)), name
    sampler = torch.Generator().set_state(trainer.generator.get_state())
    assert not replays(sampler)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_the_steps_of_one_generation_divide_by_its_tokens_per_step_as_trl(
    tiny_base_dir, tmp_path, monkeypatch, loss_type
):
    """With steps_per_generation 2, the loss types normalised by tokens divide each step's token sum by the
    generation's loss tokens / 2 (TRL's num_items_in_batch × GA / steps_per_generation), the same for both
    steps, whatever each slice holds."""
    generations, normalisers = [], []
    real_steps, real_loss = Batch.steps, update_module.grpo_loss

    def steps(self, num_steps=1):
        generations.append(float(self.completion_mask.sum()))
        return real_steps(self, num_steps)

    def grpo_loss(*args, num_tokens=None, **kwargs):
        normalisers.append(num_tokens)
        return real_loss(*args, num_tokens=num_tokens, **kwargs)

    monkeypatch.setattr(Batch, "steps", steps)
    monkeypatch.setattr(update_module, "grpo_loss", grpo_loss)
    step_tokens = []
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        quantization="none",
        loss_type=loss_type,
        epsilon_high=5.0,
        steps_per_generation=2,
        micro_batch_size=8,
        max_steps=4,
        max_completion_length=8,
    )
    real_update = trainer.update.__class__.__call__

    def update(self, batch, micro_batch_size):
        step_tokens.append(float(batch.completion_mask.sum()))
        return real_update(self, batch, micro_batch_size)

    monkeypatch.setattr(trainer.update.__class__, "__call__", update)
    trainer.train()
    assert len(generations) == 2 and len(step_tokens) == 4 == len(normalisers)  # one micro-batch a step
    expected = [g / 2 for g in generations for _ in range(2)]
    assert normalisers == pytest.approx(expected, rel=1e-6)
    assert step_tokens != pytest.approx(expected)  # the slices' own counts differ: the test tells them apart


def test_a_base_model_passed_in_gets_the_configs_adapters_and_a_peft_model_without_the_slot_is_refused(
    tiny_base_dir, tmp_path
):
    """The docstring's `model=`: a base got no adapters (torch's "optimizer got an empty parameter list"), and a
    get_peft_model(...) model trained until its first reference forward or checkpoint raised that it has no
    adapter 'reference', the run lost (found in review)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = GRPOConfig(
        model_name_or_path=tiny_base_dir,
        quantization="none",
        max_steps=1,
        num_generations=2,
        prompts_per_step=2,
        max_completion_length=4,
        micro_batch_size=4,
        gradient_checkpointing=False,
        output_dir=str(tmp_path / "a"),
        ref_sync_steps=1,
        save_steps=1,
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    trainer = GRPOTrainer(
        config, reward_funcs=[digit_share], train_dataset=PROMPTS, model=base, tokenizer=tokenizer
    )
    assert {POLICY, REFERENCE} <= set(trainer.model.peft_config)
    trainer.train()
    assert (tmp_path / "a" / "checkpoint-1").is_dir()
    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir), LoraConfig(r=4))
    config.output_dir = str(tmp_path / "b")
    with pytest.raises(ValueError, match=r"the model is a peft model with the adapters \['default'\], not"):
        GRPOTrainer(
            config, reward_funcs=[digit_share], train_dataset=PROMPTS, model=wrapped, tokenizer=tokenizer
        )
