"""A step that fails mid-run: its stages, the state the run can still be saved at, and the one error it raises.

A training step runs in stages: rollout (sampling; an environment's constructor and reset inside it are
the stage "environment"), reward, update (log-probs, forward, backward, the optimizer step), eval, sync,
log and checkpoint. `stage(name)` marks a stretch of code as one; an exception that leaves it carries the
stages it passed, innermost last (`stages_of`), whatever catches it.

`LastFinishedStep` is what the trainer keeps between steps so that whatever raises, the last finished
step can still be checkpointed when its state is whole:

- `finished(...)`: the end of a step (or the start of a run): a copy of the loop's state but its
  history (kept as a length), its per-process parts (the steps left of the current generation, held
  by reference: they are immutable), the RNG states, and how many optimizer steps have begun. Until the next
  optimizer step begins, the adapters and the optimizer are this step's; a failure in the next rollout,
  environment, reward or in the update's forward / backward (an out-of-memory) is saved as this step,
  with the data position before the batch that failed and the generation's steps before the one that
  failed, so that a resume redoes that batch, or that step of the generation, exactly.
- `update_done(...)`: a step's update finished and its step end (eval, sync, log) has not changed
  anything yet; an eval that fails here is saved as that step with its step end pending: the resumed
  run ends the step first (`TrainState.unfinished_step`), as the uninterrupted run would have.
- `changing()`: the step end is changing the state (a sync, the logs): nothing can be saved until the
  step is finished; the last checkpoint on disk is what is kept. The same once an optimizer step has
  begun (`PolicyUpdate.optimizer_steps`): the adapters or the optimizer may be half-updated.

A failure in the checkpoint stage never writes another checkpoint: the atomic write left the previous one
whole, and a second write would meet the same full disk.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# The stages an exception left, outermost first, are kept on the exception itself: an id kept beside it
# could name a later exception that reuses a dead one's id.
_STAGES_ATTRIBUTE = "_lora_grpo_stages"


@contextmanager
def stage(name: str):
    """Mark the block as stage `name` of a step: an exception leaving it records the stage (stages_of)."""
    try:
        yield
    except Exception as error:
        try:
            setattr(error, _STAGES_ATTRIBUTE, (name, *stages_of(error)))
        except (AttributeError, TypeError):
            # an exception that takes no attributes (slots, frozen) goes on unnamed, never masked
            pass
        raise


def stages_of(error: BaseException) -> tuple[str, ...]:
    """The stages `error` left, outermost first; () when it was raised outside every stage."""
    return getattr(error, _STAGES_ATTRIBUTE, ())


def describe_stages(stages: tuple[str, ...]) -> str:
    """("eval", "environment") -> 'the environment (in the eval)'; the innermost stage is the one named."""
    if not stages:
        return "the step"
    outer = [s for s in stages[:-1] if s != stages[-1]]
    return f"the {stages[-1]}" + (f" (in the {outer[-1]})" if outer else "")


class StepFailed(RuntimeError):
    """A stage of a training step raised: the run stopped after keeping what it could.

    The message names the stage, the step and what is kept (a checkpoint of the last finished step,
    the last checkpoint, or nothing: no step had finished) and how to resume; the original error is
    ``__cause__``. ``stage`` is the innermost stage, ``global_step`` the optimizer steps done,
    ``checkpoint`` the checkpoint to resume from (None when there is none).
    """

    def __init__(
        self, message: str, stage: str | None = None, global_step: int | None = None, checkpoint=None
    ):
        super().__init__(message)
        self.stage, self.global_step, self.checkpoint = stage, global_step, checkpoint


@dataclass
class Saveable:
    """The loop's state at a point where a checkpoint of it resumes exactly (see the module docstring)."""

    state: dict[str, Any]  # TrainState.state_dict() but its history, copied
    history: int  # len(log_history) then
    rng: dict[str, Any]  # this process's RNG states, the sampling generator's included
    optimizer_steps: int  # PolicyUpdate.optimizer_steps then
    pending: dict[str, Any] | None = None  # a step whose update finished and whose step end did not run
    process: dict[str, Any] = field(default_factory=dict)  # TrainState.process_parts() then (references)


class LastFinishedStep:
    """What a failure mid-run can still save; see the module docstring."""

    def __init__(self):
        self.saveable: Saveable | None = None
        self.failing_step = 1  # the step a failure now would be in (1-based, as the progress line counts)

    def finished(self, state, rng: dict[str, Any], optimizer_steps: int) -> None:
        self.saveable = Saveable(
            _copy(state), len(state.log_history), rng, optimizer_steps, process=state.process_parts()
        )
        self.failing_step = state.global_step + 1

    def update_done(
        self, state, rng: dict[str, Any], optimizer_steps: int, metrics: dict, epoch_ended: bool
    ) -> None:
        self.failing_step = state.global_step
        self.saveable = Saveable(
            _copy(state),
            len(state.log_history),
            rng,
            optimizer_steps,
            pending={"metrics": dict(metrics), "epoch_ended": epoch_ended},
            process=state.process_parts(),
        )

    def changing(self) -> None:
        self.saveable = None

    def for_failure(self, stages: tuple[str, ...], optimizer_steps: int) -> Saveable | None:
        """The state to checkpoint after a failure in `stages`, or None when only the last checkpoint can be kept."""
        saved = self.saveable
        if saved is None or "checkpoint" in stages or optimizer_steps != saved.optimizer_steps:
            return None
        return saved


def _copy(state) -> dict[str, Any]:
    # The history only grows: its length is enough, and copying it at every step would cost O(steps).
    return copy.deepcopy({k: v for k, v in state.state_dict().items() if k not in ("log_history", "extra")})
