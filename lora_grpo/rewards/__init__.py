"""Reward functions: the contract, and weighted scoring of a rollout.

The contract is TRL's: every argument is passed by keyword::

    fn(*, prompts, completions, completion_ids, **columns) -> list[float | None]

so a reward function written for TRL's GRPOTrainer works unchanged, e.g.
``def accuracy_reward(completions, solution, **kwargs)`` or ``def reward_len(completions, **kwargs)``.
A function names the keywords it uses and takes ``**kwargs`` for the rest; it may be ``async def``
(async functions of a step are awaited together, as TRL does). Every keyword but
``trainer_state``, ``log_extra`` and ``log_metric`` is a list with one entry per completion
(N = prompts_per_step × G; a prompt's row is repeated for its G completions, which are contiguous):

    prompts             the prompt text; for a conversational row (its prompt came from chat
                        messages, see :mod:`lora_grpo.data.prompts`) the message list
                        ``[{"role": ..., "content": ...}, ...]`` (with ``system_prompt`` applied)
    completions         the completion text; for a conversational row
                        ``[{"role": "assistant", "content": text}]``
    completion_ids      list[int]: the completion's token ids, up to and including EOS, no padding
    <column>            each dataset column (``answer``, ``solution``, ...), except ``prompt`` (the
                        rendered text; it is ``prompts`` for a text row) and ``prompt_messages``
                        (which is ``prompts`` for a conversational row)
    completion_lengths  int: tokens in the completion, ``len(completion_ids[i])`` (this and ``truncated``:
                        to a function that names them or takes ``**kwargs``)
    truncated           bool: the completion hit max_completion_length without EOS
    trainer_state       the run's state (``transformers.TrainerState``, as TRL passes it):
                        ``global_step`` (optimizer steps done, 0 on the first step), ``epoch``
                        (epochs done, fractional), ``max_steps``, ``log_history``
    log_extra           ``log_extra(column, values)``: one value per completion into completions.jsonl
    log_metric          ``log_metric(name, value)``: a number into the step's metrics (its mean)

A function that needs a dataset column names it as a parameter without a default, or, when it
reads columns from ``**kwargs``, declares them in a ``required_columns`` attribute; the trainer
checks at start that its datasets have them (:func:`check_reward_columns`).

None means "does not apply to this sample" (an accuracy reward on a row with no reference
answer), as in TRL: a None (or NaN) is left out of that function's mean metric, and counts as 0
in the weighted sum (TRL's nansum). A row that every function skipped logs TRL's warning ("All
reward functions returned None for the following kwargs ...") and trains on as in TRL: it is left
out of its group's mean and std and its advantage is 0. See :func:`compute_rewards`.

Where we differ from TRL:
  - we also pass ``completion_lengths`` and ``truncated`` (the length penalties below use them), to a
    function that names them or takes ``**kwargs``: one written for TRL's keywords alone runs unchanged;
  - a function may also return a tensor or array, bools or numpy scalars; an infinite value is an
    error;
  - prompts from a ``messages_column`` are conversational too (TRL reads only ``prompt``).

Built-ins (:mod:`lora_grpo.rewards.builtins`; names usable from YAML via
:func:`resolve_reward_funcs`, in :mod:`lora_grpo.rewards.specs`); they read text and
conversational completions alike:

    "format"         think_answer_format                           1.0 / 0.0
    "think_format_reward", "reasoning_accuracy_reward", "accuracy_reward"   TRL's, scoring as TRL 1.16's
    "reward_model"   RewardModel(model=<hub id or path>, batch_size)  a sequence-classification model
    "accuracy"       answer_accuracy                               1.0 / 0.0 / None
    "soft_overlong"  soft_overlong_penalty(max_completion_length, buffer_length)   in [-1, 0]
    "length"         length_penalty(target_length, scale=1.0)                     <= 0

The package: ``scoring`` (the contract's checks and :func:`compute_rewards`), ``specs`` (specs →
functions, the column check), ``builtins`` (the built-in rewards), ``models`` (:class:`RewardModel`:
a sequence-classification model as a reward function, scored as TRL does); every public name
imports from ``lora_grpo.rewards``.
"""

from .builtins import (
    accuracy_reward,
    answer_accuracy,
    extract_answer,
    length_penalty,
    parse_number,
    soft_overlong_penalty,
    think_answer_format,
)
from .models import RewardModel
from .scoring import (
    RewardFunc,
    check_reward_weights,
    compute_rewards,
    conversational_inputs,
    reward_metrics,
    rollout_keywords,
)
from .specs import (
    BUILTIN_REWARDS,
    TRAINER_KEYWORDS,
    check_reward_columns,
    resolve_reward_funcs,
    reward_name,
    reward_names,
)

__all__ = [
    "BUILTIN_REWARDS",
    "TRAINER_KEYWORDS",
    "RewardFunc",
    "RewardModel",
    "accuracy_reward",
    "answer_accuracy",
    "check_reward_weights",
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
    "rollout_keywords",
    "soft_overlong_penalty",
    "think_answer_format",
]
