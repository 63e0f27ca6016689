"""torch.compile's work kept per machine: the compiled decode step compiles once, not once per run.

The compiled decode (fast_decode.py) costs its first step tens of seconds of compiling (about
49 s for a 0.5B model and 74 s for a 1.5B one on an H200, issue 48). torch keeps what inductor built
in its own caches under /tmp, which a new machine, a container or a cleaned /tmp loses; its cache
artifacts (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``: inductor's compiled
graphs with their Triton kernels, AOTAutograd's entries, autotuning results) are portable bytes. They
are kept here, under lora_grpo's cache directory (``$LORA_GRPO_CACHE`` or ``~/.cache/lora_grpo``,
base_cache.default_cache_dir), in ``compile/<key>/``, where the key names what the artifacts are only
good for: the torch and Triton versions and the device (its name and compute capability, or "cpu").

- load(device): before a process's first compile, every file of its key is handed to
  load_cache_artifacts, which fills torch's caches; the compile then finds its graphs there (dynamo
  still traces the step, a few seconds; inductor and Triton do not build again).
- save(device): after the compiled step's first use (fast_decode saves once per new shape, so what
  a later shape or an eval compiles is saved too), what this process compiled, cache hits included,
  is written as one file named by a hash of its bytes: a file that exists is not written again, and
  two processes never write the same name with different bytes. torch's artifacts accumulate over a
  process, so its new file holds its earlier one, which is removed: one file per process. The
  newest MAX_FILES stay.

A file that cannot be read or written, or that torch refuses, is said in one warning and the run
compiles as it would have: the cache never stops a run. ``LORA_GRPO_COMPILE_CACHE=0`` (or off,
false, no) turns it off. The files are pickles written by torch for this machine's user, as torch's
own caches under /tmp are: load nothing you did not write.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from importlib import metadata
from pathlib import Path

import torch

from ..base_cache import default_cache_dir

logger = logging.getLogger(__name__)

SWITCH = "LORA_GRPO_COMPILE_CACHE"
OFF = ("0", "off", "false", "no")
MAX_FILES = 8  # files kept per key (each holds what one process compiled)
SUFFIX = ".bin"
# Keys loaded in this process: torch's caches keep what was loaded, so once is enough.
_LOADED: set[str] = set()
# key → the file this process wrote last (its next one holds all of it)
_WRITTEN: dict[str, Path] = {}


def enabled() -> bool:
    """Whether the cache is on (LORA_GRPO_COMPILE_CACHE unset, or anything but 0 / off / false / no)."""
    return os.environ.get(SWITCH, "").strip().lower() not in OFF


def _triton_version() -> str:
    for name in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


def cache_key(device: torch.device) -> str:
    """'torch-2.11.0+cu130_triton-3.5.0_NVIDIA-H200-sm90': what a file's artifacts are good for."""
    text = f"torch-{torch.__version__}_triton-{_triton_version()}_{_device_name(torch.device(device))}"
    return re.sub(r"[^A-Za-z0-9.+_-]+", "-", text)


def cache_dir(device: torch.device) -> Path:
    """The directory of this machine's artifacts for `device` (created when first saved)."""
    return default_cache_dir() / "compile" / cache_key(device)


def load(device: torch.device) -> int:
    """Fill torch's caches from every file of this key, once per process; the number of artifacts
    loaded (0: none, off, or a file that could not be read: warned)."""
    device = torch.device(device)
    if not enabled():
        return 0
    key = cache_key(device)
    if key in _LOADED:
        return 0
    _LOADED.add(key)
    folder = cache_dir(device)
    files = sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []
    loaded = 0
    for path in files:
        try:
            info = torch.compiler.load_cache_artifacts(path.read_bytes())
        except Exception as e:  # noqa: BLE001 - any reason a file is unusable: compile as usual
            logger.warning(
                "compile cache: could not load %s (%s: %s); compiling as usual", path, type(e).__name__, e
            )
            continue
        if info is None:
            logger.warning("compile cache: torch could not read %s; compiling as usual", path)
            continue
        loaded += sum(len(keys) for keys in info.artifacts.values())
    if files:
        logger.info("compile cache: %d artifacts loaded from %s", loaded, folder)
    return loaded


def save(device: torch.device) -> Path | None:
    """Write what this process compiled so far as one file of this key; its path (None: nothing
    compiled, off, or the write failed: warned). A file of the same bytes is not written again."""
    device = torch.device(device)
    if not enabled():
        return None
    try:
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return None
        data = result[0]
        key = cache_key(device)
        folder = cache_dir(device)
        path = folder / f"{hashlib.sha256(data).hexdigest()[:16]}{SUFFIX}"
        if path.is_file():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=SUFFIX, dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            # atomic: a reader sees the whole file or none
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        superseded = _WRITTEN.get(key)
        _WRITTEN[key] = path
        if superseded is not None and superseded != path:
            superseded.unlink(missing_ok=True)
        _prune(folder)
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written never stops a run
        logger.warning(
            "compile cache: could not save torch's compiled artifacts (%s: %s)", type(e).__name__, e
        )
        return None
    logger.info("compile cache: saved %s (%d bytes)", path, len(data))
    return path


def _prune(folder: Path) -> None:
    """Keep the MAX_FILES newest files: each holds what one process compiled, hits included."""
    files = sorted(folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[MAX_FILES:]:
        old.unlink(missing_ok=True)
