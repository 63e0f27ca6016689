"""Start-up checks, in one place: everything a run can refuse before its first rollout.

    prompts      tokenised once: each prompt's length as the rollout cuts it (max_prompt_length)
    context      the longest real prompt + max_completion_length against the model's context
    tokens       the tokenizer can pad and end a completion, and its special ids fit the embeddings
    rewards      every reward function can take the dataset columns it is called with
    log-probs    the chunked log-probs reproduce the model's own logits (both adapters)

The checks read what the run will really hold, never a configured maximum: a recipe whose prompts
are 6 tokens runs on a 64-token model whatever max_prompt_length says. Each failure is a
ValueError that names the prompt, token, column or model type and the fix.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .data import PROMPT_MESSAGES
from .logprobs import check_log_probs
from .rewards import check_reward_columns
from .rollout import check_prompt_lengths, context_limit, prompt_token_rows, special_token_ids, tokenize_prompts

# Datasets longer than this are not tokenised whole at start when max_prompt_length bounds them:
# their worst case is taken to be max_prompt_length (every rollout still checks its own prompts).
PROMPT_SCAN_LIMIT = 50_000


@dataclass
class PromptLengths:
    """Tokens per prompt as the rollout feeds them (after the max_prompt_length cut)."""

    lengths: np.ndarray  # (N,) int; for an unscanned dataset, one entry: max_prompt_length
    truncated: int  # prompts longer than max_prompt_length (left-truncated by every rollout)
    scanned: bool  # False: too many prompts to tokenise at start; max_prompt_length stands in

    @property
    def longest(self) -> int:
        return int(self.lengths.max())


def prompt_lengths(tokenizer, prompts: list[str], max_prompt_length: int | None) -> PromptLengths:
    """Tokenise the prompts once (in batches; no padded tensor) and return their lengths as cut."""
    if max_prompt_length is not None and len(prompts) > PROMPT_SCAN_LIMIT:
        return PromptLengths(np.array([max_prompt_length]), 0, scanned=False)
    raw = np.concatenate([
        np.fromiter(map(len, prompt_token_rows(tokenizer, prompts[i : i + 4096])), dtype=np.int64)
        for i in range(0, len(prompts), 4096)
    ]) if prompts else np.zeros(0, dtype=np.int64)
    if max_prompt_length is None:
        return PromptLengths(raw, 0, scanned=True)
    return PromptLengths(np.minimum(raw, max_prompt_length), int((raw > max_prompt_length).sum()), scanned=True)


def check_context(prompts: list[str], lengths: PromptLengths, max_completion_length: int, model, name: str) -> None:
    """Refuse, naming the first prompt, when a prompt as the rollout cuts it plus max_completion_length
    does not fit the model's context; nothing to check for a model without max_position_embeddings."""
    limit = context_limit(model)
    if limit is None:
        return
    if max_completion_length >= limit:
        raise ValueError(
            f"max_completion_length={max_completion_length} leaves no room for a prompt in the model's context "
            f"of {limit} tokens (max_position_embeddings); lower max_completion_length"
        )
    if not lengths.scanned:  # max_prompt_length stands in for the unscanned prompts
        if lengths.longest + max_completion_length > limit:
            raise ValueError(
                f"{name}: max_prompt_length + max_completion_length = {lengths.longest} + {max_completion_length} "
                f"tokens, more than the model's context of {limit} (max_position_embeddings); {len(prompts)} "
                f"prompts are too many to measure at start, so lower max_prompt_length to at most "
                f"{limit - max_completion_length}, or max_completion_length"
            )
        return
    check_prompt_lengths(prompts, lengths.lengths.tolist(), max_completion_length, limit)


def check_special_tokens(model, tokenizer) -> list[int]:
    """The EOS ids, after checking that the tokenizer can pad and end a completion (rollout's
    special_token_ids)."""
    return special_token_ids(model, tokenizer)


def check_datasets(reward_funcs, datasets: dict, tokenizer, model, config) -> dict[str, PromptLengths]:
    """Reward columns and context for each dataset ({name: Dataset or None}); returns each one's
    prompt lengths (tokenised once; the memory plan reads the train set's longest)."""
    found = {}
    for name, ds in datasets.items():
        if ds is None:
            continue
        # Columns reach the reward functions as keywords: all but the rendered prompt and the chat
        # messages, which arrive as `prompts` (trainer.rewards).
        columns = [c for c in ds.column_names if c not in ("prompt", PROMPT_MESSAGES)]
        check_reward_columns(reward_funcs, columns, name)
        prompts = list(ds["prompt"])
        lengths = prompt_lengths(tokenizer, prompts, config.max_prompt_length)
        check_context(prompts, lengths, config.max_completion_length, model, name)
        if lengths.truncated:
            warnings.warn(
                f"{name}: {lengths.truncated} of {len(prompts)} prompts are longer than max_prompt_length="
                f"{config.max_prompt_length} tokens; every rollout keeps their last {config.max_prompt_length} "
                "tokens. Raise max_prompt_length (or set it to null) to keep them whole.",
                stacklevel=3,
            )
        found[name] = lengths
    return found


def check_model_log_probs(model, tokenizer, prompts: list[str], config) -> float:
    """Refuse a model whose own logits our chunked log-probs do not reproduce (an unknown transform
    after its LM head): two prompts, then four of their own tokens as a completion. Returns the
    largest difference (nats per token), reported in summary.json."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # truncation was warned about once, by check_datasets
        ids, mask = tokenize_prompts(tokenizer, prompts[:2], None)
    ids, mask = ids[:, -32:], mask[:, -32:]  # the prompts' ends (left-padded rows) are enough
    completion = ids[:, -4:]
    device = next(model.parameters()).device
    return check_log_probs(
        model,
        torch.cat([ids, completion], 1).to(device),
        torch.cat([mask, torch.ones_like(completion)], 1).to(device),
        completion_length=completion.shape[1],
        temperature=config.temperature,
        chunk_size=config.logprob_chunk_size,
    )
