"""The countdown task: reach a target from 3–4 numbers with + − × ÷, each number used once.

As in TinyZero's countdown runs (Countdown-Tasks-3to4), but generated locally, so nothing is
downloaded:

    nums [44, 19, 35], target 98   ->   <answer>(44 + 19) + 35</answer>

``countdown_problems`` draws solvable problems only: it builds a random expression tree over the
numbers under the classic rules (every intermediate value a positive integer; a division only when
it is exact) and takes the tree's value as the target. ``countdown_reward`` scores an answer with
a small safe evaluator (``evaluate_expression``): the text is parsed with ``ast`` and only integer
literals, the four operators and parentheses are accepted; nothing is ever ``eval``-ed.

The reward's rules (``countdown_reward``), 1.0 or 0.0, no partial credit:

- the answer is the content of the completion's last ``<answer>...</answer>`` block (no block: 0);
- it is an arithmetic expression over integer literals with ``+ - * /`` and parentheses
  (``×``, ``·``, ``÷``, ``−`` and LaTeX ``\\times``, ``\\cdot``, ``\\div`` read as the same
  operators), optionally followed by ``= <target>``; no unary signs, decimals, powers or names;
- its literals are exactly the given numbers, each used once (as a multiset: all of them, no
  others);
- it evaluates exactly (rational arithmetic; intermediate values may be negative or fractions)
  to the target; a division by zero scores 0.

Format shaping (think tags) is left to a separate reward, e.g. the built-in ``format`` at a small
weight, so that each rule gets its own metric.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

__all__ = [
    "EVAL_PERCENT",
    "PROMPT_TEMPLATE",
    "countdown_problems",
    "countdown_reward",
    "evaluate_expression",
    "extract_equation",
    "format_prompt",
    "is_correct_equation",
    "make_problem",
]

NUMBER_RANGE = (1, 99)  # operands, inclusive
TARGET_RANGE = (1, 100)  # targets, inclusive (TinyZero's countdown targets are of this size)
NUM_COUNTS = (3, 4)  # numbers per problem
EVAL_PERCENT = 10  # share of (numbers, target) problems held out for eval, chosen by a hash
MAX_ANSWER_CHARS = 200  # longer answers are rejected before parsing (a 4-number answer is ~25)

PROMPT_TEMPLATE = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use +, -, *, / and "
    "parentheses, and you must use each number exactly once. Think step by step inside <think> </think> "
    "tags, then write only the equation inside <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
)


def format_prompt(nums: Sequence[int], target: int) -> str:
    """The prompt text of one problem (plain text; the recipe renders it with the chat template).

    >>> format_prompt([44, 19, 35], 98)[:60]
    'Using the numbers [44, 19, 35], create an equation that equa'
    """
    return PROMPT_TEMPLATE.format(nums=list(nums), target=target)


# ------------------------------------------------------------------------------------ generator


def _paren(text: str) -> str:
    return text if text.isdigit() else f"({text})"


def _build(rng: random.Random, values: list[int]) -> tuple[int, str]:
    """A random expression tree over ``values`` in this order: (value, text). Each node picks an
    operator that keeps its value a positive integer (+ and × always do; − when the left side is
    larger; ÷ when it is exact). Subexpressions are parenthesised."""
    if len(values) == 1:
        return values[0], str(values[0])
    cut = rng.randint(1, len(values) - 1)
    (a, left), (b, right) = _build(rng, values[:cut]), _build(rng, values[cut:])
    ops = [("+", a + b), ("*", a * b)]
    if a > b:
        ops.append(("-", a - b))
    if a % b == 0:
        ops.append(("/", a // b))
    op, value = rng.choice(ops)
    return value, f"{_paren(left)} {op} {_paren(right)}"


def make_problem(rng: random.Random, num_count: int | None = None, max_tries: int = 1000) -> dict[str, Any]:
    """One solvable problem: ``{"nums": [...], "target": int, "solution": str}``.

    Draws ``num_count`` numbers (default 3 or 4) from NUMBER_RANGE, builds a random expression tree
    over them (every intermediate a positive integer, division only when exact) and keeps it when its
    value lies in TARGET_RANGE. ``nums`` are listed in random order, not the solution's.
    """
    count = num_count or rng.choice(NUM_COUNTS)  # chosen once: 3 and 4 numbers equally often
    for _ in range(max_tries):
        nums = [rng.randint(*NUMBER_RANGE) for _ in range(count)]
        target, solution = _build(rng, nums)
        if not TARGET_RANGE[0] <= target <= TARGET_RANGE[1]:
            continue
        shown = nums[:]
        rng.shuffle(shown)
        return {"nums": shown, "target": target, "solution": solution}
    raise RuntimeError(f"no countdown problem with {count} numbers found in {max_tries} draws")


def _split_of(nums: Sequence[int], target: int) -> str:
    """ "eval" when a hash of (sorted numbers, target) mod 100 is below EVAL_PERCENT, else "train": a
    fixed split of all problems, whatever the seed, so train and eval never share a problem."""
    key = f"{sorted(nums)}->{target}".encode()
    return "eval" if int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 100 < EVAL_PERCENT else "train"


def countdown_problems(n: int, seed: int = 0, split: str = "train"):
    """``n`` distinct solvable problems as a ``datasets.Dataset``, deterministic by ``seed``.

    Columns: "prompt" (text, see ``format_prompt``), "nums" (list of 3–4 ints), "target" (int) and
    "solution" (one expression that reaches the target). Train and eval problems come from disjoint
    sets (a hash of the sorted numbers and the target decides; see ``_split_of``).
    """
    import datasets

    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"countdown:{seed}:{split}")
    rows: dict[tuple, dict[str, Any]] = {}  # (sorted numbers, target) -> problem: distinct problems
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise RuntimeError(f"could not draw {n} distinct {split} countdown problems in {tries - 1} draws")
        problem = make_problem(rng)
        key = (tuple(sorted(problem["nums"])), problem["target"])
        if key not in rows and _split_of(problem["nums"], problem["target"]) == split:
            rows[key] = problem
    problems = list(rows.values())
    return datasets.Dataset.from_dict(
        {
            "prompt": [format_prompt(p["nums"], p["target"]) for p in problems],
            "nums": [p["nums"] for p in problems],
            "target": [p["target"] for p in problems],
            "solution": [p["solution"] for p in problems],
        }
    )


# ------------------------------------------------------------------------------------ evaluator

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SYMBOLS = {"×": "*", "·": "*", "\\times": "*", "\\cdot": "*", "÷": "/", "\\div": "/", "−": "-", "–": "-"}
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/()\s]+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def extract_equation(completion: Any) -> str | None:
    """The content of the last ``<answer>...</answer>`` block, stripped; None when there is none.

    A conversational completion (``[{"role": "assistant", "content": text}]``) is read from its
    last message.
    """
    if isinstance(completion, Sequence) and not isinstance(completion, str):
        completion = (
            completion[-1].get("content", "") if completion and isinstance(completion[-1], Mapping) else ""
        )
    found = _ANSWER_RE.findall(str(completion))
    return found[-1].strip() if found else None


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """Exact value and integer literals of an arithmetic expression; ValueError if it is not one.

    Accepts integer literals, ``+ - * /`` (and ×, ·, ÷, −, ``\\times``, ``\\cdot``, ``\\div``) and
    parentheses; anything else (names, calls, powers, unary signs, decimals, ``0x..``, ``1_0``,
    leading zeros) is a ValueError, as are a division by zero and texts over MAX_ANSWER_CHARS.
    Parsed with ``ast``, evaluated in ``Fraction``s; nothing is ``eval``-ed.

    >>> evaluate_expression("(44 + 19) × 35 / 7")
    (Fraction(315, 1), [44, 19, 35, 7])
    """
    if len(text) > MAX_ANSWER_CHARS:
        raise ValueError(f"expression longer than {MAX_ANSWER_CHARS} characters")
    for symbol, op in _SYMBOLS.items():
        text = text.replace(symbol, op)
    if not _ALLOWED_CHARS.fullmatch(text):  # also rules out 0x10, 1_000, 2.5, 2e3 before parsing
        raise ValueError(f"only integers, + - * / and parentheses are allowed: {text!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:  # ValueError: e.g. null bytes
        raise ValueError(f"not an expression: {text!r} ({type(e).__name__})") from None
    literals: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"{type(node).__name__} is not allowed in a countdown expression")

    try:
        return value(tree.body), literals
    except RecursionError:
        raise ValueError("expression nested too deeply") from None


def is_correct_equation(answer: str | None, nums: Sequence[int], target: int) -> bool:
    """Whether ``answer`` uses each of ``nums`` exactly once and evaluates to ``target``.

    An optional ``= <target>`` after the expression is accepted (any other right-hand side is not).

    >>> is_correct_equation("(44 + 19) + 35 = 98", [44, 19, 35], 98), is_correct_equation("44 + 54", [44, 19, 35], 98)
    (True, False)
    """
    if answer is None:
        return False
    expression, eq, rhs = answer.partition("=")
    if eq and rhs.strip() != str(int(target)):
        return False
    try:
        got, literals = evaluate_expression(expression)
    except ValueError:
        return False
    return Counter(literals) == Counter(int(x) for x in nums) and got == int(target)


def countdown_reward(completions, nums, target, **kwargs) -> list[float | None]:
    """1.0 for a correct countdown equation in the completion's last ``<answer>`` block, else 0.0.

    TRL's reward contract: called with keywords (``prompts``, ``completions`` and the dataset
    columns ``nums`` and ``target``, one entry per completion); completions may be text or
    conversational (``[{"role": "assistant", "content": text}]``). Rules: see the module docstring.
    A row without numbers or target gets None (the reward does not apply).

    >>> countdown_reward(["<think>44+19=63, 63+35=98</think><answer>(44 + 19) + 35</answer>",
    ...                   "<answer>44 + 19 + 35 + 35</answer>", "(44 + 19) + 35"],
    ...                  nums=[[44, 19, 35]] * 3, target=[98] * 3)
    [1.0, 0.0, 0.0]
    """
    scores: list[float | None] = []
    for completion, numbers, goal in zip(completions, nums, target, strict=True):
        if numbers is None or goal is None:
            scores.append(None)
            continue
        scores.append(1.0 if is_correct_equation(extract_equation(completion), numbers, goal) else 0.0)
    return scores
