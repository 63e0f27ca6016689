"""Training health (run/health.py): each condition warns once when it starts, flags every step it holds
in the metrics, says what to look at, and survives a checkpoint (no second warning, no lost streak)."""

import json
import math

import pytest

from lora_grpo.run.health import CONDITIONS, HealthMonitor


def _step(**overrides):
    """A healthy step's metrics, as the trainer logs them."""
    return {
        "frac_reward_zero_std": 0.25,
        "truncated_fraction": 0.1,
        "kl": 0.01,
        "entropy": 1.0,
        "completion_length/mean": 40.0,
        "completion_length/max": 64.0,
        "reward/mean": 0.5,
        "reward/std": 0.3,
        "rewards/accuracy/mean": 0.5,
        **overrides,
    }


def _run(monitor, steps, start=1):
    """Feed the steps; returns [(step, warnings, metrics)]."""
    out = []
    for i, metrics in enumerate(steps, start):
        warnings = monitor.observe(i, metrics)
        out.append((i, warnings, metrics))
    return out


def test_a_healthy_run_warns_nothing_and_flags_zero():
    got = _run(HealthMonitor(), [_step() for _ in range(20)])
    assert all(not w for _, w, _ in got)
    last = got[-1][2]
    assert (
        all(last[f"health/{name}"] == 0.0 for name in CONDITIONS)
        and last["health/reward_none/accuracy"] == 0.0
    )


def test_no_reward_spread_for_n_steps_in_a_row_warns_once_with_what_to_look_at():
    monitor = HealthMonitor(zero_std_steps=3)
    steps = [_step(frac_reward_zero_std=1.0, **{"reward/mean": 1.0}) for _ in range(6)]
    steps.insert(1, _step())  # a broken streak starts again
    got = _run(monitor, steps)
    said = [(i, w) for i, w, _ in got if w]
    assert [i for i, _ in said] == [5]  # steps 3, 4, 5 in a row after the break at step 2
    text = said[0][1][0]
    assert text.startswith("step 5: every group's rewards have been equal for 3 steps in a row")
    assert (
        "reward/mean 1" in text
        and "accuracy 0.5" in text
        and "completions log" in text
        and "too easy" in text
    )
    assert [m["health/no_signal"] for _, _, m in got] == [0, 0, 0, 0, 1, 1, 1]
    assert got[-1][2]["health/zero_std_streak"] == 5


def test_all_completions_truncated_warns_when_it_starts():
    got = _run(HealthMonitor(), [_step(), _step(truncated_fraction=1.0), _step(truncated_fraction=1.0)])
    assert [bool(w) for _, w, _ in got] == [False, True, False]
    text = got[1][1][0]
    assert "every completion hit max_completion_length (64 tokens) without ending" in text
    assert "completions log" in text and "mask_truncated_completions" in text
    assert [m["health/all_truncated"] for _, _, m in got] == [0, 1, 1]


def test_a_kl_jump_of_an_order_of_magnitude_warns_naming_lr_and_beta():
    kls = (0.001, 0.002, 0.003, 0.004, 0.002, 0.005, 0.08, 0.09)  # the first 5: the warm-up
    got = _run(HealthMonitor(), [_step(kl=k) for k in kls])
    assert [bool(w) for _, w, _ in got] == [False] * 6 + [True, False]
    text = got[6][1][0]
    assert "jumped to 0.08 in one step, from at most 0.005 over the steps before (×16)" in text
    assert "learning rate" in text and "beta" in text and "completions log" in text
    assert [m["health/kl_spike"] for _, _, m in got] == [0] * 6 + [1, 0]


def test_a_kl_growing_tenfold_from_zero_after_the_start_and_a_sync_is_no_spike_but_a_later_jump_is():
    # What ordinary toy runs log: ~0 at step 1, ×17 at step 2 (a KL that grows from 0 is tenfold by
    # construction); a sync sets the reference to the policy, and the KL starts again from ~0.
    start = [0.0, 0.0167, 0.03, 0.05, 0.06]
    after_sync = [0.0002, 0.009, 0.02, 0.03, 0.03]
    steps = (
        [_step(kl=k) for k in start]
        + [_step(kl=0.07, **{"sync/event": 1.0})]
        + [_step(kl=k) for k in after_sync]
    )
    got = _run(HealthMonitor(), steps + [_step(kl=0.9)])  # the planted fault: a jump after the warm-up
    assert [i for i, w, _ in got if w] == [12]
    assert "jumped to 0.9 in one step, from at most 0.03" in got[-1][1][0]


def test_a_noisy_kl_is_no_spike():
    # The default toy recipe's KL (16 prompts a step): one low step between higher ones is no base for a jump.
    kls = (0.014, 0.0128, 0.0017, 0.0152, 0.0067, 0.1013, 0.0064, 0.031)
    assert not any(w for _, w, _ in _run(HealthMonitor(), [_step(kl=k) for k in kls]))


def test_a_kl_growing_from_zero_after_a_sync_is_no_spike():
    # Right after a (hard) sync the KL restarts near 0: a growth under kl_floor × 10 is not a jump.
    got = _run(
        HealthMonitor(), [_step(kl=0.0), _step(kl=1e-5), _step(kl=1e-4), _step(kl=0.004), _step(kl=0.009)]
    )
    assert not any(w for _, w, _ in got)


def test_entropy_collapse_against_the_first_steps():
    steps = [_step(entropy=e) for e in (1.2, 1.0, 0.8, 0.5, 0.2, 0.09, 0.05)]
    got = _run(HealthMonitor(), steps)
    assert [i for i, w, _ in got if w] == [6]
    assert "entropy fell to 0.09 nats/token, under 0.1 × its 1 over the first 3 steps" in got[5][1][0]
    assert "temperature" in got[5][1][0] and "completions log" in got[5][1][0]


def test_completion_length_collapse_against_the_first_steps():
    lengths = (50, 40, 60, 30, 12, 8, 7)
    got = _run(HealthMonitor(), [_step(**{"completion_length/mean": float(n)}) for n in lengths])
    assert [i for i, w, _ in got if w] == [6]
    assert (
        "completions shrank to 8 tokens on average, under 0.2 × the 50 of the first 3 steps" in got[5][1][0]
    )
    # Completions that were short from the start (a one-token answer task) never "collapse".
    short = _run(HealthMonitor(), [_step(**{"completion_length/mean": n}) for n in (3.0, 3.0, 3.0, 0.5)])
    assert not any(w for _, w, _ in short)


def test_a_reward_function_that_applies_to_no_completion_warns_naming_it():
    got = _run(HealthMonitor(), [_step(), _step(**{"rewards/accuracy/mean": math.nan})])
    assert (
        got[1][1] == [got[1][1][0]]
        and "reward function 'accuracy' returned None for every completion" in got[1][1][0]
    )
    assert got[1][2]["health/reward_none/accuracy"] == 1.0


def test_a_flickering_condition_warns_again_only_after_rearm_steps_off():
    truncated = [1.0, 0.9, 1.0, 0.9, 1.0] + [0.0] * 4 + [1.0]
    got = _run(HealthMonitor(rearm_steps=4), [_step(truncated_fraction=t) for t in truncated])
    assert [i for i, w, _ in got if w] == [1, 10]


def test_state_survives_a_checkpoint_mid_streak_and_mid_episode():
    steps = [_step(frac_reward_zero_std=1.0, truncated_fraction=1.0, entropy=e) for e in (1.0, 0.9, 0.8, 0.7)]
    whole = HealthMonitor(zero_std_steps=5)
    uninterrupted = _run(
        whole, [dict(s) for s in steps] + [_step(frac_reward_zero_std=1.0, truncated_fraction=1.0)]
    )
    first = HealthMonitor(zero_std_steps=5)
    head = _run(first, [dict(s) for s in steps])
    saved = json.loads(json.dumps(first.state_dict()))  # as lora_grpo_state.json holds it
    resumed = HealthMonitor(zero_std_steps=5)
    resumed.load_state_dict(saved)
    tail = _run(resumed, [_step(frac_reward_zero_std=1.0, truncated_fraction=1.0)], start=5)
    assert [w for _, w, _ in head + tail] == [w for _, w, _ in uninterrupted]
    assert tail[0][1] and tail[0][1][0].startswith(
        "step 5: every group's rewards have been equal for 5 steps"
    )
    assert not any(
        "max_completion_length" in w for w in tail[0][1]
    )  # warned before the checkpoint: not again
    assert resumed.state_dict() == whole.state_dict()


@pytest.mark.parametrize("missing", ["kl", "entropy", "frac_reward_zero_std"])
def test_missing_or_nan_metrics_are_no_condition(missing):
    metrics = _step()
    del metrics[missing]
    got = _run(HealthMonitor(), [dict(metrics) for _ in range(5)] + [_step(kl=math.nan, entropy=math.nan)])
    assert not any(w for _, w, _ in got)
