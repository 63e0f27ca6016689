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
- `update_done(...)`: a step's update finished and its step end (eval, sync, log, checkpoint, the epoch's
  end) has not synced the reference; a failure there (an eval, a tracker, a callback) is saved as that step
  with its step end pending, its records since dropped: the resumed run ends the step first
  (`TrainState.unfinished_step`), as the uninterrupted run would have.
- `changing()`: the step end syncs the reference slot, which that state cannot describe: nothing can be
  saved until the step is finished; the last checkpoint on disk is what is kept. The same once an optimizer
  step has begun (`PolicyUpdate.optimizer_steps`): the adapters or the optimizer may be half-updated.

A failure in the checkpoint stage never writes another checkpoint: the atomic write left the previous one
whole, and a second write would meet the same full disk.

Under several processes a stage can raise on one process alone (a reward function, a tool, an environment, a
forward out of memory) while the others go on to the step's next collective, which the failing one never joins.
`agreed_failures()` closes each stretch of such code before its next collective: every process learns there
whether any raised, and all raise together (the others a `PeerFailed` naming the process and its error, in its
stages), so that every process reaches the failure handling, and the checkpoint of the last finished step
(which gathers every process's RNG states) is written as in one process.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# The stages an exception left, outermost first, are kept on the exception itself: an id kept beside it
# could name a later exception that reuses a dead one's id.
_STAGES_ATTRIBUTE = "_lora_grpo_stages"
# Marks an exception every process raised together (agreed_failures).
_AGREED_ATTRIBUTE = "_lora_grpo_agreed"


@contextmanager
def stage(name: str):
    """Mark the block as stage `name` of a step: an exception leaving it records the stage (stages_of)."""
    try:
        yield
    except Exception as error:
        _mark(error, _STAGES_ATTRIBUTE, (name, *stages_of(error)))
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


class PeerFailed(RuntimeError):
    """Another process's step raised (agreed_failures): this process stops with it. `process` is the one that
    raised, `error_type` and `error_text` its error's type name and text."""

    def __init__(self, process: int, error_type: str, error_text: str):
        super().__init__(f"process {process} stopped: {error_type}: {error_text}")
        self.process, self.error_type, self.error_text = process, error_type, error_text


@contextmanager
def agreed_failures(accelerator):
    """A stretch of a step that may raise on one process alone, before the step's next collective (a collective
    itself under several processes: every process runs it). On leaving it, every process raises when any raised:
    the one that did its own error, the others a PeerFailed in its stages naming it; both marked `agreed`."""
    if accelerator.num_processes == 1:
        yield
        return
    import torch
    from accelerate.utils import gather_object

    failure = None
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any error of the stretch is told to the other processes
        failure = error
    flag = torch.tensor([int(failure is not None)], device=accelerator.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if not flag.item():
        return
    told = gather_object(
        [None if failure is None else (stages_of(failure), type(failure).__name__, str(failure))]
    )
    first = next(i for i, one in enumerate(told) if one is not None)
    if failure is None:
        stages, error_type, error_text = told[first]
        failure = PeerFailed(first, error_type, error_text)
        setattr(failure, _STAGES_ATTRIBUTE, stages)
    _mark(failure, _AGREED_ATTRIBUTE, True)
    raise failure


def agreed(error: BaseException) -> bool:
    """Whether every process raised `error`'s failure together (agreed_failures)."""
    return getattr(error, _AGREED_ATTRIBUTE, False)


def _mark(error: BaseException, name: str, value) -> None:
    try:
        setattr(error, name, value)
    except (AttributeError, TypeError):
        # an exception that takes no attributes (slots, frozen) goes on unmarked, never masked
        pass


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
