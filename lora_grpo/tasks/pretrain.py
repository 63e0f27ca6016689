"""The tiny offline bases' pre-training loop, shared by the offline tasks, and their cache.

Each task brings its model and its batches; the loop is the same: AdamW (betas 0.9, 0.98), a linear
warmup then a cosine decay to 10% of the learning rate, gradient clipping at norm 1, one batch per
step drawn from a generator seeded with ``seed + 1``. Everything runs inside a fork of torch's RNG,
so the caller's random state is left as it was, and a seed gives the same weights on a fixed thread
count.

``ensure_cached_base`` builds a task's base once per machine and settings: the toy's, the
calculator's and the countdown toy's.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


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

# What a cache entry holds besides the task's record; an entry missing any of them is rebuilt.
BASE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
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


def base_dirname(name: str, version: int, settings: dict) -> str:
    """A cache entry's name, e.g. "countdown_toy_base-v1-3f2a9c1d0b7e": a hash of the settings."""
    blob = json.dumps({"v": version, **settings}, sort_keys=True)
    return f"{name}-v{version}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def base_problem(path, record: str, version: int) -> str | None:
    """Why the base at ``path`` is unusable ("missing model.safetensors", ...), or None when it holds
    every file of BASE_FILES and ``record``, its record states ``version`` and its config loads.
    Cheap: no weights are read."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_dir():
        return "missing"
    if missing := [f for f in (*BASE_FILES, record) if not (path / f).is_file()]:
        return "missing " + ", ".join(missing)
    try:
        found = json.loads((path / record).read_text()).get("format_version")
    except (OSError, ValueError, AttributeError) as err:
        return f"unreadable {record} ({err})"
    if found != version:
        return f"format_version {found!r}, expected {version}"
    try:
        AutoConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - any reason config.json does not load makes the entry unusable
        return f"config.json does not load ({type(err).__name__}: {err})"
    return None


def _build(final: Path, build: Callable[[Path], object], record: str, version: int, label: str) -> None:
    """Build the entry ``final`` unless it is usable: an unusable one is moved aside and removed, the
    new one built into a temporary directory beside it, checked, and renamed into place."""
    problem = base_problem(final, record, version)
    if problem is None:
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        print(f"[{label}] cache entry {final} is unusable ({problem}); rebuilding it", flush=True)
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}-invalid-", dir=final.parent))
        try:
            os.replace(final, aside / final.name)  # atomic, so the rename below finds the name free
        except FileNotFoundError:  # another process moved it first
            pass
        shutil.rmtree(aside, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    print(f"[{label}] building {final} (once; about a minute on CPU)", flush=True)
    try:
        build(tmp)
        if (problem := base_problem(tmp, record, version)) is not None:  # never publish an unusable entry
            raise RuntimeError(f"the base built in {tmp} is unusable ({problem})")
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first; its result is identical
            if base_problem(final, record, version) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    setting, so other settings or seeds get their own entry. It is built in a temporary directory
    beside it and renamed into place, so a crash never leaves a half-written entry; an entry that is
    unusable (``base_problem``: a missing file, another ``version`` in ``record``) is rebuilt.

    Under torch.distributed (world size > 1) every process must call this: the local main process
    (LOCAL_RANK 0; the cache is per machine) builds while the others wait at a barrier.
    """
    overrides = dict(overrides or {})
    final = Path(cache_dir) / base_dirname(name, version, base_settings(pretrain, seed, overrides))

    def build(out_dir: Path) -> None:
        pretrain(out_dir, seed=seed, **overrides)

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        _build(final, build, record, version, label)
        return str(final)
    # Exactly one barrier on every rank, built or cached, so all ranks take the same collective path;
    # the builder reaches it even when its build fails, so the others fail below instead of hanging.
    local_main = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    try:
        if local_main:
            _build(final, build, record, version, label)
    finally:
        dist.barrier()
    if not local_main and (problem := base_problem(final, record, version)) is not None:
        raise RuntimeError(f"the local main process did not build the base {final} ({problem})")
    return str(final)
