"""Small sums asked through a chat template, for a real instruction-tuned model (SmolLM2-135M-Instruct).

    user:      "What is 7 + 24?"
    assistant: "7 + 24 = 31"            reward 1: the last integer of the reply is the sum

A candidate task for a real model's recipe (benchmarks/smollm2_task_search.py measures the base on it).
Measured on SmolLM2-135M-Instruct (GGUF Q4_1, dequantised), 200 held-out problems, 24 new tokens: greedy
0.03, sampled pass@1 0.013, pass@8 0.10 -- too hard at that budget (it rambles, "To add 7 and 24, you
..."), so no recipe is built on it yet. The split is by problem: no held-out sum is ever a training
prompt.
"""

from __future__ import annotations

import random
import re

KINDS = {
    # one digit plus two digits, either order: 2 × 9 × 90 = 1,620 problems
    "add-1-2": lambda rng: (
        (rng.randint(1, 9), rng.randint(10, 99))
        if rng.random() < 0.5
        else (rng.randint(10, 99), rng.randint(1, 9))
    ),
}
_INT = re.compile(r"-?\d+")


def _held_out(a: int, b: int) -> bool:
    """One problem in four is held out, by a hash of the problem, so the splits never share one."""
    return (a * 131 + b * 71) % 4 == 0


def chat_sum_problems(n: int, seed: int = 0, split: str = "train", kind: str = "add-1-2"):
    """``n`` distinct problems of ``split`` ("train" or "eval") as a datasets.Dataset with a
    conversational ``prompt`` (one user turn) and the ``answer`` column (the sum, as text)."""
    import datasets

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: use one of {sorted(KINDS)}")
    rng = random.Random(f"{seed}-{split}-{kind}")
    rows, seen = [], set()
    for _ in range(200 * n):
        if len(rows) == n:
            break
        a, b = KINDS[kind](rng)
        if (a, b) in seen or _held_out(a, b) != (split == "eval"):
            continue
        seen.add((a, b))
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} distinct {split} problems of kind {kind!r}, asked for {n}")
    return datasets.Dataset.from_list(rows)


def last_number(completion) -> int | None:
    text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def last_number_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last integer of the completion (text or conversational) is the ``answer`` column."""
    return [float(last_number(c) == int(a)) for c, a in zip(completions, answer, strict=True)]
