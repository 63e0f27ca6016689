"""Scoring a rollout: every reward function called by keyword, their values checked, weighted and summed.

The contract the functions follow is in :mod:`lora_grpo.rewards` (the package docstring).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import event_loop
from ..algo.advantages import weighted_sum
from ..run.failures import StepFailed
from .builtins import _text
from .specs import reward_names

RewardFunc = Callable[..., Sequence[float | None]]


# ---------------------------------------------------------------------------------- contract

# Keywords holding one value for the whole batch, not one per completion.
logger = logging.getLogger(__name__)

_BATCH_KEYWORDS = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})


# ---------------------------------------------------------------------------------- failures


class RewardFunctionError(StepFailed, ValueError):
    """A reward function failed while scoring: it raised, or returned what the contract does not
    allow (a wrong number of values, a value that is no number, NaN for every completion).

    A RuntimeError for a function that raised and a ValueError for bad values alike, so either
    `except` catches it. ``function`` is its name; ``global_step`` the optimizer steps done when it
    failed (``trainer_state.global_step``; None when scored outside a trainer). The trainer catches
    it to keep the work done so far (a checkpoint) and say how to resume: a failed step's stage
    "reward" (failures.StepFailed, a RuntimeError).
    """

    def __init__(
        self, message: str, function: str | None = None, global_step: int | None = None, checkpoint=None
    ):
        super().__init__(message, "reward", global_step, checkpoint)
        self.function = function


def _when(columns: Mapping[str, Any]) -> tuple[str, int | None]:
    """('after 12 of 100 optimizer steps: ', 12) from the trainer_state keyword, ('', None) without one."""
    state = columns.get("trainer_state")
    step = getattr(state, "global_step", None)
    if not isinstance(step, int):
        return "", None
    total = getattr(state, "max_steps", None)
    return f"after {step}{f' of {total}' if isinstance(total, int) else ''} optimizer steps: ", step


# ---------------------------------------------------------------------------------- scoring


def _clip(text: Any, limit: int = 200) -> str:
    s = _text(text)
    return repr(s if len(s) <= limit else s[:limit] + "...")


def _sample(i: int, prompts: Sequence, completions: Sequence) -> str:
    return f"sample {i}: prompt={_clip(prompts[i])}, completion={_clip(completions[i])}"


def conversational_inputs(
    prompts: Sequence[str], completions: Sequence[str], prompt_messages: Sequence[list | None] | None
) -> tuple[list, list]:
    """``prompts`` and ``completions`` as TRL passes them to reward functions.

    Where a row's prompt came from chat messages (``prompt_messages[i]`` is a message list, see
    :mod:`lora_grpo.data.prompts`), its prompt is that list and its completion
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


def rollout_keywords(
    rollout, rows: Mapping[str, Sequence], group_size: int, trainer_state, messages_column: str
) -> tuple[list, list, dict[str, Any]]:
    """(prompts, completions, columns) for :func:`compute_rewards` from a rollout of the dataset
    rows `rows` (column → one value per prompt), G = group_size completions per prompt: every column
    but ``prompt`` repeated for each completion of its group; a row whose prompt was chat messages
    (in ``messages_column``: data.PROMPT_MESSAGES) gets them as its prompt and
    ``[{"role": "assistant", "content": text}]`` as its completion; then
    ``completion_ids`` (up to and including EOS), ``completion_lengths``, ``truncated`` and
    ``trainer_state``."""
    # Each completion its own copy of a list or dict value (chat messages, a nested column), as each of TRL's rows is
    # fetched from the dataset anew: a function that edits its prompt in place would change the group's others.
    columns = {
        k: [copy.deepcopy(v) if isinstance(v, (list, dict)) else v for v in values for _ in range(group_size)]
        for k, values in rows.items()
        if k != "prompt"
    }
    prompts, completions = conversational_inputs(
        rollout.prompts, rollout.completions, columns.pop(messages_column, None)
    )
    ids, mask = rollout.completion_ids.cpu(), rollout.completion_mask.cpu().bool()
    columns["completion_ids"] = [row[keep].tolist() for row, keep in zip(ids, mask)]
    columns["completion_lengths"] = rollout.completion_lengths.tolist()
    columns["truncated"] = rollout.truncated.tolist()
    columns["trainer_state"] = trainer_state
    return prompts, completions, columns


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


# The keywords passed beyond TRL's, given only to a function that names them or takes **kwargs: a function
# written for TRL's keyword set alone (no **kwargs) runs unchanged.
_OWN_KEYWORDS = frozenset({"completion_lengths", "truncated"})


def _taken(fn, keywords: dict[str, Any]) -> dict[str, Any]:
    """``keywords`` less those of :data:`_OWN_KEYWORDS` that ``fn`` cannot take."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: pass them all, as before
        return keywords
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return keywords
    return {k: v for k, v in keywords.items() if k not in _OWN_KEYWORDS or k in params}


def _find_failing_sample(fn, prompts, completions, columns) -> tuple[int, Exception] | None:
    """Call ``fn`` one sample at a time to find the first that raises (only on the error path)."""
    for i in range(len(completions)):
        try:
            value = fn(**_taken(fn, _keywords(prompts, completions, columns, i)))
            if inspect.isawaitable(value) and isinstance(error := run_coroutines([value])[0], Exception):
                raise error
        except Exception as e:  # noqa: BLE001 - reported to the user
            return i, e
    return None


def run_coroutines(awaitables: list) -> list:
    """Await them concurrently (asyncio.gather) on the process's one event loop (event_loop.py: every step
    on the same loop, as in TRL, and inside a running loop too); each result, or the exception it raised."""

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    results = event_loop.run(gather())
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # KeyboardInterrupt and the like are not a reward function's failure
    return results


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


def _start(fn, name, prompts, completions, columns):
    """Call one reward function on the batch: its values, an awaitable (an async function, awaited with
    the others), or the exception it raised. A signature that cannot take the keywords fails first."""
    when, step = _when(columns)
    keywords = _taken(fn, _keywords(prompts, completions, columns))
    try:
        _check_signature(fn, name, keywords)
    except ValueError as e:
        raise RewardFunctionError(f"{when}{e}", name, step) from None
    try:
        return fn(**keywords)
    except Exception as e:  # noqa: BLE001 - reported, naming the sample, by _score_one
        return e


def _score_one(fn, name, prompts, completions, columns, n, values, bisect: bool = True) -> list[float | None]:
    """Check one function's result (`values`, or the exception it raised): a list of n rewards. `bisect`: on a
    raise, call `fn` again one sample at a time to name the first that fails."""
    when, step = _when(columns)

    def fail(message: str) -> RewardFunctionError:
        return RewardFunctionError(f"{when}reward function {name!r} {message}", name, step)

    try:
        if isinstance(values, Exception):  # the call raised (an async function's result, or _call's)
            raise values
    except Exception as e:
        if not bisect:
            raise fail(
                f"raised {type(e).__name__}: {e} on the batch of {n} completions (not called again per sample: "
                f"reward_bisect_on_error=false); first {_sample(0, prompts, completions)}"
            ) from e
        found = _find_failing_sample(fn, prompts, completions, columns)
        if found is not None:
            i, err = found
            where = f"first failing {_sample(i, prompts, completions)} ({type(err).__name__}: {err})"
        else:
            first = _sample(0, prompts, completions)
            where = f"it fails on the batch of {n} but on no single sample; first {first}"
        raise fail(f"raised {type(e).__name__}: {e}; {where}") from e
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    try:
        got = len(values)
    except TypeError:  # a scalar, a generator, a 0-d array
        got = None
    if got is None or isinstance(values, (str, bytes, Mapping)):  # a str or dict is no list of rewards
        raise fail(
            f"must return a list of {n} numbers (one per completion), got a {type(values).__name__} "
            f"({values!r:.60})"
        )
    if got != n:
        raise fail(f"returned {got} values for {n} completions (expected one per completion, {n})")
    out, nans = [], 0
    for i, value in enumerate(values):
        try:
            out.append(_to_float(value))
        except TypeError as e:
            raise fail(
                f"returned a bad value at index {i}: {e}; a reward must be a finite number (float, int, bool, "
                "numpy scalar, one-element tensor), or None where it does not apply: convert it (float(...)) or "
                f"clip it; {_sample(i, prompts, completions)}"
            ) from None
        nans += out[-1] is None and value is not None
    if n and nans == n:  # None for all is "applies to none of them"; NaN for all is a failed computation
        raise fail(
            f"returned NaN for every one of the {n} completions, which means its computation failed "
            f"(e.g. a mean over nothing); return None where a reward does not apply. First "
            f"{_sample(0, prompts, completions)}"
        )
    return out


def check_reward_weights(weights, num_funcs: int) -> None:
    """One weight per reward function, or None (all 1): the trainer checks at start, before the model loads."""
    if weights is not None and len(weights) != num_funcs:
        raise ValueError(
            f"Number of reward weights ({len(weights)}) must match number of reward functions ({num_funcs}): "
            "give reward_weights one weight per function, in their order"
        )


def compute_rewards(
    reward_funcs: Sequence[Callable],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence] | None = None,
    weights: Sequence[float] | torch.Tensor | None = None,
    bisect_on_error: bool = True,
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
        bisect_on_error: when a function raises, call it again on one sample at a time to name the first
            sample that fails on its own (N more calls at most, on the error path only); False calls each
            function once per batch whatever happens (paid or remote rewards: the config's
            reward_bisect_on_error).

    Returns:
        rewards: (N,) float32, ``sum_f w_f * r_f`` where a None counts as 0 (TRL's nansum); NaN only
            for a row where every function returned None, which logs TRL's warning "All reward functions
            returned None for the following kwargs ..." (the advantages give such a row 0).
        per_func: (N, F) float32, NaN where a function returned None (a NaN return counts as None).
        metrics: ``rewards/{name}/mean`` and ``rewards/{name}/std`` per function over its non-None
            values (NaN when all are None), ``reward/mean`` and ``reward/std`` over the non-NaN
            rewards. Std is the sample std (n − 1, TRL's nanstd; NaN for fewer than two values). A name
            repeated among the functions gets a suffix (``length_penalty_2``).

    Example: two functions, weights (1, 0.5), per_func [[1, None], [0, -1]] -> rewards [1.0, -0.5];
    metrics rewards/f/mean = 0.5, rewards/g/mean = -1.0 (the None is left out, not averaged as 0).

    Errors: a function that raises, whose signature cannot take the keywords (say
    ``lambda p, c: ...``), that returns a wrong number of values, a non-numeric / infinite value
    or NaN for every completion -> :class:`RewardFunctionError` (a RuntimeError and a ValueError)
    naming the function, the optimizer steps done (from ``trainer_state``) and the sample: for a
    raise, the first sample that fails on its own (found by calling it per sample), chained from
    the original (with ``bisect_on_error=False``, the first sample of the batch). len(weights) != F ->
    ValueError.
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
            raise ValueError(
                f"column name {key!r} clashes with the keyword {key!r} that compute_rewards passes itself"
            )
        if key in _BATCH_KEYWORDS:
            continue
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    check_reward_weights(weights, n_funcs)
    w = torch.ones(n_funcs) if weights is None else torch.as_tensor(weights, dtype=torch.float32).reshape(-1)

    names = reward_names(reward_funcs)
    per_func = torch.full((n, n_funcs), float("nan"), dtype=torch.float32)
    prompts, completions = list(prompts), list(completions)
    results = [
        _start(fn, name, prompts, completions, columns) for fn, name in zip(reward_funcs, names, strict=True)
    ]
    pending = [j for j, r in enumerate(results) if inspect.isawaitable(r)]
    for j, value in zip(pending, run_coroutines([results[j] for j in pending]) if pending else []):
        results[j] = value  # async functions run concurrently, as TRL awaits them
    for j, (fn, name) in enumerate(zip(reward_funcs, names, strict=True)):
        scores = _score_one(fn, name, prompts, completions, columns, n, results[j], bisect_on_error)
        per_func[:, j] = torch.tensor([float("nan") if s is None else s for s in scores], dtype=torch.float32)

    # None -> 0 in the sum; a row nothing applied to is NaN: left out of the baseline, advantage 0 (as TRL)
    rewards = weighted_sum(per_func, w)
    unscored = per_func.isnan().all(dim=1)
    if unscored.any():
        _warn_unscored(int(unscored.nonzero()[0, 0]), prompts, completions, columns)

    return rewards, per_func, reward_metrics(rewards, per_func, names)


def _warn_unscored(row: int, prompts: list, completions: list, columns: Mapping[str, Sequence]) -> None:
    # TRL 1.16's warning, with the first such row's dataset columns (not the trainer's completion_ids,
    # completion_lengths, truncated); training goes on (its advantage is 0).
    trainer_keys = _BATCH_KEYWORDS | {"completion_ids", "completion_lengths", "truncated"}
    kwargs = {k: v[row] for k, v in columns.items() if k not in trainer_keys}
    kwargs["prompt"], kwargs["completion"] = prompts[row], completions[row]
    logger.warning(
        f"All reward functions returned None for the following kwargs:\n{kwargs}\n"
        "Please ensure that at least one reward function returns a valid reward. Here the row is left out "
        "of its group's mean and std and gets advantage 0, as in TRL; give it a reward function that "
        "scores it to learn from it."
    )


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
    """The mean and the sample standard deviation (n − 1, as TRL's nanstd and the group advantages; NaN for
    fewer than two values)."""
    mean = values.mean().item() if values.numel() else float("nan")
    std = values.std(correction=1).item() if values.numel() > 1 else float("nan")
    return {f"{prefix}/mean": mean, f"{prefix}/std": std}
