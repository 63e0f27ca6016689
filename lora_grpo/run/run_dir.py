"""The run directory: one run writes it at a time, and a new run never mixes with an old one's files.

`claim_output_dir` is the first thing a training run does (before config.yaml is written), on the
main process only:

- **A lock**: ``output_dir/.lora_grpo.lock``, held with ``flock`` for the whole run and holding the
  holder's pid, host and start time (for the message). A second run into the same directory is
  refused while the first is alive. The operating system drops the lock when its process ends, so
  a crashed or killed run never leaves it behind for good: the next run takes it over and says so.
  Where the file system has no locks, the file alone is the lock; it is stale when its pid is gone
  on this host (on another host the message says to delete it once that run is gone).
- **No mixing**: a new run (no resume_from_checkpoint) into a directory that holds another run's
  files (metrics.jsonl records, completions.jsonl, checkpoint-N, adapter/, summary.json) is
  refused, with the fixes: another output_dir, resume_from_checkpoint=latest (when it has a
  checkpoint), or ``overwrite_output_dir=true``, which moves those files into
  ``output_dir/previous-run-K/`` first (nothing is deleted). Left alone they would be overwritten
  (metrics.jsonl, completions.jsonl, config.yaml, summary.json) or mixed in (a stale checkpoint-200
  beside the new run's checkpoint-50 is what resume_from_checkpoint=latest would pick).
- **Not the user's files**: a directory that holds files but no run of ours (no run's records, no
  config.yaml or metrics.jsonl we wrote, no previous-run-K/) is the user's: refused, naming a few of
  them, unless ``overwrite_output_dir=true``, which moves those with a run's names (config.yaml,
  metrics.png, ...) into ``previous-run-K/`` and leaves the others where they are.
- **Never the base**: output_dir is not the base model's directory, nor inside it, its cache or the
  warm-start adapter (owned_dir.py), whatever the flags.

`nothing_to_train` is the line for a resumed checkpoint already at (or past) the run's last step;
`trained_already` the refusal of a second train() on a trainer that has trained.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from . import model_card
from .checkpoint import ADAPTER_MARKER, list_checkpoints
from .logs import read_log
from .owned_dir import TargetError, check_not_protected, protected_paths, shown

LOCK_NAME = ".lora_grpo.lock"
OVERWRITE_FIELD = "overwrite_output_dir"  # the config field that lets a new run set an old one aside
# A run's own files: what is set aside (config.yaml, metrics.png and runs/ go along, but alone they are no run).
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "completions.jsonl",
    "summary.json",
    "metrics.png",
    "adapter",
    "runs",
    # what transformers' Trainer methods write there (the TRL front door's save_metrics, save_state)
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    "trainer_state.json",
)
_CHECKPOINT_GLOB = "checkpoint-*"


class OutputDirError(TargetError):
    """output_dir cannot be used as asked: the message names what is there and the fixes."""


class OutputDirInUse(OutputDirError):
    """Another live run holds output_dir's lock."""


# ----------------------------------------------------------------------------- what a run left
def _records_after_start(path: Path) -> int:
    """Lines of a JSON-lines log with step ≥ 1 (a step-0 eval of a run that failed at once is no run); a line
    that is no complete record (half-written, edited) still counts: it is a run's."""
    if not path.is_file():
        return 0
    log = read_log(path)
    return sum(record["step"] >= 1 for record in log.records) + len(log.skipped)


def previous_run(output_dir: str | Path) -> dict | None:
    """What another run left in output_dir, or None when it holds none of a run's records:
    {"finished": bool, "steps": int | None, "checkpoints": [names], "evidence": [names]}."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    checkpoints = sorted(p.name for p in root.glob(_CHECKPOINT_GLOB) if p.is_dir())  # with .superseded-K ones
    resumable = sorted(
        (n for n in checkpoints if n.split("-", 1)[1].isdigit()), key=lambda n: int(n.split("-", 1)[1])
    )
    evidence = (
        [
            name
            for name, present in (
                ("summary.json", (root / "summary.json").is_file()),
                ("adapter/", (root / "adapter").is_dir()),
                ("metrics.jsonl", _records_after_start(root / "metrics.jsonl") > 0),
                (
                    "completions.jsonl",
                    (root / "completions.jsonl").is_file()
                    and (root / "completions.jsonl").stat().st_size > 0,
                ),
            )
            if present
        ]
        + resumable
        + [n for n in checkpoints if n not in resumable]
    )
    if not evidence:
        return None
    steps = None
    if (root / "summary.json").is_file():
        try:
            steps = json.loads((root / "summary.json").read_text()).get("steps")
        except (ValueError, AttributeError):
            pass
    return {
        "finished": (root / "summary.json").is_file(),
        "steps": steps,
        "checkpoints": resumable,
        "evidence": evidence,
    }


# Fields every config.yaml we write holds (config.to_yaml writes every field): a user's file rarely has all.
_OUR_CONFIG_KEYS = frozenset(
    "model_name_or_path quantization lora_r lora_alpha learning_rate num_generations max_prompt_length "
    "max_completion_length beta loss_type num_iterations output_dir max_steps save_steps seed "
    "temperature".split()
)


def _our_config(path: Path) -> bool:
    """config.yaml as a run of ours writes it: a mapping that holds every key of _OUR_CONFIG_KEYS."""
    import yaml

    try:
        found = yaml.safe_load(path.read_text(errors="replace"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(found, dict) and _OUR_CONFIG_KEYS <= set(found)


def _our_metrics(path: Path) -> bool:
    """metrics.jsonl as a run of ours writes it: every complete line a JSON record with a step."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return False
    try:
        # the last line may be half written (a run killed mid-line)
        records = [json.loads(line) for line in lines[:-1] or lines]
    except ValueError:
        return False
    return bool(records) and all(isinstance(r, dict) and "step" in r for r in records)


def _leftover(name: str) -> bool:
    return name == LOCK_NAME or any(Path(name).match(pattern) for pattern in _LEFTOVER_GLOBS)


def not_a_runs(output_dir: str | Path) -> list[str]:
    """The entries of output_dir when it holds files but nothing of a run of ours (previous_run finds
    none, and no config.yaml or metrics.jsonl we wrote, no previous-run-K/): the user's. [] otherwise."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    names = sorted(p.name for p in root.iterdir() if not _leftover(p.name))
    ours = (
        previous_run(root) is not None
        or _our_config(root / "config.yaml")
        or _our_metrics(root / "metrics.jsonl")
        or any(p.is_dir() for p in root.glob("previous-run-*"))
    )
    return [] if ours else names


def set_aside(output_dir: str | Path) -> Path:
    """Move a run's files (RUN_FILES, checkpoint-* dirs) into output_dir/previous-run-K/ (the first
    free K) and return that directory; other files stay where they are."""
    root = Path(output_dir)
    k = 1
    while (target := root / f"previous-run-{k}").exists():
        k += 1
    target.mkdir()
    # the run's model card too (save_model's, create_model_card's), never a README of the user's
    card = (
        [root / "README.md"]
        if (root / "README.md").is_file() and model_card.is_ours(root / "README.md")
        else []
    )
    # an adapter a script saved into the run's directory (the TRL front door's save_model(output_dir)), marked by
    # save_adapter's lora_grpo.json: its files, and its tokenizer's, which the run's adapter/ holds too
    saved = []
    if (root / ADAPTER_MARKER).is_file():
        names = {ADAPTER_MARKER, "adapter_config.json", "adapter_model.safetensors"}
        if (root / "adapter").is_dir():
            names |= {p.name for p in (root / "adapter").iterdir() if p.is_file()}
        saved = [root / name for name in sorted(names - {"README.md"})]
    for path in [root / name for name in RUN_FILES] + card + saved + sorted(root.glob(_CHECKPOINT_GLOB)):
        if path.exists():
            shutil.move(str(path), str(target / path.name))
    return target


def _describe(found: dict) -> str:
    state = (
        f"a finished run ({found['steps']} steps, summary.json)"
        if found["finished"] and found["steps"] is not None
        else "a finished run (summary.json)"
        if found["finished"]
        else f"an unfinished run (last checkpoint {found['checkpoints'][-1]})"
        if found["checkpoints"]
        else "an unfinished run without checkpoints"
    )
    shown = ", ".join(found["evidence"][:6]) + (", ..." if len(found["evidence"]) > 6 else "")
    return f"{state}: {shown}"


# ----------------------------------------------------------------------------- the lock
def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    except OSError:
        return False
    return True


def _read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _holder_text(holder: dict) -> str:
    if not holder:
        return "a run that has not written its details yet"
    mine = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
    return (
        f"{'this process' if mine else 'pid'} {holder.get('pid')} on host {holder.get('host')!r}, started "
        f"{holder.get('started')}" + (f" ({holder['command']})" if holder.get("command") else "")
    )


def _in_use(output_dir: Path, lock: Path, holder: dict, how: str) -> OutputDirInUse:
    return OutputDirInUse(
        f"output_dir {str(output_dir)!r} is in use by another run: {_holder_text(holder)}; its "
        f"lock is {lock}. Wait for "
        f"it to finish, stop it, or train into another output_dir. {how}"
    )


def _my_record() -> str:
    import sys

    return json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv)[:200],
        }
    )


_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _acquire(output_dir: Path) -> tuple[int | None, str | None]:
    """(the open lock fd, or None in file-only mode; a note about a stale lock taken over)."""
    lock = output_dir / LOCK_NAME
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the file alone is the lock
        return None, _acquire_file_only(output_dir, lock)
    for _ in range(5):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in _NO_LOCKS:
                return None, _acquire_file_only(output_dir, lock)
            raise _in_use(
                output_dir,
                lock,
                _read_holder(lock),
                "The lock goes with its process: once that run has "
                "ended, however it ended, the next run takes it over.",
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:  # released and removed between our open and our lock: try again
            same = False
        if not same:
            os.close(fd)
            continue
        left = _read_holder(lock)
        os.ftruncate(fd, 0)
        os.write(fd, _my_record().encode())
        os.fsync(fd)
        note = (
            (
                f"{lock}: a lock left by {_holder_text(left)}, which has ended without releasing it (a crash?); "
                "taken over"
            )
            if left
            else None
        )
        return fd, note
    raise OutputDirError(
        f"could not take the lock {lock}: it keeps being replaced; is another run starting there?"
    )


def held_by(output_dir: str | Path) -> str | None:
    """Who holds output_dir's lock now (a live run, in _holder_text's words), or None: the lock tried and let go
    at once where the file system has locks, else the file's process looked up."""
    lock = Path(output_dir) / LOCK_NAME
    if not lock.is_file():
        return None
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the file alone is the lock
        fcntl = None
    if fcntl is not None:
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                return _holder_text(_read_holder(lock))
        finally:
            os.close(fd)
    holder = _read_holder(lock)
    alive = holder.get("host") == socket.gethostname() and _process_alive(int(holder.get("pid") or -1))
    return _holder_text(holder) if alive else None


def _acquire_file_only(output_dir: Path, lock: Path) -> str | None:
    note = None
    for _ in range(5):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_holder(lock)
            if (
                holder.get("host") == socket.gethostname()
                and isinstance(holder.get("pid"), int)
                and not _process_alive(holder["pid"])
            ):
                lock.unlink(missing_ok=True)  # its process is gone: stale
                note = (
                    f"{lock}: a lock left by {_holder_text(holder)}, which is no longer running; taken over"
                )
                continue
            raise _in_use(
                output_dir,
                lock,
                holder,
                "This file system has no file locks, so if that run is gone "
                f"(another host cannot tell), delete {lock}.",
            ) from None
        os.write(fd, _my_record().encode())
        os.close(fd)
        return note
    raise OutputDirError(
        f"could not take the lock {lock}: it keeps coming back; is another run starting there?"
    )


# ----------------------------------------------------------------------------- the claim
class RunDirClaim:
    """output_dir, claimed by this run: `release()` (or leaving the `with` block) drops the lock.
    `notes`: lines to print (a stale lock taken over, a previous run set aside); `set_aside`: where
    a previous run's files went (overwrite), else None."""

    def __init__(
        self, output_dir: Path, fd: int | None, locked: bool, notes: list[str], set_aside: Path | None = None
    ):
        self.output_dir, self._fd, self._locked, self.notes, self.set_aside = (
            output_dir,
            fd,
            locked,
            notes,
            set_aside,
        )

    @property
    def lock_path(self) -> Path:
        return self.output_dir / LOCK_NAME

    @property
    def held(self) -> bool:
        return self._locked

    def release(self) -> None:
        """Drop the lock (idempotent): remove the file while still holding it, then close."""
        if not self._locked:
            return
        self._locked = False
        try:
            if self._fd is None or os.fstat(self._fd).st_ino == os.stat(self.lock_path).st_ino:
                self.lock_path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        finally:
            if self._fd is not None:
                os.close(self._fd)  # closing drops the flock
                self._fd = None

    def __enter__(self) -> RunDirClaim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_output_dir(
    output_dir: str | Path,
    *,
    resume_from: str | Path | bool | None = None,
    overwrite: bool = False,
    is_main: bool = True,
    protected: dict | None = None,
) -> RunDirClaim:
    """Claim `output_dir` for a training run (see the module docstring): take its lock, then make
    sure a new run does not land on another run's files.

    resume_from: the run's resume_from_checkpoint ('latest' or True, a checkpoint path, or None). A resume
    from 'latest' or from a checkpoint inside output_dir continues that run (its logs are cut back
    to the checkpoint); a fresh run, or a resume from a checkpoint elsewhere, needs a directory
    without another run's files, or overwrite=True (that run's files move to previous-run-K/).
    is_main: on other processes of a multi-process run nothing is claimed or checked (the main one
    writes the run's files); the claim returned then holds nothing.
    protected: {path: what} the run reads (owned_dir.protected_paths): output_dir may be none of them
    nor lie inside one.

    Raises OutputDirInUse while another live run holds the lock, OutputDirError when another run's
    files, or the user's, are there, or output_dir is protected; each names the holder, the files or
    the path, and the fixes.
    """
    root = Path(output_dir)
    if not is_main:
        return RunDirClaim(root, None, False, [])
    try:
        check_not_protected(root, protected or {}, "output_dir")
    except TargetError as e:
        raise OutputDirError(str(e)) from None
    if root.exists() and not root.is_dir():  # the user's file: left as it is
        raise OutputDirError(
            f"output_dir {str(root)!r} is a file, not a directory; give output_dir a new directory"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, note = _acquire(root)
    except OSError as e:
        raise OutputDirError(_not_writable(root, e)) from e
    claim = RunDirClaim(root, fd, True, [note] if note else [])
    try:
        # a checkpoint of this run is one of its own checkpoint dirs: one of a run set aside in previous-run-K/
        # lies inside root too, but its resume is another run's (root's files are set aside, or refused)
        continues = resume_from is not None and (
            resume_from is True or str(resume_from) == "latest" or _is_checkpoint_of(Path(resume_from), root)
        )
        found = None if continues else previous_run(root)
        theirs = [] if continues or found is not None else not_a_runs(root)
        # The lock is ours: no live writer owns a run's leftovers. In a directory of the user's files, names
        # like them are the user's: kept, whether the run is refused there or writes beside them.
        leftovers = [] if theirs else remove_leftovers(root)
        if leftovers:
            claim.notes.append(
                f"{root}: removed {len(leftovers)} temporary dir(s) of a checkpoint write that never "
                f"finished (its process died): {', '.join(leftovers)}"
            )
        if found is not None:
            if not overwrite:
                raise OutputDirError(_refusal(root, found, resume_from))
            claim.set_aside = set_aside(root)
            claim.notes.append(
                f"{OVERWRITE_FIELD}=true: the previous run's files in {root} moved to "
                f"{claim.set_aside} (nothing deleted)"
            )
        elif theirs:
            if not overwrite:
                raise OutputDirError(_foreign_refusal(root, theirs))
            clashing = [name for name in RUN_FILES if (root / name).exists()]
            claim.set_aside = set_aside(root) if clashing else None
            claim.notes.append(
                f"{OVERWRITE_FIELD}=true: {root} held files that are not a run's ({shown(theirs)}); "
                + (f"those with a run's names moved to {claim.set_aside}, " if clashing else "")
                + "the others stay where they are (nothing deleted)"
            )
    except BaseException:
        claim.release()
        raise
    return claim


# A checkpoint's snapshot while it uploads to the hub (hub.py): output_dir/.hub-push-checkpoint-N.<random>, on the
# checkpoint's file system so that its files are links, never copies; removed when its uploads end, and never
# pushed. One a killed run left is a leftover.
SNAPSHOT_PREFIX = ".hub-push-"
# What checkpoint.atomic_dir writes before the rename into place: ".{name}.{random}" beside the target; a push's
# snapshot.
_LEFTOVER_GLOBS = (".checkpoint-*.*", ".adapter.*", f"{SNAPSHOT_PREFIX}*")


def remove_leftovers(root: Path) -> list[str]:
    """Remove the temporary dirs of atomic writes that never finished (a writer killed mid-write); call it
    only while holding the run's lock, so that no live writer owns them. Returns their names."""
    removed = []
    for pattern in _LEFTOVER_GLOBS:
        for path in sorted(root.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
    return removed


def _not_writable(root: Path, error: OSError) -> str:
    """Our words for an output_dir that cannot be created or locked (read-only, no permission, full)."""
    why = {
        errno.EROFS: "it is on a read-only file system",
        errno.ENOSPC: "its disk is full",
        errno.EDQUOT: "the disk quota is used up",
        errno.EACCES: "this user may not write there",
        errno.EPERM: "this user may not write there",
    }.get(error.errno, error.strerror or str(error))
    fix = (
        "free space there (old checkpoints, previous-run-K/ dirs) or train into another output_dir"
        if error.errno in (errno.ENOSPC, errno.EDQUOT)
        else "give output_dir a writable place (--set output_dir=runs/NAME in the CLI, GRPOConfig(output_dir=...) in "
        "Python) or fix its permissions"
    )
    return (
        f"output_dir {str(root)!r} cannot be used: {why} (creating {error.filename or root / LOCK_NAME} failed: "
        f"{error.strerror or error}). A run writes its lock, logs and checkpoints there before step 1; {fix}"
    )


def _is_checkpoint_of(path: Path, root: Path) -> bool:
    try:
        return path.resolve().parent == root.resolve()
    except OSError:
        return False


def _refusal(root: Path, found: dict, resume_from) -> str:
    what = "resuming from a checkpoint elsewhere into it" if resume_from is not None else "a new run there"
    fixes = [f"train into another output_dir (--set output_dir={root}-2)"]
    if found["checkpoints"]:
        fixes.append(
            "continue that run: --set resume_from_checkpoint=latest"
            + (" with a larger max_steps" if found["finished"] else "")
        )
    fixes.append(
        f"or set {OVERWRITE_FIELD}=true: its files then move to {root}/previous-run-K/ first (nothing is "
        "deleted)"
    )
    return (
        f"output_dir {str(root)!r} holds {_describe(found)}. {what[0].upper() + what[1:]} would overwrite its "
        "metrics.jsonl, completions.jsonl and summary.json and mix its checkpoints with the new run's "
        f"(resume_from_checkpoint=latest would pick the newest of either). Either {'; '.join(fixes)}"
    )


def _foreign_refusal(root: Path, theirs: list[str]) -> str:
    clashing = [name for name in RUN_FILES if name in theirs]
    return (
        f"output_dir {str(root)!r} holds files that are not a lora_grpo run's: {shown(theirs)}. A run writes "
        "config.yaml, metrics.jsonl, completions.jsonl, metrics.png, summary.json, checkpoint-N/ and adapter/ "
        + (f"there and would overwrite {shown(clashing)}" if clashing else "there among them")
        + f". Either train into a new directory (--set output_dir={root}-run), or set {OVERWRITE_FIELD}=true: "
        f"files with a run's names then move to {root}/previous-run-K/ first and the others stay (nothing is "
        "deleted)"
    )


# ----------------------------------------------------------------------------- resume at the end
def nothing_to_train(
    global_step: int,
    total_steps: int,
    checkpoint: str | Path,
    adapter_missing: bool = False,
    *,
    further: Callable[[int], str],
) -> str | None:
    """The line for a resumed checkpoint with no step left (global_step ≥ total_steps), else None.
    What train() does then: no step, no eval, no checkpoint; the run directory stays as it is, but
    for a final adapter/ that is missing (a run that ended between its last checkpoint and it),
    which is written from the checkpoint's policy (`adapter_missing`). `further(max_steps)`: how to
    train on to max_steps, in the words of the entry point (GRPOTrainer.train_further_hint)."""
    if global_step < total_steps:
        return None
    name = Path(checkpoint).name
    where = (
        f"{name} is at step {global_step}, the run's last (max_steps={total_steps})"
        if global_step == total_steps
        else f"{name} is at step {global_step}, past this run's max_steps={total_steps}"
    )
    kept = (
        "the run directory stays as it is but for adapter/, which was missing and is written from its policy"
        if adapter_missing
        else "the run directory stays as it is"
    )
    return (
        f"{where}: nothing left to train, so nothing is trained, evaluated or saved again and {kept}. To train "
        f"further, raise max_steps: {further(max(total_steps, global_step) * 2)}"
        + (
            ""
            if global_step == total_steps
            else "; to end at an earlier step, resume from an earlier checkpoint"
        )
    )


def trained_already(
    global_step: int, total_steps: int, output_dir: str | Path, resume: str, further: Callable[[int], str]
) -> str:
    """The refusal of a second train() on a trainer that has trained (without resume_from_checkpoint):
    it would train nothing, or start from the middle of this run's state, and set this run's files aside.
    `resume` and `further` say how to go on in the entry point's words (GRPOTrainer.resume_hint and
    train_further_hint)."""
    head = (
        f"train() was already called on this GRPOTrainer: it trained {output_dir} to step "
        f"{global_step}/{total_steps}"
    )
    new_run = (
        "for a new run, build a new GRPOTrainer (another output_dir, or overwrite_output_dir=True to move "
        "this run's files aside)"
    )
    if global_step >= total_steps:
        return (
            f"{head}, so a second call would train nothing. To train further, raise max_steps: "
            f"{further(total_steps * 2)}; {new_run}"
        )
    return f"{head} and stopped there. To continue it: {resume}; {new_run}"


def claim_for_run(output_dir: str | Path, config, accelerator) -> RunDirClaim:
    """claim_output_dir for a trainer: the main process claims; under several processes a refusal
    reaches every process, so that they all stop together."""
    problem, claim = [None], None
    if accelerator.is_main_process:
        try:
            claim = claim_output_dir(
                output_dir,
                resume_from=config.resume_from_checkpoint,
                overwrite=config.overwrite_output_dir,
                protected=protected_paths(config),
            )
        except OutputDirError as e:
            problem = [(type(e), str(e))]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(problem)
    if problem[0]:
        raise problem[0][0](problem[0][1])
    return claim or claim_output_dir(output_dir, is_main=False)


def kept_work(
    output_dir: Path, written: Path | None, resume: str, fix: str = "the cause", trained: bool = False
) -> str:
    """What a run that stops on an error keeps, and how to go on (`resume`: the entry point's words): the
    checkpoint just written, the last one, or nothing (`trained`: steps were done, none could be kept)."""
    kept = list_checkpoints(Path(output_dir))
    if not (written or kept):
        if trained:
            return (
                "no checkpoint is kept (none was saved before the failure, and the state at it could not be); "
                f"fix {fix} and start again"
            )
        return f"nothing was trained yet; fix {fix} and start again"
    how = f"checkpoint written to {written}" if written else f"the last checkpoint, {kept[-1]}, is kept"
    return f"{how}; fix {fix}, then resume: {resume}"
