"""Start-up checks, in one place: everything a run can refuse before its first rollout.

    prompts      tokenised once: each prompt's length as the rollout cuts it (max_prompt_length)
    context      the longest real prompt + max_completion_length against the model's context
    tokens       the tokenizer can pad and end a completion; every id the run feeds (pad, EOS, BOS,
                 each prompt's tokens) fits the model's input embeddings
    generation   the model's generation_config asks for no logits processor the sampler does not apply
    rewards      every reward function can take the dataset columns it is called with
    log-probs    the chunked log-probs reproduce the model's own logits (both adapters)

The checks read what the run will really hold, never a configured maximum: a recipe whose prompts
are 6 tokens runs on a 64-token model whatever max_prompt_length says. Each failure is a
ValueError that names the prompt, token, column, module or model type and the fix.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .algo.logprobs import sequence_log_probs
from .data.prompts import PROMPT_MESSAGES, chat_rendered
from .model.adapters import POLICY, REFERENCE, use_adapter
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


def prompt_lengths(
    tokenizer, prompts: list[str], max_prompt_length: int | None, chat: list[bool] | None = None
) -> PromptLengths:
    """Tokenise the prompts once (in batches; no padded tensor) and return their lengths as cut (``chat``: per
    prompt, whether the chat template rendered it; None: none did)."""
    if max_prompt_length is not None and len(prompts) > PROMPT_SCAN_LIMIT:
        return PromptLengths(np.array([max_prompt_length]), 0, scanned=False)
    raw, highest = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for i in range(0, len(prompts), 4096):
        rows = prompt_token_rows(
            tokenizer, prompts[i : i + 4096], None if chat is None else chat[i : i + 4096]
        )
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
    prompts: list[str], lengths: PromptLengths, max_completion_length: int, model, name: str, can_cut: bool
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
    check_prompt_lengths(prompts, lengths.lengths.tolist(), max_completion_length, limit, can_cut)


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


# generation_config fields that make transformers' generate (TRL's sampler) add a logits processor which
# lora_grpo's sampler does not have (it applies repetition_penalty, temperature, top_k, top_p, min_p and EOS)
UNAPPLIED_GENERATION_FIELDS = (
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "sequence_bias",
    "no_repeat_ngram_size",
    "min_length",
    "min_new_tokens",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "top_h",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "guidance_scale",
    "watermarking_config",
)


def check_generation_config(model) -> None:
    """Refuse a model whose generation_config sets a logits processor the sampler would ignore: generate fills
    every field a GenerationConfig leaves unset from the model's (TRL's sampling applies them); dropping one
    silently would train on draws from another distribution."""
    from transformers import GenerationConfig

    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        return
    off = GenerationConfig._get_default_generation_params()
    set_ = {
        name: value
        for name in UNAPPLIED_GENERATION_FIELDS
        if (value := getattr(generation_config, name, None)) is not None
        and value != off.get(name)
        and not (name == "guidance_scale" and value == 1)
    }
    if set_:
        settings = ", ".join(f"{name}={value!r}" for name, value in set_.items())
        fix = "; ".join(f"model.generation_config.{name} = None" for name in set_)
        raise ValueError(
            f"the model's generation_config sets {settings}: transformers' generate (TRL's sampler) applies it, "
            "but lora_grpo's sampler applies repetition_penalty, temperature, top_k, top_p, min_p and the EOS "
            f"tokens only, so it would sample from another distribution. Set {fix} before handing the model to "
            "the trainer (or remove it from the model's generation_config.json)"
        )


def check_prompt_ids(
    prompts: list[str], lengths: PromptLengths, tokenizer, model, name: str, chat: list[bool] | None = None
) -> None:
    """Refuse, naming the first prompt and its token, when a prompt holds an id beyond the model's
    input embeddings (a tokenizer that does not fit its model)."""
    rows = embedding_rows(model)
    if rows is None or lengths.highest is None:
        return
    bad = np.flatnonzero(lengths.highest >= rows)
    if bad.size:
        i = int(bad[0])
        ids = prompt_token_rows(tokenizer, [prompts[i]], None if chat is None else chat[i : i + 1])[0]
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
        messages = ds[PROMPT_MESSAGES] if PROMPT_MESSAGES in ds.column_names else None
        prompts, chat = list(ds["prompt"]), chat_rendered(messages, len(ds), config.use_chat_template)
        lengths = prompt_lengths(tokenizer, prompts, config.max_prompt_length, chat)
        check_context(
            prompts, lengths, config.max_completion_length, model, name, config.max_prompt_length is not None
        )
        check_prompt_ids(prompts, lengths, tokenizer, model, name, chat)
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


# ------------------------------------------------------------------------------ log-probs against the model's logits
# check_log_probs tolerance. Both paths run the same decoder body on the same inputs, so the hidden
# states agree exactly; they differ only in how the LM head's output is rounded. The model rounds each
# logit to its dtype (for bf16 / fp16 our head keeps float32, _head_logits: half a unit in the last
# place, eps/2·|z|; in float32 both round, from different matmul shapes and so possibly different
# accumulation orders: one unit, eps·|z|). The model also rounds after each of its own post-head
# operations (a scale, a softcap's divide/tanh/multiply), which we compute in float32.
# log p = z_target − logsumexp(z), and each term moves by about that much, so the tolerance grows
# with the largest |logit| / temperature:
#   atol = _ATOL_FLOOR + k · eps(dtype) · max|z|
# float32: eps = 1.2e-7, so ≈ 1e-3 for any realistic logits — three orders of magnitude above the
#   accumulation-order noise, far below any real transform (a missing ×4 was 0.83 nats).
# float16 / bfloat16: k = 4 (eps = 2⁻¹⁰ / 2⁻⁷): bf16 logits up to 30 give ≈ 0.94 nats; a missing
#   softcap of 30 there moves the top logit by 7 nats, a missing ×4 or ÷8 by far more. Measured on
#   tiny bf16 HyperCLOVAX models (×3 and ×5, rounded by the model, exact here; 8 seeds):
#   0.22–0.60 · eps · max|z|, so k = 4 leaves a margin of 6 over that.
# 4/8-bit quantized bases: k = 8 — their linear layers choose kernels (and dequantisation order) by
#   input shape, so the head may round differently again.
_ATOL_FLOOR = 1e-3
_ULPS = {"float": 4.0, "quantized": 8.0}


def _coarsest_float_dtype(model: nn.Module) -> torch.dtype:
    # LoRA weights are float32 on a bf16 base, a 4-bit base's weights are uint8: the coarsest
    # floating dtype among the parameters is the one the forward rounds to.
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def _is_quantized(causal_lm: nn.Module) -> bool:
    return (
        getattr(causal_lm, "hf_quantizer", None) is not None
        or getattr(causal_lm, "is_loaded_in_4bit", False)
        or getattr(causal_lm, "is_loaded_in_8bit", False)
        or getattr(causal_lm.config, "quantization_config", None) is not None
    )


def check_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    completion_length: int | None = None,
    adapters: tuple[str, ...] = (POLICY, REFERENCE),
    temperature: float = 1.0,
    chunk_size: int = 1024,
    atol: float | None = None,
) -> float:
    """Check sequence_log_probs against log_softmax of the model's own logits; return the max |difference|.

    The load-time guarantee behind `_LOGIT_TRANSFORMS`: a model whose forward transforms its logits
    in a way that list does not know fails here instead of training on the wrong distribution.
    input_ids, attention_mask (B, L): a short batch laid out as in training (left-padded prompts,
    then completions); the last `completion_length` tokens (default L − 1) are compared wherever
    both the token and the position predicting it are real. Runs in eval mode under no_grad, once per
    adapter in `adapters` the (peft) model has — once as-is when it has none of them or is a plain
    transformers model — and restores every module's train/eval mode, the active adapter and all
    requires_grad flags. atol: None picks one from the model's dtype (see _ATOL_FLOOR).
    Raises ValueError, naming config.model_type, when the difference exceeds the tolerance.
    """
    length = input_ids.shape[1]
    completion_length = length - 1 if completion_length is None else completion_length
    if not 0 < completion_length < length:
        raise ValueError(f"completion_length must be in [1, {length - 1}], got {completion_length}")
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(causal_lm.config, "model_type", type(causal_lm).__name__)
    available = set(getattr(model, "peft_config", {})) if hasattr(model, "get_base_model") else set()
    names: list[str | None] = [name for name in adapters if name in available] or [None]
    # Compare only where the target token is real and so is the position that predicts it.
    real = (
        attention_mask[:, -completion_length:].bool() & attention_mask[:, -completion_length - 1 : -1].bool()
    )
    if not real.any():
        raise ValueError("check_log_probs needs at least one real completion token")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    targets = input_ids[:, -completion_length:]
    dtype = _coarsest_float_dtype(model)
    ulps = _ULPS["quantized" if _is_quantized(causal_lm) else "float"]

    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    worst = 0.0
    try:
        for name in names:
            with use_adapter(model, name) if name else nullcontext(), torch.no_grad():
                ours, _ = sequence_log_probs(
                    model,
                    input_ids,
                    attention_mask,
                    completion_length,
                    chunk_size=chunk_size,
                    temperature=temperature,
                )
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                )
                logits = out.logits[:, -completion_length - 1 : -1].float() / temperature
                if not torch.isfinite(logits[real]).all():
                    where = f" with adapter {name!r}" if name is not None else ""
                    raise ValueError(
                        f"the model's own logits are NaN/inf (model type {model_type!r}{where}, dtype "
                        f"{str(dtype).removeprefix('torch.')}): float16 overflows in many models (use "
                        "torch_dtype bfloat16 or float32), or the adapter weights (init_adapter) hold NaN/inf"
                    )
                theirs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                diff = (ours.float() - theirs)[real].abs().max().item()
                largest = logits[real].abs().max().item()
                del out, logits
            tolerance = atol if atol is not None else _ATOL_FLOOR + ulps * torch.finfo(dtype).eps * largest
            if not diff <= tolerance:  # NaN fails too
                where = f" with adapter {name!r}" if name is not None else ""
                raise ValueError(
                    f"lora_grpo's log-probs do not match this model's own logits (model type {model_type!r}{where}): "
                    f"max difference {diff:.4g} nats per token over {int(real.sum())} completion tokens, tolerance "
                    f"{tolerance:.3g} for {str(dtype).removeprefix('torch.')}. The model applies a transform "
                    "around its "
                    f"LM head (a logit scale, multiplier or softcap) that lora_grpo does not know, so training would "
                    f"optimise a different distribution from the one rollout samples; please report the model type "
                    f"{model_type!r} to lora_grpo."
                )
            worst = max(worst, diff)
    finally:
        for module, training in modes:
            module.training = training
    return worst
