"""The tiny offline bases' pre-training loop, shared by the offline tasks, and their cache.

Each task brings its model and its batches; the loop is the same: AdamW (betas 0.9, 0.98), a linear
warmup then a cosine decay to 10% of the learning rate, gradient clipping at norm 1, one batch per
step drawn from a generator seeded with ``seed + 1``. Everything runs inside a fork of torch's RNG,
so the caller's random state is left as it was, and a seed gives the same weights on a fixed thread
count.

``ensure_cached_base`` builds a task's base once per machine and settings (the toy's, the
calculator's and the countdown toy's) in the cache of built bases (``lora_grpo.base_cache``).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..base_cache import BASE_FILES, base_dirname, base_problem, ensure_entry  # noqa: F401 (the tasks' names)


def warmup_cosine(warmup_steps: int, steps: int, floor: float = 0.1) -> Callable[[int], float]:
    """The LR multiplier of step ``step``: linear warmup to 1, then cosine decay to ``floor``."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def pretrain_tiny_model(
    build_model: Callable[[], torch.nn.Module],
    batch_loss: Callable[[torch.nn.Module, torch.Generator], torch.Tensor],
    *,
    seed: int,
    steps: int,
    learning_rate: float,
    warmup_steps: int,
    weight_decay: float = 0.01,
    log_every: int = 100,
    label: str = "pretrain",
) -> tuple[torch.nn.Module, list[float], float]:
    """Build a model with ``build_model()`` and train it for ``steps`` steps on ``batch_loss``.

    Args:
        build_model: makes the freshly initialised model (called inside the RNG fork).
        batch_loss: ``batch_loss(model, generator)`` draws one batch with ``generator`` and returns
            its scalar loss.
        seed: the batches' generator is seeded with ``seed + 1`` (the model's own seed is the
            caller's, in ``build_model``).
        log_every: print ``[label] step k/steps loss ...`` at step 1, every ``log_every`` steps and at
            the end (0: silent).

    Returns:
        (the trained model, the loss of every step, the seconds it took).
    """
    t0 = time.perf_counter()
    losses: list[float] = []
    with torch.random.fork_rng(devices=[]):
        model = build_model()
        model.train()
        gen = torch.Generator().manual_seed(seed + 1)
        opt = torch.optim.AdamW(
            model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=weight_decay
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup_steps, steps))
        for step in range(steps):
            loss = batch_loss(model, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if log_every and ((step + 1) % log_every == 0 or step == 0 or step + 1 == steps):
                print(
                    f"[{label}] step {step + 1}/{steps} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
    return model, losses, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- the cache

_NOT_HASHED = {"log_every"}  # settings that do not change the trained weights


def base_settings(pretrain: Callable, seed: int, overrides: dict) -> dict:
    """Every setting of ``pretrain(out_dir, **settings)`` (its defaults, then ``overrides``) and the
    seed, without those that do not change the weights; TypeError naming any unknown override."""
    params = inspect.signature(pretrain).parameters
    if unknown := set(overrides) - set(params):
        raise TypeError(f"unknown pretraining settings: {sorted(unknown)}")
    settings = {k: p.default for k, p in params.items() if k != "out_dir"}
    settings.update(overrides, seed=seed)
    return {k: v for k, v in settings.items() if k not in _NOT_HASHED}


def ensure_cached_base(
    pretrain: Callable[..., object],
    *,
    name: str,
    version: int,
    record: str,
    cache_dir: Path,
    seed: int = 0,
    overrides: dict | None = None,
    label: str = "pretrain",
) -> str:
    """The path of the base ``pretrain(out_dir, seed=seed, **overrides)`` writes, built on first use
    (``[label] building ...`` printed when it is).

    The entry lives in ``cache_dir`` under ``base_dirname(name, version, settings)``, a hash of every
    setting, so other settings or seeds get their own entry; base_cache.ensure_entry builds it
    (atomically, once per machine under torch.distributed).
    """
    overrides = dict(overrides or {})
    final = Path(cache_dir) / base_dirname(name, version, base_settings(pretrain, seed, overrides))

    def build(out_dir: Path) -> None:
        pretrain(out_dir, seed=seed, **overrides)

    return ensure_entry(final, build, record=record, version=version, label=label)
