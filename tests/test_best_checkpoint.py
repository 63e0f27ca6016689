"""metric_for_best_model: the eval that beats the best so far keeps its checkpoint (saved when no save is due,
never rotated away), summary.json names it, load_best_model_at_end makes its policy the final adapter, and a
resumed run carries it on (run/best.py)."""

import json
import shutil

import pytest
from helpers import PROMPTS, adapter_state, digit_share, make_trainer, run_torchrun
from safetensors.torch import load_file

from lora_grpo.config import ConfigError
from lora_grpo.model.adapters import POLICY
from lora_grpo.run import best
from lora_grpo.run.checkpoint import rotate_checkpoints
from lora_grpo.state import TrainState

TWO_PROCESSES = """
import json, sys
from pathlib import Path
from helpers import PROMPTS, digit_share, make_trainer
from test_best_checkpoint import PLAN, planned_by

base, out = sys.argv[1], Path(sys.argv[2])
trainer = make_trainer(base, out, reward_funcs=(digit_share, planned_by(PLAN)), eval_dataset=PROMPTS[:5], max_steps=8,
                       eval_steps=2, metric_for_best_model="planned", save_total_limit=1, load_best_model_at_end=True)
saves = []
trainer.hooks.append(lambda event, t, **p: saves.append(t.state.global_step) if event == "save" else None)
summary = trainer.train()
seen = {"saves": saves, "best": summary.get("best")}
(out / f"seen-{trainer.accelerator.process_index}.json").write_text(json.dumps(seen))
"""

# The eval score of each step, by plan: a reward function that gives every completion of a step the same score
# (no advantage in training: digit_share trains), so that the evals' order is known. Step 0 scores best of all.
PLAN = {0: 1.0, 2: 0.5, 4: 0.9, 6: 0.3, 8: 0.4}


def planned_by(plan: dict):
    """The reward function `planned` of a plan {step: score}."""

    def planned(completions, trainer_state, **kwargs):
        return [plan.get(trainer_state.global_step, 0.0)] * len(completions)

    return planned


def planned_run(base_dir, out_dir, plan=PLAN, **overrides):
    """8 steps of TINY_RUN, evaluated every 2 steps, with the step's saves recorded in trainer.saves."""
    fields = dict(max_steps=8, eval_steps=2, metric_for_best_model="planned", save_total_limit=1)
    trainer = make_trainer(
        base_dir,
        out_dir,
        reward_funcs=(digit_share, planned_by(plan)),
        eval_dataset=PROMPTS[:3],
        **{**fields, **overrides},
    )
    trainer.saves = []
    trainer.hooks.append(
        lambda event, t, **payload: t.saves.append(t.state.global_step) if event == "save" else None
    )
    return trainer


def policy_of(checkpoint):
    return load_file(str(checkpoint / "policy" / "adapter_model.safetensors"))


def same_weights(model_state: dict, saved: dict) -> bool:
    """The policy's parameters (adapter_state: peft's names, with the adapter's) equal a saved adapter file's."""
    values = {name.replace(f".{POLICY}.", "."): value.cpu() for name, value in model_state.items()}
    return values.keys() == saved.keys() and all(bool((values[k] == saved[k]).all()) for k in saved)


def test_the_best_eval_after_a_step_keeps_its_checkpoint_and_becomes_the_final_adapter(
    tiny_base_dir, tmp_path
):
    # a hard sync after every step, the last included
    trainer = planned_run(
        tiny_base_dir, tmp_path, load_best_model_at_end=True, ref_sync_steps=1, ref_sync_alpha=1.0
    )
    summary = trainer.train()
    run = tmp_path / "run"
    # step 2 (the first eval after a step) and step 4 beat the best, and were saved though no save was due; step 6
    # did not; step 8 is the run's last. The eval before training (1.0) counts for nothing: the start is no
    # checkpoint.
    assert trainer.saves == [2, 4, 8]
    # save_total_limit=1 keeps the newest (to resume) and the best
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert summary["best"] == {
        "metric": "eval/planned",
        "value": pytest.approx(0.9),
        "step": 4,
        "checkpoint": "checkpoint-4",
    }
    assert json.loads((run / "summary.json").read_text())["best"]["checkpoint"] == "checkpoint-4"
    # the policy, in memory and in the final adapter, is checkpoint-4's; checkpoint-8 keeps the last step's
    best_policy, last_policy = policy_of(run / "checkpoint-4"), policy_of(run / "checkpoint-8")
    assert not same_weights(best_policy, last_policy)
    assert same_weights(adapter_state(trainer.model, POLICY), best_policy)
    assert same_weights(best_policy, load_file(str(run / "adapter" / "adapter_model.safetensors")))
    assert not trainer.state.reference_is_policy  # the slot holds the last step's policy, not the best's
    # the last checkpoint records the best, in transformers' fields
    recorded = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())
    assert (recorded["best_global_step"], recorded["best_metric"]) == (4, pytest.approx(0.9))
    assert recorded["best_model_checkpoint"] == str(run / "checkpoint-4")
    # the final adapter's card: the steps of its policy
    assert "| optimizer steps | 4 |" in (run / "adapter" / "README.md").read_text()


def test_a_best_at_the_eval_after_the_last_step_is_the_last_checkpoint(tiny_base_dir, tmp_path, capsys):
    trainer = planned_run(tiny_base_dir, tmp_path, plan={**PLAN, 8: 0.95}, load_best_model_at_end=True)
    summary = trainer.train()
    run = tmp_path / "run"
    assert trainer.saves == [2, 4, 8] and summary["best"]["checkpoint"] == "checkpoint-8"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-8"]  # the best is the newest
    assert same_weights(
        policy_of(run / "checkpoint-8"), load_file(str(run / "adapter" / "adapter_model.safetensors"))
    )
    assert "| optimizer steps | 8 |" in (run / "adapter" / "README.md").read_text()
    assert "the final adapter is the best checkpoint's policy: checkpoint-8" in capsys.readouterr().out


def test_a_best_checkpoint_that_cannot_be_loaded_leaves_the_last_steps_adapter_with_a_warning(
    tiny_base_dir, tmp_path
):
    trainer = planned_run(tiny_base_dir, tmp_path, load_best_model_at_end=True, save_total_limit=0)
    run = tmp_path / "run"

    def damage_the_best(event, t, **payload):  # once the last checkpoint is written
        if event == "save" and t.state.global_step == 8:
            (run / "checkpoint-4" / "policy" / "adapter_model.safetensors").write_bytes(b"not tensors")

    trainer.hooks.append(damage_the_best)
    with pytest.warns(UserWarning, match="load_best_model_at_end: the best checkpoint could not be loaded"):
        trainer.train()
    final = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert same_weights(policy_of(run / "checkpoint-8"), final)
    assert "| optimizer steps | 8 |" in (run / "adapter" / "README.md").read_text()


def test_a_lower_is_better_metric_and_the_last_steps_adapter_without_load_best(tiny_base_dir, tmp_path):
    trainer = planned_run(tiny_base_dir, tmp_path, greater_is_better=False, save_total_limit=0)
    summary = trainer.train()
    run = tmp_path / "run"
    assert trainer.saves == [2, 6, 8]  # 0.5 first, then 0.3; 0.9 and the end's 0.4 are not lower
    assert summary["best"]["step"] == 6
    final = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert same_weights(adapter_state(trainer.model, POLICY), final)
    assert same_weights(policy_of(run / "checkpoint-8"), final)


def test_a_resumed_run_keeps_the_best_of_the_steps_before(tiny_base_dir, tmp_path, capsys):
    planned_run(tiny_base_dir, tmp_path, max_steps=4).train()
    trainer = planned_run(
        tiny_base_dir, tmp_path, resume_from_checkpoint="latest", load_best_model_at_end=True
    )
    summary = trainer.train()
    assert trainer.saves == [8]  # 0.3 at step 6 and 0.4 at the end do not beat step 4's 0.9
    assert summary["best"]["checkpoint"] == "checkpoint-4"
    assert "the final adapter is the best checkpoint's policy: checkpoint-4 (eval/planned 0.9 at step 4)" in (
        capsys.readouterr().out
    )


def test_resuming_a_finished_run_without_its_adapter_writes_the_best_checkpoints(tiny_base_dir, tmp_path):
    planned_run(tiny_base_dir, tmp_path, load_best_model_at_end=True).train()
    run = tmp_path / "run"
    final = run / "adapter" / "adapter_model.safetensors"
    shutil.rmtree(run / "adapter")  # as when a run failed after its last checkpoint
    trainer = planned_run(
        tiny_base_dir, tmp_path, resume_from_checkpoint="latest", load_best_model_at_end=True
    )
    trainer.train()
    assert trainer.saves == []  # nothing trained or saved
    assert same_weights(policy_of(run / "checkpoint-4"), load_file(str(final)))
    assert same_weights(adapter_state(trainer.model, POLICY), policy_of(run / "checkpoint-4"))


def test_a_resume_finds_the_best_checkpoint_under_the_runs_directory_or_says_it_is_gone(tmp_path):
    state = TrainState(global_step=6)
    state.best_metric, state.best_global_step, state.best_metric_name = 0.9, 4, "eval/planned"
    state.best_model_checkpoint = "/elsewhere/run/checkpoint-4"  # the run was moved
    (tmp_path / "checkpoint-4").mkdir()
    assert best.resumed(state, tmp_path, "planned") is None
    assert state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4").rmdir()
    assert "checkpoint-4 recorded in the resumed state is gone" in best.resumed(state, tmp_path, "planned")
    assert state.best_model_checkpoint is None
    state.best_model_checkpoint = str(tmp_path / "checkpoint-4")
    line = best.resumed(state, tmp_path, "eval/digit_share")
    assert "chosen by eval/planned, this run's by eval/digit_share" in line
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == (None, None, None)


def test_an_eval_improves_on_the_best_in_its_direction_and_a_nan_never_does():
    state = TrainState(global_step=2)
    assert not best.improved(state, {"eval/r": float("nan")}, "r", True)
    assert best.improved(state, {"eval/r": 0.5}, "eval/r", True)
    state.global_step = 4
    assert not best.improved(state, {"eval/r": 0.5}, "r", True)  # equal is no improvement, as in transformers
    assert best.improved(state, {"eval/r": 0.7}, "r", True)
    assert (state.best_metric, state.best_global_step, state.best_metric_name) == (0.7, 4, "eval/r")
    state.global_step = 6
    assert not best.improved(state, {"eval/r": 0.6}, "r", True)
    assert best.improved(state, {"eval/r": 0.6}, "r", False)  # lower is better: the caller's direction
    # a best of another metric is replaced by the first eval of this one
    assert best.improved(state, {"eval/k": 9.0}, "k", False) and state.best_metric_name == "eval/k"


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    def names():
        return sorted((p.name for p in tmp_path.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))

    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
    rotate_checkpoints(tmp_path, 3, protect=tmp_path / "checkpoint-2")
    assert names() == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]  # the best counts within the limit
    rotate_checkpoints(tmp_path, 1, protect="/moved/run/checkpoint-2")  # by name, under this directory
    assert names() == ["checkpoint-2", "checkpoint-8"]
    rotate_checkpoints(tmp_path, 1)
    assert names() == ["checkpoint-8"]


def test_best_model_settings_that_cannot_work_are_refused_when_the_trainer_is_built(tiny_base_dir, tmp_path):
    with pytest.raises(ConfigError, match="load_best_model_at_end=true needs metric_for_best_model"):
        make_trainer(tiny_base_dir, tmp_path, load_best_model_at_end=True)
    with pytest.raises(ConfigError, match="metric_for_best_model='planned' .* there are no eval prompts"):
        make_trainer(tiny_base_dir, tmp_path, metric_for_best_model="planned")
    with pytest.raises(
        ConfigError, match="not one of this run's eval metrics: eval/reward, eval/digit_share, "
    ):
        make_trainer(tiny_base_dir, tmp_path, metric_for_best_model="accuracy", eval_dataset=PROMPTS[:3])
    # each of a named set's metrics, under its name
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        metric_for_best_model="eval/hard/digit_share",
        eval_dataset={"easy": PROMPTS[:2], "hard": PROMPTS[2:4]},
    )
    assert "eval/easy/reward" in trainer.eval_metric_names()


def test_two_processes_take_the_same_best_and_save_it_together(tiny_base_dir, tmp_path):
    run_torchrun(TWO_PROCESSES, tmp_path, tiny_base_dir, tmp_path)
    seen = [json.loads((tmp_path / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] == seen[1]  # every save is a collective: each process decided it alike
    assert seen[0]["saves"] == [2, 4, 8] and seen[0]["best"]["checkpoint"] == "checkpoint-4"
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert same_weights(
        policy_of(run / "checkpoint-4"), load_file(str(run / "adapter" / "adapter_model.safetensors"))
    )
