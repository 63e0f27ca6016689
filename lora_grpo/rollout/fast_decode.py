"""Fast decode: a static KV cache and a compiled one-token forward for the rollout's decode loop.

The eager sampler (:func:`lora_grpo.rollout.generate_rollout` with ``decode_mode="eager"``) grows a
dynamic KV cache by one column per token and drops finished rows from the batch, so every step has
new shapes: fine for PyTorch eager, but ``torch.compile`` would recompile every step and CUDA
graphs need one shape and fixed buffer addresses. Here the prefix-shared prefill's KV is copied into a transformers
``StaticCache`` of fixed size (N = n·G rows, L slots), and each step runs all N rows at slot ``t``:
finished rows keep decoding a pad token whose output the sampler ignores.

This module only owns the model side (the cache and the forward); sampling stays in rollout.py,
outside the compiled function, so from the same logits the generator draws what the eager sampler
draws. The logits are the eager sampler's to float32 rounding on a CPU (tested); on a GPU, and in
bf16 / fp16, other kernels and attention over the padded slots change their last bits, so a near-tie
can go the other way.

What is kept per model (as an attribute, so it lives and dies with the model): the compiled
forward (torch.compile caches one graph per shape; see :func:`cache_length` for why shapes are
few), and, for compiled decoding only, its static caches: CUDA graphs read the cache at fixed
addresses, so a compiled step reuses them on every rollout. A compiled decode of N rows and L slots
runs in the smallest kept cache of at least N rows and L slots (the extra rows decode a pad token,
their logits unused); a run reserves its largest decode's shape up front (:func:`reserve_shape`), so
its training rollouts and its evals share one cache and one graph. A new cache that holds a kept
one's shape replaces it; at most KEPT_CACHES stay. That memory stays allocated between rollouts, and
the memory plan counts it (memory.decode_memory, from :func:`static_cache_bytes`). An uncompiled
static rollout frees its cache when it ends. Once compilation has failed, why (logged once): every
later rollout is eager, and what the compiled path kept is freed.

What torch compiled is kept per machine (compile_cache.py): loaded before the process's first
compile, saved after each new shape's first compiled step, so a later run with the same shapes
skips inductor's and Triton's work.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict

import torch
from torch import Tensor
from transformers.cache_utils import StaticLayer

from ..device import compile_pays
from . import compile_cache

logger = logging.getLogger(__name__)

# A compiled step keeps at most this many static caches (a run reserves one shape: reserve_shape; a
# decode larger than it, an evaluate() of longer prompts, adds a second).
KEPT_CACHES = 2
_STATE_ATTR = "_lora_grpo_fast_decode"
# The samplers generate_rollout offers (config.DECODE_MODES repeats the names; config imports no torch).
DECODE_MODES = ("auto", "eager", "static", "compiled")


def cache_length(needed: int) -> int:
    """Slots of the static cache for ``needed`` = prompt width + max new tokens: the next of
    64, 96, 128, 192, 256, 384, ... (powers of two and 1.5× them). Prompt widths change from batch to
    batch, and every new cache length is a new graph to compile (tens of seconds; past torch's
    recompile limit, 8 by default, dynamo runs the step uncompiled); buckets keep them to a handful
    (a run reserves one: :func:`reserve_shape`), at the price of attention over at most 1.5× the
    slots (masked, so the result is unchanged) and of that much more cache memory."""
    if needed <= 64:
        return 64
    power = 1 << (needed - 1).bit_length()  # the next power of two, ≥ needed
    return power * 3 // 4 if power * 3 // 4 >= needed else power


def kv_bytes_per_slot(model_config, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in every layer, for a row of the KV cache."""
    cfg = model_config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def static_cache_bytes(model_config, rows: int, needed: int, dtype: torch.dtype) -> int:
    """Bytes of the static cache :class:`StaticDecoder` allocates for `rows` sequences of `needed`
    = prompt width + max new tokens: cache_length(needed) slots per row, whatever is filled."""
    return rows * cache_length(needed) * kv_bytes_per_slot(model_config, dtype)


def kept_cache_bytes(model) -> int:
    """Bytes of the static caches this model keeps between rollouts now (0 when none)."""
    state = model.__dict__.get(_STATE_ATTR)
    caches = state.caches.values() if state is not None else ()
    return sum(
        t.nbytes
        for cache in caches
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if t is not None
    )


class _ModelState:
    """What one model keeps across rollouts (see the module docstring)."""

    def __init__(self):
        self.compiled = None  # the compiled forward, built on first use
        self.caches: OrderedDict[tuple, object] = (
            OrderedDict()
        )  # (N, L, dtype, device) → StaticCache; compiled only
        self.failed: str | None = None  # why fast decoding is off for this model (see unavailable)
        self.checked = False  # whether _unsupported ran
        self.auto: str | None = None  # what decode_mode 'auto' chose (said once)
        self.reserved: tuple[int, int] = (
            0,
            0,
        )  # (rows, slots) every compiled cache has at least (reserve_shape)
        # the compiled shapes (rows, slots, dtype, device) whose compile was saved (compile_cache.save)
        self.saved: set[tuple] = set()


def reserve_shape(model, rows: int, needed: int) -> None:
    """Make every compiled decode of `model` run in a static cache of at least `rows` rows and
    cache_length(`needed`) slots (needed = prompt + new tokens): a run's largest decode, so that its
    training rollouts and evals, whatever their prompt widths and row counts, share one cache and
    one CUDA graph instead of one per shape (each a recompile, and gigabytes of KV kept)."""
    _state(model).reserved = (int(rows), cache_length(int(needed)))


def cache_shape(model, rows: int, needed: int) -> tuple[int, int]:
    """(rows, slots) of the static cache a compiled decode of `rows` sequences of `needed` tokens
    allocates when no kept cache holds it: the shape asked for, raised to the reserved one."""
    reserved = _state(model).reserved
    return max(rows, reserved[0]), max(cache_length(needed), reserved[1])


def _state(model) -> _ModelState:
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        state = _ModelState()
        # A plain attribute (not a module or a parameter): not in state_dict, not moved by .to().
        object.__setattr__(model, _STATE_ATTR, state)
    return state


def unavailable(model) -> str | None:
    """Why fast decoding is off for this model (compiling failed once, or the model's cache is not
    one static decoding supports), or None."""
    state = model.__dict__.get(_STATE_ATTR)
    return None if state is None else state.failed


def give_up(model, reason: str) -> None:
    """Turn fast decoding off for this model, saying why in one logged line (once: later rollouts
    see ``unavailable(model)`` and go eager without a word), and let go of what only the fast path
    used: the kept static caches (gigabytes of KV on a GPU) and the compiled step. A rollout still
    running holds its own cache until it ends."""
    state = _state(model)
    state.failed, state.compiled = reason, None
    state.caches.clear()
    logger.warning("fast decoding is unavailable (%s); rollouts use the eager sampler from now on", reason)


def _reason(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else 'no message'}"


def _unsupported(model) -> str | None:
    """Why this model cannot decode with a static cache, read from the static cache transformers builds
    for its config, before any work. Full and sliding-window attention layers are served (each as a
    plain static layer: StaticDecoder); others (chunked, linear, offloaded) are not."""
    try:
        from transformers import StaticCache
        from transformers.cache_utils import StaticSlidingWindowLayer
    except ImportError as e:
        return f"this transformers has no StaticCache or static sliding layer ({e})"
    config = _transformers_model(model).config
    text = config.get_text_config()
    if getattr(text, "attention_chunk_size", None):
        # transformers builds chunked layers (Llama 4) as sliding ones; flash attention refuses them past a chunk
        return (
            f"the model attends in chunks (attention_chunk_size {text.attention_chunk_size}); static decoding "
            "supports full and sliding-window attention only"
        )
    try:
        cache = StaticCache(config=config, max_cache_len=1)
    except Exception as e:  # older transformers (another signature), configs it cannot read
        return f"no static cache for this model ({_reason(e)})"
    kinds = {type(layer) for layer in cache.layers}
    if not kinds <= {StaticLayer, StaticSlidingWindowLayer} or not hasattr(
        cache.layers[0], "cumulative_length"
    ):
        names = sorted(kind.__name__ for kind in kinds)
        return (
            f"the model's static cache has {names} layers; static decoding supports full and sliding-window "
            "attention only"
        )
    return None


def resolve_decode_mode(mode: str, model, device: torch.device) -> str:
    """The sampler to run for ``mode`` (one of DECODE_MODES): "eager", "static" or "compiled".

    "auto" compiles where it pays (device.compile_pays): on a CUDA GPU that Triton serves for the
    model's dtype, where CUDA graphs remove the per-kernel launch cost that dominates decoding small
    batches; everywhere else (CPU, pre-Volta GPUs, bf16 on pre-Ampere ones) the eager sampler, which
    also drops finished rows, wins. What 'auto' chose is said once per model, in one line (a warning
    when a GPU does not compile). A model static decoding cannot serve, or whose compilation failed
    before, gets "eager". Sliding-window layers (Gemma 2 and 3, Mistral v0.1) decode statically too, at
    any length: the model masks their window over the static cache's slots, as over the eager cache's.
    """
    if mode not in DECODE_MODES:
        raise ValueError(f"decode_mode={mode!r} is not one of {list(DECODE_MODES)}")
    state = _state(model)
    if mode == "auto":
        pays, why = compile_pays(device, _weight_dtype(model))
        mode = "compiled" if pays else "eager"
        if state.auto is None:
            state.auto = mode
            level = logging.WARNING if device.type == "cuda" and not pays else logging.INFO
            logger.log(level, "decode_mode auto → %s (%s)", mode, why)
    if mode == "eager":
        return mode
    if not state.checked:  # the first fast rollout of this model: can it decode with a static cache?
        state.checked = True
        reason = _unsupported(model)
        if reason is not None:
            give_up(model, reason)
    return "eager" if state.failed else mode


def _weight_dtype(model) -> torch.dtype:
    """The dtype the model computes in: its input embeddings' (a 4-bit base keeps them unquantized)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _transformers_model(model):
    """The transformers model under a peft wrapper. The LoRA layers live inside it, so calling it
    directly runs the active adapter just as the peft wrapper's forward does, without the wrapper's
    Python-side hooks (a cleaner graph for dynamo)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _one_token_forward(model):
    """model's forward for one token per row → the next-token logits (N, V); the function that is
    compiled (a closure, so the compiled graph holds no chunk's cache or mask)."""
    params = set(inspect.signature(model.forward).parameters)
    cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def forward(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache) -> Tensor:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{cache_kw: cache},
            **extra,
        )
        return out.logits[:, -1]

    return forward


class _SlotLayer(StaticLayer):
    """A static layer whose filled length is read as a copy: flex attention's mask function keeps the query
    offset it is given and reads it when the kernel runs, after this layer's update has advanced the length
    in place (one slot ahead: a sliding window one key short)."""

    def get_seq_length(self):
        length = super().get_seq_length()
        return length.clone() if isinstance(length, Tensor) else length


class StaticDecoder:
    """Fixed-shape decoding for one chunk: N rows, a static cache of L slots, one slot per step.

    ``compiled=True`` runs the forward through ``torch.compile`` (CUDA graphs on CUDA, inductor
    elsewhere); when compiling fails the step is redone uncompiled, the reason is logged once, and
    :func:`resolve_decode_mode` sends every later rollout of the model to the eager sampler.
    """

    def __init__(self, model, prefill_cache, attention_mask: Tensor, max_new: int, *, compiled: bool):
        """``prefill_cache``: the eager prefill's dynamic cache, already repeated to N rows;
        ``attention_mask`` (N, P): its padding mask. Call only for a model that
        :func:`resolve_decode_mode` let through (full or sliding-window attention)."""
        self.owner = model
        self.model = _transformers_model(model)
        self.state = _state(model)
        self.forward = _one_token_forward(self.model)
        N, P = attention_mask.shape
        self.slot = P  # the cache slot the next token is written to, the same for every row
        self.rows = N  # the decode's rows; the cache may hold more (a kept cache of a larger shape)
        compiled = compiled and self.state.failed is None
        # Only a compiled step keeps its cache (CUDA graphs' fixed addresses); this decoder owns an
        # uncompiled one, of exactly its shape, freed with it when the rollout ends.
        self.cache, R, L = self._static_cache(prefill_cache, N, P + max_new, keep=compiled)
        self.shape = (R, L, attention_mask.dtype, attention_mask.device)
        self.attn = torch.zeros((R, L), dtype=attention_mask.dtype, device=attention_mask.device)
        self.attn[:N, :P] = attention_mask
        self.attn[N:, 0] = 1  # rows beyond the decode's attend to one (zero) slot: finite, and unused
        self.compiled = self._compiled() if compiled else None

    # ------------------------------------------------------------------ setup
    def _static_cache(self, prefill_cache, N: int, needed: int, *, keep: bool):
        """(cache, its rows R ≥ N, its slots L), slots [0, P) holding the prefill's keys and values
        (zeros in rows N..R). Kept (compiled): the smallest kept cache of at least N rows and
        cache_length(needed) slots, else a new one of cache_shape(...), which replaces the kept
        caches it holds."""
        from transformers.cache_utils import Cache

        layers = prefill_cache.layers
        first = layers[0].keys
        caches = self.state.caches
        cache = None
        if keep:
            fits = [
                key
                for key in caches
                if key[2:] == (first.dtype, first.device) and key[0] >= N and key[1] >= cache_length(needed)
            ]
            if fits:
                key = min(fits, key=lambda k: k[0] * k[1])
                cache = caches.pop(key)
                cache.reset()  # same buffers (same addresses for CUDA graphs), zeroed, slot 0
            else:
                R, L = cache_shape(self.owner, N, needed)
                key = (R, L, first.dtype, first.device)
                for held in [k for k in caches if k[2:] == key[2:] and k[0] <= R and k[1] <= L]:
                    del caches[held]  # the new cache serves whatever that one did
        else:
            key = (N, cache_length(needed), first.dtype, first.device)
        R, L = key[:2]
        if cache is None:
            # One plain static layer of L slots a model layer, sliding ones too: the model masks each
            # sliding layer's window itself, over the slots (transformers' sliding static layer, a
            # ring buffer of the window, counts its fill in a Python int: a recompile a token).
            cache = Cache(layers=[_SlotLayer(max_cache_len=L) for _ in layers])
        if keep:
            caches[key] = cache  # most recently used last
            while len(caches) > KEPT_CACHES:
                caches.popitem(last=False)
        for i, layer in enumerate(layers):  # slots [0, P) ← the prompt's keys and values
            keys, values = layer.keys, layer.values
            if R > N:  # the cache's extra rows: zeros
                keys, values = (torch.cat([t, t.new_zeros((R - N, *t.shape[1:]))]) for t in (keys, values))
            cache.update(keys, values, i)
        return cache, R, L

    def _compiled(self):
        if self.state.compiled is None:
            cuda = self.attn.device.type == "cuda"
            # what earlier runs on this machine compiled, before this process compiles anything
            compile_cache.load(self.attn.device)
            try:
                # "reduce-overhead" = inductor + CUDA graphs: one graph launch per token instead of
                # hundreds of small kernels, the whole point on a GPU. dynamic=False: one graph per
                # (N, L); cache_length keeps those few.
                self.state.compiled = torch.compile(
                    self.forward, mode="reduce-overhead" if cuda else None, dynamic=False
                )
            except Exception as e:  # torch.compile refused outright (unsupported Python, no backend)
                give_up(self.owner, f"torch.compile failed: {_reason(e)}")
                return None
        return self.state.compiled

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Feed one token per row (N,) at ``positions`` (N,) → next-token logits (N, V)."""
        self.attn[:, self.slot] = 1
        R, N = self.attn.shape[0], self.rows
        if R > N:  # the cache's extra rows decode token 0 at position 0; their logits are dropped
            tokens = torch.cat([tokens, tokens.new_zeros(R - N)])
            positions = torch.cat([positions, positions.new_zeros(R - N)])
        args = (tokens[:, None], self.attn, positions[:, None], self.cache)
        logits = None
        if self.compiled is not None:
            try:
                if self.attn.device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
                logits = self.compiled(*args)[:N].clone()  # a CUDA graph reuses its output buffer
            except Exception as e:  # compiling failed (no C++ compiler, an op dynamo cannot trace, ...)
                give_up(self.owner, f"compiling the decode step failed: {_reason(e)}")
                self.compiled = None
                for layer in self.cache.layers:  # undo a partial write, if the failure came mid-run
                    layer.cumulative_length.fill_(self.slot)
        if logits is not None and self.shape not in self.state.saved:
            # this shape's first compiled step: keep what it compiled (compile_cache never raises)
            self.state.saved.add(self.shape)
            compile_cache.save(self.attn.device)
        if logits is None:
            logits = self.forward(*args)[:N]  # a genuine error (not compilation's) raises here again
        self.slot += 1
        return logits
