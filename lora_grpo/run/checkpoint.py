"""File I/O of a run: atomic directories, adapters, trainer state, checkpoints and their rotation.

A checkpoint is one directory, written whole or not at all (a temporary directory beside it,
fsynced, then renamed into place):

    checkpoint-{step}/
      policy/      adapter_model.safetensors, adapter_config.json   (a plain peft adapter)
      reference/   the same for the reference slot
      adapter_model.safetensors, adapter_config.json    the policy's again (the weights a hard link), as TRL's
                   checkpoints hold their adapter: PeftModel.from_pretrained(base, "checkpoint-N") loads the policy
      trainer_state.pt    optimizer, LR scheduler, every process's RNG states and per-process state
                          (the steps left of the generation the checkpoint lies in: its rollout's rows)
      lora_grpo_state.json  the loop's TrainState (state.py) whole: step, data position, metrics history, ...
      trainer_state.json  transformers' TrainerState alone, as TRL's checkpoints hold it
                          (TrainerState.load_from_json reads it; a resume reads lora_grpo_state.json)
      tokenizer files     the run's tokenizer, as TRL's checkpoints hold it (AutoTokenizer loads the checkpoint)
      README.md           the policy's model card (run/model_card.py), as peft writes one beside an adapter
      config.yaml         the run's resolved config

Checkpoints written before lora_grpo_state.json existed hold the loop's state as trainer_state.json (and no
tokenizer); they resume as they are (state_file).

trainer_state.pt is read with weights_only=True: only tensors and plain values (optimizer, scheduler,
rng.py's states) unpickle, anything else is refused, so a checkpoint from elsewhere cannot run code.
It is read onto the CPU; each optimizer state goes to its parameter's device (no process on cuda:0).

Adapters are written from the adapter's own parameters, never from `model.state_dict()`:
bitsandbytes' `Linear4bit._save_to_state_dict` rewrites the frozen 4-bit weights it serialises
(on CPUs with AVX512-BF16 it unpacks them from its CPU layout and re-quantises the absmax, a lossy
round trip), so asking the model for its state dict changes the model.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import as_saved
from ..device import optimizer_state_on_devices
from ..model.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PICKLED_WEIGHTS,
    load_failure,
    missing_adapter_files,
    read_adapter_weights,
    refused_global,
    same_base,
    trained_base,
)
from ..model.adapters import POLICY, POLICY_DIR, REFERENCE, REFERENCE_DIR, lora_layers
from ..rng import fresh_sampling, restore_sampling, set_rng_state
from .logs import read_log

logger = logging.getLogger(__name__)

STATE_BLOBS = "trainer_state.pt"
ADAPTER_MARKER = (
    "lora_grpo.json"  # beside every adapter save_adapter writes: which adapter of the model it is
)
STATE_JSON = "lora_grpo_state.json"
# transformers' TrainerState; in a checkpoint written before STATE_JSON existed, the loop's state
TRAINER_STATE_JSON = "trainer_state.json"
# Fields that fix the adapters' shapes or meaning: a checkpoint resumes only under the same values.
# (Target modules are compared as the resolved sets in the adapters' configs, not as written.)
STRUCTURAL_FIELDS = ("model_name_or_path", "lora_r", "lora_alpha", "use_rslora", "ref_rank")


class CheckpointError(ValueError):
    """A checkpoint cannot be used: the message names the file or field and what to do."""


# ----------------------------------------------------------------------------- atomic writes
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    # Files first, then the directories that name them: a crash after the rename exposes no empty file.
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        _fsync(path)
    _fsync(root)


def write_bytes(path: Path, data: bytes) -> None:
    """Write through a Python file object, so that a full disk or a denied write is an OSError
    (safetensors and torch.save report them as their own error types when they write themselves)."""
    with open(path, "wb") as f:
        f.write(data)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(target: str | Path):
    """Yield a fresh temporary dir beside `target`; when the block succeeds, move it into place so
    that a reader sees the old `target` or the new one, whole. When it fails, the temp dir goes
    and `target` is as it was (a replaced `target` is rolled back, also after a crash: see below)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    old = target.with_name(target.name + ".old")
    if old.exists() and not target.exists():  # a crash between the two renames below: roll back
        os.replace(old, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a run dir is as shareable as the user's umask says
    try:
        yield tmp
        _fsync_tree(tmp)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(target, old)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(old, target)
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------------- adapters
def adapter_tensors(model: nn.Module, adapter: str) -> dict[str, nn.Parameter]:
    """The adapter's parameters under peft's saved names: "{module path}.lora_A.weight" (the
    adapter name dropped), found through the LoRA layers, not by matching names as text."""
    out = {}
    for name, module in lora_layers(model, (adapter,)):
        out[f"{name}.lora_A.weight"] = module.lora_A[adapter].weight
        out[f"{name}.lora_B.weight"] = module.lora_B[adapter].weight
    return out


def adapter_state_dict(model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in adapter_tensors(model, adapter).items()}


def save_adapter(
    model: nn.Module, path: str | Path, adapter: str = POLICY, *, tokenizer=None, card: str | None = None
) -> Path:
    """Save one adapter as a standard peft adapter dir (loadable by PeftModel.from_pretrained), atomically;
    with `tokenizer`, its files beside it (AutoTokenizer loads the directory too); with `card`, its model card
    as README.md (run/model_card.py), as peft's save_pretrained writes one.

    Refuses to write non-finite weights: an adapter on disk is never NaN.
    """
    from safetensors.torch import save

    state = adapter_state_dict(model, adapter)
    if not state:
        raise ValueError(f"the model has no adapter named {adapter!r}")
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise FloatingPointError(
            f"adapter {adapter!r} holds NaN/inf values ({len(bad)} tensors, e.g. {bad[0]}); not writing it to {path}"
        )
    with atomic_dir(path) as tmp:
        write_bytes(tmp / ADAPTER_WEIGHTS, save({k: v.contiguous().cpu() for k, v in state.items()}))
        model.peft_config[adapter].save_pretrained(str(tmp))
        (tmp / ADAPTER_MARKER).write_text(json.dumps({"adapter": adapter}))
        _save_beside(tmp, tokenizer, card)
    return Path(path)


def _save_beside(folder: Path, tokenizer, card: str | None) -> None:
    """What lies beside an adapter in `folder`: the tokenizer's files (AutoTokenizer loads the folder) and the
    model card as README.md, as peft's save_pretrained writes one; each when given."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    if card is not None:
        (folder / "README.md").write_text(card, encoding="utf-8")


def load_adapter_weights(model: nn.Module, path: str | Path, adapter: str, *, damaged_hint: str = "") -> None:
    """Copy weights saved by save_adapter into the model's existing adapter `adapter`, in place.

    Every tensor of the adapter must be in the file with the same shape; the message names the
    first that is missing, extra or of another shape (a different lora_r or target modules).
    `damaged_hint` ends the message when the file is missing or unreadable (what to do instead).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file() and (Path(path) / PICKLED_WEIGHTS).is_file():
        # a peft adapter saved as .bin (given to eval): tensors only, anything else refused unread
        file = Path(path) / PICKLED_WEIGHTS
        saved = read_adapter_weights(path)
    elif not file.is_file():
        raise CheckpointError(f"{file} is missing{damaged_hint}")
    else:
        try:
            saved = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file} is damaged or truncated ({e}){damaged_hint}") from None
    params = adapter_tensors(model, adapter)
    missing, extra = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params.keys())
    if missing or extra:
        raise CheckpointError(
            f"{file} does not fit adapter {adapter!r} of this model: "
            + (f"{len(missing)} tensors missing (e.g. {missing[0]}) " if missing else "")
            + (f"{len(extra)} unexpected (e.g. {extra[0]})" if extra else "")
            + "; it was saved for other lora_target_modules or another model"
        )
    for key, p in params.items():
        if saved[key].shape != p.shape:
            # lora_A is (rank, inputs), lora_B (outputs, rank): the rank side is the adapter's, the other the base's.
            rank_axis = 0 if ".lora_A." in key else 1
            why = (
                "it was saved with another lora_r / ref_rank"
                if saved[key].shape[1 - rank_axis] == p.shape[1 - rank_axis]
                else f"it was saved on another base (its adapter_config.json names {trained_base(path)!r}; this "
                f"model is {model.peft_config[adapter].base_model_name_or_path!r})"
            )
            raise CheckpointError(
                f"{file}: {key} has shape {tuple(saved[key].shape)}, this model's is {tuple(p.shape)}; {why}"
            )
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(saved[key])


# ---------------------------------------------------------------------------------- checkpoints
def explain_write_failure(what: str, output_dir: Path, write) -> None:
    """Run `write()`; an OSError (disk full, no permission) becomes one clear error naming what was
    written and the previous checkpoint, which the atomic write left as it was."""
    try:
        write()
    except OSError as e:
        kept = list_checkpoints(output_dir)
        previous = f"the previous checkpoint {kept[-1]} is intact" if kept else "no earlier checkpoint exists"
        raise OSError(
            e.errno,
            f"could not write {what} in {output_dir} ({e.strerror or e}); {previous}. Free space or fix the "
            "permissions of output_dir",
        ) from e


def save_checkpoint(
    target: Path,
    model: nn.Module,
    *,
    blobs: dict[str, Any],
    state: dict[str, Any],
    trainer_state: dict[str, Any],
    config_yaml: str,
    tokenizer=None,
    card: str | None = None,
) -> Path:
    """Write checkpoint dir `target` atomically. `blobs` go to trainer_state.pt (tensors: optimizer,
    scheduler, per-process RNG), `state` to lora_grpo_state.json (step, data position, history),
    `trainer_state` (transformers' TrainerState fields) to trainer_state.json as TrainerState.save_to_json
    writes it, the tokenizer's files and the policy's model card (README.md) beside them."""
    with atomic_dir(target) as tmp:
        save_adapter(model, tmp / POLICY_DIR, POLICY)
        save_adapter(model, tmp / REFERENCE_DIR, REFERENCE)
        # the policy at the root too, as a TRL checkpoint holds its adapter: peft loads the checkpoint itself
        # (PeftModel.from_pretrained(base, "checkpoint-N")); the weights hard-linked, so that they cost no space
        # where links work, the config copied (a resume reads policy/'s: an edit of this one must not reach it)
        _link_or_copy(tmp / POLICY_DIR / ADAPTER_WEIGHTS, tmp / ADAPTER_WEIGHTS)
        shutil.copyfile(tmp / POLICY_DIR / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
        buffer = io.BytesIO()
        torch.save(blobs, buffer)
        write_bytes(tmp / STATE_BLOBS, buffer.getvalue())
        (tmp / STATE_JSON).write_text(json.dumps(state))
        (tmp / TRAINER_STATE_JSON).write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        _save_beside(tmp, tokenizer, card)
        (tmp / "config.yaml").write_text(config_yaml)
    return target


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(source, target)


def state_file(path: Path) -> Path:
    """The loop state's file of checkpoint `path`: lora_grpo_state.json, or trainer_state.json in a checkpoint
    written before lora_grpo_state.json existed (that file held the loop's state then: its data position). A
    trainer_state.json that is transformers' alone (a TRL checkpoint's, or one whose lora_grpo_state.json is
    gone) is not: lora_grpo_state.json is then the file missing."""
    ours, before = path / STATE_JSON, path / TRAINER_STATE_JSON
    if ours.is_file() or not before.is_file():
        return ours
    try:
        loop_state = "batches" in json.loads(before.read_text())
    except (OSError, ValueError):
        loop_state = True  # a damaged file of either kind: its reader names the damage
    return before if loop_state else ours


def _step_of(path: Path) -> int | None:
    """N of a checkpoint-N dir; None for anything else (temporary, .old, .superseded-K dirs)."""
    suffix = path.name.split("-", 1)[1]
    return int(suffix) if suffix.isdigit() else None


def list_checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N dirs of a run, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def rotate_checkpoints(output_dir: Path, keep: int, protect: str | Path | None = None) -> None:
    """Remove the oldest checkpoints until `keep` are left, never the newest (what a resume reads) nor `protect`
    (the best checkpoint, run/best.py): as transformers' rotation, both may make it keep 2 where keep is 1."""
    found = list_checkpoints(output_dir)
    kept = {found[-1]} if found else set()
    if protect is not None:
        kept.add(Path(output_dir) / Path(protect).name)
    left = len(found)
    for old in found:
        if left <= max(keep, len(kept)):
            break
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
            left -= 1


def set_aside_later_checkpoints(output_dir: Path, step: int) -> list[Path]:
    """On resume from step `step`: rename checkpoints of later steps (an abandoned continuation) to
    checkpoint-N.superseded-K, so that 'latest' and rotation see this run's; nothing is deleted."""
    moved = []
    for path in list_checkpoints(output_dir):
        if _step_of(path) > step:
            k = 1
            while (target := path.with_name(f"{path.name}.superseded-{k}")).exists():
                k += 1
            os.replace(path, target)
            moved.append(target)
    return moved


def resolve_adapter(path: str | Path) -> tuple[Path, str]:
    """(the adapter dir, what it is) for what a user passes to eval or merge: an adapter dir itself, a
    checkpoint dir (its policy adapter) or a run dir (its final adapter/). CheckpointError otherwise."""
    path = Path(path)
    # a checkpoint first: it holds its policy at its root as well (save_checkpoint)
    if (path / POLICY_DIR / ADAPTER_CONFIG).is_file() and state_file(path).is_file():
        others = [p for p in list_checkpoints(path.parent) if p != path and not missing_checkpoint_files(p)]
        instead = (
            f"another checkpoint ({others[-1]}, the newest complete one)" if others else "another checkpoint"
        )
        return _whole_adapter(path / POLICY_DIR, instead), f"the policy adapter of checkpoint {path}"
    if (path / ADAPTER_CONFIG).is_file():
        return _whole_adapter(path, "another adapter"), f"the adapter {path}"
    if (path / "adapter" / ADAPTER_CONFIG).is_file():
        return _whole_adapter(
            path / "adapter", "one of the run's checkpoints"
        ), f"the final adapter of the run {path}"
    if not path.is_dir():
        raise CheckpointError(
            f"{path} does not exist or is no directory; pass an adapter, checkpoint or run directory"
        )
    inner = list_checkpoints(path)
    if inner:
        incomplete = {p: missing for p in inner if (missing := missing_checkpoint_files(p))}
        complete = [p for p in inner if p not in incomplete]
        broken = "; ".join(f"{p.name} lacks {', '.join(missing)}" for p, missing in incomplete.items())
        if not complete:
            raise CheckpointError(
                f"{path} is a run directory without a final adapter/ (the run did not finish?), and none of its "
                f"checkpoints is complete ({broken}): there is no trained adapter in it to use"
            )
        raise CheckpointError(
            f"{path} is a run directory without a final adapter/ (the run did not finish?); pass one "
            f"of its checkpoints, e.g. {complete[-1]}, the newest complete one (its policy adapter is used)"
            + (f". Incomplete, not usable: {broken}" if broken else "")
        )
    raise CheckpointError(
        f"{path} holds no adapter ({ADAPTER_CONFIG}), checkpoint or final adapter/; pass an adapter "
        "directory, a checkpoint-N directory or a run directory"
    )


def _whole_adapter(path: Path, instead: str) -> Path:
    """`path` when its weights file is there; else the CheckpointError eval and merge alike give (peft would
    take the directory for a hub id: "Repo id must be in the form ...")."""
    if missing_adapter_files(path):
        raise CheckpointError(
            f"{path / ADAPTER_WEIGHTS} is missing: the adapter's weights were never written (a run stopped while "
            f"saving?) or were deleted since; pass {instead}"
        )
    return path


def resolve_checkpoint(path: str | Path | bool, output_dir: Path) -> Path:
    """The checkpoint dir a `resume_from_checkpoint` value points at, checked to be complete.

    'latest' (or True, transformers' spelling) is the newest checkpoint-N in output_dir. A run directory, an
    adapter directory, a missing file or a file that is not a checkpoint's gets a CheckpointError that says
    what to pass.
    """
    if path is True or str(path) == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            # transformers' sentence first (the TRL front door's users know it)
            raise CheckpointError(
                f"No valid checkpoint found in output directory ({output_dir}): resume_from_checkpoint={path!r} "
                "but it has no checkpoint-N directory; check output_dir (the run's directory, where its "
                "checkpoints are), or start without resume_from_checkpoint"
            )
        path = found[-1]
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"resume_from_checkpoint={str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"resume_from_checkpoint={str(path)!r} is a file; pass a checkpoint-N directory"
        )
    if (path / ADAPTER_CONFIG).exists() and state_file(path.parent).exists():
        raise CheckpointError(
            f"{path} is the {path.name} adapter inside checkpoint {path.parent}; pass the checkpoint itself: "
            f"resume_from_checkpoint={str(path.parent)!r}"
        )
    if (
        (path / ADAPTER_CONFIG).exists()
        and (path / TRAINER_STATE_JSON).exists()
        and not (path / POLICY_DIR).exists()
    ):
        raise CheckpointError(
            f"{path} is a checkpoint of transformers' Trainer (TRL's GRPOTrainer writes these), not of lora_grpo: "
            "it holds no reference slot or data position to resume. To start a new run from its adapter, set "
            f"init_adapter={str(path)!r} instead of resume_from_checkpoint (lora_grpo.trl: pass "
            f"PeftModel.from_pretrained(base, {str(path)!r}, is_trainable=True) as the model)"
        )
    if (
        (path / ADAPTER_CONFIG).exists()
        and not state_file(path).exists()
        and not (path / POLICY_DIR).exists()
    ):
        raise CheckpointError(
            f"{path} is an adapter, not a checkpoint (it has no optimizer or trainer state). To start a new run "
            f"from its weights, set init_adapter={str(path)!r} instead of resume_from_checkpoint"
        )
    inner = list_checkpoints(path)
    if inner and not state_file(path).exists():
        raise CheckpointError(
            f"{path} is a run directory, not a checkpoint; pass one of its checkpoints (e.g. {inner[-1]}), "
            f"or resume_from_checkpoint='latest' with output_dir={str(path)!r}"
        )
    if (path / "metrics.jsonl").exists() and not state_file(path).exists():
        raise CheckpointError(
            f"{path} is a run directory without any checkpoint (save_steps=0 and the run did not finish?); "
            "there is nothing to resume: start the run again, with save_steps > 0 to be able to resume"
        )
    missing = missing_checkpoint_files(path)
    if missing:
        raise CheckpointError(
            f"{path} is not a complete lora_grpo checkpoint: missing {', '.join(missing)}. "
            + _earlier_hint(path)
        )
    return path


def missing_checkpoint_files(path: Path) -> list[str]:
    """The files of a complete checkpoint that `path` lacks ([] for a complete one): a write that never
    finished, or files deleted since."""
    required = [state_file(path).name, STATE_BLOBS, "config.yaml"] + [
        f"{adapter}/{name}"
        for adapter in (POLICY_DIR, REFERENCE_DIR)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)
    ]
    return [name for name in required if not (path / name).is_file()]


def _earlier_hint(path: Path) -> str:
    others = [p.name for p in list_checkpoints(path.parent) if p != path]
    return f"Resume from another checkpoint ({', '.join(others)})." if others else "Start the run again."


def _target_modules(config_file: Path) -> set[str]:
    return _target_set(json.loads(config_file.read_text()).get("target_modules"))


def _target_set(targets) -> set[str]:
    """peft's target_modules as a set: a list of names, or one string (a regular expression, 'all-linear')."""
    return {targets} if isinstance(targets, str) else set(targets or ())


def check_compatible(
    path: Path,
    config_values: dict[str, Any],
    policy_targets: set[str] | None = None,
) -> None:
    """Refuse a checkpoint saved with other adapter-shaping fields.

    policy_targets: the resolved target modules of this run's policy adapter ('all-linear' and the
    explicit list it stands for are the same thing), compared with the checkpoint's.
    """
    import yaml

    try:
        saved = yaml.safe_load((path / "config.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise CheckpointError(f"{path / 'config.yaml'} is damaged ({e}). " + _earlier_hint(path)) from None
    # both sides as config.yaml holds them (config.as_saved): a derived field null at its default
    saved, config_values = as_saved(saved), as_saved(config_values)
    diffs = [
        f"{name}: checkpoint {saved.get(name)!r}, this run {config_values.get(name)!r}"
        for name in STRUCTURAL_FIELDS
        if name in saved
        and not (
            same_base(saved[name], config_values.get(name))
            if name == "model_name_or_path"
            else saved[name] == config_values.get(name)
        )
    ]
    if policy_targets is not None:
        theirs = _target_modules(path / POLICY_DIR / ADAPTER_CONFIG)
        if theirs != set(policy_targets):
            diffs.append(
                f"lora_target_modules: checkpoint {sorted(theirs)}, this run {sorted(policy_targets)}"
            )
    if diffs:
        raise CheckpointError(
            f"{path} was saved under a different config ({'; '.join(diffs)}). Resume with the checkpoint's values "
            f"(its config.yaml), or start a new run; to start from its policy weights use "
            f"init_adapter={str(path / POLICY_DIR)!r}"
        )


def _other_process_count(path: Path, per_process: list[dict], saved: int, num_processes: int) -> str:
    """The line a resume under another number of processes than the checkpoint's says (TRL resumes so too): each
    process that was in the saved run takes back its own RNG states, the others start their sampling afresh. A
    checkpoint inside a generation is refused: its steps left train on each process's own rows of the rollout,
    which cannot be dealt out to another number of processes."""
    inside = [i for i, part in enumerate(per_process) if (part.get("generation") or {}).get("steps")]
    if inside:
        raise CheckpointError(
            f"{path} was saved by {saved} process(es) inside a generation (steps_per_generation × num_iterations: "
            f"optimizer steps of the rollout were left, each process's on its own rows), and this run has "
            f"{num_processes}: those rows cannot be dealt out to another number of processes. Resume it with "
            f"--nproc_per_node {saved}, or from a checkpoint at the start of a rollout (save_steps a multiple of "
            "steps_per_generation × num_iterations)"
        )
    return (
        f"saved by {saved} process(es); this run has {num_processes}: resumed with the checkpoint's adapters, "
        "optimizer, LR schedule and data position; "
        + (
            f"{_processes(saved, num_processes)} (not in that run) sample from fresh streams"
            if num_processes > saved
            else f"the sampling streams of {_processes(num_processes, saved)} of that run are left"
        )
        + ". The run goes on, but not with the draws of one never interrupted"
    )


def _whole_dataset_position(path: Path, position: dict, saved_processes: int, batches) -> dict:
    """The data position of a checkpoint that several processes wrote before each held the whole dataset (each
    drew from a shard of len // processes rows; data.PromptBatches): the same share of the same epoch of the seeded
    order of every row, said in a warning (the rest of that epoch is not exactly the prompts the run had left). A
    position of any other size is left for PromptBatches to refuse."""
    rows = len(batches.dataset)
    shard = (rows - rows % saved_processes) // saved_processes
    if int(position.get("num_rows", -1)) != shard:
        return position
    index = int(position["index"]) * saved_processes
    logger.warning(
        "%s: written by %d processes when each drew from its own %d of the %d rows: resumed at the same share of "
        "epoch %s (row %s of %d) of the seeded order of every row, which every process now holds; the rest of that "
        "epoch is not exactly the prompts that run had left",
        path,
        saved_processes,
        shard,
        rows,
        position["epoch"],
        index,
        rows,
    )
    return {**position, "num_rows": rows, "index": index}


def _processes(first: int, end: int) -> str:
    """'process 1', or 'processes 1-3' (first to end - 1)."""
    return f"process {first}" if end - first == 1 else f"processes {first}-{end - 1}"


def load_checkpoint_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(lora_grpo_state.json, trainer_state.pt) of a resolved checkpoint, with clear errors when damaged."""
    file = state_file(path)
    try:
        state = json.loads(file.read_text())
        missing = [
            k
            for k in ("global_step", "batches")
            if k not in state and not (k == "global_step" and "step" in state)
        ]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{file} is damaged ({e}). " + _earlier_hint(path)) from None
    try:
        # CPU first: RNG states must be CPU byte tensors; optimizer states move in restore_training_state.
        blobs = torch.load(path / STATE_BLOBS, map_location="cpu", weights_only=True)
        missing = [k for k in ("optimizer", "scheduler", "rng") if k not in blobs]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
    except Exception as e:  # noqa: BLE001 - pickle/zip errors of many kinds mean one thing here
        # A refused global is an object a checkpoint never holds; other weights-only errors (an unknown
        # opcode) are what random bytes give: a damaged file, below.
        found = refused_global(e)
        if found:
            raise CheckpointError(
                f"{path / STATE_BLOBS} holds a reference to {found}, which a lora_grpo checkpoint never "
                "contains: refused, not loaded (unpickling it could run code). It was written by something else, or "
                "altered; resume only from checkpoints you trust. " + _earlier_hint(path)
            ) from None
        raise CheckpointError(
            f"{path / STATE_BLOBS} is damaged or truncated ({load_failure(e)}). " + _earlier_hint(path)
        ) from None
    return state, blobs


def load_checkpoint_adapters(model: nn.Module, path: Path) -> None:
    """Both adapters of a resolved checkpoint into the model; a damaged file names the way out."""
    for adapter, folder in ((POLICY, POLICY_DIR), (REFERENCE, REFERENCE_DIR)):
        load_adapter_weights(model, path / folder, adapter, damaged_hint=f". {_earlier_hint(path)}")


def truncate_log(path: Path, step: int, also_drop: Callable[[dict], bool] | None = None) -> None:
    """Drop records after `step` from a JSON-lines log (a resumed run logs those steps again), and those at or
    before it that `also_drop` picks.

    A line that is no complete record (a process killed in the middle of writing it) is dropped with a
    warning naming the file and the line (logs.read_log).
    """
    if not path.exists():
        return
    log = read_log(path)
    if log.skipped:
        logger.warning(
            "%s: %s: no complete records (an interrupted write?), dropped", path, log.skipped_note()
        )
    kept = [
        line
        for line, record in zip(log.lines, log.records)
        if record["step"] <= step and not (also_drop and also_drop(record))
    ]

    def write() -> None:
        # beside it, then in its place: a failure or a kill while writing leaves the whole log as it was (it was
        # rewritten in place: an empty file, its history gone for good)
        tmp = path.with_name(f"{path.name}.tmp")
        try:
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    explain_write_failure(path.name, path.parent, write)


def restore_training_state(
    path: Path,
    *,
    model: nn.Module,
    optimizer,
    scheduler,
    state,
    generator: torch.Generator,
    config_values: dict[str, Any],
    num_processes: int,
    process_index: int,
    device=None,
) -> dict[str, Any]:
    """Resume from the resolved checkpoint `path` into the run's parts: both adapters, optimizer and
    LR scheduler, the TrainState (state.py) with this process's own part of it (its tensors onto
    `device`; default: the sampling generator's) and this process's RNG states. Checks first that the
    checkpoint fits (check_compatible). Returns the saved TrainState dict (its sizes, for the caller)."""
    saved, blobs = load_checkpoint_state(path)
    # Every field checked against the state's own dataclass before any of it is used.
    problems = state.saved_problems(saved)
    if problems:
        raise CheckpointError(
            f"{state_file(path)}: {'; '.join(problems)}. No run writes that: the file was edited or damaged. "
            "Put back the values the run wrote, or else: " + _earlier_hint(path)
        )
    check_compatible(
        path, config_values, policy_targets=_target_set(model.peft_config[POLICY].target_modules)
    )
    # Checkpoints written before the per-process state existed have none: no generation left.
    per_process = blobs.get("process_state") or [{}] * len(blobs["rng"])
    saved_processes = int(saved.get("num_processes", len(blobs["rng"])))
    if saved_processes != num_processes:
        logger.warning(
            "%s: %s", path, _other_process_count(path, per_process, saved_processes, num_processes)
        )
    if state_file(path).name == TRAINER_STATE_JSON and saved_processes > 1:
        saved = {
            **saved,
            "batches": _whole_dataset_position(path, saved["batches"], saved_processes, state.batches),
        }
    load_checkpoint_adapters(model, path)
    optimizer.load_state_dict(optimizer_state_on_devices(blobs["optimizer"], optimizer))
    scheduler.load_state_dict(blobs["scheduler"])
    state.load_state_dict(saved)
    state.num_processes = num_processes
    seed, step = int(config_values.get("seed", 0)), int(saved.get("global_step", saved.get("step", 0)))
    if process_index >= saved_processes:  # a process the saved run did not have: its RNGs as a fresh run's
        state.load_process_state_dict({}, generator.device if device is None else device)
        fresh_sampling(generator, seed=seed, process_index=process_index, step=step)
        return saved
    state.load_process_state_dict(per_process[process_index], generator.device if device is None else device)
    rng = blobs["rng"][process_index]  # this process's own states
    set_rng_state(rng)
    line = restore_sampling(generator, rng["sampling"], seed=seed, process_index=process_index, step=step)
    if line:
        logger.warning("%s: %s", path, line)
    return saved
