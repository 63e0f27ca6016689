"""Directories lora_grpo writes: never over files the user owns, never over the base a run depends on.

Every directory we create or fill goes through here:

- **The base is never a target.** ``protected_paths`` names what a run or a merge reads: the local
  base directory (``model_name_or_path``), its GGUF file, the tokenizer, a warm-start adapter, the
  adapter being merged, and the caches of built bases (``$LORA_GRPO_CACHE``: toy bases and GGUF
  conversions) and of hub downloads. ``check_not_protected`` refuses a target that is one of them or
  lies inside one (paths resolved, so ``./base/`` and a symlink to it are the same), whatever flag is
  given; a target written whole (``write_whole``) must not hold one either, since replacing it would
  delete it.
- **What we did not write is refused.** A run directory is ours when it holds a run's own files
  (run_dir.py recognises its layout); a directory written whole (``merge --out``, exports) carries a
  record, ``.lora_grpo.json``, listing the files we wrote. Anything else in the target is the user's:
  refused, naming a few of its files and the flag that allows it, or a new directory.
- **Written whole, renamed into place** (``write_whole``): the files go to a temporary directory beside
  the target, which is renamed into place once complete; a reader sees the old directory or the new
  one, never a mix, and a failed write leaves the old one as it was.
- **Files into a run's own directory** (``write_into``: the TRL front door's ``save_model`` into its
  output_dir, as TRL saves beside its checkpoints): written to a temporary directory inside it, then
  each file renamed over its name; the run's other files stay, and a reader sees each file whole.
- **A single file** (``export --gguf``: ``write_file``) is written to a temporary name beside it and renamed
  into place: a full disk or an interrupted write leaves no half-written file under its name. An existing
  file there is replaced only with the flag (``check_file_target``), and never one of the protected paths.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..base_cache import default_cache_dir

RECORD = ".lora_grpo.json"


class TargetError(ValueError):
    """A directory cannot be written as asked: the message names it, what is in it and the fix."""


def shown(names: Iterable[str], limit: int = 5) -> str:
    """A few names for a message: "a, b, c and 4 more"."""
    names = sorted(names)
    head = ", ".join(names[:limit])
    return head + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ----------------------------------------------------------------------------- the base is never a target
def _local(path: str | os.PathLike | None) -> Path | None:
    # a model object handed to the TRL front door, or no path at all: nothing on disk to protect
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        return None
    local = Path(path).expanduser()
    return local.resolve() if local.exists() else None


def protected_paths(config, resolved: str | None = None, adapter: str | os.PathLike | None = None) -> dict:
    """{path: what it is} for everything a run or a merge of `config` reads from disk: the local base
    (given and `resolved`, e.g. a GGUF file's conversion), its GGUF file, the tokenizer, init_adapter,
    the `adapter` merged, and the caches of built bases and hub downloads. Hub ids are no paths: left out."""
    from huggingface_hub import constants

    name = getattr(config, "model_name_or_path", None)
    gguf = getattr(config, "gguf_file", None)
    found = [
        (_local(name), f"the base model (model_name_or_path {name!r})"),
        (
            _local(os.path.join(name, gguf) if isinstance(name, str) and isinstance(gguf, str) else None),
            f"the base's GGUF file (gguf_file {gguf!r})",
        ),
        (_local(resolved), "the base model as loaded (its converted or cached copy)"),
        (_local(getattr(config, "tokenizer_name_or_path", None)), "the tokenizer (tokenizer_name_or_path)"),
        (_local(getattr(config, "init_adapter", None)), "the warm-start adapter (init_adapter)"),
        (_local(adapter), "the adapter being merged"),
        (
            _local(default_cache_dir()),
            "the cache of built bases (toy bases, GGUF conversions; $LORA_GRPO_CACHE)",
        ),
        (_local(constants.HF_HUB_CACHE), "the Hugging Face hub cache"),
    ]
    protected: dict[Path, str] = {}
    for path, what in found:
        # the first words win: a base given as a path is "the base model", not its cached copy
        if path is not None:
            protected.setdefault(path, what)
    return protected


def check_not_protected(target: str | os.PathLike, protected: dict, label: str, whole: bool = False) -> None:
    """TargetError when `target` is a protected path or inside one; with `whole` (the target is replaced
    as a whole) also when it holds one."""
    where = Path(target).expanduser().resolve()
    for path, what in protected.items():
        if where == path or where.is_relative_to(path):
            relation = "is" if where == path else "lies inside"
        elif whole and path.is_relative_to(where):
            relation = "holds"
        else:
            continue
        raise TargetError(
            f"{label} {str(target)!r} {relation} {what}: {path}. Runs and merges read it, so no flag allows "
            f"writing there; give {label} a new directory outside it"
        )


# ----------------------------------------------------------------------------- what we wrote
def record(root: Path) -> dict | None:
    """The record of a directory written whole by us (``.lora_grpo.json``), or None."""
    try:
        found = json.loads((Path(root) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("files"), list) else None


def foreign_entries(root: Path) -> list[str]:
    """The entries of `root` that its record does not list (all of them without a record)."""
    listed = set((record(root) or {}).get("files", [])) | {RECORD}
    return sorted(p.name for p in Path(root).iterdir() if p.name not in listed)


def check_whole_target(
    target: str | os.PathLike, protected: dict, *, overwrite: bool, label: str, flag: str
) -> str | None:
    """Refuse (TargetError) a target for `write_whole` that is protected, a file, or holds files we did not
    write unless `overwrite`. Returns a note when an earlier output of ours (or, with `overwrite`, the
    user's files) will be replaced, else None."""
    check_not_protected(target, protected, label, whole=True)
    path = Path(target).expanduser()
    if not path.exists():
        return None
    if not path.is_dir():
        raise TargetError(f"{label} {str(target)!r} is a file, not a directory; give {label} a new directory")
    here = Path.cwd().resolve()
    if here.is_relative_to(path.resolve()) or Path.home().resolve().is_relative_to(path.resolve()):
        raise TargetError(
            f"{label} {str(target)!r} holds the current directory or your home directory: writing there would "
            f"replace them, so no flag allows it; give {label} a new directory"
        )
    foreign = foreign_entries(path)
    if not foreign:
        return f"replaced the earlier output written to {target}" if record(path) else None
    if not overwrite:
        raise TargetError(
            f"{label} {str(target)!r} holds files lora_grpo did not write there: {shown(foreign)}; writing "
            f"there would delete or overwrite them. Give {label} a new directory, or add {flag} to replace "
            f"the directory's contents (its files are deleted)"
        )
    return f"{flag}: replaced {target} and the files that were in it ({shown(foreign)})"


def _fsync_tree(root: Path) -> None:
    # Files first, then the directories that name them: after the rename no file is seen empty.
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)) + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def write_whole(
    target: str | os.PathLike, protected: dict, *, overwrite: bool, label: str, flag: str, writer: str
) -> Iterator[Path]:
    """Yield a temporary directory beside `target` to write into; when the block succeeds, the record of
    what was written goes in and the directory is renamed into place (the old `target`, which
    `check_whole_target` allowed, is renamed aside first and deleted last). On failure `target` stays as
    it was. Only names of our own (".{name}.*") are used beside it: nothing of the user's is touched."""
    check_whole_target(target, protected, overwrite=overwrite, label=label, flag=flag)
    target = Path(target).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-", dir=target.parent))
    try:
        yield tmp
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / RECORD).write_text(json.dumps({"written_by": writer, "files": files}, indent=1) + "\n")
        mask = os.umask(0)
        os.umask(mask)
        # mkdtemp makes 0700; the output is as shareable as the user's umask says
        os.chmod(tmp, 0o777 & ~mask)
        _fsync_tree(tmp)
        if target.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced-", dir=target.parent))
            os.replace(target, aside / target.name)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(aside / target.name, target)
                aside.rmdir()
                raise
            shutil.rmtree(aside)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def write_into(target: str | os.PathLike, protected: dict, *, label: str) -> Iterator[Path]:
    """Yield a temporary directory inside `target` (a directory of ours that keeps its other files: a run's
    output_dir) to write into; when the block succeeds, each file written is renamed over its name in
    `target`. On failure nothing in `target` changes. The temporary name (".adapter.save-*") is one the run
    directory's claim removes if a writer died mid-write."""
    check_not_protected(target, protected, label)
    target = Path(target).expanduser()
    target.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".adapter.save-", dir=target))
    try:
        yield tmp
        _fsync_tree(tmp)
        for item in sorted(tmp.iterdir()):
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- a single file
def check_file_target(
    target: str | os.PathLike, protected: dict, *, overwrite: bool, label: str, flag: str, suffix: str
) -> str | None:
    """Refuse (TargetError) a file target for `write_file` that is protected or inside a protected path, a
    directory, not named ``*{suffix}``, or an existing file unless `overwrite`. Returns a note when an
    existing file will be replaced, else None."""
    check_not_protected(target, protected, label)
    path = Path(target).expanduser()
    if path.is_dir():
        raise TargetError(
            f"{label} {str(target)!r} is a directory; give {label} a file name ending in {suffix}"
        )
    if not path.name.lower().endswith(suffix):
        raise TargetError(
            f"{label} {str(target)!r} is not named *{suffix}; give {label} a file name ending in {suffix}"
        )
    if not path.exists():
        return None
    if not overwrite:
        raise TargetError(
            f"{label} {str(target)!r} exists; writing it would replace that file. Give {label} a new file name, "
            f"or add {flag} to replace it"
        )
    return f"{flag}: replaced the file that was at {target}"


@contextmanager
def write_file(
    target: str | os.PathLike, protected: dict, *, overwrite: bool, label: str, flag: str, suffix: str
) -> Iterator[Path]:
    """Yield a temporary path beside `target` to write the file to; when the block succeeds it is synced and
    renamed onto `target` (which `check_file_target` allowed); on failure it is deleted and `target` stays as
    it was."""
    check_file_target(target, protected, overwrite=overwrite, label=label, flag=flag, suffix=suffix)
    target = Path(target).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.writing-", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        # mkstemp makes 0600; the output is as shareable as the user's umask says
        os.chmod(tmp, 0o666 & ~mask)
        _fsync_tree(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
