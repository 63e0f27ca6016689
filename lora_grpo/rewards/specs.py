"""From reward specs (Python or YAML) to reward functions, and the checks made on them before training.

:func:`resolve_reward_funcs` turns specs (a callable, a built-in name, a dotted import path, or a
factory with kwargs) into reward functions; :func:`check_reward_columns` checks, at start, that
they can take what the trainer passes (see the contract in :mod:`lora_grpo.rewards`);
:func:`reward_name` names them in metrics.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..model.loading import LoadError
from ..tasks.countdown import countdown_reward
from .builtins import (
    accuracy_reward,
    answer_accuracy,
    length_penalty,
    reasoning_accuracy_reward,
    soft_overlong_penalty,
    think_answer_format,
    think_format_reward,
)
from .models import RewardModel

__all__ = [
    "BUILTIN_REWARDS",
    "TRAINER_KEYWORDS",
    "check_reward_columns",
    "resolve_reward_funcs",
    "reward_name",
    "reward_names",
]


# -------------------------------------------------------------------------------- resolution

# name -> (object, is_factory). A factory is called with the spec's kwargs to build the function.
BUILTIN_REWARDS: dict[str, tuple[Callable, bool]] = {
    "format": (think_answer_format, False),
    "accuracy": (answer_accuracy, False),
    # TRL's registry names: its functions' scoring
    "accuracy_reward": (accuracy_reward, False),
    "think_format_reward": (think_format_reward, False),
    "reasoning_accuracy_reward": (reasoning_accuracy_reward, False),
    "soft_overlong": (soft_overlong_penalty, True),
    "length": (length_penalty, True),
    "countdown": (countdown_reward, False),
    "reward_model": (
        RewardModel,
        True,
    ),  # {name: reward_model, kwargs: {model: <hub id or path>, batch_size: 32}}
}
_ALIASES = {obj.__name__: name for name, (obj, _) in BUILTIN_REWARDS.items()}

_ACCEPTED = (
    f"a callable; a built-in name {sorted(BUILTIN_REWARDS)} (or its function name); a dotted import "
    "path 'package.module:function' or 'package.module.function'; or a dict "
    "{'name': <built-in or dotted path>, 'kwargs': {...}} for factories that take parameters"
)


def _import_object(path: str) -> Any:
    """Import 'pkg.mod:attr.sub' or 'pkg.mod.attr' (the longest importable module prefix)."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        obj = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
        return obj
    parts = path.split(".")
    if len(parts) < 2:
        raise ImportError(f"{path!r} is not a dotted path")
    first_error: Exception | None = None
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this prefix is not a module" means: try a shorter one. An import error raised
            # inside an existing module is a real error and propagates.
            if e.name is None or not (module_name + ".").startswith(e.name + "."):
                raise
            first_error = first_error or e
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise first_error  # type: ignore[misc]


def import_hint(path: str, error: Exception) -> str:
    """What to do about a dotted reward path that did not import: the package is not on the path (the
    lora-grpo command puts only the current directory first, as `python -m` does), or the module lacks
    the name."""
    top = path.replace(":", ".").split(".")[0]
    if isinstance(error, ModuleNotFoundError) and error.name is not None and error.name.split(".")[0] == top:
        return (
            f". {top!r} is not importable from here: install it (pip install -e <its project>), run from "
            f"the directory that holds {top}/ or {top}.py (`lora-grpo` puts the current directory first "
            f"on the path, as python -m does), or add that directory to PYTHONPATH"
        )
    if isinstance(error, AttributeError) and (module := getattr(error, "obj", None)) is not None:
        names = (
            sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            if hasattr(module, "__dict__")
            else []
        )
        close = difflib.get_close_matches(getattr(error, "name", None) or "", names, n=3, cutoff=0.5)
        return f". {getattr(module, '__name__', module)!r} has no {error.name!r}" + (
            f"; did you mean {', '.join(map(repr, close))}?"
            if close
            else f"; its functions: {names[:12]}"
            if names
            else ""
        )
    return ""


def _call_factory(factory: Callable, kwargs: dict, context: Mapping[str, Any], spec: Any) -> Callable:
    params = inspect.signature(factory).parameters
    filled = {k: v for k, v in context.items() if k in params and k not in kwargs}
    try:
        return factory(**filled, **kwargs)
    except TypeError as e:
        raise ValueError(
            f"reward spec {spec!r}: cannot build {getattr(factory, '__name__', factory)} with "
            f"kwargs {kwargs}: {e}. Its parameters: {list(params)}"
        ) from e


def _is_pretrained_model(spec: Any) -> bool:
    from transformers import PreTrainedModel

    return isinstance(spec, PreTrainedModel)


def _resolve_one(spec: Any, context: Mapping[str, Any]) -> Callable:
    if isinstance(spec, Mapping):
        if "name" not in spec or set(spec) - {"name", "kwargs"}:
            raise ValueError(f"reward spec {spec!r}: a dict spec has keys 'name' and optional 'kwargs'")
        if not isinstance(spec["name"], str) or not isinstance(spec.get("kwargs") or {}, Mapping):
            raise ValueError(
                f"reward spec {spec!r}: 'name' must be text and 'kwargs' a mapping, e.g. "
                "{name: length, kwargs: {target_length: 100}}"
            )
        name, kwargs = spec["name"], dict(spec.get("kwargs") or {})
    elif isinstance(spec, str):
        name, kwargs = spec, {}
    elif _is_pretrained_model(spec):
        # a sequence-classification model object, as TRL takes one: scored through RewardModel (its own tokenizer)
        return RewardModel(spec)
    elif callable(spec):
        return spec
    else:
        raise ValueError(f"reward spec {spec!r} ({type(spec).__name__}) is not valid; accepted: {_ACCEPTED}")

    name = name.strip()
    key = _ALIASES.get(name, name)
    if key in BUILTIN_REWARDS:
        obj, is_factory = BUILTIN_REWARDS[key]
        if is_factory:
            return _call_factory(obj, kwargs, context, spec)
        if kwargs:
            raise ValueError(f"reward spec {spec!r}: built-in {key!r} takes no kwargs")
        return obj
    if "." not in name and ":" not in name:
        raise ValueError(f"unknown reward {name!r} in spec {spec!r}; accepted: {_ACCEPTED}")
    try:
        obj = _import_object(name)
    except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, or the module's own error
        raise ValueError(
            f"cannot import reward {name!r} ({type(e).__name__}: {e}){import_hint(name, e)}; accepted: {_ACCEPTED}"
        ) from e
    if isinstance(obj, type) or kwargs:  # a class or a factory: build the reward function
        obj = _call_factory(obj, kwargs, context, spec)
    if not callable(obj):
        raise ValueError(f"reward {name!r} resolved to a non-callable {type(obj).__name__}")
    return obj


def resolve_reward_funcs(specs: Any, *, context: Mapping[str, Any] | None = None) -> list[Callable]:
    """Turn reward specs (from Python or YAML) into reward functions.

    Each spec is one of:
      - a callable (returned as is);
      - a built-in name: "format", "accuracy", "soft_overlong", "length" (or the function names
        "think_answer_format", ...);
      - a dotted import path, "my_pkg.rewards:fn" or "my_pkg.rewards.fn";
      - a dict ``{"name": <built-in or dotted path>, "kwargs": {...}}``: the target is a factory
        called with the kwargs (a class is instantiated with them).

    ``context`` holds defaults for factory parameters not given in kwargs, e.g. the trainer passes
    ``{"max_completion_length": config.max_completion_length}`` so that
    ``{"name": "soft_overlong", "kwargs": {"buffer_length": 64}}`` is enough. A single spec (not a
    list) is accepted too. Raises ValueError naming the spec and what is accepted.

    >>> [reward_name(f) for f in resolve_reward_funcs(
    ...     ["format", {"name": "length", "kwargs": {"target_length": 100}}])]
    ['think_answer_format', 'length_penalty']
    """
    if isinstance(specs, (str, Mapping)) or callable(specs):
        specs = [specs]
    return [
        in_position(i, spec, lambda spec=spec: _resolve_one(spec, context or {}))
        for i, spec in enumerate(specs)
    ]


def in_position(index: int, spec: Any, build: Callable[[], Callable]) -> Callable:
    """build(); a reward model that cannot load says which of the reward functions it is (the index, 0-based)."""
    try:
        return build()
    except LoadError as e:
        raise LoadError(f"reward_funcs[{index}] ({spec!r}): {e}") from e.__cause__


# --------------------------------------------------------------------------------- names


def reward_name(fn: Callable) -> str:
    """A reward function's name for metrics: ``__name__``, a partial's function name, or the class name."""
    if isinstance(fn, functools.partial):
        return reward_name(fn.func)
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def reward_names(reward_funcs: Sequence[Callable]) -> list[str]:
    """reward_name per function; repeats get a suffix ("length_penalty", "length_penalty_2")."""
    names, seen = [], {}
    for fn in reward_funcs:
        base = reward_name(fn)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


# ----------------------------------------------------------------------------- column check

# Names the trainer itself passes to every reward function: never dataset columns.
TRAINER_KEYWORDS = frozenset(
    {
        "prompts",
        "completions",
        "completion_ids",
        "completion_lengths",
        "truncated",
        "trainer_state",
        "log_extra",
        "log_metric",
        "environments",
    }
)


def _needed_columns(fn: Callable) -> list[tuple[str, ...]]:
    """The columns ``fn`` needs, each as a tuple of alternatives (any one will do): its parameters
    without a default (every argument is passed by keyword), and its ``required_columns``."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    declared = getattr(fn, "required_columns", None) or getattr(target, "required_columns", ())
    needed = [(c,) if isinstance(c, str) else tuple(c) for c in declared]
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some C callables): check nothing more
        return needed
    needed += [
        (p.name,)
        for p in params
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in TRAINER_KEYWORDS
    ]
    return needed


def _positional_only(fn: Callable) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]


def _hint(name: str) -> str:
    """' (did you mean 'completion_ids'?)' for a parameter name close to a trainer keyword."""
    close = difflib.get_close_matches(name, sorted(TRAINER_KEYWORDS), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_reward_columns(reward_funcs: Sequence[Callable], columns: Sequence[str], dataset_name: str) -> None:
    """Raise ValueError, before any training, when reward functions cannot take what the trainer passes.

    ``columns`` are the dataset columns that reach the reward functions (all but ``prompt`` and
    ``prompt_messages``). Every argument is passed by keyword (TRL's contract), so a function needs:
    each parameter without a default that is not one of :data:`TRAINER_KEYWORDS` nor ``*args`` /
    ``**kwargs`` (``def accuracy_reward(completions, solution, **kwargs)`` needs ``solution``;
    ``lambda p, c, **kw`` needs columns ``p`` and ``c``: name them ``prompts, completions``); and
    the columns in its ``required_columns`` attribute, each a name or a tuple of names of which one
    is enough (:func:`answer_accuracy` declares ``(("answer", "solution"),)``). A function with
    positional-only parameters, or a dataset column named like a trainer keyword
    (``completions``, ``truncated``...), is an error too. The message names every function, its
    missing columns, the dataset and its columns.
    """
    for fn, name in zip(reward_funcs, reward_names(reward_funcs), strict=True):
        positional = _positional_only(fn)
        if positional:
            raise ValueError(
                f"reward function {name!r} has positional-only parameters {positional}, but every argument "
                "is passed by keyword (TRL's contract): make them regular parameters (drop the '/')"
            )
    clashes = sorted(TRAINER_KEYWORDS.intersection(columns))
    if clashes:
        raise ValueError(
            f"{dataset_name} has column(s) {clashes}, named like keywords the trainer passes to reward "
            f"functions ({sorted(TRAINER_KEYWORDS)}); rename them (ds.rename_column)"
        )
    available = set(columns) | TRAINER_KEYWORDS
    problems = []
    for fn, name in zip(reward_funcs, reward_names(reward_funcs), strict=True):
        missing = [group for group in _needed_columns(fn) if not available.intersection(group)]
        if missing:
            what = ", ".join(" or ".join(f"{c!r}{_hint(c)}" for c in group) for group in missing)
            problems.append(f"reward function {name!r} needs column {what}")
    if problems:
        raise ValueError(
            f"{dataset_name} lacks columns that reward functions need: {'; '.join(problems)}. "
            f"{dataset_name} has columns {list(columns)}. Reward functions are called with every "
            "argument by keyword (TRL's contract): prompts, completions, completion_ids, the "
            "dataset's columns, completion_lengths, truncated, trainer_state; a parameter is matched "
            "by its name. Add or rename the column (ds.add_column / ds.rename_column), rename the "
            "parameter, or give it a default if the function can do without it."
        )
