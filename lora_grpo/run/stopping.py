"""Stopping a run: deferred SIGINT / SIGTERM, the errors that end a run, and processes agreeing on it."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the current step finished, a checkpoint was written, the run stopped."""

    def __init__(self, message: str, signum: int, checkpoint: Path | None):
        super().__init__(message)
        self.signum, self.checkpoint = signum, checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class NonFiniteError(FloatingPointError):
    """The loss or the gradients were NaN/inf for too many optimizer updates in a row."""


class StopSignals:
    """While active, SIGINT / SIGTERM only set a flag (`received`) that the loop reads between steps.

    A second signal of either kind restores the previous handlers and raises at once, so a user can
    always get out. Only the main thread can install handlers; elsewhere this is inert.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if self.received is not None:  # the second one: stop now
            self.__exit__()
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.received = signum
        # os.write, not print: a handler that interrupts a print must not print (reentrant call).
        os.write(
            2,
            f"\n{signal.Signals(signum).name} received: finishing the current step, then writing a "
            "checkpoint (send it again to stop at once)\n".encode(),
        )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        self._previous = {}


def agreed_signal(local: int | None, num_processes: int, device) -> int | None:
    """The signal that stops the run, the same on every process (one that got a signal stops all)."""
    if num_processes == 1:
        return local
    flag = torch.tensor([local or 0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # a sum would invent signals
    return int(flag.item()) or None


def count_nonfinite(state, finite: bool, config) -> None:
    """Count NaN/inf updates in a row in `state.nonfinite_in_a_row` (a finite one resets it); raise
    NonFiniteError, with the likely causes, once max_nonfinite_updates are reached."""
    state.nonfinite_in_a_row = 0 if finite else state.nonfinite_in_a_row + 1
    if state.nonfinite_in_a_row >= config.max_nonfinite_updates:
        raise NonFiniteError(
            f"the loss or gradients were NaN/inf for {state.nonfinite_in_a_row} updates in a row (up to step "
            f"{state.global_step + 1}); each was skipped, the adapters hold the last finite update. Common causes: "
            f"a learning rate too high (learning_rate={config.learning_rate}), activations beyond float16's "
            f"range (torch_dtype={config.torch_dtype!r}; use bfloat16 or float32), or a reward of extreme magnitude. "
            f"Resume from the last checkpoint with a lower learning_rate, or raise max_nonfinite_updates."
        )
