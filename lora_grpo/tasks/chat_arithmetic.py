"""Small sums asked through a chat template, for a real instruction-tuned model (SmolLM2-135M-Instruct).

    user:      "What is 7 + 4?"
    assistant: "7 + 4 = 11"            reward 1: the last integer of the reply is the sum

Two kinds (``KINDS``), measured on SmolLM2-135M-Instruct (GGUF Q4_1, dequantised) by
benchmarks/studies/smollm2_task_search.py:

- ``add-1-1``: two one-digit numbers, each problem asked in ten phrasings ("What is 3 plus 5?",
  "Add 3 and 5.", ...). The smollm2-135m-chat-sum recipe's task: on the 210 held-out prompts at 24 new
  tokens, greedy 0.352, sampled at temperature 0.7 pass@1 0.207 and pass@8 0.748.
- ``add-1-2``: one one-digit and one two-digit number, "What is a + b?" only. At 24 new tokens greedy
  0.03, pass@8 0.10: too hard at that budget (it rambles, "To add 7 and 24, you ..."), so no recipe
  is built on it.

The split is by problem, and ``a + b`` and ``b + a`` are one problem: no held-out sum, in either order
or any phrasing, is ever a training prompt.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """A family of sums: every problem ``(a, b)`` it holds, and the phrasings each is asked in."""

    problems: tuple[tuple[int, int], ...]
    phrasings: tuple[str, ...]


_DIGITS = range(1, 10)
KINDS = {
    # 81 problems x 10 phrasings; 21 problems (210 prompts, sums 3 to 18) held out
    "add-1-1": Kind(
        problems=tuple((a, b) for a in _DIGITS for b in _DIGITS),
        phrasings=(
            "What is {a} + {b}?",
            "What is {a} plus {b}?",
            "Compute {a} + {b}.",
            "Add {a} and {b}.",
            "What is the sum of {a} and {b}?",
            "Calculate {a} + {b}.",
            "How much is {a} + {b}?",
            "{a} + {b} = ?",
            "What do you get when you add {a} to {b}?",
            "Find {a} + {b}.",
        ),
    ),
    # one digit plus two digits, either order: 2 x 9 x 90 = 1,620 problems
    "add-1-2": Kind(
        problems=tuple(p for a in _DIGITS for b in range(10, 100) for p in ((a, b), (b, a))),
        phrasings=("What is {a} + {b}?",),
    ),
}
_INT = re.compile(r"-?\d+")


def _held_out(a: int, b: int) -> bool:
    """One problem in about four is held out, by a CRC of the unordered pair, so the splits never
    share a sum in either order (a linear hash such as ``131a + 71b mod 4`` would hold out exactly
    the sums divisible by 4)."""
    low, high = sorted((a, b))
    return zlib.crc32(f"{low}+{high}".encode()) % 4 == 0


def chat_sum_problems(n: int, seed: int = 0, split: str = "train", kind: str = "add-1-1"):
    """``n`` distinct prompts of ``split`` ("train" or "eval") as a datasets.Dataset with a
    conversational ``prompt`` (one user turn) and the ``answer`` column (the sum, as text), drawn
    without repeats from the split's problems times the kind's phrasings."""
    import datasets

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: use one of {sorted(KINDS)}")
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r}: use 'train' or 'eval'")
    family = KINDS[kind]
    prompts = [
        (phrasing.format(a=a, b=b), a + b)
        for a, b in family.problems
        if _held_out(a, b) == (split == "eval")
        for phrasing in family.phrasings
    ]
    if n > len(prompts):
        raise ValueError(
            f"kind {kind!r} has {len(prompts)} distinct {split} prompts, asked for {n}: ask for at most that"
        )
    random.Random(f"{seed}-{split}-{kind}").shuffle(prompts)
    rows = [
        {"prompt": [{"role": "user", "content": text}], "answer": str(total)} for text, total in prompts[:n]
    ]
    return datasets.Dataset.from_list(rows)


def last_number(completion) -> int | None:
    text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def last_number_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last integer of the completion (text or conversational) is the ``answer`` column."""
    return [float(last_number(c) == int(a)) for c, a in zip(completions, answer, strict=True)]
