"""Reward functions: the contract, the built-ins, and weighted scoring of a rollout.

The contract (the same as TRL's)::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

``prompts`` and ``completions`` have one entry per completion (N = prompts_per_step × G; each prompt
is repeated for its G completions). Every dataset column arrives as a keyword list of length N (the
prompt's row repeated G times). The trainer also passes ``completion_lengths: list[int]`` (tokens per
completion) and ``truncated: list[bool]`` (the completion hit max_completion_length without EOS), so
a reward function should accept ``**kwargs`` for whatever it does not use.

A reward function that needs a column names it as a parameter without a default (TRL style,
``def accuracy_reward(completions, solution, **kwargs)``), or, when it reads columns from
``**kwargs``, declares them in a ``required_columns`` attribute (see :func:`check_reward_columns`);
the trainer then checks at start that its datasets have them.

A value of None means "does not apply to this sample" (for example an accuracy reward on a row with
no reference answer): it counts as 0 in the weighted sum and is left out of that function's mean
metric. See :func:`compute_rewards`.

Built-ins (names usable from YAML via :func:`resolve_reward_funcs`):

    "format"         think_answer_format                           1.0 / 0.0
    "accuracy"       answer_accuracy                               1.0 / 0.0 / None
    "soft_overlong"  soft_overlong_penalty(max_completion_length, buffer_length)   in [-1, 0]
    "length"         length_penalty(target_length, scale=1.0)                     <= 0
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch

try:  # optional extra: `pip install lora_grpo[math]`
    import math_verify as _math_verify
except ImportError:  # pragma: no cover - depends on the environment
    _math_verify = None

RewardFunc = Callable[..., Sequence[float | None]]

__all__ = [
    "RewardFunc",
    "TRAINER_KEYWORDS",
    "answer_accuracy",
    "check_reward_columns",
    "compute_rewards",
    "extract_answer",
    "length_penalty",
    "parse_number",
    "resolve_reward_funcs",
    "reward_metrics",
    "reward_name",
    "reward_names",
    "soft_overlong_penalty",
    "think_answer_format",
]


def _text(completion: Any) -> str:
    """A completion as text; a conversational completion (list of messages) gives its last content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _lengths(kwargs: dict, who: str) -> list[int]:
    lengths = kwargs.get("completion_lengths")
    if lengths is None:
        raise ValueError(
            f"{who} needs the keyword 'completion_lengths' (tokens per completion); the trainer "
            "passes it, a direct call must too"
        )
    return [int(n) for n in lengths]


# --------------------------------------------------------------------------------------- format

_TAGS = r"</?(?:think|answer)>"
_FORMAT_RE = re.compile(
    rf"\s*<think>(?:(?!{_TAGS}).)*</think>\s*<answer>(?:(?!{_TAGS}).)*</answer>\s*", re.DOTALL
)


def think_answer_format(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1.0 when the whole completion is ``<think>...</think> <answer>...</answer>``, else 0.0.

    Whitespace is allowed around and between the two blocks (and anything inside them), but no
    other text, and neither block may contain another think/answer tag.

    >>> think_answer_format(["q"] * 3, ["<think>2+2</think>\\n<answer>4</answer>\\n",
    ...                                 "<answer>4</answer>", "<think>a</think><answer>4</answer>!"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _FORMAT_RE.fullmatch(_text(c)) else 0.0 for c in completions]


# ------------------------------------------------------------------------------------- accuracy

_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(rf"^(?:{_NUM})$")
_FRACTION_RE = re.compile(rf"^({_NUM})\s*/\s*({_NUM})$")
_LATEX_FRAC_RE = re.compile(rf"^([-+]?)\\[dt]?frac\s*\{{\s*({_NUM})\s*\}}\s*\{{\s*({_NUM})\s*\}}$")
# A number anywhere in free text, for "the last number": fractions first so "3/4" is one match.
_ANY_NUMBER_RE = re.compile(
    rf"[-+]?\\[dt]?frac\s*\{{[^{{}}]*\}}\s*\{{[^{{}}]*\}}|(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?"
)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _braced(text: str, start: int) -> str | None:
    """Content of the first {...} group at or after ``start``, braces matched; None if unclosed."""
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``); None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    return None if start < 0 else _braced(text, start)


def parse_number(text: str) -> Fraction | None:
    """Parse a whole string as one exact number, or None.

    Accepts integers, decimals, signs, thousands separators ("1,234"), fractions ("3/4",
    "\\frac{3}{4}", "-\\dfrac{1}{2}"), a surrounding ``\\boxed{}`` or ``$...$``, a leading "$"
    (currency), and a trailing period or percent sign ("50%" parses as 50, not 0.5, as in GSM8K
    answers). Returns an exact ``Fraction`` so "0.75" == "3/4" compares exactly.

    >>> parse_number("1,234."), parse_number("\\\\boxed{\\\\frac{3}{4}}"), parse_number("-0.5")
    (Fraction(1234, 1), Fraction(3, 4), Fraction(-1, 2))
    >>> parse_number("about 4") is None
    True
    """
    s = text.strip()
    for _ in range(3):  # peel wrappers in any order: $\boxed{12\%}$.
        if s.startswith(("\\boxed", "\\fbox")) and s.endswith("}"):
            boxed = _braced(s, 0)
            if boxed is not None and len(boxed) == len(s) - s.index("{") - 2:  # one group, whole
                s = boxed.strip()
        s = s.strip().strip("$").strip().rstrip(".").strip()
        s = re.sub(r"\\?%$", "", s).strip()
        s = re.sub(r"^\\?\$", "", s).strip()
        s = re.sub(r"^\\text\{(.*)\}$", r"\1", s).strip()
    s = s.replace("\\!", "").replace("{,}", ",")
    try:
        if _NUMBER_RE.match(s):
            return Fraction(s.replace(",", ""))
        m = _FRACTION_RE.match(s)
        if m:
            num, den = (Fraction(g.replace(",", "")) for g in m.groups())
            return num / den if den != 0 else None
        m = _LATEX_FRAC_RE.match(s)
        if m:
            sign, num, den = m.groups()
            num, den = Fraction(num.replace(",", "")), Fraction(den.replace(",", ""))
            if den == 0:
                return None
            return -num / den if sign == "-" else num / den
    except (ValueError, ZeroDivisionError):
        return None
    return None


def extract_answer(text: str) -> str | None:
    """The model's final answer as text, or None when it gave none.

    The content of the last ``<answer>...</answer>`` block if there is one (whole, so non-numeric
    answers survive); else the content of the last ``\\boxed{...}``; else the last number in the text.

    >>> extract_answer("<think>...</think><answer> 42 </answer>"), extract_answer("so 3/4, then 12.")
    ('42', '12')
    """
    tags = _ANSWER_TAG_RE.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _ANY_NUMBER_RE.findall(text)
    return numbers[-1].strip() if numbers else None


def _reference_text(reference: Any) -> str | None:
    if reference is None:
        return None
    text = str(reference).strip()
    if "####" in text:  # GSM8K-style solution: the final answer follows "####".
        text = text.rsplit("####", 1)[1].strip()
    return text or None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().strip("$").rstrip(".")).lower()


def _numbers_match(reference: str, answer: str) -> bool:
    """Exact numeric comparison; False when either side is not a number."""
    ref = parse_number(reference)
    if ref is None:
        return False
    got = parse_number(answer)
    if got is None:  # the <answer> block may hold a sentence: use its last number.
        numbers = _ANY_NUMBER_RE.findall(answer)
        got = parse_number(numbers[-1]) if numbers else None
    return got is not None and got == ref


def _math_verify_match(reference: str, answer: str) -> bool:
    # math_verify's timeout uses signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parses(s: str) -> list:
        # Bare LaTeX ("x^2+1") is only read whole inside $...$; plain parsing reads just "1" of
        # "1+x^2". So try the $-wrapped text first, then the text as is.
        texts = [s] if "$" in s else [f"${s}$", s]
        return [p for p in (_math_verify.parse(t, parsing_timeout=timeout) for t in texts) if p]

    golds = parses(reference)
    if not golds:
        return False
    return any(_math_verify.verify(golds[0], answer, timeout_seconds=timeout) for answer in parses(answer))


def answer_accuracy(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]:
    """1.0 when the model's final answer equals the reference answer, 0.0 otherwise.

    The reference comes from the ``answer`` column (or ``solution`` when there is no ``answer``;
    for a GSM8K-style solution the text after "####"). A row whose reference is None or empty gets
    None (the reward does not apply). The model's answer is :func:`extract_answer`'s (the
    ``<answer>`` block, else the last ``\\boxed{}``, else the last number); no answer scores 0.0.

    A match is any of: an exact numeric match by :func:`parse_number` ("1,234" == "1234", "0.75" ==
    "3/4" == "\\frac{3}{4}"); equal texts after removing whitespace, case and a final period; and,
    when ``math_verify`` is installed (the ``math`` extra), its ``verify`` (symbolic expressions,
    sets, intervals...). Without math_verify, non-numeric answers are thus compared as text.

    >>> answer_accuracy(["q"] * 3, ["<answer>1,234</answer>", "so it is 7.", "<answer>8</answer>"],
    ...                 answer=["1234", "7", None])
    [1.0, 1.0, None]
    """
    if "answer" in kwargs:
        references = kwargs["answer"]
    elif "solution" in kwargs:
        references = kwargs["solution"]
    else:
        raise ValueError(
            "answer_accuracy needs a dataset column 'answer' (or 'solution') with the reference "
            f"answers; got columns {sorted(kwargs)}"
        )
    scores: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        ref = _reference_text(reference)
        if ref is None:
            scores.append(None)
            continue
        answer = extract_answer(_text(completion))
        if answer is None:
            scores.append(0.0)
            continue
        match = (
            _numbers_match(ref, answer)
            or _normalise(ref) == _normalise(answer)
            or (_math_verify is not None and _math_verify_match(ref, answer))
        )
        scores.append(1.0 if match else 0.0)
    return scores


answer_accuracy.required_columns = (("answer", "solution"),)  # one of the two; see check_reward_columns


# ------------------------------------------------------------------------------ length penalties


def soft_overlong_penalty(max_completion_length: int, buffer_length: int) -> RewardFunc:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), as a reward function.

    With L = completion length in tokens, Lmax = ``max_completion_length`` and
    Lcache = ``buffer_length``::

        R(L) = 0                          if L <= Lmax - Lcache
             = (Lmax - Lcache - L)/Lcache  if Lmax - Lcache < L <= Lmax   (linear from 0 to -1)
             = -1                          if L > Lmax

    Uses the ``completion_lengths`` keyword the trainer passes.

    >>> fn = soft_overlong_penalty(max_completion_length=100, buffer_length=20)
    >>> fn(["q"] * 4, [""] * 4, completion_lengths=[80, 90, 100, 120])
    [0.0, -0.5, -1.0, -1.0]
    """
    l_max, l_cache = int(max_completion_length), int(buffer_length)
    if not 0 < l_cache <= l_max:
        raise ValueError(
            "soft_overlong_penalty needs 0 < buffer_length <= max_completion_length, got "
            f"buffer_length={buffer_length}, max_completion_length={max_completion_length}"
        )
    start = l_max - l_cache

    def soft_overlong_penalty(prompts, completions, **kwargs) -> list[float]:
        lengths = _lengths(kwargs, "soft_overlong_penalty")
        return [0.0 if n <= start else (start - n) / l_cache if n <= l_max else -1.0 for n in lengths]

    return soft_overlong_penalty


def length_penalty(target_length: int, scale: float = 1.0) -> RewardFunc:
    """A linear penalty on tokens beyond a target length: ``-scale * max(0, L - target) / target``.

    0 up to ``target_length`` tokens, then -scale per extra ``target_length`` tokens (unbounded
    below, unlike :func:`soft_overlong_penalty`). Uses the ``completion_lengths`` keyword.

    >>> length_penalty(target_length=50, scale=0.5)(["q"] * 3, [""] * 3, completion_lengths=[10, 50, 150])
    [0.0, 0.0, -1.0]
    """
    if target_length <= 0 or scale < 0:
        raise ValueError(
            f"length_penalty needs target_length > 0 and scale >= 0, got {target_length}, {scale}"
        )

    def length_penalty(prompts, completions, **kwargs) -> list[float]:
        lengths = _lengths(kwargs, "length_penalty")
        return [-scale * (n - target_length) / target_length if n > target_length else 0.0 for n in lengths]

    return length_penalty


# -------------------------------------------------------------------------------- resolution

# name -> (object, is_factory). A factory is called with the spec's kwargs to build the function.
BUILTIN_REWARDS: dict[str, tuple[Callable, bool]] = {
    "format": (think_answer_format, False),
    "accuracy": (answer_accuracy, False),
    "soft_overlong": (soft_overlong_penalty, True),
    "length": (length_penalty, True),
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


def _resolve_one(spec: Any, context: Mapping[str, Any]) -> Callable:
    if isinstance(spec, Mapping):
        if "name" not in spec or set(spec) - {"name", "kwargs"}:
            raise ValueError(f"reward spec {spec!r}: a dict spec has keys 'name' and optional 'kwargs'")
        name, kwargs = spec["name"], dict(spec.get("kwargs") or {})
    elif isinstance(spec, str):
        name, kwargs = spec, {}
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
            f"cannot import reward {name!r} ({type(e).__name__}: {e}); accepted: {_ACCEPTED}"
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
    return [_resolve_one(spec, context or {}) for spec in specs]


def reward_name(fn: Callable) -> str:
    """A reward function's name for metrics: ``__name__``, a partial's function name, or the class name."""
    if isinstance(fn, functools.partial):
        return reward_name(fn.func)
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


# ----------------------------------------------------------------------------- column check

# Names the trainer itself passes to every reward function: never dataset columns.
TRAINER_KEYWORDS = frozenset(
    {"prompts", "completions", "completion_ids", "completion_lengths", "truncated", "trainer_state"}
)


def _needed_columns(fn: Callable) -> list[tuple[str, ...]]:
    """The columns ``fn`` needs, each as a tuple of alternatives (any one will do)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    declared = getattr(fn, "required_columns", None) or getattr(target, "required_columns", ())
    needed = [(c,) if isinstance(c, str) else tuple(c) for c in declared]
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some C callables): check nothing more
        return needed
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not any(p.name in TRAINER_KEYWORDS for p in positional[:2]):
        # Positional style, fn(p, c, **kw): the first two receive prompts and completions whatever
        # their names. Otherwise parameters are matched by name (keyword style, TRL's).
        params = [p for p in params if p not in positional[:2]]
    needed += [
        (p.name,)
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in TRAINER_KEYWORDS
    ]
    return needed


def check_reward_columns(reward_funcs: Sequence[Callable], columns: Sequence[str], dataset_name: str) -> None:
    """Raise ValueError, before any training, when ``dataset_name`` lacks a column a reward needs.

    A reward function needs: its parameters without a default, except :data:`TRAINER_KEYWORDS` and
    ``*args``/``**kwargs`` (``def accuracy_reward(completions, solution, **kwargs)`` needs
    ``solution``; ``lambda p, c, **kw``, whose first two parameters are not trainer names, takes
    them as prompts and completions); and the columns in its ``required_columns`` attribute, each
    a name or a tuple of names of which one is enough (:func:`answer_accuracy` declares
    ``(("answer", "solution"),)``). The message names every function, its missing columns, the
    dataset and its columns.
    """
    available = set(columns) | TRAINER_KEYWORDS
    problems = []
    for fn, name in zip(reward_funcs, reward_names(reward_funcs), strict=True):
        missing = [group for group in _needed_columns(fn) if not available.intersection(group)]
        if missing:
            what = ", ".join(" or ".join(map(repr, group)) for group in missing)
            problems.append(f"reward function {name!r} needs column {what}")
    if problems:
        raise ValueError(
            f"{dataset_name} lacks columns that reward functions need: {'; '.join(problems)}. "
            f"{dataset_name} has columns {list(columns)}. Add or rename the column (ds.add_column / "
            "ds.rename_column), or give the function's parameter a default if it can do without it."
        )


# ---------------------------------------------------------------------------------- scoring


def _clip(text: Any, limit: int = 200) -> str:
    s = _text(text)
    return repr(s if len(s) <= limit else s[:limit] + "...")


def _sample(i: int, prompts: Sequence, completions: Sequence) -> str:
    return f"sample {i}: prompt={_clip(prompts[i])}, completion={_clip(completions[i])}"


def reward_names(reward_funcs: Sequence[Callable]) -> list[str]:
    """reward_name per function; repeats get a suffix ("length_penalty", "length_penalty_2")."""
    names, seen = [], {}
    for fn in reward_funcs:
        base = reward_name(fn)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


def _find_failing_sample(fn, prompts, completions, columns) -> tuple[int, Exception] | None:
    """Call ``fn`` one sample at a time to find the first that raises (only on the error path)."""
    for i in range(len(completions)):
        one = {k: v[i : i + 1] for k, v in columns.items()}
        try:
            fn(prompts[i : i + 1], completions[i : i + 1], **one)
        except Exception as e:  # noqa: BLE001 - reported to the user
            return i, e
    return None


def _to_float(value: Any) -> float | None:
    """A reward value as float; None (or NaN) gives None; non-numeric or infinite raises TypeError
    describing the value."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "shape", None) in ((), (1,)):
        value = value.item()  # 0-d / 1-element tensor or array, numpy scalar (np.bool_ is no Real)
    if not isinstance(value, numbers.Real):  # bool is a Real: True -> 1.0
        raise TypeError(f"a {type(value).__name__} ({value!r:.60})")
    try:
        out = float(value)
    except OverflowError:  # an int beyond float range
        out = math.inf
    if math.isinf(out):
        raise TypeError(f"an infinite value ({value!r:.60})")
    return None if math.isnan(out) else out


def _score_one(fn, name, prompts, completions, columns, n) -> list[float | None]:
    try:
        values = fn(prompts, completions, **columns)
    except Exception as e:
        found = _find_failing_sample(fn, prompts, completions, columns)
        if found is not None:
            i, err = found
            where = f"first failing {_sample(i, prompts, completions)} ({type(err).__name__}: {err})"
        else:
            first = _sample(0, prompts, completions)
            where = f"it fails on the batch of {n} but on no single sample; first {first}"
        raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}; {where}") from e
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    try:
        got = len(values)
    except TypeError:  # a scalar, a generator, a 0-d array
        got = None
    if got is None or isinstance(values, (str, bytes, Mapping)):  # a str or dict is no list of rewards
        raise ValueError(
            f"reward function {name!r} must return a list of {n} numbers (one per completion), "
            f"got a {type(values).__name__} ({values!r:.60})"
        )
    if got != n:
        raise ValueError(
            f"reward function {name!r} returned {got} values for {n} completions "
            f"(expected one per completion, {n})"
        )
    out = []
    for i, value in enumerate(values):
        try:
            out.append(_to_float(value))
        except TypeError as e:
            raise ValueError(
                f"reward function {name!r} returned a bad value at index {i}: {e}; a reward must be "
                "a finite number (float, int, bool, numpy scalar, one-element tensor), or None where "
                f"it does not apply: convert it (float(...)) or clip it; {_sample(i, prompts, completions)}"
            ) from None
    return out


def compute_rewards(
    reward_funcs: Sequence[Callable],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence] | None = None,
    weights: Sequence[float] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score N completions with F reward functions and combine them.

    Args:
        reward_funcs: F reward functions (see the module docstring for the contract).
        prompts, completions: N texts each.
        columns: keyword lists of length N passed to every function (dataset columns, plus the
            trainer's ``completion_lengths`` and ``truncated``).
        weights: F weights, default all 1.

    Returns:
        rewards: (N,) float32, ``sum_f w_f * r_f`` where a None counts as 0 (TRL's nansum); NaN only
            for a row where every function returned None (advantages reject NaN with a clear error).
        per_func: (N, F) float32, NaN where a function returned None (a NaN return counts as None).
        metrics: ``rewards/{name}/mean`` and ``rewards/{name}/std`` per function over its non-None
            values (NaN when all are None), ``reward/mean`` and ``reward/std`` over the non-NaN
            rewards. Std is the population std (ddof=0). A name repeated among the functions gets a
            suffix (``length_penalty_2``).

    Example: two functions, weights (1, 0.5), per_func [[1, None], [0, -1]] -> rewards [1.0, -0.5];
    metrics rewards/f/mean = 0.5, rewards/g/mean = -1.0 (the None is left out, not averaged as 0).

    Errors: a function that raises -> RuntimeError naming it and the first sample that fails on its
    own (found by calling it per sample), chained from the original; a wrong number of values or a
    non-numeric / infinite value -> ValueError naming the function (and the sample); len(weights) != F
    -> ValueError.
    """
    reward_funcs = list(reward_funcs)
    n, n_funcs = len(completions), len(reward_funcs)
    columns = dict(columns or {})
    if n_funcs == 0:
        raise ValueError("compute_rewards needs at least one reward function")
    if len(prompts) != n:
        raise ValueError(
            f"got {len(prompts)} prompts for {n} completions; expected one prompt per completion"
        )
    for key, values in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"column name {key!r} clashes with the reward functions' positional argument")
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    if weights is None:
        w = torch.ones(n_funcs, dtype=torch.float32)
    else:
        w = torch.as_tensor(weights, dtype=torch.float32).reshape(-1)
        if w.numel() != n_funcs:
            raise ValueError(f"got {w.numel()} reward weights for {n_funcs} reward functions")

    names = reward_names(reward_funcs)
    per_func = torch.full((n, n_funcs), float("nan"), dtype=torch.float32)
    for j, (fn, name) in enumerate(zip(reward_funcs, names, strict=True)):
        scores = _score_one(fn, name, list(prompts), list(completions), columns, n)
        per_func[:, j] = torch.tensor([float("nan") if s is None else s for s in scores], dtype=torch.float32)

    present = ~per_func.isnan()  # (N, F)
    rewards = torch.nansum(per_func * w, dim=1)  # None -> 0 in the sum
    rewards[~present.any(dim=1)] = float("nan")  # nothing applied to this row

    return rewards, per_func, reward_metrics(rewards, per_func, names)


def reward_metrics(rewards: torch.Tensor, per_func: torch.Tensor, names: Sequence[str]) -> dict[str, float]:
    """rewards/{name}/mean|std per function over its non-None (non-NaN) values, reward/mean|std.

    rewards (N,), per_func (N, F): the outputs of compute_rewards (possibly gathered from several
    processes).
    """
    metrics: dict[str, float] = {}
    for j, name in enumerate(names):
        column = per_func[:, j]
        metrics.update(_mean_std(f"rewards/{name}", column[~column.isnan()]))
    metrics.update(_mean_std("reward", rewards[~rewards.isnan()]))
    return metrics


def _mean_std(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{prefix}/mean": float("nan"), f"{prefix}/std": float("nan")}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/std": values.std(correction=0).item(),
    }
