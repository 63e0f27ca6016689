"""The offline countdown toy: reach a target from three one-digit numbers with + - ×, and a tiny base
pre-trained on noisy transcripts. GRPO's job is to make it pick the operator that reaches the target.

The countdown task (:mod:`lora_grpo.tasks.countdown`) shrunk to what a character-level model of ~0.3M
parameters learns in a minute of CPU. A problem is three numbers from 1..9 and a target that two of
them reach with one of ``+ - *``; the prompt and completion are compact, one character a token::

    "3 7 5:21="   ->   "3*7<eos>"  (or "7*3")

The rule (``countdown_toy_reward``): the completion is an expression over two or three of the given
numbers, each used **at most once** (one number may be left out: here 5), with ``+ - *`` and
parentheses, whose exact value is the target; it is checked with the countdown task's safe evaluator
(``countdown.evaluate_expression``: parsed with ``ast``, nothing ``eval``-ed). 1.0 or 0.0, never None.

``ensure_countdown_toy_base`` pre-trains the tiny Llama-style base (tasks.toy's tokenizer and model) on
transcripts of the train problems with a systematic error, as tasks.toy does with dropped carries: with
probability ``noise`` a sum is written as a difference of the same numbers and a difference as a sum
("3 7 5:10=" -> "3-7", "3 7 5:4=" -> "7+3"); a product is always written right. Where a well-fit model
puts ``noise`` > 0.5 on the swapped operator, greedy decoding writes a wrong equation for most sums and
differences, and right ones for products (about a third of the problems), while sampling at temperature
1 still finds the right operator often (held-out pass@8 ~0.95): one well-separated preference for GRPO
to flip, the same on every sum and difference (is the target above or below the larger number?).
``countdown_toy_problems`` and ``countdown_toy_reward`` are the data and the reward of the toy-countdown
recipe.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .countdown import evaluate_expression
from .pretrain import ensure_cached_base
from .toy import EOS, PAD, default_cache_dir, make_tokenizer, pretrain_base

__all__ = [
    "countdown_toy_problems",
    "countdown_toy_reward",
    "ensure_countdown_toy_base",
    "format_prompt",
    "is_reachable",
    "pretrain_countdown_toy_base",
]

NUMBER_RANGE = (1, 9)  # operands, inclusive: one character each
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SWAPPED = {"+": "-", "-": "+"}  # the noisy transcripts' operator; a product is never corrupted
EVAL_PERCENT = 20  # share of problems held out, chosen by a hash of (sorted numbers, target)


# ---------------------------------------------------------------------------------------------- data


def format_prompt(nums: Sequence[int], target: int) -> str:
    """The prompt of one problem: ``format_prompt([3, 7, 5], 21) == "3 7 5:21="``."""
    return " ".join(map(str, nums)) + f":{target}="


@functools.cache
def _problems(split: str) -> tuple[tuple[tuple[int, ...], int, tuple[str, ...]], ...]:
    """Every problem of a split: (sorted numbers, target, its two-number solutions such as "3*7"),
    in a fixed order. A problem is a multiset of three numbers and a target that a pair of them
    reaches with + (either order), * (either order) or - (the larger first; a positive difference).
    The EVAL_PERCENT% of all problems with the smallest hash are held out, whatever the seed."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    low, high = NUMBER_RANGE
    solutions: dict[tuple[tuple[int, ...], int], set[str]] = {}
    for nums in itertools.combinations_with_replacement(range(low, high + 1), 3):
        for a, b in itertools.permutations(nums, 2):
            for op, fn in OPS.items():
                if fn(a, b) > 0:
                    solutions.setdefault((nums, fn(a, b)), set()).add(f"{a}{op}{b}")
    keys = sorted(solutions)
    ranked = sorted(keys, key=lambda k: hashlib.sha256(f"{list(k[0])}->{k[1]}".encode()).digest())
    n_eval = len(keys) * EVAL_PERCENT // 100
    held = set(ranked[:n_eval])
    chosen = [k for k in keys if (k in held) == (split == "eval")]
    return tuple((nums, target, tuple(sorted(solutions[nums, target]))) for nums, target in chosen)


def countdown_toy_problems(n: int, seed: int = 0, split: str = "train"):
    """``n`` problems as a ``datasets.Dataset``: "prompt" (text, ``"3 7 5:21="``), "nums" ([3, 7, 5],
    in the prompt's order), "target" (21) and "solution" (one equation that reaches it, "3*7").

    Train and eval come from disjoint sets of problems (a fixed hash split of (sorted numbers,
    target), 20% held out: 211 eval problems, 848 train). Deterministic by ``seed``; problems are
    distinct while ``n`` is at most the split's size, beyond that they repeat (in new orders).
    """
    import datasets

    problems = _problems(split)
    gen = torch.Generator().manual_seed(seed)
    if n <= len(problems):
        idx = torch.randperm(len(problems), generator=gen)[:n]
    else:
        idx = torch.randint(len(problems), (n,), generator=gen)
    rows = []
    for i in idx.tolist():
        nums, target, solutions = problems[i]
        shown = [nums[j] for j in torch.randperm(3, generator=gen).tolist()]
        rows.append((shown, target, solutions[int(torch.randint(len(solutions), (1,), generator=gen))]))
    return datasets.Dataset.from_dict(
        {
            "prompt": [format_prompt(nums, target) for nums, target, _ in rows],
            "nums": [nums for nums, _, _ in rows],
            "target": [target for _, target, _ in rows],
            "solution": [solution for _, _, solution in rows],
        }
    )


# ---------------------------------------------------------------------------------------------- reward


def is_reachable(text: str, nums: Sequence[int], target: int) -> bool:
    """Whether ``text`` is an expression over two or more of ``nums``, each used at most once, with
    + - * and parentheses, whose exact value is ``target``. Division is not allowed.

    >>> is_reachable("3*7", [3, 7, 5], 21), is_reachable("3+7", [3, 7, 5], 21), is_reachable("7*3*1", [3, 7, 5], 21)
    (True, False, False)
    """
    if "/" in text:
        return False
    try:
        value, literals = evaluate_expression(text)
    except ValueError:
        return False
    used, given = Counter(literals), Counter(int(x) for x in nums)
    return len(literals) >= 2 and all(used[x] <= given[x] for x in used) and value == int(target)


def _completion_text(completion: Any) -> str:
    """The completion's text up to its end-of-sequence marker; a message list's last content."""
    if isinstance(completion, Sequence) and not isinstance(completion, str):
        last = completion[-1] if completion else {}
        completion = last.get("content", "") if isinstance(last, Mapping) else ""
    return str(completion).split(EOS, 1)[0].replace(PAD, "").strip()


def countdown_toy_reward(completions, nums, target, **kwargs) -> list[float]:
    """1.0 when the completion is a correct equation for its row's ``nums`` and ``target`` (see
    ``is_reachable``: each number at most once), else 0.0; never None.

    TRL's reward contract: called by keyword with the dataset columns, one entry per completion;
    completions may be text (read up to ``<eos>``) or conversational.

    >>> countdown_toy_reward(["3*7", "3+7", "7*7", "x"], nums=[[3, 7, 5]] * 4, target=[21] * 4)
    [1.0, 0.0, 0.0, 0.0]
    """
    return [
        float(is_reachable(_completion_text(c), n, t))
        for c, n, t in zip(completions, nums, target, strict=True)
    ]


# ---------------------------------------------------------------------------------------------- the base

FORMAT_VERSION = 1  # bump when the task or the training code changes what a seed produces
RECORD = "pretrain.json"


def _transcripts(tokenizer, rows: list[tuple[list[int], int, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (len(rows), T): "prompt solution<eos>" right-padded; labels -100 on
    the prompt and the padding, so the loss is over the completion (solution and <eos>) only."""
    prompts = tokenizer([format_prompt(n, t) for n, t, _ in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([s for _, _, s in rows], add_special_tokens=False)["input_ids"]
    seqs = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]
    starts = [len(p) for p in prompts]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, start : len(s)] = ids[i, start : len(s)]
    return ids, labels


def _noisy(solution: str) -> str:
    """The solution with its operator swapped (+ <-> -), e.g. "3+7" -> "3-7"; a product is kept."""
    op = next(ch for ch in solution if ch in OPS)
    return solution.replace(op, SWAPPED.get(op, op))


def pretrain_countdown_toy_base(
    out_dir,
    *,
    seed: int = 0,
    steps: int = 800,
    batch_size: int = 128,
    learning_rate: float = 2e-3,
    warmup_steps: int = 50,
    weight_decay: float = 0.01,
    noise: float = 0.6,
    hidden_size: int = 96,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    log_every: int = 100,
) -> str:
    """Pre-train the countdown toy base on transcripts of the train problems and save model, tokenizer
    and ``pretrain.json`` (settings, per-step losses, seconds) to ``out_dir``.

    Each step draws ``batch_size`` train problems uniformly (numbers in a random order, one of their
    solutions at random); with probability ``noise`` the solution's operator is swapped (see the module
    docstring). Next-token loss on the completion; AdamW, warmup then cosine to 10%
    (``pretrain.pretrain_tiny_model``). Deterministic by ``seed`` on a fixed thread count; the
    caller's RNG state is untouched. Returns ``str(out_dir)``.
    """
    settings = {k: v for k, v in locals().items() if k != "out_dir"}
    tokenizer, problems = make_tokenizer(), _problems("train")

    # Every transcript of the train problems, each problem's numbers in all 6 orders times its solutions,
    # written right and noisy; a step draws a problem uniformly, then an order and a solution.
    rows, first, count = [], [], []
    for nums, target, solutions in problems:
        first.append(len(rows))
        orders = list(itertools.permutations(nums))
        rows += [(list(order), target, solution) for order in orders for solution in solutions]
        count.append(len(rows) - first[-1])
    right_ids, right_labels = _transcripts(tokenizer, rows)
    noisy_ids, noisy_labels = _transcripts(tokenizer, [(n, t, _noisy(s)) for n, t, s in rows])
    first_t, count_t = torch.tensor(first), torch.tensor(count)

    def batch_loss(model, gen):
        idx = torch.randint(len(problems), (batch_size,), generator=gen)
        pick = first_t[idx] + (torch.rand(batch_size, generator=gen) * count_t[idx]).long()
        use_noisy = (torch.rand(batch_size, generator=gen) < noise)[:, None]
        ids = torch.where(use_noisy, noisy_ids[pick], right_ids[pick])
        labels = torch.where(use_noisy, noisy_labels[pick], right_labels[pick])
        return model(input_ids=ids, labels=labels).loss

    return pretrain_base(
        out_dir,
        tokenizer,
        batch_loss,
        settings,
        version=FORMAT_VERSION,
        record=RECORD,
        label="countdown toy pretrain",
    )


def ensure_countdown_toy_base(cache_dir=None, seed: int = 0, **overrides) -> str:
    """Path of the pre-trained countdown toy base (model + tokenizer), trained on first use (~1 min
    on CPU) and cached under ``cache_dir`` (default ``$LORA_GRPO_CACHE`` or ``~/.cache/lora_grpo``) in a
    directory named by a hash of every pretraining setting and the seed; ``overrides`` are
    ``pretrain_countdown_toy_base`` settings. Built in a temporary directory and renamed into place;
    an incomplete entry is rebuilt. Under torch.distributed every process calls it: LOCAL_RANK 0
    builds, the others wait (see ``pretrain.ensure_cached_base``)."""
    return ensure_cached_base(
        pretrain_countdown_toy_base,
        name="countdown_toy_base",
        version=FORMAT_VERSION,
        record=RECORD,
        cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
        seed=seed,
        overrides=overrides,
    )
