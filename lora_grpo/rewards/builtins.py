"""The built-in reward functions; they follow the keyword contract of :mod:`lora_grpo.rewards`.

Each reads text and conversational completions alike (a message list is read from its last
message's content). :mod:`lora_grpo.rewards.specs` names them for YAML (with "countdown", from
:mod:`lora_grpo.tasks.countdown`):

    "format"         think_answer_format                           1.0 / 0.0
    "accuracy"       answer_accuracy                               1.0 / 0.0 / None
    "soft_overlong"  soft_overlong_penalty(max_completion_length, buffer_length)   in [-1, 0]
    "length"         length_penalty(target_length, scale=1.0)                     <= 0

The two length penalties are factories: called with their parameters, they return the reward
function. This module imports nothing from the rest of the package.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

try:  # optional extra: `pip install lora_grpo[math]`
    import math_verify as _math_verify
except ImportError:  # pragma: no cover - depends on the environment
    _math_verify = None

__all__ = [
    "accuracy_reward",
    "answer_accuracy",
    "extract_answer",
    "length_penalty",
    "parse_number",
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


def _first_text(completion: Any) -> str:
    """A completion as TRL's built-ins read it: a conversational completion's first message (in a tool run the
    assistant's first turn, before any tool reply), text as it is."""
    if isinstance(completion, Sequence) and not isinstance(completion, str) and completion:
        if isinstance(completion[0], Mapping):
            return str(completion[0].get("content") or "")
    return _text(completion)


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
    if got is None:  # the <answer> block may hold a sentence around its number
        got = _sentence_number(answer)
    return got is not None and got == ref


# Characters of an expression around a number: an answer block holding one is no number ("x^2", "x+1").
_EXPRESSION = set("^*/+<>\\_()[]{}|")


def _sentence_number(answer: str) -> Fraction | None:
    """The one number of an answer that is a sentence around it ("The answer is 42."), else None: an answer
    holding several numbers ("3 or 4", "1, 2, 3") or an expression ("x^2", "3x", "sqrt(2)") is no number, so
    that hedging or a formula never scores as the number it contains."""
    numbers = list(_ANY_NUMBER_RE.finditer(answer))
    if len(numbers) != 1:
        return None
    found = numbers[0]
    before, after = answer[: found.start()], answer[found.end() :]
    if _EXPRESSION & set(before + after) or before[-1:].isalnum() or after[:1].isalnum():
        return None
    return parse_number(found.group())


def _math_verify_match(reference: str, answer: str) -> bool:
    # math_verify's timeout uses signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parses(s: str) -> list:
        # Bare LaTeX ("x^2+1") is only read whole inside $...$; plain parsing reads just "1" of
        # "1+x^2". So try the $-wrapped text first, then the text as is.
        texts = [s] if "$" in s else [f"${s}$", s]
        return [p for p in (_math_verify.parse(t, parsing_timeout=timeout) for t in texts) if p]

    # Each side read one way, the first that parses: the plain reading of "3 or 4" is its last number alone.
    golds, answers = parses(reference), parses(answer)
    return bool(golds and answers) and _math_verify.verify(golds[0], answers[0], timeout_seconds=timeout)


def answer_accuracy(completions: list, **kwargs) -> list[float | None]:
    """1.0 when the model's final answer equals the reference answer, 0.0 otherwise.

    The reference comes from the ``answer`` column (or ``solution`` when there is no ``answer``;
    for a GSM8K-style solution the text after "####"). A row whose reference is None or empty gets
    None (the reward does not apply). The model's answer is :func:`extract_answer`'s (the
    ``<answer>`` block, else the last ``\\boxed{}``, else the last number); no answer scores 0.0.

    A match is any of: an exact numeric match by :func:`parse_number` ("1,234" == "1234", "0.75" ==
    "3/4" == "\\frac{3}{4}"; an answer that is a sentence around one number, "The answer is 42.", is that
    number, but several numbers, "3 or 4", or an expression, "3x", are none); equal texts after removing
    whitespace, case and a final period; and, when ``math_verify`` is installed (the ``math`` extra), its
    ``verify`` (symbolic expressions, sets, intervals...). Without math_verify, non-numeric answers are thus
    compared as text. A conversational completion is read from its last message's content.

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


_THINK_RE = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """TRL's ``think_format_reward``: 1.0 when the completion opens with one ``<think>...</think>``
    block (anything may follow it), else 0.0.

    >>> think_format_reward(completions=["<think>\\nreasons\\n</think>\\nanswer", "<think>\\nno end"])
    [1.0, 0.0]
    """
    return [1.0 if _THINK_RE.match(_first_text(c)) else 0.0 for c in completions]


def accuracy_reward(
    completions: list, solution: list, log_extra: Callable | None = None, **kwargs
) -> list[float | None]:
    r"""TRL's ``accuracy_reward``, as TRL 1.16 scores (what a ``trl grpo`` recipe naming it expects): math_verify
    reads the ``solution`` column (None where it finds no answer there: the row is skipped) and the first LaTeX
    answer of the completion that has an anchor (``\boxed{}`` first, ``$...$``, ``\(...\)``; units
    normalised), and verifies them equal: 1.0 or 0.0. A bare number or a plain ``x = 3`` is no answer here (0.0);
    :func:`answer_accuracy` is the lenient one. Logs TRL's columns (solution, gold_parsed, answer_parsed) with
    log_extra. Needs math_verify (``pip install 'lora_grpo[math]'``).

    >>> accuracy_reward(completions=[r"it is \boxed{\frac{1}{3}}", r"\boxed{1/2}", "3"], solution=["1/3"] * 3)
    [1.0, 0.0, 0.0]
    """
    return _math_verified([_first_text(c) for c in completions], solution, log_extra, "accuracy_reward")


def reasoning_accuracy_reward(
    completions: list,
    solution: list,
    reasoning_delimiters: Sequence[str] | None = None,
    log_extra: Callable | None = None,
    **kwargs,
) -> list[float | None]:
    r"""TRL's ``reasoning_accuracy_reward``: :func:`accuracy_reward` of the text after the first of the reasoning
    delimiters (default ``</think>``) that the completion holds (after its last occurrence); 0.0 for a completion
    without one (its reasoning never ended), as TRL 1.16.

    >>> reasoning_accuracy_reward(completions=[r"<think>5?</think> \boxed{7}", r"<think>\boxed{7}"], solution=["7"] * 2)
    [1.0, 0.0]
    """
    finals = []
    for text in map(_first_text, completions):
        delimiter = next((d for d in reasoning_delimiters or ["</think>"] if d in text), None)
        finals.append(None if delimiter is None else text.split(delimiter)[-1])
    return _math_verified(finals, solution, log_extra, "reasoning_accuracy_reward")


def _math_verified(
    answers: list, solutions: list, log_extra: Callable | None, who: str
) -> list[float | None]:
    """TRL's math_verify scoring of each answer text against its solution (an answer None: 0.0, its reasoning
    never ended); see :func:`accuracy_reward`."""
    if _math_verify is None:
        raise ImportError(
            f"Please install the `math_verify` package to use {who}: pip install 'lora_grpo[math]'"
        )
    from latex2sympy2_extended import NormalizationConfig

    # math_verify's timeouts use signal.alarm, which works in the main thread only
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if main else (None, None)
    # an answer only where an anchor marks it, \boxed{} first, the first one found: as TRL asks math_verify
    anchored = [
        _math_verify.LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    scores, golds, found = [], [], []
    for answer, solution in zip(answers, solutions, strict=True):
        if answer is None:
            scores.append(0.0)
            golds.append("[incomplete reasoning]")
            found.append("[incomplete reasoning]")
            continue
        gold = _math_verify.parse(solution, parsing_timeout=parse_timeout)
        if not gold:
            scores.append(None)
            golds.append("[unparseable]")
            found.append("[skipped]")
            continue
        parsed = _math_verify.parse(
            answer, extraction_config=anchored, extraction_mode="first_match", parsing_timeout=parse_timeout
        )
        scores.append(float(_math_verify.verify(gold, parsed, timeout_seconds=verify_timeout)))
        golds.append(str(gold))
        found.append(str(parsed) if parsed else "[unparseable]")
    if log_extra is not None:
        log_extra("solution", list(solutions))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", found)
    return scores


# ------------------------------------------------------------------------------ length penalties


def soft_overlong_penalty(max_completion_length: int, buffer_length: int) -> Callable[..., list[float]]:
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


def length_penalty(target_length: int, scale: float = 1.0) -> Callable[..., list[float]]:
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
