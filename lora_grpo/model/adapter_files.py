"""A saved peft adapter on disk, read before anything loads it: its files, the base it was trained on, whether
it fits a given base.

peft's loaders take a directory that lacks ``adapter_model.safetensors`` for a hub id ("Repo id must be in the
form ..."), and an adapter of another base either fails with one torch ``size mismatch`` line per tensor or, when
the shapes agree, loads and computes something else without a word. `missing_adapter_files` and
`check_adapter_fits` say it first, naming the adapter, the base it was trained on (``adapter_config.json``'s
``base_model_name_or_path``) and the base given. Imports only the standard library (torch and safetensors
lazily), so the checkpoint, startup and CLI modules all build on it.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

from .adapters import POLICY_DIR

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Older peft adapters' weights: a torch pickle, read with the weights-only unpickler (read_adapter_weights).
PICKLED_WEIGHTS = "adapter_model.bin"
# peft reads either; lora_grpo writes the first.
_WEIGHT_FILES = (ADAPTER_WEIGHTS, PICKLED_WEIGHTS)
# A saved tensor's name: "[base_model.model.]{module}.lora_{A|B}[.{adapter}].weight".
_SAVED_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")


def missing_adapter_files(path: str | Path) -> list[str]:
    """What a peft adapter directory lacks: adapter_config.json, and a weights file (adapter_model.safetensors
    or .bin, named as the first); [] for a whole adapter."""
    path = Path(path)
    missing = [] if (path / ADAPTER_CONFIG).is_file() else [ADAPTER_CONFIG]
    if not any((path / name).is_file() for name in _WEIGHT_FILES):
        missing.append(ADAPTER_WEIGHTS)
    return missing


class AdapterFileError(ValueError):
    """A saved adapter's weights file cannot be read, or is refused: the message names the file, why, and the fix."""


def refused_global(error: BaseException) -> str | None:
    """The Python object a weights-only torch.load refused to unpickle (e.g. 'builtins.print'), or None when
    `error` is no such refusal. Such a file holds more than tensors: unpickling it could run code."""
    import pickle

    if not isinstance(error, pickle.UnpicklingError):
        return None
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    return found.group(1) if found else None


def load_failure(error: BaseException) -> str:
    """What went wrong in a weights-only torch.load that was no refusal, in one line fit to show: the error's type
    and first line, never torch's advice to load the file another way (unpickling what it refused)."""
    import pickle

    if isinstance(error, pickle.UnpicklingError):
        # torch's text here offers to unpickle the file anyway; a damaged file is what it means for us
        return f"{type(error).__name__}: not a file of tensors torch can read"
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _damaged(file: Path, error: BaseException) -> AdapterFileError:
    return AdapterFileError(
        f"{file} is damaged or truncated ({load_failure(error)}); save the adapter again, or pass another one"
    )


def read_adapter_weights(path: str | Path) -> dict:
    """{tensor name: tensor} of the saved peft adapter in directory `path`: adapter_model.safetensors, else
    adapter_model.bin, read by torch's weights-only unpickler (tensors and plain containers only, on the CPU).

    AdapterFileError naming the file: a damaged or truncated file, a .bin that holds other Python objects (refused,
    not loaded: unpickling them could run code) or anything but a {name: tensor} mapping; FileNotFoundError when
    neither file is there.
    """
    import torch

    path = Path(path)
    file = path / ADAPTER_WEIGHTS
    if file.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(file))
        except Exception as e:  # noqa: BLE001 - SafetensorError is no OSError/ValueError; any failure is a bad file
            raise _damaged(file, e) from None
    file = path / PICKLED_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{path} holds no adapter weights: no {ADAPTER_WEIGHTS} or {PICKLED_WEIGHTS}")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle and zip errors of many kinds mean one of the two below
        found = refused_global(e)
        if found:
            raise AdapterFileError(
                f"{file} holds a pickled Python object ({found}), not only tensors: refused, not loaded, since "
                "unpickling it could run code. An adapter's weights are tensors: save the adapter again from code "
                f"you trust with peft's save_pretrained (it writes {ADAPTER_WEIGHTS}), or pass another adapter"
            ) from None
        raise _damaged(file, e) from None
    if not isinstance(saved, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in saved.items()
    ):
        raise AdapterFileError(
            f"{file} holds a {type(saved).__name__} that is not a mapping of tensor names to tensors, which is "
            f"what an adapter's weights are; save the adapter again with peft's save_pretrained (it writes "
            f"{ADAPTER_WEIGHTS}), or pass another adapter"
        )
    return saved


def saved_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """{tensor name: shape} of a saved peft adapter, read from the file's header (safetensors) without loading
    the weights; None when there is no weights file. AdapterFileError for a file that cannot be read or is
    refused (read_adapter_weights)."""
    path = Path(path)
    if (path / ADAPTER_WEIGHTS).is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(path / ADAPTER_WEIGHTS), "pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - SafetensorError is no OSError/ValueError; any failure is a bad file
            raise _damaged(path / ADAPTER_WEIGHTS, e) from None
    if (path / PICKLED_WEIGHTS).is_file():
        return {k: tuple(v.shape) for k, v in read_adapter_weights(path).items()}
    return None


def trained_base(path: str | Path) -> str | None:
    """The base an adapter was trained on: its adapter_config.json's base_model_name_or_path (None when unset
    or unreadable)."""
    try:
        name = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def same_base(a, b) -> bool:
    """Whether two model names are the same model: equal, or local paths (one relative, one absolute, a
    symlink) to the same directory."""
    if isinstance(a, str) and isinstance(b, str) and Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def _base_modules(model):
    """The base model's modules by the names a saved adapter uses (a peft model's wrapper prefix dropped)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return dict(inner.named_modules())


def check_adapter_fits(
    model, path: str | Path, *, label: str, base_given: Iterable[str | None], fix: str
) -> None:
    """Before an adapter is loaded onto `model`: refuse one trained on another base, warn when it only names one.

    label: how the message names the adapter ("the adapter '/x'", "init_adapter='/x'"). base_given: the names
    the base goes by here (as the user gave it, then resolved to a path), the first shown. fix: the sentence
    that ends a refusal (what to pass instead).

    Raises ValueError when a tensor's module is not in this base, or its in/out size is not the module's (the
    rank, the other side of each factor, is the adapter's own): naming the module, both shapes, the base the
    adapter was trained on and the base given. When every shape fits but adapter_config.json names another
    base, logs a warning with both names: the adapter loads, and computes something else on this base.
    """
    given = [name for name in base_given if name]
    saved_for = trained_base(path)
    origin = f" (it was trained on the base {saved_for!r}; the base given is {given[0]!r})" if given else ""
    if not saved_for:
        origin = f" (its {ADAPTER_CONFIG} names no base; the base given is {given[0]!r})" if given else ""
    shapes = saved_tensor_shapes(path) or {}
    modules = _base_modules(model)
    for key, shape in shapes.items():
        match = _SAVED_KEY.fullmatch(key)
        if match is None:
            continue
        name, factor = match.groups()
        module = modules.get(name)
        if module is None:
            raise ValueError(
                f"{label} was saved for another model: it adapts {name!r}, which this model does not have"
                f"{origin}. {fix}"
            )
        size, axis = (
            (getattr(module, "in_features", None), 1)
            if factor == "A"
            else (getattr(module, "out_features", None), 0)
        )
        if size is not None and len(shape) == 2 and shape[axis] != size:
            raise ValueError(
                f"{label} was saved for another model: its lora_{factor} of {name} has shape {shape}, but this "
                f"model's {name.rsplit('.', 1)[-1]} has {size} {'inputs' if factor == 'A' else 'outputs'}"
                f"{origin}. {fix}"
            )
    if saved_for and given and not any(same_base(saved_for, name) for name in given):
        logger.warning(
            "%s was trained on the base %r, but the base given is %r. Their layers have the same shapes, so it "
            "loads, but on another base it computes something else: use the base it was trained on, unless %r is "
            "that model under another name or path",
            label,
            saved_for,
            given[0],
            given[0],
        )


# Module types LoRA can wrap (peft's LoRA layers), by class name so that bitsandbytes and
# transformers' Conv1D need no import here.
_LORA_TYPES = ("Linear", "Linear4bit", "Linear8bitLt", "Conv1D", "Embedding", "Conv1d", "Conv2d")


def _lora_leaves(model) -> dict[str, str]:
    """{last name component: class name} of the modules LoRA can wrap (lm_head left out, as 'all-linear' does)."""
    return {
        name.rsplit(".", 1)[-1]: type(m).__name__
        for name, m in model.named_modules()
        if name and type(m).__name__ in _LORA_TYPES and not name.endswith("lm_head")
    }


def check_target_modules(model, targets) -> None:
    """Refuse lora_target_modules entries that match no module of `model`, or only modules LoRA cannot
    wrap, naming the closest module names (peft ignores an unmatched entry when another one matches:
    a typo'd 'q_prj' next to 'v_proj' would train only v_proj). Matching is peft's: a list entry
    matches a module whose name is it or ends in '.<entry>'; a string other than 'all-linear' is a
    regular expression over the whole name."""
    if targets is None or targets == "all-linear":
        return
    modules = [(name, type(m).__name__) for name, m in model.named_modules() if name]
    entries = [targets] if isinstance(targets, str) else list(targets)
    leaves = _lora_leaves(model)
    for entry in entries:
        if isinstance(targets, str):
            hits = [(n, t) for n, t in modules if re.fullmatch(entry, n)]
        else:
            hits = [(n, t) for n, t in modules if n == entry or n.endswith("." + entry)]
        wrappable = [h for h in hits if h[1] in _LORA_TYPES]
        if wrappable:
            continue
        key = entry.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(key, sorted(leaves), n=3, cutoff=0.5)
        what = (
            f"matches only {sorted({t for _, t in hits})} modules (e.g. {hits[0][0]}), which LoRA cannot wrap"
            if hits
            else "matches no module of this model"
        )
        raise ValueError(
            f"lora_target_modules entry {entry!r} {what}"
            + (f"; closest: {', '.join(map(repr, close))}" if close else "")
            + f". The layers LoRA can wrap here: {sorted(leaves)}. Use those names, or lora_target_modules: all-linear"
        )


def check_init_adapter(model, init_adapter: str, model_name: str | None = None) -> None:
    """Refuse an init_adapter saved for another model before peft loads it: a layer this model does
    not have (peft would drop its weights silently) or of other in/out sizes (peft's size-mismatch
    error). A local path that is no adapter, or a lora_grpo checkpoint dir, is named with what to pass."""
    path = Path(init_adapter).expanduser()
    if not path.exists():
        if init_adapter.startswith((".", "/", "~")) or len(Path(init_adapter).parts) > 2:
            raise ValueError(
                f"init_adapter={init_adapter!r} does not exist; pass a directory saved by "
                "save_pretrained / lora-grpo (it holds adapter_config.json)"
            )
        return  # a hub adapter id: peft downloads and checks it
    if not (path / "adapter_config.json").is_file():
        inside = [p.parent.name for p in sorted(path.glob("*/adapter_config.json"))]
        hint = (
            f"; it is a checkpoint or run directory: pass {str(path / POLICY_DIR)!r}"
            if POLICY_DIR in inside
            else f"; adapters inside it: {inside}"
            if inside
            else ""
        )
        raise ValueError(
            f"init_adapter={init_adapter!r} has no adapter_config.json, so it is not a peft adapter{hint}"
        )
    if missing_adapter_files(path):  # peft would take the directory for a hub id
        raise ValueError(
            f"init_adapter={init_adapter!r}: {path / ADAPTER_WEIGHTS} is missing, so it holds no adapter weights "
            "(a save that never finished, or a file deleted since); pass a directory holding both "
            f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        )
    check_adapter_fits(
        model,
        path,
        label=f"init_adapter={init_adapter!r}",
        base_given=(model_name, getattr(getattr(model, "config", None), "_name_or_path", None)),
        fix="Use an adapter trained on this base, or drop init_adapter",
    )
