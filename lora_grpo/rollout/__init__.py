"""Rollout: sampling G completions per prompt with the policy (no gradients) → a :class:`Rollout`.

generate     the sampler: prompts tokenised and prefilled once per prompt, G samples decoded
             together (:func:`generate_rollout`); the :class:`Rollout` it returns
sampling     one draw from (N, V) logits: repetition penalty, temperature, top-k/top-p/min-p
fast_decode  the fixed-shape decode (static KV cache, torch.compile / CUDA graphs)
compile_cache  what torch.compile built for the decode, kept per machine under lora_grpo's cache
             directory, so a later run does not compile it again
tools        tool calls inside a rollout: :class:`Toolbox` (tools, schemas, the template check,
             parsing, replies), :class:`ToolEpisode` (one rollout's tools and environments),
             :func:`tool_metrics`
"""

from .generate import (
    Rollout,
    check_prompt_lengths,
    context_limit,
    eos_token_ids,
    generate_rollout,
    prompt_token_rows,
    special_token_ids,
    tokenize_prompts,
)
from .sampling import (
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    sample_next,
    warp_logits,
)
from .tools import (
    TOOL_CALL_FORMATS,
    Toolbox,
    ToolEpisode,
    check_tool_template,
    non_text_block,
    parse_tool_calls,
    reply_ids,
    tool_metrics,
    tool_schema,
    with_observation,
)

__all__ = [
    "Rollout",
    "TOOL_CALL_FORMATS",
    "ToolEpisode",
    "Toolbox",
    "apply_min_p",
    "apply_repetition_penalty",
    "apply_top_k",
    "apply_top_p",
    "check_prompt_lengths",
    "check_tool_template",
    "context_limit",
    "eos_token_ids",
    "generate_rollout",
    "non_text_block",
    "parse_tool_calls",
    "prompt_token_rows",
    "reply_ids",
    "sample_next",
    "special_token_ids",
    "tokenize_prompts",
    "tool_metrics",
    "tool_schema",
    "warp_logits",
    "with_observation",
]
