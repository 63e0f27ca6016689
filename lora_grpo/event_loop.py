"""The process's one asyncio event loop, for async reward functions, tools and environments.

It runs on a daemon thread, so that a call from code already inside a running loop (a notebook) works,
and it lives as long as the process: every step awaits on the same loop, as TRL's GRPOTrainer does.
What a function keeps between calls (an ``httpx.AsyncClient``, an ``asyncio.Semaphore`` that limits the
requests to a judge) stays bound to a loop that is still running. A loop per call (``asyncio.run``) closes
it after the first step, and the second fails ("Event loop is closed", "is bound to a different event loop").
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """The running loop of the daemon thread, started at the first call."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, daemon=True, name="lora_grpo-async").start()
        return _loop


def submit(coro: Coroutine) -> Future:
    """Schedule ``coro`` on the loop -> a Future of its result."""
    return asyncio.run_coroutine_threadsafe(coro, event_loop())


def run(coro: Coroutine):
    """Await ``coro`` on the loop and return its result (or raise what it raised)."""
    return submit(coro).result()
