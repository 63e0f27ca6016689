"""The machine's cache of built bases: one directory per entry, published whole or not at all.

A base that is built rather than downloaded (an offline task's pre-trained toy, a GGUF file converted
to safetensors) lives in ``$LORA_GRPO_CACHE`` (default ``~/.cache/lora_grpo``) under a name that
hashes what it was built from. ``ensure_entry`` builds a missing or unusable entry into a temporary
directory beside it, checks it, and renames it into place, so a crash never leaves a half-written
entry. One process builds an entry at a time: a second process that needs it (another run started
beside the first, a test worker, the other ranks under torch.distributed) waits for the build and uses
it instead of building it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock, Timeout

# What a cache entry holds besides its record; an entry missing any of them is rebuilt.
BASE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_cache_dir() -> Path:
    return Path(os.environ.get("LORA_GRPO_CACHE") or Path.home() / ".cache" / "lora_grpo")


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


def _build(
    final: Path, build: Callable[[Path], object], record: str, version: int, label: str, how_long: str
) -> None:
    """Build the entry ``final`` unless it is usable, holding its lock (``.NAME.lock`` beside it) so that
    a process that needs the entry while another builds it waits and then finds it built."""
    if base_problem(final, record, version) is None:
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    # The lock is an OS file lock: the system lets go of it when its holder ends, crashed or not, and a
    # waiter that then finds no usable entry builds it itself.
    lock = FileLock(final.parent / f".{final.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"[{label}] waiting for another process that is building {final}", flush=True)
        lock.acquire()
    try:
        _build_unlocked(final, build, record, version, label, how_long)
    finally:
        lock.release()


def _build_unlocked(
    final: Path, build: Callable[[Path], object], record: str, version: int, label: str, how_long: str
) -> None:
    """Build the entry ``final`` unless it is usable (checked again under the lock: another process may have
    built it meanwhile): an unusable one is removed in place, the new one built into a temporary directory
    beside it, checked, and renamed into place."""
    problem = base_problem(final, record, version)
    if problem is None:
        return
    # What a build of this entry that was killed (out of memory, SIGKILL) left: no other build of it
    # runs while we hold its lock, so these are nobody's (a GGUF conversion's can be gigabytes).
    for left in [p for p in final.parent.iterdir() if p.name.startswith(f".{final.name}-")]:
        print(f"[{label}] removing {left}, left by a build that did not finish", flush=True)
        shutil.rmtree(left, ignore_errors=True)
    if final.exists():
        # Nobody uses an unusable entry, and nobody else removes it while we hold the lock; a removal cut
        # short leaves an entry as unusable, which the next build removes.
        print(f"[{label}] cache entry {final} is unusable ({problem}); rebuilding it", flush=True)
        shutil.rmtree(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    print(f"[{label}] building {final} (once; {how_long})", flush=True)
    try:
        # A build draws from torch's RNG (a GGUF conversion initialises the model before its weights are
        # read): restored after it, so that the run that builds the base initialises its adapters from
        # the same RNG state as every later run that finds it cached (same seed, same run).
        with torch.random.fork_rng(devices=[]):
            build(tmp)
        if (problem := base_problem(tmp, record, version)) is not None:  # never publish an unusable entry
            raise RuntimeError(f"the base built in {tmp} is unusable ({problem})")
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_entry(
    final: Path,
    build: Callable[[Path], object],
    *,
    record: str,
    version: int,
    label: str,
    how_long: str = "about a minute on CPU",
) -> str:
    """The path of the cache entry ``final``, built by ``build(out_dir)`` when it is missing or
    unusable (``base_problem``: a missing file, another ``version`` in ``record``), with
    ``[label] building ...`` printed when it is.

    Under torch.distributed (world size > 1) every process must call this: the local main process
    (LOCAL_RANK 0; the cache is per machine) builds while the others wait at a barrier.
    """
    final = Path(final)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        _build(final, build, record, version, label, how_long)
        return str(final)
    # Exactly one barrier on every rank, built or cached, so all ranks take the same collective path;
    # the builder reaches it even when its build fails, so the others fail below instead of hanging.
    local_main = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    try:
        if local_main:
            _build(final, build, record, version, label, how_long)
    finally:
        dist.barrier()
    if not local_main and (problem := base_problem(final, record, version)) is not None:
        raise RuntimeError(f"the local main process did not build the base {final} ({problem})")
    return str(final)
