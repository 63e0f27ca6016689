"""The loop's mutable state, one typed object: what a checkpoint saves and restores whole.

`TrainState` is transformers' `TrainerState` (so callbacks, reward functions and TRL scripts read
`global_step`, `epoch`, `max_steps`, `log_history` as they know them) with the fields of our loop
beside them. `state_dict()` walks every dataclass field, so a field added here is saved and
restored without a line anywhere else; a field whose value is a part with its own state (the data
position, the sync schedule, the warmup restarts) is saved through that part's `state_dict()`.

Fields marked PER_PROCESS hold tensors and are each process's own (the steps left of the current
generation): `state_dict()` leaves them out, `process_state_dict()` gives them as CPU tensors, which
run/checkpoint.py writes to trainer_state.pt beside every process's RNG states, with each process's own data
position (ALSO_PER_PROCESS: the JSON holds the main process's). Not in here at all: the
optimizer, the LR scheduler, the RNG states and the adapters themselves.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import TrainerState

from .algo.loss import AdaptiveEntropy
from .batch import RolloutSteps
from .model.reference import SyncSchedule
from .optim import LossScale
from .run.health import HealthMonitor

# Fields that a run takes from its config, not from the checkpoint it resumes: a resumed run may
# train for more steps, log or save at another rate.
FROM_CONFIG = frozenset(
    {
        "max_steps",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "num_train_epochs",
        "train_batch_size",
        "is_local_process_zero",
        "is_world_process_zero",
    }
)
# A field's saved form (in lora_grpo_state.json) where its annotation says another or nothing: a part
# (an Any field) is saved as its state_dict(), a JSON object; a run without warmup restarts saves null for
# them; transformers saves stateful_callbacks as an object.
_SAVED_FORM = {"warmup_restarts": dict | None, "stateful_callbacks": dict | None}
# A part's own check of what it would restore (the entries inside its JSON object).
_PART_PROBLEMS = {"loss_scale": LossScale.saved_problems}
# Saved integers count something (steps, tokens, updates): none is negative, and these are at least 1.
_AT_LEAST_ONE = frozenset({"num_processes", "micro_batch_size"})
# Fields a new run of the same trainer keeps (TRL's second train(), GRPOTrainer._start_again): facts about the
# adapters and the sizes in use, not about the run.
OF_THE_MODEL = frozenset(
    {"reference_is_policy", "micro_batch_size", "gradient_checkpointing", "num_processes"}
)
# Parts saved in lora_grpo_state.json (the main process's) and again per process in trainer_state.pt, where each
# process's own is restored: with dynamic sampling each process draws its prompts at its own pace.
ALSO_PER_PROCESS = ("batches",)
# A field's metadata key: the field is this process's own, saved with tensors in trainer_state.pt; its value
# is the function that rebuilds the part from its saved state (saved, device) -> part.
PER_PROCESS = "lora_grpo_per_process"


@dataclass
class StepFlow:
    """What is due after an optimizer step; a hook at "step_end" may change it (a callback's control)."""

    evaluate: bool
    log: bool
    save: bool


@dataclass
class TrainState(TrainerState):
    """transformers' TrainerState (global_step = optimizer steps done; log_history = one metrics
    record per step and eval, as metrics.jsonl) plus the loop's own state."""

    nonfinite_in_a_row: int = 0  # NaN/inf updates skipped in a row (max_nonfinite_updates ends the run)
    # The reference slot provably equals the policy (start, or right after a hard sync): its forward
    # is skipped and the policy's log-probs stand in.
    reference_is_policy: bool = True
    # A sync since the current rollout's reference log-probs were taken: the rollout's steps left measure their KL
    # to the reference before it, which the KL trigger must not read (it waits for the next rollout's).
    synced_in_generation: bool = False
    micro_batch_size: int | str | None = None  # the sizes in use ('auto' resolved by the memory plan)
    gradient_checkpointing: bool | str | None = None
    num_processes: int = 1  # the processes that wrote a checkpoint (each one's RNG is saved)
    batches: Any = None  # data.PromptBatches: the data position
    sync_schedule: Any = None  # reference.SyncSchedule: the plateau trigger's best score and count
    warmup_restarts: Any = None  # optim.WarmupRestarts: the update of the last warmup restart
    health: Any = None  # health.HealthMonitor: streaks, recent KLs, first-steps baselines, warnings given
    adaptive_entropy: Any = None  # loss.AdaptiveEntropy: the entropy coefficient and its last measurement
    loss_scale: Any = None  # optim.LossScale: a float16 model's loss scale and its growth count
    # the eval metric that chose best_metric / best_model_checkpoint (run/best.py; metric_for_best_model)
    best_metric_name: str | None = None
    # a front door's own state (the TRL front door's log history)
    extra: dict = dataclasses.field(default_factory=dict)
    # the eval before training (eval_on_start, at step 0): summary.json's "before" figures, a resumed run's too
    eval_before: dict = dataclasses.field(default_factory=dict)
    # A step whose update finished but whose step end (eval, sync, log) did not: its eval failed
    # (run/failures.py). {"metrics", "epoch_ended"}; a resumed run ends that step first.
    unfinished_step: dict | None = None
    # batch.RolloutSteps: the optimizer steps of the current rollout not trained yet (None or empty:
    # the next step samples a new rollout). A checkpoint inside a generation saves them, so that the
    # resumed run trains them on the same rollout. (The field's name is the checkpoint's key.)
    generation: Any = dataclasses.field(default=None, metadata={PER_PROCESS: RolloutSteps.from_state_dict})

    @classmethod
    def for_run(
        cls, config, accelerator, total_steps: int, batches, warmup_restarts, loss_scale
    ) -> "TrainState":
        """A fresh run's state: transformers' fields from the config, our parts at their start."""
        return cls(
            max_steps=total_steps,
            logging_steps=config.logging_steps,
            eval_steps=config.eval_steps,
            save_steps=config.save_steps,
            is_local_process_zero=accelerator.is_local_main_process,
            is_world_process_zero=accelerator.is_main_process,
            num_processes=accelerator.num_processes,
            batches=batches,
            sync_schedule=SyncSchedule.from_config(config),
            warmup_restarts=warmup_restarts,
            health=HealthMonitor(),
            micro_batch_size=config.micro_batch_size,
            gradient_checkpointing=config.gradient_checkpointing,
            adaptive_entropy=AdaptiveEntropy(
                config.entropy_coef,
                config.entropy_target,
                config.entropy_coef_delta,
                config.entropy_coef_min,
                config.entropy_coef_max,
            ),
            loss_scale=loss_scale,
        )

    @property
    def step(self) -> int:
        """Alias of global_step (the name reward functions and our metrics use)."""
        return self.global_step

    def state_dict(self) -> dict[str, Any]:
        """Every field but the PER_PROCESS ones, JSON-ready; parts with a state_dict() give theirs."""
        return {
            f.name: _export(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if PER_PROCESS not in f.metadata
        }

    def transformers_state_dict(self) -> dict[str, Any]:
        """transformers' TrainerState fields alone (a checkpoint's trainer_state.json, which
        TrainerState.load_from_json and scripts that read a run's log_history take)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainerState)}

    def process_parts(self) -> dict[str, Any]:
        """The PER_PROCESS fields' values themselves (immutable parts: a reference keeps them as they are)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if PER_PROCESS in f.metadata}

    def process_state_dict(self) -> dict[str, Any]:
        """This process's PER_PROCESS fields as plain values and CPU tensors, and its ALSO_PER_PROCESS parts' states
        (for trainer_state.pt)."""
        own = {
            name: _export(getattr(self, name)) for name in ALSO_PER_PROCESS if getattr(self, name) is not None
        }
        return {**{name: _export(value) for name, value in self.process_parts().items()}, **own}

    def load_process_state_dict(self, saved: dict[str, Any], device) -> None:
        """Restore process_state_dict()'s fields, tensors onto `device`; a field the checkpoint lacks
        (one written before the field existed) is None, an ALSO_PER_PROCESS part it lacks keeps the main
        process's state (load_state_dict's)."""
        for f in dataclasses.fields(self):
            if PER_PROCESS in f.metadata:
                value = saved.get(f.name)
                setattr(self, f.name, None if value is None else f.metadata[PER_PROCESS](value, device))
        for name in ALSO_PER_PROCESS:
            if saved.get(name) is not None and getattr(self, name) is not None:
                getattr(self, name).load_state_dict(saved[name])

    def start_again(self, fresh: TrainState) -> None:
        """Become `fresh` (a new run's state, TrainState.for_run) in place, parts included, but for the
        OF_THE_MODEL fields: what a new run on the same adapters starts from. In place, since the
        update, the sizes and the scorer hold this object."""
        kept = {name: getattr(self, name) for name in OF_THE_MODEL}
        self.load_state_dict(fresh.state_dict())
        for name, value in {**kept, **fresh.process_parts()}.items():
            setattr(self, name, value)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore every saved field but FROM_CONFIG; parts restore through their load_state_dict().
        Unknown keys are ignored. ValueError naming each field whose value does not fit (saved_problems), before
        any field is set."""
        problems = self.saved_problems(saved)
        if problems:
            raise ValueError("; ".join(problems))
        for f in dataclasses.fields(self):
            if f.name not in saved or f.name in FROM_CONFIG:
                continue
            current = getattr(self, f.name)
            if hasattr(current, "load_state_dict"):
                current.load_state_dict(saved[f.name])
            else:
                setattr(self, f.name, saved[f.name])

    @classmethod
    def saved_problems(cls, saved: Mapping[str, Any]) -> list[str]:
        """What is wrong in `saved` (a state_dict(), as lora_grpo_state.json holds it), field by field: a value of
        another type than its field's (`"global_step": "two"`, `"batches": null`) or out of range (a negative
        count); [] when every field it restores fits. Unknown keys and FROM_CONFIG fields (not restored) are not
        checked."""
        hints = typing.get_type_hints(cls)
        problems = []
        for f in dataclasses.fields(cls):
            if f.name not in saved or f.name in FROM_CONFIG or PER_PROCESS in f.metadata:
                continue
            value = saved[f.name]
            form = _SAVED_FORM.get(f.name, dict if hints[f.name] is Any else hints[f.name])
            if not _fits(value, form):
                problems.append(f"{f.name} is {_shown(value)}; it must be {_described(form)}")
            elif f.name in _PART_PROBLEMS:
                problems.extend(_PART_PROBLEMS[f.name](value))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                least = 1 if f.name in _AT_LEAST_ONE else 0
                # `not >=`: NaN fails too
                if not value >= least:
                    problems.append(f"{f.name} is {_shown(value)}; it must be {least} or more")
        return problems


def _fits(value: Any, form: Any) -> bool:
    """Whether a JSON value has the type `form` (an annotation): containers by their own type only, an int for a
    float, never a bool for a number."""
    if form is Any:
        return True
    if typing.get_origin(form) in (typing.Union, types.UnionType):
        return any(_fits(value, member) for member in typing.get_args(form))
    if form is type(None):
        return value is None
    form = typing.get_origin(form) or form
    if isinstance(value, bool):
        return form is bool
    if form is float:
        return isinstance(value, (int, float))
    return isinstance(value, form)


_JSON_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    dict: "an object",
}


def _described(form: Any) -> str:
    """An annotation in the words of a JSON file: "an integer or null"."""
    if typing.get_origin(form) in (typing.Union, types.UnionType):
        return " or ".join(_described(member) for member in typing.get_args(form))
    if form is type(None):
        return "null"
    form = typing.get_origin(form) or form
    return _JSON_NAMES.get(form, "a list" if form is list else form.__name__)


def _shown(value: Any) -> str:
    """A saved value as the JSON file shows it, cut short."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _export(value: Any) -> Any:
    return value.state_dict() if hasattr(value, "state_dict") else value
