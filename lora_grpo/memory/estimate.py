"""What a run needs on a GPU, computed from the model's shapes alone (its config: layers, heads, KV
heads, hidden, intermediate, vocab), without loading weights or measuring: the recipes' stated
figures (tests/test_recipes.py computes each and checks it against the header) and what
benchmarks/gpu_check.py compares the measured peaks with.

The start-up plan (memory/probe.py) measures the training pass; here it is estimated, and the same chooser
(memory.plan_memory, given `estimate=`) picks the sizes, so the 'auto' rules and the preflight are the
real ones. Everything else is the plan's own arithmetic: the rollouts and the compiled decode's kept
cache (memory.decode_memory, memory.rollout_shapes), the optimizer states. Added here: the weights
(4-bit: half a byte per body weight plus its quantisation constants; embeddings and an untied head
in the compute dtype), the adapters (policy at lora_r, reference slot at ref_rank, float32), and the
stated margin: SLACK (20%, the allocator's fragmentation and what the estimate misses) and the CUDA
context (CUDA_CONTEXT).

The training pass estimate, per token of m × (prompt + completion), for a Llama / Qwen2 layer with
every linear layer under LoRA (lora_target_modules all-linear; peft casts each LoRA input to float32)
and memory-efficient attention (no L × L scores on a GPU), in bytes with s = the compute dtype's size:

    one layer's saved activations  A = s·(11·hidden + 3·kv_heads·head_dim + 4·intermediate)
                                       + 4·(6·hidden + intermediate)
    without checkpointing          layers·A + A (the backward's activation gradients)
    with checkpointing             layers·s·hidden (each layer's input) + 2·A (one layer recomputed)
    plus the log-probs             the final hidden states, and 2 float32 (chunk, vocab) blocks and
                                   the head's weight slices cast to float32 (algo/logprobs.py)

It is an estimate: the GPU check prints it beside the measured pass (benchmarks/gpu_check.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..device import GiB
from ..model.load import QUANTIZED_WEIGHT_BYTES
from .probe import (
    MemoryPlan,
    decode_memory,
    optimizer_state_bytes,
    plan_memory,
    rollout_shapes,
)

SLACK = 1.2  # the README's stated margin: 20% on top of the plan ...
CUDA_CONTEXT = 0.5 * GiB  # ... and the CUDA context
_HEAD_CAST = 2**23 * 4  # logprobs._CAST_ELEMENTS of a bf16 head's weight cast to float32 at once


# Model types whose layers fuse q, k, v into one linear layer and gate, up into another (Phi-3's qkv_proj and
# gate_up_proj): the same weights, but LoRA adds its two factors to each fused layer once.
FUSED_PROJECTIONS = ("phi3",)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _kv_width(model_config) -> int:
    """Keys' (and values') width: KV heads × head dim."""
    cfg = model_config.get_text_config()
    return (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * _head_dim(cfg)


def _linear_shapes(model_config) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linear layers: q, k, v, o, gate, up, down (fused: qkv, o, gate_up,
    down)."""
    cfg = model_config.get_text_config()
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q = heads * _head_dim(cfg)
    kv, i = _kv_width(model_config), cfg.intermediate_size
    if cfg.model_type in FUSED_PROJECTIONS:
        return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def weight_bytes(model_config, quantization: str, dtype: torch.dtype) -> float:
    """The loaded base: body linear weights (4-bit: 0.5 byte + the double-quantised absmax, 64-weight
    blocks; 8-bit: 1 byte + a float32 scale per row; none: the dtype), embeddings, an untied head and
    the norms in the compute dtype."""
    cfg = model_config.get_text_config()
    s = torch.empty(0, dtype=dtype).element_size()
    linear = cfg.num_hidden_layers * sum(a * b for a, b in _linear_shapes(model_config))
    per_weight = {**QUANTIZED_WEIGHT_BYTES, "none": float(s)}[quantization]
    embeddings = (
        cfg.vocab_size * cfg.hidden_size * s * (1 if getattr(cfg, "tie_word_embeddings", True) else 2)
    )
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size * s
    return linear * per_weight + embeddings + norms


def lora_parameters(model_config, rank: int) -> int:
    """Parameters of one adapter of `rank` on every linear layer of the body (all-linear)."""
    return model_config.get_text_config().num_hidden_layers * sum(
        rank * (a + b) for a, b in _linear_shapes(model_config)
    )


def layer_activation_bytes(model_config, dtype: torch.dtype) -> float:
    """A: one layer's activations saved for backward, per token (the module docstring's formula)."""
    cfg = model_config.get_text_config()
    s = torch.empty(0, dtype=dtype).element_size()
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = _kv_width(model_config)
    return s * (11 * h + 3 * kv + 4 * i) + 4 * (6 * h + i)


def training_pass_bytes(
    model_config, m: int, tokens: tuple[int, int], checkpointing: bool, dtype: torch.dtype, chunk_size: int
) -> float:
    """Estimated peak of one training forward + backward of m sequences of tokens = (prompt, completion)."""
    cfg = model_config.get_text_config()
    s = torch.empty(0, dtype=dtype).element_size()
    n = m * sum(tokens)
    a = layer_activation_bytes(model_config, dtype)
    body = (
        (cfg.num_hidden_layers * s * cfg.hidden_size + 2 * a)
        if checkpointing
        else (cfg.num_hidden_layers + 1) * a
    )
    chunk = min(chunk_size, m * tokens[1])
    head = n * cfg.hidden_size * s + 2 * chunk * cfg.vocab_size * 4 + (_HEAD_CAST if s < 4 else 0)
    return n * body + head


def pass_estimate(
    model_config,
    dtype: torch.dtype,
    tokens: tuple[int, int],
    worst: tuple[int, int],
    chunk_size: int,
    attention_scores: bool = False,
) -> Callable[[int, bool], float]:
    """estimate(m, checkpointing): the larger of the training pass of m sequences of tokens and the
    no-grad log-prob forward at worst (the longest prompt, eval's included), as plan_memory's
    `estimate=` takes it. attention_scores: add the (heads, L, L) scores and probabilities each layer
    keeps for backward, as the CPU's attention kernel does (a GPU's memory-efficient one keeps none)."""
    cfg = model_config.get_text_config()
    s = torch.empty(0, dtype=dtype).element_size()

    def scores(m: int, on: bool, length: int) -> float:
        if not attention_scores:
            return 0.0
        layers = 2 if on else cfg.num_hidden_layers + 1
        return m * layers * 2 * cfg.num_attention_heads * length * length * s

    def estimate(m: int, on: bool) -> float:
        return max(
            training_pass_bytes(model_config, m, tokens, on, dtype, chunk_size) + scores(m, on, sum(tokens)),
            (
                training_pass_bytes(model_config, m, worst, True, dtype, chunk_size)
                + scores(m, True, sum(worst))
            )
            / 2,
        )

    return estimate


@dataclass
class RunMemory:
    """A run's GPU memory from shapes (bytes): what is resident once loaded, and the plan over it."""

    weights: float
    adapters: float
    plan: MemoryPlan

    @property
    def total(self) -> float:
        """Loaded model + the plan's predicted peak, with the stated margin (SLACK, CUDA_CONTEXT)."""
        return SLACK * (self.weights + self.adapters + self.plan.need) + CUDA_CONTEXT


def run_memory(
    config,
    model_config,
    gpu_bytes: float,
    *,
    dtype: torch.dtype = torch.bfloat16,
    mode: str = "compiled",
    longest_prompt: int | None = None,
    eval_longest_prompt: int | None = None,
    micro_batch_size: int | str | None = None,
    gradient_checkpointing: bool | str | None = None,
) -> RunMemory:
    """The plan a run of `config` on a model of `model_config` would make on a GPU of `gpu_bytes`, with
    the pass estimated (training_pass_bytes) and the decode of `mode` (resolved: eager / static /
    compiled). Prompts default to max_prompt_length (the worst case the rollout cuts to); an eval set
    is assumed when the config has one. micro_batch_size: the config's unless given (1 gives the
    smallest footprint, the figure a recipe states). Raises memory.MemoryBudgetError when it does not
    fit, as the start-up preflight would."""
    longest = longest_prompt or config.max_prompt_length
    eval_longest = eval_longest_prompt or (config.max_prompt_length if config.eval_dataset else None)
    tokens = (longest, config.max_completion_length)
    weights = weight_bytes(model_config, config.quantization, dtype)
    policy = lora_parameters(model_config, config.lora_r)
    adapters = 4.0 * (policy + lora_parameters(model_config, config.ref_rank))
    vocab, device = model_config.get_text_config().vocab_size, torch.device("cuda")
    rollout, kept = decode_memory(
        model_config, rollout_shapes(config, longest, eval_longest), dtype, vocab, mode, device
    )
    eval_tokens = (eval_longest or 0, config.max_completion_length)
    worst = max(tokens, eval_tokens, key=sum)

    estimate = pass_estimate(model_config, dtype, tokens, worst, config.logprob_chunk_size)
    available = gpu_bytes - CUDA_CONTEXT - weights - adapters
    plan = plan_memory(
        None,
        lambda on: None,
        batch=config.step_batch,
        rollout_sequences=config.generation_batch,
        micro_batch_size=config.micro_batch_size if micro_batch_size is None else micro_batch_size,
        gradient_checkpointing=config.gradient_checkpointing
        if gradient_checkpointing is None
        else gradient_checkpointing,
        budget_fraction=config.memory_budget,
        available=(available, "GPU memory left once the model is loaded"),
        optimizer=optimizer_state_bytes([torch.empty(policy, device="meta")], config.optimizer),
        rollout=rollout,
        kept=kept,
        tokens=tokens,
        fix_hint="",
        rollout_hint="",
        device=device,
        estimate=estimate,
    )
    return RunMemory(weights, adapters, plan)


def recipe_floor(config, model_config, gpu_bytes: float, **kwargs) -> RunMemory:
    """The smallest footprint of a run of `config` (one sequence per pass, recomputed): what must fit
    for the start-up probe to find any size; the figure a recipe's header states. The probe then
    grows micro_batch_size into the memory_budget left over."""
    return run_memory(
        config, model_config, gpu_bytes, micro_batch_size=1, gradient_checkpointing=True, **kwargs
    )
