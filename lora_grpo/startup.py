"""Start-up checks, in one place: everything a run can refuse before its first rollout.

    prompts      tokenised once: each prompt's length as the rollout cuts it (max_prompt_length)
    context      the longest real prompt + max_completion_length against the model's context
    tokens       the tokenizer can pad and end a completion; every id the run feeds (pad, EOS, BOS,
                 each prompt's tokens) fits the model's input embeddings
    adapters     lora_target_modules name modules of this model; init_adapter was saved for its shapes
                 (called by model.attach_adapters, before peft loads anything)
    rewards      every reward function can take the dataset columns it is called with
    log-probs    the chunked log-probs reproduce the model's own logits (both adapters)

The checks read what the run will really hold, never a configured maximum: a recipe whose prompts
are 6 tokens runs on a 64-token model whatever max_prompt_length says. Each failure is a
ValueError that names the prompt, token, column, module or model type and the fix.
"""

from __future__ import annotations

import difflib
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter_fits, missing_adapter_files
from .data import PROMPT_MESSAGES
from .logprobs import check_log_probs
from .rewards import check_reward_columns
from .rollout import (
    check_prompt_lengths,
    context_limit,
    prompt_token_rows,
    special_token_ids,
    tokenize_prompts,
)

# Datasets longer than this are not tokenised whole at start when max_prompt_length bounds them:
# their worst case is taken to be max_prompt_length (every rollout still checks its own prompts).
PROMPT_SCAN_LIMIT = 50_000


@dataclass
class PromptLengths:
    """Tokens per prompt as the rollout feeds them (after the max_prompt_length cut)."""

    lengths: np.ndarray  # (N,) int; for an unscanned dataset, one entry: max_prompt_length
    truncated: int  # prompts longer than max_prompt_length (left-truncated by every rollout)
    scanned: bool  # False: too many prompts to tokenise at start; max_prompt_length stands in
    highest: np.ndarray | None = None  # (N,) int: each prompt's largest token id (None when unscanned)

    @property
    def longest(self) -> int:
        return int(self.lengths.max())


def prompt_lengths(tokenizer, prompts: list[str], max_prompt_length: int | None) -> PromptLengths:
    """Tokenise the prompts once (in batches; no padded tensor) and return their lengths as cut."""
    if max_prompt_length is not None and len(prompts) > PROMPT_SCAN_LIMIT:
        return PromptLengths(np.array([max_prompt_length]), 0, scanned=False)
    raw, highest = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for i in range(0, len(prompts), 4096):
        rows = prompt_token_rows(tokenizer, prompts[i : i + 4096])
        raw.append(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)))
        kept = (
            rows if max_prompt_length is None else [r[-max_prompt_length:] for r in rows]
        )  # as the rollout cuts
        highest.append(np.fromiter(map(max, kept), dtype=np.int64, count=len(rows)))
    raw, top = np.concatenate(raw), np.concatenate(highest)
    if max_prompt_length is None:
        return PromptLengths(raw, 0, scanned=True, highest=top)
    return PromptLengths(
        np.minimum(raw, max_prompt_length), int((raw > max_prompt_length).sum()), scanned=True, highest=top
    )


def check_context(
    prompts: list[str], lengths: PromptLengths, max_completion_length: int, model, name: str
) -> None:
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


def embedding_rows(model) -> int | None:
    """Rows of the model's input embeddings: every id fed to it must be below this (None: unknown)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def _token(tokenizer, token_id: int) -> str:
    """ "'<s>' (id 82, the tokenizer's bos_token)": a token as a message names it."""
    roles = [
        name
        for name in ("pad_token", "eos_token", "bos_token", "unk_token")
        if getattr(tokenizer, f"{name}_id", None) == token_id
    ]
    text = tokenizer.convert_ids_to_tokens(int(token_id))
    return f"{text!r} (id {token_id}" + (f", the tokenizer's {' and '.join(roles)})" if roles else ")")


def _resize_fix(tokenizer, rows: int) -> str:
    return (
        f"The tokenizer ({len(tokenizer)} tokens) has ids the model's {rows} input embeddings (ids 0-{rows - 1}) "
        "do not cover: tokens added without resizing the model. Use the tokenizer saved with this model "
        "(tokenizer_name_or_path), or call model.resize_token_embeddings(len(tokenizer)) before handing the model "
        "to GRPOTrainer (the new rows are untrained and the base stays frozen, so prefer tokens the model knows)"
    )


def check_special_tokens(model, tokenizer) -> list[int]:
    """The EOS ids, after checking that the tokenizer can pad and end a completion (rollout's
    special_token_ids) and that every special id the run feeds fits the model's input embeddings.

    An id beyond the embeddings would otherwise end the first forward in `IndexError: index out of
    range in self`. A pad token beyond them (transformers adds '<|endoftext|>' to some tokenizers
    saved without one) is replaced by EOS, with a warning: padding is masked, so nothing else
    changes. An EOS or a prepended BOS beyond them is refused, naming the token and the fix; other
    tokens beyond them are warned about (each prompt's ids were checked by check_datasets)."""
    eos = special_token_ids(model, tokenizer)
    rows = embedding_rows(model)
    if rows is None:
        return eos
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_rows = getattr(getattr(head, "weight", None), "shape", (0,))[0]
    if out_rows > rows:
        raise ValueError(
            f"the model's LM head scores {out_rows} tokens but its input embeddings have {rows} rows: a sampled "
            f"token id >= {rows} could not be fed back. Resize the model (model.resize_token_embeddings({out_rows}))"
        )
    usable_eos = [i for i in eos if 0 <= i < rows]
    if not usable_eos:
        raise ValueError(
            f"every EOS token ({', '.join(_token(tokenizer, i) for i in eos)}) is beyond the model's "
            f"{rows} input embeddings, so no completion could end. {_resize_fix(tokenizer, rows)}"
        )
    pad = tokenizer.pad_token_id
    if not 0 <= pad < rows:
        end = tokenizer.eos_token_id if tokenizer.eos_token_id in usable_eos else usable_eos[0]
        warnings.warn(
            f"the tokenizer's pad token {_token(tokenizer, pad)} is beyond the model's {rows} input embeddings "
            "(transformers adds one to a tokenizer saved without a pad token); padding with "
            f"{_token(tokenizer, end)} instead, which changes nothing else (padding is masked). To silence this, "
            "set tokenizer.pad_token = tokenizer.eos_token before handing it to GRPOTrainer",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(end)
        replaced = pad  # said above: not said again below
    else:
        replaced = None
    bos = tokenizer.bos_token_id
    if bos is not None and not 0 <= bos < rows and tokenizer("a")["input_ids"][:1] == [bos]:
        raise ValueError(
            f"the tokenizer prepends {_token(tokenizer, bos)} to every prompt, beyond the model's {rows} "
            f"input embeddings. {_resize_fix(tokenizer, rows)}"
        )
    beyond = [i for i in range(rows, len(tokenizer)) if i != replaced]
    if beyond:
        shown = ", ".join(_token(tokenizer, i) for i in beyond[:5]) + (", ..." if len(beyond) > 5 else "")
        warnings.warn(
            f"the tokenizer has {len(beyond)} token(s) beyond the model's {rows} input embeddings ({shown}); no prompt "
            "measured at start holds one, but a prompt, chat template or system prompt that produced one would "
            f"stop the run. {_resize_fix(tokenizer, rows)}",
            stacklevel=2,
        )
    return eos


def check_prompt_ids(prompts: list[str], lengths: PromptLengths, tokenizer, model, name: str) -> None:
    """Refuse, naming the first prompt and its token, when a prompt holds an id beyond the model's
    input embeddings (a tokenizer that does not fit its model)."""
    rows = embedding_rows(model)
    if rows is None or lengths.highest is None:
        return
    bad = np.flatnonzero(lengths.highest >= rows)
    if bad.size:
        i = int(bad[0])
        ids = prompt_token_rows(tokenizer, [prompts[i]])[0]
        token = next(t for t in ids if t >= rows)
        raise ValueError(
            f"{name}: {bad.size} of {len(prompts)} prompts hold token ids beyond the model's {rows} input embeddings; "
            f"the first, prompt {i} ({prompts[i][:80]!r}), holds {_token(tokenizer, token)}. "
            f"{_resize_fix(tokenizer, rows)}"
        )


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
        check_prompt_ids(prompts, lengths, tokenizer, model, name)
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


# ------------------------------------------------------------------------------ model set-up
# Module types LoRA can wrap (peft's LoRA layers), by class name so that bitsandbytes and
# transformers' Conv1D need no import here.
_LORA_TYPES = ("Linear", "Linear4bit", "Linear8bitLt", "Conv1D", "Embedding", "Conv1d", "Conv2d")


def _lora_leaves(model) -> dict[str, str]:
    """{last name component: class name} of the modules LoRA can wrap (lm_head left out, as 'all-linear' does)."""
    return {
        name.rsplit(".", 1)[-1]: type(m).__name__
        for name, m in model.named_modules()
        if name and type(m).__name__ in _LORA_TYPES and not name.endswith("lm_head")
    }


def check_target_modules(model, targets) -> None:
    """Refuse lora_target_modules entries that match no module of `model`, or only modules LoRA cannot
    wrap, naming the closest module names (peft ignores an unmatched entry when another one matches:
    a typo'd 'q_prj' next to 'v_proj' would train only v_proj). Matching is peft's: a list entry
    matches a module whose name is it or ends in '.<entry>'; a string other than 'all-linear' is a
    regular expression over the whole name."""
    if targets is None or targets == "all-linear":
        return
    modules = [(name, type(m).__name__) for name, m in model.named_modules() if name]
    entries = [targets] if isinstance(targets, str) else list(targets)
    leaves = _lora_leaves(model)
    for entry in entries:
        if isinstance(targets, str):
            hits = [(n, t) for n, t in modules if re.fullmatch(entry, n)]
        else:
            hits = [(n, t) for n, t in modules if n == entry or n.endswith("." + entry)]
        wrappable = [h for h in hits if h[1] in _LORA_TYPES]
        if wrappable:
            continue
        key = entry.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(key, sorted(leaves), n=3, cutoff=0.5)
        what = (
            f"matches only {sorted({t for _, t in hits})} modules (e.g. {hits[0][0]}), which LoRA cannot wrap"
            if hits
            else "matches no module of this model"
        )
        raise ValueError(
            f"lora_target_modules entry {entry!r} {what}"
            + (f"; closest: {', '.join(map(repr, close))}" if close else "")
            + f". The layers LoRA can wrap here: {sorted(leaves)}. Use those names, or lora_target_modules: all-linear"
        )


def check_init_adapter(model, init_adapter: str, model_name: str | None = None) -> None:
    """Refuse an init_adapter saved for another model before peft loads it: a layer this model does
    not have (peft would drop its weights silently) or of other in/out sizes (peft's size-mismatch
    error). A local path that is no adapter, or a lora_grpo checkpoint dir, is named with what to pass."""
    path = Path(init_adapter).expanduser()
    if not path.exists():
        if init_adapter.startswith((".", "/", "~")) or len(Path(init_adapter).parts) > 2:
            raise ValueError(
                f"init_adapter={init_adapter!r} does not exist; pass a directory saved by "
                "save_pretrained / lora-grpo (it holds adapter_config.json)"
            )
        return  # a hub adapter id: peft downloads and checks it
    if not (path / "adapter_config.json").is_file():
        inside = [p.parent.name for p in sorted(path.glob("*/adapter_config.json"))]
        hint = (
            f"; it is a checkpoint or run directory: pass {str(path / 'policy')!r}"
            if "policy" in inside
            else f"; adapters inside it: {inside}"
            if inside
            else ""
        )
        raise ValueError(
            f"init_adapter={init_adapter!r} has no adapter_config.json, so it is not a peft adapter{hint}"
        )
    if missing_adapter_files(path):  # peft would take the directory for a hub id
        raise ValueError(
            f"init_adapter={init_adapter!r}: {path / ADAPTER_WEIGHTS} is missing, so it holds no adapter weights "
            "(a save that never finished, or a file deleted since); pass a directory holding both "
            f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        )
    check_adapter_fits(
        model,
        path,
        label=f"init_adapter={init_adapter!r}",
        base_given=(model_name, getattr(getattr(model, "config", None), "_name_or_path", None)),
        fix="Use an adapter trained on this base, or drop init_adapter",
    )
