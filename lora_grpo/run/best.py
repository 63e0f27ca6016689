"""The run's best checkpoint (metric_for_best_model): which eval beat the best so far, and the checkpoint that
holds it. Kept in transformers' TrainerState fields (best_metric, best_global_step, best_model_checkpoint) and the
metric's name (TrainState.best_metric_name), so that a checkpoint's trainer_state.json and a resumed run carry it.

    an eval after a step ─► improved(): its metric beats best_metric (greater_is_better picks the direction; NaN
                            never does) → best_metric, best_global_step = the eval's, the step
                          ─► the trainer saves that step's checkpoint when none is due
    checkpoint-N         ─► saved(): N is the best step → best_model_checkpoint = its path
                          ─► rotation keeps it (checkpoint.rotate_checkpoints' `protect`)
    the run's end        ─► load_best_model_at_end: the policy of best_model_checkpoint

As transformers' Trainer: the eval before the first step does not count (the start is no checkpoint). Unlike it, a
new best at a step where no save is due is saved: transformers records the step and keeps no checkpoint of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ..config_checks import ConfigError


def metric_key(name: str) -> str:
    """The eval metric a metric_for_best_model names: 'eval/' + name unless it has it ('reward' → 'eval/reward')."""
    return name if name.startswith("eval/") else f"eval/{name}"


class UnknownMetric(ConfigError):
    """metric_for_best_model names none of the run's eval metrics; `known`: those it may name."""

    def __init__(self, name: str, known: Sequence[str]):
        super().__init__(
            f"metric_for_best_model={name!r} is not one of this run's eval metrics: {', '.join(known)}. Name one "
            "of them (eval/reward is the reward functions' weighted sum), or leave metric_for_best_model unset",
            field="metric_for_best_model",
        )
        self.known = list(known)


def check_metric(name: str, known: Sequence[str]) -> None:
    """UnknownMetric unless metric_for_best_model `name` is one of the eval metrics `known` (those the run's
    evaluate() returns)."""
    if metric_key(name) not in known:
        raise UnknownMetric(name, known)


def improved(state, metrics: dict[str, float], name: str, greater_is_better: bool) -> bool:
    """Whether this eval (metrics, at state.global_step) beats the best so far by `name`; if so it becomes the best
    (state.best_metric, best_global_step, best_metric_name). A NaN never does; a best of another metric (a run
    resumed with another metric_for_best_model) is replaced by the first eval."""
    key, value = metric_key(name), float(metrics[metric_key(name)])
    if math.isnan(value):
        return False
    best = state.best_metric if state.best_metric_name == key else None
    if best is not None and not (value > best if greater_is_better else value < best):
        return False
    state.best_metric, state.best_global_step, state.best_metric_name = value, state.global_step, key
    state.best_model_checkpoint = None  # until its checkpoint is written (saved)
    return True


def saved(state, target: Path) -> None:
    """Checkpoint `target` of state.global_step was written: the best's when it is the best step."""
    if state.best_global_step is not None and state.best_global_step == state.global_step:
        state.best_model_checkpoint = str(target)


def resumed(state, output_dir: Path, name: str | None) -> str | None:
    """After a resume: the best checkpoint under this output_dir (the run may have moved), or none when it is gone
    or was chosen by another metric than `name` (a line saying so; None when nothing changed)."""
    if state.best_model_checkpoint is None:
        return None
    here = Path(output_dir) / Path(state.best_model_checkpoint).name
    if name is not None and state.best_metric_name != metric_key(name):
        state.best_metric = state.best_global_step = state.best_model_checkpoint = None
        return (
            f"the checkpoint's best was chosen by {state.best_metric_name}, this run's by {metric_key(name)}: "
            "the best is chosen afresh from the next eval"
        )
    if not here.is_dir():
        state.best_model_checkpoint = None
        return f"the best checkpoint {here.name} recorded in the resumed state is gone: the next best is kept"
    state.best_model_checkpoint = str(here)
    return None


def describe(state) -> str:
    """'checkpoint-20 (eval/reward 0.625 at step 20)'."""
    return (
        f"{Path(state.best_model_checkpoint).name} ({state.best_metric_name} {state.best_metric:.4g} "
        f"at step {state.best_global_step})"
    )


def summary(state) -> dict | None:
    """summary.json's "best": the metric, its value, the step and the checkpoint's name; None without one."""
    if state.best_model_checkpoint is None:
        return None
    return {
        "metric": state.best_metric_name,
        "value": state.best_metric,
        "step": state.best_global_step,
        "checkpoint": Path(state.best_model_checkpoint).name,
    }
