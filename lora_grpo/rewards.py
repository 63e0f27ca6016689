"""Reward functions: the contract, the built-ins, and weighted scoring of a rollout.

The contract is TRL's: every argument is passed by keyword::

    fn(*, prompts, completions, completion_ids, **columns) -> list[float | None]

so a reward function written for TRL's GRPOTrainer works unchanged, e.g.
``def accuracy_reward(completions, solution, **kwargs)`` or ``def reward_len(completions, **kwargs)``.
A function names the keywords it uses and takes ``**kwargs`` for the rest. Every keyword but
``trainer_state`` is a list with one entry per completion (N = prompts_per_step × G; a prompt's
row is repeated for its G completions, which are contiguous):

    prompts             the prompt text; for a conversational row (its prompt came from chat
                        messages, see :mod:`lora_grpo.data`) the message list
                        ``[{"role": ..., "content": ...}, ...]`` (with ``system_prompt`` applied)
    completions         the completion text; for a conversational row
                        ``[{"role": "assistant", "content": text}]``
    completion_ids      list[int]: the completion's token ids, up to and including EOS, no padding
    <column>            each dataset column (``answer``, ``solution``, ...), except ``prompt`` (the
                        rendered text; it is ``prompts`` for a text row) and ``prompt_messages``
                        (which is ``prompts`` for a conversational row)
    completion_lengths  int: tokens in the completion, ``len(completion_ids[i])``
    truncated           bool: the completion hit max_completion_length without EOS
    trainer_state       one :class:`TrainerState` for the whole batch: ``global_step`` (optimizer
                        steps done, 0 on the first step; also ``step``), ``epoch`` (epochs done,
                        fractional), ``max_steps``

A function that needs a dataset column names it as a parameter without a default, or, when it
reads columns from ``**kwargs``, declares them in a ``required_columns`` attribute; the trainer
checks at start that its datasets have them (:func:`check_reward_columns`).

None means "does not apply to this sample" (an accuracy reward on a row with no reference
answer), as in TRL: a None (or NaN) is left out of that function's mean metric, and counts as 0
in the weighted sum (TRL's nansum). See :func:`compute_rewards`.

Where we differ from TRL:
  - we also pass ``completion_lengths`` and ``truncated`` (the length penalties below use them);
  - ``trainer_state`` is our small frozen :class:`TrainerState`, not ``transformers.TrainerState``
    (only ``global_step``/``step``, ``epoch`` and ``max_steps``; no ``log_history``...);
  - a row for which every function returned None gets reward NaN and training stops with an error
    naming it (TRL logs a warning and uses 0);
  - ``async def`` reward functions are refused with a ValueError (TRL awaits them concurrently):
    wrap one in a plain function that calls ``asyncio.run``;
  - reward models (``nn.Module``) are not accepted as reward functions, and TRL's newer
    ``log_extra`` / ``log_metric`` callables are not passed (TRL's own rewards default them to None);
  - a function may also return a tensor or array, bools or numpy scalars; an infinite value is an
    error;
  - prompts from a ``messages_column`` are conversational too (TRL reads only ``prompt``).

Built-ins (names usable from YAML via :func:`resolve_reward_funcs`); they read text and
conversational completions alike:

    "format"         think_answer_format                           1.0 / 0.0
    "accuracy"       answer_accuracy                               1.0 / 0.0 / None
    "soft_overlong"  soft_overlong_penalty(max_completion_length, buffer_length)   in [-1, 0]
    "length"         length_penalty(target_length, scale=1.0)                     <= 0
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from .countdown import countdown_reward

try:  # optional extra: `pip install lora_grpo[math]`
    import math_verify as _math_verify
except ImportError:  # pragma: no cover - depends on the environment
    _math_verify = None

RewardFunc = Callable[..., Sequence[float | None]]

__all__ = [
    "TRAINER_KEYWORDS",
    "RewardFunc",
    "TrainerState",
    "answer_accuracy",
    "check_reward_columns",
    "compute_rewards",
    "conversational_inputs",
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
    """Tokens per completion: ``completion_lengths``, else the lengths of ``completion_ids``."""
    lengths = kwargs.get("completion_lengths")
    if lengths is None and kwargs.get("completion_ids") is not None:
        lengths = [len(ids) for ids in kwargs["completion_ids"]]
    if lengths is None:
        raise ValueError(
            f"{who} needs the keyword 'completion_lengths' or 'completion_ids' (tokens per "
            "completion); the trainer passes both, a direct call must pass one"
        )
    return [int(n) for n in lengths]


# --------------------------------------------------------------------------------------- format

_TAGS = r"</?(?:think|answer)>"
_FORMAT_RE = re.compile(
    rf"\s*<think>(?:(?!{_TAGS}).)*</think>\s*<answer>(?:(?!{_TAGS}).)*</answer>\s*", re.DOTALL
)


def think_answer_format(completions: list, **kwargs) -> list[float]:
    """1.0 when the whole completion is ``<think>...</think> <answer>...</answer>``, else 0.0.

    Whitespace is allowed around and between the two blocks (and anything inside them), but no
    other text, and neither block may contain another think/answer tag. A conversational
    completion (a list of messages) is read from its last message's content.

    >>> think_answer_format(completions=["<think>2+2</think>\\n<answer>4</answer>\\n",
    ...                                  "<answer>4</answer>", "<think>a</think><answer>4</answer>!"])
    [1.0, 0.0, 0.0]
    >>> think_answer_format(completions=[[{"role": "assistant", "content": "<think>a</think><answer>4</answer>"}]])
    [1.0]
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


def answer_accuracy(completions: list, **kwargs) -> list[float | None]:
    """1.0 when the model's final answer equals the reference answer, 0.0 otherwise.

    The reference comes from the ``answer`` column (or ``solution`` when there is no ``answer``;
    for a GSM8K-style solution the text after "####"). A row whose reference is None or empty gets
    None (the reward does not apply). The model's answer is :func:`extract_answer`'s (the
    ``<answer>`` block, else the last ``\\boxed{}``, else the last number); no answer scores 0.0.

    A match is any of: an exact numeric match by :func:`parse_number` ("1,234" == "1234", "0.75" ==
    "3/4" == "\\frac{3}{4}"); equal texts after removing whitespace, case and a final period; and,
    when ``math_verify`` is installed (the ``math`` extra), its ``verify`` (symbolic expressions,
    sets, intervals...). Without math_verify, non-numeric answers are thus compared as text. A
    conversational completion is read from its last message's content.

    >>> answer_accuracy(completions=["<answer>1,234</answer>", "so it is 7.", "<answer>8</answer>"],
    ...                 answer=["1234", "7", None])
    [1.0, 1.0, None]
    >>> answer_accuracy(completions=[[{"role": "assistant", "content": "\\\\boxed{3/4}"}]], solution=["0.75"])
    [1.0]
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

    Uses the ``completion_lengths`` keyword the trainer passes (or, when absent, the lengths of
    ``completion_ids``, as TRL's ``get_soft_overlong_punishment`` does).

    >>> fn = soft_overlong_penalty(max_completion_length=100, buffer_length=20)
    >>> fn(completions=[""] * 4, completion_lengths=[80, 90, 100, 120])
    [0.0, -0.5, -1.0, -1.0]
    """
    l_max, l_cache = int(max_completion_length), int(buffer_length)
    if not 0 < l_cache <= l_max:
        raise ValueError(
            "soft_overlong_penalty needs 0 < buffer_length <= max_completion_length, got "
            f"buffer_length={buffer_length}, max_completion_length={max_completion_length}"
        )
    start = l_max - l_cache

    def soft_overlong_penalty(completions, **kwargs) -> list[float]:
        lengths = _lengths(kwargs, "soft_overlong_penalty")
        return [0.0 if n <= start else (start - n) / l_cache if n <= l_max else -1.0 for n in lengths]

    return soft_overlong_penalty


def length_penalty(target_length: int, scale: float = 1.0) -> RewardFunc:
    """A linear penalty on tokens beyond a target length: ``-scale * max(0, L - target) / target``.

    0 up to ``target_length`` tokens, then -scale per extra ``target_length`` tokens (unbounded
    below, unlike :func:`soft_overlong_penalty`). Uses the ``completion_lengths`` keyword (or the
    lengths of ``completion_ids``).

    >>> length_penalty(target_length=50, scale=0.5)(completions=[""] * 3, completion_lengths=[10, 50, 150])
    [0.0, 0.0, -1.0]
    """
    if target_length <= 0 or scale < 0:
        raise ValueError(
            f"length_penalty needs target_length > 0 and scale >= 0, got {target_length}, {scale}"
        )

    def length_penalty(completions, **kwargs) -> list[float]:
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
    "countdown": (countdown_reward, False),
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
    funcs = [_resolve_one(spec, context or {}) for spec in specs]
    for fn in funcs:
        _check_not_async(fn)
    return funcs


def _is_async(fn: Callable) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` function, a partial of one, or an
    object whose ``__call__`` is one."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)


def _check_not_async(fn: Callable) -> None:
    if _is_async(fn):
        raise ValueError(
            f"reward function {reward_name(fn)!r} is an async function (async def); lora_grpo calls "
            "reward functions synchronously (unlike TRL, which awaits them concurrently). Wrap it: "
            f"def {reward_name(fn)}_sync(**kwargs): return asyncio.run({reward_name(fn)}(**kwargs))"
        )


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
# Keywords holding one value for the whole batch, not one per completion.
_BATCH_KEYWORDS = frozenset({"trainer_state"})


@dataclass(frozen=True)
class TrainerState:
    """The ``trainer_state`` keyword: training progress, for rewards that change over training
    (curricula, annealed penalties). The fields of ``transformers.TrainerState`` (what TRL passes)
    that such rewards read, with the same meaning; nothing else.

    Attributes:
        global_step: optimizer steps done before this batch was scored (0 on the first step).
        max_steps: the optimizer steps the run will take.
        epoch: epochs done, fractional (``global_step / steps_per_epoch``).
    """

    global_step: int
    max_steps: int
    epoch: float

    @property
    def step(self) -> int:
        """Alias of ``global_step``."""
        return self.global_step


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
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in TRAINER_KEYWORDS
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


def conversational_inputs(
    prompts: Sequence[str], completions: Sequence[str], prompt_messages: Sequence[list | None] | None
) -> tuple[list, list]:
    """``prompts`` and ``completions`` as TRL passes them to reward functions.

    Where a row's prompt came from chat messages (``prompt_messages[i]`` is a message list, see
    :mod:`lora_grpo.data`), its prompt is that list and its completion
    ``[{"role": "assistant", "content": text}]``; elsewhere (and for ``prompt_messages=None``)
    both stay text. All three have one entry per completion.

    >>> conversational_inputs(["u: hi\\na: ", "2+2="], ["hello", "4"], [[{"role": "user", "content": "hi"}], None])
    ([[{'role': 'user', 'content': 'hi'}], '2+2='], [[{'role': 'assistant', 'content': 'hello'}], '4'])
    """
    if prompt_messages is None:
        return list(prompts), list(completions)
    chat = [m is not None for m in prompt_messages]
    return (
        [m if c else p for p, m, c in zip(prompts, prompt_messages, chat, strict=True)],
        [[{"role": "assistant", "content": t}] if c else t for t, c in zip(completions, chat, strict=True)],
    )


def _keywords(prompts, completions, columns, i: int | None = None) -> dict[str, Any]:
    """The keyword set of one call: all N samples, or only sample ``i`` (batch keywords whole)."""
    if i is None:
        return {"prompts": prompts, "completions": completions, **columns}
    one = slice(i, i + 1)
    return {
        "prompts": prompts[one],
        "completions": completions[one],
        **{k: v if k in _BATCH_KEYWORDS else v[one] for k, v in columns.items()},
    }


def _find_failing_sample(fn, prompts, completions, columns) -> tuple[int, Exception] | None:
    """Call ``fn`` one sample at a time to find the first that raises (only on the error path)."""
    for i in range(len(completions)):
        try:
            fn(**_keywords(prompts, completions, columns, i))
        except Exception as e:  # noqa: BLE001 - reported to the user
            return i, e
    return None


def _check_signature(fn, name: str, keywords: Mapping[str, Any]) -> None:
    """ValueError, before the call, when ``fn`` cannot take the keyword set (a parameter no keyword
    fills, or no ``**kwargs`` for the rest): the usual mistake of a positional-style function."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: let the call speak
        return
    try:
        signature.bind(**keywords)
    except TypeError as e:
        raise ValueError(
            f"reward function {name!r} cannot take the keywords it is called with ({e}); its "
            f"parameters: {list(signature.parameters)}; the keywords: {sorted(keywords)}. Every "
            "argument is passed by keyword (TRL's contract): name the parameters you use after the "
            "keywords and end with **kwargs, e.g. def my_reward(completions, answer, **kwargs)"
        ) from None


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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
    if abs(out) > _FLOAT32_MAX:  # the reward table is float32: this would become inf there
        raise TypeError(f"a value beyond float32's range ({value!r:.60})")
    return None if math.isnan(out) else out


def _score_one(fn, name, prompts, completions, columns, n) -> list[float | None]:
    keywords = _keywords(prompts, completions, columns)
    _check_signature(fn, name, keywords)
    try:
        values = fn(**keywords)
    except Exception as e:
        found = _find_failing_sample(fn, prompts, completions, columns)
        if found is not None:
            i, err = found
            where = f"first failing {_sample(i, prompts, completions)} ({type(err).__name__}: {err})"
        else:
            first = _sample(0, prompts, completions)
            where = f"it fails on the batch of {n} but on no single sample; first {first}"
        raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}; {where}") from e
    if inspect.isawaitable(values):
        if inspect.iscoroutine(values):
            values.close()  # never awaited: close it rather than leave a "never awaited" warning
        _check_not_async(fn)  # the message for an async def function
        raise ValueError(
            f"reward function {name!r} returned an awaitable ({type(values).__name__}); reward "
            "functions are called synchronously and must return a list of numbers"
        )
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

    Every function is called with every argument by keyword (see the module docstring):
    ``fn(prompts=prompts, completions=completions, **columns)``.

    Args:
        reward_funcs: F reward functions (see the module docstring for the contract).
        prompts, completions: N each, as passed to the functions: texts, or for conversational
            rows message lists (see :func:`conversational_inputs`).
        columns: the other keywords: lists of length N (dataset columns, plus the trainer's
            ``completion_ids``, ``completion_lengths`` and ``truncated``), except
            ``trainer_state``, passed as is.
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
    own (found by calling it per sample), chained from the original; a function whose signature
    cannot take the keywords (say ``lambda p, c: ...``), an ``async def`` function, a wrong number
    of values or a non-numeric / infinite value -> ValueError naming the function (and the
    sample); len(weights) != F -> ValueError.
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
    for fn in reward_funcs:
        _check_not_async(fn)
    for key, values in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"column name {key!r} clashes with the keyword {key!r} that compute_rewards passes itself")
        if key in _BATCH_KEYWORDS:
            continue
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
