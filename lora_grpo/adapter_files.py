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

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# peft reads either; lora_grpo writes the first.
_WEIGHT_FILES = (ADAPTER_WEIGHTS, "adapter_model.bin")
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


def saved_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """{tensor name: shape} of a saved peft adapter, read from the file's header (safetensors) without loading
    the weights; None when there is no weights file."""
    path = Path(path)
    if (path / ADAPTER_WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(path / ADAPTER_WEIGHTS), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if (path / "adapter_model.bin").is_file():
        import torch

        return {
            k: tuple(v.shape)
            for k, v in torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True).items()
        }
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
