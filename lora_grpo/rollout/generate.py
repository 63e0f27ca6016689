"""Rollout: sample G completions per prompt with the policy, batched and without gradients.

Each distinct prompt is prefilled once; its KV cache and last-position logits are then repeated
G times along the batch (prefix sharing), and a plain token-by-token sampling loop decodes all
P·G sequences together until every one has emitted EOS or ``max_completion_length`` is reached.
That loop runs eagerly (finished rows leave the batch) or, for torch.compile and CUDA graphs, with
fixed shapes over a static KV cache (:mod:`lora_grpo.rollout.fast_decode`); both draw the same
tokens. Each draw is :func:`lora_grpo.rollout.sampling.sample_next`.

With tools (:mod:`lora_grpo.rollout.tools`) a completion is several turns: when a row draws EOS, its
tool calls are parsed and run, and the reply's tokens (rendered by the chat template) are fed to the
model as if drawn, one per decode step, on the same KV cache and in the same decode batch as the rows
still sampling; no second prefill, nothing the model wrote re-tokenised. The row goes on sampling
after the reply, until a turn makes no call, ``max_tool_calling_iterations`` rounds are done, or
``max_completion_length`` (all turns and replies together) is spent. Without tools nothing changes:
the same tokens are drawn.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .fast_decode import StaticDecoder, resolve_decode_mode
from .sampling import NONFINITE_LOGITS, sample_next
from .tools import Toolbox, ToolEpisode, ToolTurns


@dataclass
class Rollout:
    """One generation batch. B = num_prompts · G; rows ``[g*G:(g+1)*G]`` are prompt g's group."""

    prompt_ids: Tensor  # (B, P) long, left-padded with pad_token_id
    prompt_mask: Tensor  # (B, P) long, 1 on real prompt tokens
    completion_ids: Tensor  # (B, T) long, pad_token_id after the first EOS
    completion_mask: Tensor  # (B, T) long, 1 up to and including the first EOS
    truncated: Tensor  # (B,) bool, no EOS within max_completion_length
    prompts: list[str]  # (B,) prompt text, repeated G times, groups contiguous
    completions: list[str]  # (B,) decoded completion text, special tokens skipped
    # (B, T) float32: log-prob of each sampled token under the distribution it was drawn from
    # (after penalty, temperature and filters); 0 for greedy decoding and where the mask is 0.
    sampling_logprobs: Tensor | None = None
    # With tools only (None without): the loss counts what the policy chose, not what tools wrote.
    tool_mask: Tensor | None = (
        None  # (B, T) long, 1 on drawn completion tokens, 0 on tool-reply tokens and padding
    )
    messages: list[list[dict]] | None = None  # (B,) the completion as chat messages: assistant turns (with
    #   "tool_calls" where they called), {"role": "tool", "name", "content"} replies; TRL's conversational completions
    tool_calls: Tensor | None = None  # (B,) long, tool calls run per completion (failed ones included)
    tool_failures: Tensor | None = (
        None  # (B,) long, calls that raised, timed out, or could not be parsed or found
    )

    def to(self, device) -> Rollout:
        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), Tensor) else v)
            for f in fields(self)
        }
        return Rollout(**moved)

    def rows(self, index: Tensor) -> Rollout:
        """The rows ``index`` (1-D long), in that order: every per-row field, tensors and lists alike."""
        picked = index.tolist()
        return Rollout(
            **{
                f.name: v
                if (v := getattr(self, f.name)) is None
                else v[index.to(v.device)]
                if isinstance(v, Tensor)
                else [v[i] for i in picked]
                for f in fields(self)
            }
        )

    @staticmethod
    def concat(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
        """Rollouts of different lengths as one: prompts left-padded to the longest prompt, completions
        right-padded to the longest completion (pad_token_id, mask 0, log-prob 0), rows in order."""
        if len(rollouts) == 1:
            return rollouts[0]
        P = max(r.prompt_ids.shape[1] for r in rollouts)
        T = max(r.completion_ids.shape[1] for r in rollouts)

        def join(name: str):
            values = [getattr(r, name) for r in rollouts]
            if any(v is None for v in values):
                return None
            if not isinstance(values[0], Tensor):
                return [x for v in values for x in v]
            if values[0].ndim == 1:
                return torch.cat(values)
            prompt_side = name in ("prompt_ids", "prompt_mask")
            width, fill = (P, pad_token_id if name == "prompt_ids" else 0) if prompt_side else (T, 0)
            if name == "completion_ids":
                fill = pad_token_id
            padded = [
                torch.nn.functional.pad(
                    v, (width - v.shape[1], 0) if prompt_side else (0, width - v.shape[1]), value=fill
                )
                for v in values
            ]
            return torch.cat(padded)

        return Rollout(**{f.name: join(f.name) for f in fields(Rollout)})

    @property
    def input_ids(self) -> Tensor:  # (B, P+T)
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # (B, P+T)
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def completion_lengths(self) -> Tensor:  # (B,) long
        return self.completion_mask.sum(1)


# ---------------------------------------------------------------------------------------------
# Model plumbing


def _forward_params(model) -> set[str]:
    """Keyword names the underlying transformers model's forward accepts (peft forwards kwargs)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


def _cache_keyword(model) -> str:
    """The forward's KV cache argument: ``cache`` in transformers 5, ``past_key_values`` before."""
    return "cache" if "cache" in _forward_params(model) else "past_key_values"


def _cache_of(out):
    """The KV cache a forward returned: ``out.cache`` in transformers 5, ``past_key_values`` before."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def eos_token_ids(model, tokenizer) -> list[int]:
    """The token ids that end a completion: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([config_eos] if isinstance(config_eos, int) else (config_eos or []))
    if not ids:
        raise ValueError(
            "no EOS token: the tokenizer has none (tokenizer.eos_token_id is None) and the model's "
            "generation_config.eos_token_id is not set, so no completion could ever stop; set "
            "tokenizer.eos_token = '<the token that ends an answer>' or "
            "model.generation_config.eos_token_id = <its id>"
        )
    return sorted(ids)


def special_token_ids(model, tokenizer) -> list[int]:
    """The EOS ids, after checking that the tokenizer can pad and completions can end (ValueError
    saying what to set otherwise). Every rollout checks; startup.check_special_tokens also checks
    the ids against the model's embeddings."""
    ids = eos_token_ids(model, tokenizer)
    if tokenizer.pad_token_id is None:
        # with no EOS of the tokenizer's own, pad_token = eos_token sets nothing: name the generation config's
        fix = (
            "tokenizer.pad_token = tokenizer.eos_token (lora_grpo.model.load.load_tokenizer does)"
            if tokenizer.eos_token is not None
            else f"tokenizer.pad_token = {tokenizer.convert_ids_to_tokens(ids[0])!r} (the model's "
            f"generation_config.eos_token_id {ids[0]}; the tokenizer has no eos_token)"
        )
        raise ValueError(
            f"the tokenizer has no pad token (tokenizer.pad_token_id is None); set one, e.g. {fix}"
        )
    return ids


def context_limit(model_or_config) -> int | None:
    """The most tokens (prompt + completion) the model takes: its config's ``max_position_embeddings``,
    or its text config's (multimodal models), times a YaRN factor where the config extends it so without
    raising max_position_embeddings (Qwen2.5's model cards: rope_scaling yarn, factor 4 over 32768 gives
    131072); None when it declares no such limit."""
    config = getattr(model_or_config, "config", model_or_config)
    for cfg in (config, config.get_text_config()):
        limit = getattr(cfg, "max_position_embeddings", None)
        if isinstance(limit, int) and limit > 0:
            rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
            kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
            original = rope.get("original_max_position_embeddings", limit) if kind == "yarn" else None
            if original == limit and isinstance(rope.get("factor"), (int, float)) and rope["factor"] > 1:
                return int(rope["factor"] * limit)
            return limit
    return None


def has_response_parser(tokenizer) -> bool:
    """Whether the tokenizer reads a response into a message: a ``response_template``, or the older
    ``response_schema`` (a tokenizer a TRL tool run saved carries one)."""
    return any(
        getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema")
    )


def response_messages(
    tokenizer, completions: list[list[int]], prefixes: list[list[int]], chat: list[bool]
) -> list[list[dict] | None] | None:
    """Each chat row's completion as the assistant message the tokenizer's response parser reads from its tokens
    (reasoning_content beside content, tool_calls), as TRL builds a conversational completion when the tokenizer
    has one; a completion it cannot parse is its decoded text, as in TRL. None without a parser (the rows'
    decoded text is the content); None for a text prompt's row."""
    if not has_response_parser(tokenizer):
        return None
    template = getattr(tokenizer, "response_template", None) is not None
    out = []
    for ids, prefix, is_chat in zip(completions, prefixes, chat, strict=True):
        if not is_chat:
            out.append(None)
            continue
        try:
            parsed = (
                tokenizer.parse_response(ids, prefix=prefix) if template else tokenizer.parse_response(ids)
            )
            if parsed is None:  # cut so short that not even its content is left
                raise ValueError("parse_response returned None")
            content = parsed.get("content")
            if isinstance(content, str) and tokenizer.eos_token:
                content = content.removesuffix(tokenizer.eos_token)
            parsed = {"role": "assistant", **parsed, "content": content or ""}
        except (ValueError, TypeError):
            parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        out.append([parsed])
    return out


def check_prompt_lengths(
    prompts: list[str], lengths: list[int], max_completion_length: int, limit: int, can_cut: bool = True
) -> None:
    """ValueError naming the first prompt whose length (tokens, as the rollout cuts it) + max_completion_length
    exceeds the model's context `limit`. can_cut: the config cuts prompts (max_prompt_length set), so the
    advice may be to cut them shorter (the TRL front door's GRPOConfig has no max_prompt_length)."""
    too_long = [i for i, n in enumerate(lengths) if n + max_completion_length > limit]
    if too_long:
        i = too_long[0]
        shown = repr(prompts[i][:80]) + ("..." if len(prompts[i]) > 80 else "")
        raise ValueError(
            f"{len(too_long)} of {len(prompts)} prompts do not fit the model's context of {limit} tokens "
            f"(max_position_embeddings) with max_completion_length={max_completion_length}; the first, "
            f"prompt {i} ({shown}), has {lengths[i]} tokens. "
            + (
                f"Set max_prompt_length to at most {limit - max_completion_length} (long prompts are then "
                "left-truncated), filter such prompts out of the dataset, or lower max_completion_length"
                if can_cut
                else "Filter such prompts out of the dataset (dataset.filter) or lower max_completion_length"
            )
        )


def prompt_token_rows(tokenizer, prompts: list[str], chat: Sequence[bool] | None = None) -> list[list[int]]:
    """Each prompt's token ids as the rollout feeds them, before any cut. ``chat``: per prompt, whether the
    chat template rendered it (None: none did)."""
    # A rendered chat template carries the special tokens it wants, so add none (as TRL, and transformers'
    # apply_chat_template(tokenize=True)); a plain-text prompt to a model that expects BOS (Llama, Gemma)
    # gets one, once.
    rows = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer("a")["input_ids"][:1] == [bos]:
        text = [True] * len(rows) if chat is None else [not c for c in chat]
        rows = [[bos] + r if plain and r[:1] != [bos] else r for r, plain in zip(rows, text, strict=True)]
    if any(len(r) == 0 for r in rows):
        raise ValueError("a prompt tokenized to zero tokens; there is nothing to condition on")
    return rows


def tokenize_prompts(
    tokenizer, prompts: list[str], max_prompt_length: int | None, chat: Sequence[bool] | None = None
) -> tuple[Tensor, Tensor]:
    """-> (ids (N, P), mask (N, P)), left-padded, each prompt cut to its last max_prompt_length tokens
    (``chat``: :func:`prompt_token_rows`)."""
    rows = prompt_token_rows(tokenizer, prompts, chat)
    if max_prompt_length is not None:
        n_cut = sum(len(r) > max_prompt_length for r in rows)
        if n_cut:
            warnings.warn(
                f"{n_cut} of {len(rows)} prompts are longer than max_prompt_length={max_prompt_length} "
                "tokens and were left-truncated (their first tokens dropped); raise max_prompt_length "
                "to keep them whole.",
                stacklevel=3,
            )
            rows = [r[-max_prompt_length:] for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _take_rows(cache, rows: Tensor) -> None:
    """Keep the cache's rows ``rows``, in that order, in every layer (a row named twice is repeated).
    reorder_cache is the row operation every cache layer has (beam search calls it): the key and value
    layers, and the convolution and recurrent states of hybrid models (Qwen3.5, LFM2, Jamba, ...), where
    batch_repeat_interleave and batch_select_indices are missing or reach only the attention part."""
    cache.reorder_cache(rows)


def _prefill(model, ids, mask, *, G, sampling, every_slot=False):
    """Prefill the n distinct prompts of (ids, mask), (n, P) each, once; repeat for their G samples.
    -> (KV cache of N = n·G rows, last logits (N, V), padding mask (N, P'), next position (N,),
    seen-token mask (N, V) bool or None), P' <= P after dropping columns that only pad.
    ``every_slot``: a cache that keeps all P' prompt slots in every layer, for the static decode to copy
    (the model's own keeps only the window of a sliding layer; the window is masked either way)."""
    # Drop leading columns that are padding in every row of this chunk: less prefill work.
    first = int((mask.sum(0) > 0).nonzero()[0])
    ids, mask = ids[:, first:], mask[:, first:]
    extra = {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(model) else {}
    # Positions count real tokens only, so a left-padded prompt gets the same positions as it
    # would alone (as transformers' generate does).
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    if every_slot:
        from transformers import DynamicCache

        # a cache of plain layers (none sliding), filled as the model runs
        extra[_cache_keyword(model)] = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **extra)
    cache = _cache_of(out)
    # Share the prefix: the G samples of a prompt start from the same KV cache and logits.
    _take_rows(cache, torch.arange(ids.size(0), device=ids.device).repeat_interleave(G))
    logits = out.logits[:, -1].repeat_interleave(G, 0)  # (N, V), N = n·G
    attn = mask.repeat_interleave(G, 0)
    next_pos = mask.sum(1).repeat_interleave(G, 0)  # (N,) position of the next token
    seen = None
    if sampling["repetition_penalty"] != 1.0:
        # Count real prompt tokens per vocab id (pads add 0); scatter_add is order-independent.
        counts = torch.zeros(logits.shape, dtype=torch.long, device=logits.device)
        seen = counts.scatter_add_(1, ids.repeat_interleave(G, 0), attn) > 0  # (N, V) bool
    return cache, logits, attn, next_pos, seen


def _sample_tokens(
    logits, seen, advance, *, max_new, eos_ids, pad_id, sampling, generator, turns=None, overwrite=False
) -> tuple[Tensor, Tensor]:
    """The sampling loop both samplers share. ``logits`` (N, V): the first token's; ``seen``: the
    repetition-penalty mask (N, V) or None. Each step draws one token per row still decoding, then
    asks ``advance(keep, tok)`` for the next logits of the rows left: ``keep`` indexes the rows that
    did not just finish (None when none did), ``tok`` their tokens. The draws depend only on these
    logits and the generator, so samplers that compute them differently draw the same tokens.
    ``turns`` (a :class:`ToolTurns`, with tools) replaces the draws of rows inside a tool reply by the
    reply's tokens and decides which rows a drawn EOS finishes (one that called a tool goes on).
    ``overwrite``: the logits ``advance`` returns are the sampler's to overwrite (sample_next).
    -> (tokens (N, T), log-probs (N, T)) with T <= max_new; pad_id after a row's end."""
    eos = torch.tensor(eos_ids, device=logits.device)
    N = logits.size(0)
    tokens = torch.full((N, max_new), pad_id, dtype=torch.long, device=logits.device)
    logps = torch.zeros((N, max_new), dtype=torch.float32, device=logits.device)
    rows = torch.arange(N, device=logits.device)  # output row of each sequence still decoding
    for step in range(max_new):
        # The first logits (the prefill's, repeated per sample) are a copy of their own in both samplers.
        tok, logp = sample_next(
            logits, seen, generator=generator, overwrite=overwrite or step == 0, **sampling
        )
        if turns is not None:
            tok, logp = turns.force(rows, step, tok, logp)
        tokens[rows, step] = tok
        logps[rows, step] = logp
        if turns is None:
            done = torch.isin(tok, eos)
            finished = int(done.sum())  # the loop's one device sync per token
        else:  # (its one sync: turns' ends, counted)
            done, finished = turns.end_turns(rows, step, tok, tokens)
        if finished == done.numel() or step == max_new - 1:
            break
        keep = None
        if finished:
            # its size known on the host already: no second sync
            keep = torch.nonzero_static(~done, size=done.numel() - finished).squeeze(1)
            rows, tok = rows[keep], tok[keep]
            seen = None if seen is None else seen[keep]
        if seen is not None:
            seen.scatter_(1, tok[:, None], True)
        logits = advance(keep, tok)
    return tokens[:, : step + 1], logps[:, : step + 1]


def _decode_chunk(
    model, ids, mask, *, G, max_new, eos_ids, pad_id, sampling, generator, turns=None
) -> tuple[Tensor, Tensor]:
    """The eager sampler. Sample G completions for each of the n prompts in (ids, mask): (n, P)
    each, left-padded. -> (tokens (n·G, T), log-probs (n·G, T)) with T <= max_new; pad_id after a
    row's first EOS."""
    cache_kw = _cache_keyword(model)
    cache, logits, attn, next_pos, seen = _prefill(model, ids, mask, G=G, sampling=sampling)

    def advance(keep, tok):
        nonlocal cache, attn, next_pos
        if keep is not None:
            # Drop finished sequences from the batch and the cache: no compute on rows that only pad.
            attn, next_pos = attn[keep], next_pos[keep]
            _take_rows(cache, keep)
        attn = torch.cat([attn, attn.new_ones(attn.size(0), 1)], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=attn,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{cache_kw: cache},
        )
        cache, next_pos = _cache_of(out), next_pos + 1
        return out.logits[:, -1]

    return _sample_tokens(
        logits,
        seen,
        advance,
        max_new=max_new,
        eos_ids=eos_ids,
        pad_id=pad_id,
        sampling=sampling,
        generator=generator,
        turns=turns,
        overwrite=True,
    )  # each forward's logits are new


def _decode_chunk_static(
    model, ids, mask, *, G, max_new, eos_ids, pad_id, sampling, generator, compiled, turns=None
) -> tuple[Tensor, Tensor]:
    """The fixed-shape sampler (:mod:`lora_grpo.rollout.fast_decode`): same arguments and result as
    :func:`_decode_chunk`, and the same tokens under the same generator. All N rows run every step
    (finished ones feed pad, their outputs unused); the draws see only the rows still decoding, as
    in the eager sampler (:func:`_sample_tokens`)."""
    cache, logits, attn, next_pos, seen = _prefill(model, ids, mask, G=G, sampling=sampling, every_slot=True)
    decoder = StaticDecoder(model, cache, attn, max_new, compiled=compiled)
    del cache  # its KV now lives in the decoder's static cache
    N = logits.size(0)
    rows = torch.arange(N, device=logits.device)  # cache row of each sequence still decoding

    def advance(keep, tok):
        nonlocal rows, next_pos
        if keep is not None:
            rows = rows[keep]
        feed = torch.full((N,), pad_id, dtype=torch.long, device=tok.device)
        feed[rows] = tok
        out = decoder.step(feed, next_pos)
        next_pos = next_pos + 1
        return out if rows.numel() == N else out[rows]  # index only once a row has finished

    return _sample_tokens(
        logits,
        seen,
        advance,
        max_new=max_new,
        eos_ids=eos_ids,
        pad_id=pad_id,
        sampling=sampling,
        generator=generator,
        turns=turns,
    )


def _pad_right(x: Tensor, width: int, value) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.size(1)), value=value)


def generate_rollout(
    model,
    tokenizer,
    prompts: list[str],
    *,
    num_generations: int,
    max_prompt_length: int | None,
    max_completion_length: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
    micro_batch_prompts: int | None = None,
    decode_mode: str = "eager",
    tools: Toolbox | ToolEpisode | None = None,
    max_tool_calling_iterations: int | None = None,
    chat: Sequence[bool] | None = None,
) -> Rollout:
    """Sample ``num_generations`` completions for each prompt (already-rendered text; ``chat``: per prompt,
    whether the chat template rendered it, which then gets no BOS beyond the template's own; None: none did).

    Returns a Rollout of B = len(prompts) · num_generations rows, groups contiguous. The model
    (a transformers causal LM or a peft wrapper of one) runs in eval mode, so LoRA dropout is off;
    every module's training flag is restored afterwards. ``micro_batch_prompts`` caps how many
    prompts (times G sequences) are decoded at once. ``generator`` must live on the model's device.

    ``decode_mode`` picks the sampler, all drawing the same tokens from the same generator:
    "eager" (a growing KV cache; finished rows leave the batch), "static" (a fixed-shape static
    cache, :mod:`lora_grpo.rollout.fast_decode`), "compiled" ("static" with the step under torch.compile:
    CUDA graphs on CUDA), or "auto" ("compiled" on CUDA, "eager" elsewhere). A model that cannot
    decode statically or compile is sampled eagerly, with one logged line saying why.

    ``tools``: a :class:`~lora_grpo.rollout.tools.Toolbox` (an episode of B rows is made from it: its
    environments reset without fields) or a :class:`~lora_grpo.rollout.tools.ToolEpisode` of B rows
    (row b is completion b). Then each completion may call tools, up to
    ``max_tool_calling_iterations`` rounds (None: no limit), within ``max_completion_length`` tokens
    in all, replies included; the Rollout's ``tool_mask``, ``messages``, ``tool_calls`` and
    ``tool_failures`` say what was drawn, said and run. Prompts should be rendered with the tools
    (:meth:`Toolbox.render_prompt`).

    Raises ValueError (before any model call) when the tokenizer has no pad or EOS token, or when
    a prompt (after ``max_prompt_length`` truncation) plus ``max_completion_length`` exceeds the
    model's context (:func:`context_limit`).
    """
    if num_generations < 1 or max_completion_length < 1:
        raise ValueError("num_generations and max_completion_length must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or not 0 <= min_p <= 1 or repetition_penalty <= 0:
        raise ValueError("invalid sampling parameters")
    G, pad_id = num_generations, tokenizer.pad_token_id
    eos_ids = special_token_ids(model, tokenizer)
    episode = tools.episode(len(prompts) * G) if isinstance(tools, Toolbox) else tools
    if episode is not None and len(episode) != len(prompts) * G:
        raise ValueError(
            f"the tool episode has {len(episode)} rows; the rollout has {len(prompts)} prompts x {G}"
        )
    device = next(model.parameters()).device
    sampling = dict(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty
    )
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, chat)
    limit = context_limit(model)
    if limit is not None:  # a clear error here, not an index error deep inside the model
        check_prompt_lengths(prompts, prompt_mask.sum(1).tolist(), max_completion_length, limit)
    chunk = micro_batch_prompts or len(prompts)
    mode = resolve_decode_mode(decode_mode, model, device)
    decode = (
        _decode_chunk
        if mode == "eager"
        else functools.partial(_decode_chunk_static, compiled=mode == "compiled")
    )

    training = [
        m for m in model.modules() if m.training
    ]  # their flags go back afterwards (none: the trainer's model)
    if training:
        model.eval()
    parts, turns = [], []
    try:
        with torch.no_grad():
            for i in range(0, len(prompts), chunk):
                ids, mask = prompt_ids[i : i + chunk].to(device), prompt_mask[i : i + chunk].to(device)
                if episode is not None:
                    rows = [r[m.bool()].tolist() for r, m in zip(ids, mask) for _ in range(G)]
                    turns.append(
                        ToolTurns(
                            episode,
                            offset=i * G,
                            prompts=rows,
                            max_new=max_completion_length,
                            stop_ids=eos_ids,
                            max_iterations=max_tool_calling_iterations,
                            device=device,
                        )
                    )
                parts.append(
                    decode(
                        model,
                        ids,
                        mask,
                        G=G,
                        max_new=max_completion_length,
                        eos_ids=eos_ids,
                        pad_id=pad_id,
                        sampling=sampling,
                        generator=generator,
                        turns=turns[-1] if turns else None,
                    )
                )
    finally:
        for m in training:
            m.training = True

    T = max(t.size(1) for t, _ in parts)
    completion_ids = torch.cat([_pad_right(t, T, pad_id) for t, _ in parts])
    sampling_logprobs = torch.cat([_pad_right(lp, T, 0.0) for _, lp in parts])
    extra = {}
    if episode is None:
        is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
        # 1 on tokens with no EOS strictly before them: up to and including the first EOS.
        completion_mask = ((is_eos.long().cumsum(1) - is_eos.long()) == 0).long()
        truncated = ~is_eos.any(1)
    else:  # EOS also ends the turns before a tool reply: a completion ends where its loop ended
        ends = [t.finish(tokens) for t, (tokens, _) in zip(turns, parts)]
        lengths = torch.cat([n for n, _, _ in ends])
        completion_mask = (torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]).long()
        truncated = torch.cat([tr for _, _, tr in ends])
        extra = dict(
            tool_mask=torch.cat([_pad_right(m, T, 0) for _, m, _ in ends]),
            messages=[m for t in turns for m in t.messages],
            tool_calls=torch.tensor([c for t in turns for c in t.calls], device=device),
            tool_failures=torch.tensor([c for t in turns for c in t.failures], device=device),
        )
    # a greedy draw over overflowed logits (sample_next: a NaN log-prob; a sampled one raises in multinomial), checked
    # for greedy rollouts alone: a training rollout pays no device sync for it
    if temperature == 0 and not bool(torch.isfinite(sampling_logprobs[completion_mask.bool()]).all()):
        raise RuntimeError(
            f"{NONFINITE_LOGITS} while decoding greedily: a token drawn from them means nothing (in float16, "
            "activations past ±65504)"
        )
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id)
    # on the host in one transfer each: row by row, each boolean index and tolist was a device sync (2 a completion)
    host_ids, host_mask = completion_ids.cpu(), completion_mask.cpu().bool()
    kept = [row[m].tolist() for row, m in zip(host_ids, host_mask)]
    if episode is None and chat is not None and any(chat) and has_response_parser(tokenizer):
        prefixes = [row[m].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu().bool())]
        extra["messages"] = response_messages(
            tokenizer, kept, [p for p in prefixes for _ in range(G)], [c for c in chat for _ in range(G)]
        )
    return Rollout(
        prompt_ids=prompt_ids.to(device).repeat_interleave(G, 0),
        prompt_mask=prompt_mask.to(device).repeat_interleave(G, 0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
        prompts=[p for p in prompts for _ in range(G)],
        completions=tokenizer.batch_decode(kept, skip_special_tokens=True),
        sampling_logprobs=sampling_logprobs * completion_mask,
        **extra,
    )
