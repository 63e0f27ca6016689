"""Per-token log-probs of given tokens, from hidden states through the LM head, in chunks.

A (batch, length, vocab) float32 logits tensor is the largest thing in a GRPO step (8 × 1024 ×
152k × 4 bytes = 5 GB for Qwen2.5). Here the head runs on `chunk_size` tokens at a time and only
the gathered log-prob (and the log-sum-exp) of each token is kept; the backward pass recomputes
each chunk's logits. Peak extra memory is O(chunk_size × vocab), independent of batch × length.

A bf16 / fp16 head gives float32 logits too, accumulated in float32 (_head_logits): rounded to bf16, a
logit moves by up to 2⁻⁹ of itself (0.03–0.06 nats at |z| 16–32), more than a policy and a just-synced
reference differ, which biases their KL up near zero. On a CUDA GPU that float32 matmul runs on TF32
tensor cores (_tf32_matmuls), which is exact for those inputs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

Tensor = torch.Tensor
_CAST_ELEMENTS = 2**23  # of a bf16 head's weight cast to float32 at once (32 MiB; all of Qwen2.5's: 545 MB)


_HALF = (torch.bfloat16, torch.float16)


def _exact_in_tf32(device: torch.device, *dtypes: torch.dtype) -> bool:
    """Whether a float32 matmul of float32 copies of tensors of `dtypes` gives the same products on
    TF32 tensor cores as in IEEE float32, on `device`: CUDA only (TF32 is a cuBLAS mode), and only
    for bf16 / fp16 values, whose 7 / 10 mantissa bits TF32's 10 hold exactly (the products, of at
    most 22 bits, are exact either way; both accumulate in float32). A float32 input would be
    rounded to 10 bits."""
    return device.type == "cuda" and all(d in _HALF for d in dtypes)


@contextmanager
def _tf32_matmuls(enabled: bool):
    """Float32 CUDA matmuls inside on TF32 tensor cores when `enabled` (see _exact_in_tf32), the
    process's setting restored afterwards, exceptions included; nothing changes when TF32 is on
    already, or when torch refuses to read its setting (its legacy and new APIs set to disagree).

    Set through the legacy `allow_tf32`: its setter writes both the legacy and the new (torch ≥ 2.9
    `fp32_precision`) value, and cuBLAS raises at every float32 matmul when the two disagree, which
    setting only the new one leaves them doing. The new value is restored as it was read. A
    process-wide flag: nothing else runs float32 matmuls meanwhile, this being one thread's head
    matmul (the autograd thread's in backward, while the caller waits)."""
    matmul, before = torch.backends.cuda.matmul, None
    if enabled:
        try:
            before = matmul.allow_tf32
        except RuntimeError:  # the two APIs disagree: torch refuses to say; leave it alone
            pass
    if before is not False:
        yield
        return
    try:
        precision = matmul.fp32_precision  # torch ≥ 2.9
    except (AttributeError, RuntimeError):
        precision = None
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = False
        if precision is not None:
            matmul.fp32_precision = precision


def _head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """hidden (n, H) · weight (V, H)ᵀ + bias → a fresh (n, V) float32 block. A float32 head runs the
    one matmul it always ran (bit-identical); a bf16 / fp16 one multiplies float32 copies of the
    hidden states and of weight slices: products of bf16 numbers are exact in float32, so the
    logits carry float32's rounding, not bf16's. Those copies are exact in TF32 too, so on a CUDA
    GPU the matmul runs on TF32 tensor cores when the hidden states are bf16 / fp16 as well."""
    if hidden.dtype == weight.dtype == torch.float32:
        return (hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())).float()
    h, step = hidden.float(), max(1, _CAST_ELEMENTS // weight.shape[1])
    with _tf32_matmuls(_exact_in_tf32(hidden.device, hidden.dtype, weight.dtype)):
        if step >= weight.shape[0]:
            logits = h @ weight.float().t()
        else:
            logits = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32, device=h.device)
            for v in range(0, weight.shape[0], step):
                logits[:, v : v + step] = h @ weight[v : v + step].float().t()
    return logits if bias is None else logits.add_(bias.float())


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    # One fresh (chunk, V) float32 block; every later step works in place on it.
    logits = _head_logits(hidden, weight, bias)
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """log_softmax(h Wᵀ + b)[target] and optionally the entropy for each row of h; saves only (N,)
    log-sum-exps (and entropies, when they carry a gradient) for backward.

    At most about two (chunk, V) blocks are alive at once: each chunk's logits are transformed in
    place and dropped before the next chunk's matmul.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, want_entropy, entropy_grad):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if want_entropy else 0, dtype=torch.float32)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = _chunk_logits(hidden[start:end], weight, bias, temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[start:end] = chunk_lse
            logp[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - chunk_lse
            if want_entropy:
                # H = lse − Σ p·logits; vecdot avoids a (chunk, V) product temporary.
                probs = torch.exp(logits - chunk_lse[:, None])
                entropy[start:end] = chunk_lse - torch.linalg.vecdot(probs, logits)
                del probs
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if entropy_grad else None)
        ctx.chunk_size, ctx.temperature, ctx.entropy_grad = chunk_size, temperature, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h, z = hidden[start:end], _chunk_logits(hidden[start:end], weight, bias, ctx.temperature)
            if ctx.entropy_grad:
                g = _logits_grad_with_entropy(
                    z,
                    lse[start:end],
                    entropy[start:end],
                    targets[start:end],
                    grad_logp[start:end],
                    grad_entropy[start:end],
                    ctx.temperature,
                )
            else:
                # d logp[target] / d logits = onehot(target) − softmax, then chain through 1/temperature;
                # built in place in the recomputed logits' storage.
                g = z.sub_(lse[start:end, None]).exp_().neg_()
                g.scatter_add_(-1, targets[start:end, None], torch.ones_like(g[:, :1]))
                g.mul_(grad_logp[start:end, None] / ctx.temperature)
            if need_h:
                grad_h[start:end] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w += g.t() @ h.float()
            if need_b:
                grad_b += g.sum(0)
            del g, z
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _logits_grad_with_entropy(z, lse, entropy, targets, grad_logp, grad_entropy, temperature):
    """The gradient wrt the raw head outputs, from a chunk's temperature-scaled logits z (chunk, V),
    in place in z: g_logp·(onehot − p) + g_H·dH/dz, with dH/dz = −p·(log p + H) for H = −Σ p log p,
    then · 1/temperature. One more (chunk, V) block (p) lives meanwhile."""
    p = torch.exp(z - lse[:, None])
    g = z.sub_((lse - entropy)[:, None]).mul_(p).mul_(-grad_entropy[:, None])  # log p + H = z − (lse − H)
    g.addcmul_(p, grad_logp[:, None], value=-1.0).scatter_add_(-1, targets[:, None], grad_logp[:, None])
    del p
    return g.div_(temperature) if temperature != 1.0 else g


class _Float32Linear(torch.autograd.Function):
    """A bf16 / fp16 nn.Linear head's float32 logits (_head_logits) under autograd, saving only its
    inputs for backward (no float32 copy of the weight): for heads wrapped by _TransformedHead."""

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        ctx.save_for_backward(hidden, weight, bias)
        return _head_logits(hidden, weight, bias)  # (n, V) float32

    @staticmethod
    def backward(ctx, grad):
        (hidden, weight, bias), (need_h, need_w, need_b) = ctx.saved_tensors, ctx.needs_input_grad
        return (
            (grad.to(weight.dtype) @ weight).to(hidden.dtype) if need_h else None,
            (grad.t() @ hidden.float()).to(weight.dtype) if need_w else None,
            grad.sum(0).to(bias.dtype) if need_b else None,
        )


def _generic_head_log_probs(hidden, head, targets, chunk_size, temperature, want_entropy, entropy_grad):
    # Any head module (e.g. one wrapped by an adapter): checkpoint each chunk so only one chunk's
    # logits live at a time, in forward and in backward.
    from torch.utils.checkpoint import checkpoint

    def chunk_fn(h, t):
        logits = head(h).float() / temperature
        return logits.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    def with_entropy(h, t):  # entropy_grad: the entropy inside the checkpointed chunk, differentiable
        logp = torch.log_softmax(head(h).float() / temperature, -1)
        return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    pieces, entropies, fn = [], [], with_entropy if entropy_grad else chunk_fn
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        out = checkpoint(fn, h, t, use_reentrant=False) if torch.is_grad_enabled() else fn(h, t)
        pieces.append(out[0] if entropy_grad else out)
        if entropy_grad:
            entropies.append(out[1])
        elif want_entropy:
            with torch.no_grad():
                logits = head(h).float() / temperature
                entropies.append(-(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1))
    entropy = torch.cat(entropies) if want_entropy else hidden.new_empty(0, dtype=torch.float32)
    return torch.cat(pieces), entropy


def chunked_log_probs(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `targets` under softmax(head(hidden) / temperature).

    hidden (B, T, H) — the hidden states that predict targets (B, T) (already shifted by one).
    Returns (logp (B, T) float32, entropy (B, T) float32 or None). The entropy is a no-grad metric,
    unless entropy_grad (which needs return_entropy): then it carries its exact gradient (an entropy
    bonus), still without a (B, T, V) tensor.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    if entropy_grad and not return_entropy:
        raise ValueError("entropy_grad=True is a gradient for the entropy: pass return_entropy=True too")
    batch, length, dim = hidden.shape
    flat_h, flat_t = hidden.reshape(-1, dim), targets.reshape(-1)
    weight = getattr(head, "weight", None)
    plain_linear = type(head) is nn.Linear and weight is not None and weight.is_floating_point()
    if plain_linear:
        logp, entropy = _ChunkedLinearLogProbs.apply(
            flat_h, weight, head.bias, flat_t, chunk_size, temperature, return_entropy, entropy_grad
        )
    else:
        logp, entropy = _generic_head_log_probs(
            flat_h, head, flat_t, chunk_size, temperature, return_entropy, entropy_grad
        )
    return logp.view(batch, length), (entropy.view(batch, length) if return_entropy else None)


class _LogitTransform(NamedTuple):
    """What a CausalLM forward does around its LM head, in this order:
    logits = head(hidden * hidden_scale)[..., :vocab_limit] * logit_scale, then cap·tanh(logits / cap)."""

    hidden_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    vocab_limit: int | None = None


def _factor(value) -> float:
    return 1.0 if value is None else float(value)


def _softcap_from_config(causal_lm) -> _LogitTransform:
    # CausalLMs read config.final_logit_softcapping; their multimodal wrappers read the text config's
    # (get_text_config() of a text config is the config itself).
    return _LogitTransform(
        softcap=getattr(causal_lm.config.get_text_config(), "final_logit_softcapping", None)
    )


def _minicpm(causal_lm) -> _LogitTransform:
    # MiniCPM (remote code) and MiniCPM3: lm_head(hidden / (hidden_size / dim_model_base)).
    config = causal_lm.config
    base = getattr(config, "dim_model_base", None)
    return _LogitTransform(hidden_scale=float(base) / config.hidden_size) if base else _LogitTransform()


def _inkling(causal_lm) -> _LogitTransform:
    # lm_head(hidden / logits_mup_width_multiplier)[..., :unpadded_vocab_size]
    text = causal_lm.config.get_text_config()
    return _LogitTransform(
        hidden_scale=1.0 / _factor(getattr(text, "logits_mup_width_multiplier", None)),
        vocab_limit=getattr(text, "unpadded_vocab_size", None),
    )


# Keyed by config.model_type, each read from where that model's own forward (transformers 5.24) reads
# it. The same attribute name means different things in different models: Granite divides by
# logits_scaling, HyperCLOVAX multiplies by it, MiniCPM3 divides the hidden states by it; Cohere2Vision
# and AyaVision carry a Cohere text config with a logit_scale that their forward never applies; the
# Gemma3 multimodal wrapper does not softcap. Model types not listed get no transform; check_log_probs
# catches a model that applies one anyway.
_LOGIT_TRANSFORMS = {
    # logits * logit_scale (Cohere): the module attribute, set from the config
    **dict.fromkeys(
        ("cohere", "cohere2", "cohere2_moe", "cohere_compass", "cohere_compass_text"),
        lambda m: _LogitTransform(logit_scale=_factor(getattr(m, "logit_scale", None))),
    ),
    # logits / logits_scaling (Granite)
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared"),
        lambda m: _LogitTransform(logit_scale=1.0 / _factor(m.config.logits_scaling)),
    ),
    **dict.fromkeys(
        ("granite4_vision", "granite_docling"),
        lambda m: _LogitTransform(logit_scale=1.0 / _factor(m.config.text_config.logits_scaling)),
    ),
    # logits * logits_scaling (HyperCLOVAX's MuP: the opposite of Granite)
    "hyperclovax": lambda m: _LogitTransform(logit_scale=_factor(m.config.logits_scaling)),
    "hyperclovax_vision_v2": lambda m: _LogitTransform(
        logit_scale=_factor(m.config.text_config.logits_scaling)
    ),
    # logits * self.model.lm_head_multiplier (Falcon-H1)
    "falcon_h1": lambda m: _LogitTransform(
        logit_scale=_factor(
            getattr(m.model, "lm_head_multiplier", getattr(m.config, "lm_head_multiplier", None))
        )
    ),
    # hidden states scaled before the head
    "minicpm": _minicpm,
    "minicpm3": _minicpm,
    "inkling_text": _inkling,
    "inkling_mm_model": _inkling,
    # cap · tanh(logits / cap)
    **dict.fromkeys(
        (
            "gemma2",
            "gemma3_text",
            "gemma3n",
            "gemma3n_text",
            "gemma4",
            "gemma4_text",
            "gemma4_unified",
            "gemma4_unified_text",
            "vaultgemma",
            "nanochat",
            "paligemma",
            "beam",
        ),
        _softcap_from_config,
    ),
    "mistral_large4": lambda m: _LogitTransform(softcap=m.final_logit_softcapping),
    "recurrent_gemma": lambda m: _LogitTransform(softcap=m.config.logits_soft_cap),
    "xlstm": lambda m: _LogitTransform(softcap=m.config.output_logit_soft_cap),
    **dict.fromkeys(
        ("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text"),
        lambda m: _LogitTransform(softcap=m.logit_softcap.softcap),
    ),
    # cap · tanh(logits * output_multiplier / cap)
    **dict.fromkeys(
        ("muse_glimmer", "muse_spark"),
        lambda m: _LogitTransform(
            logit_scale=_factor(m.config.text_config.output_multiplier),
            softcap=m.config.text_config.final_logit_softcapping,
        ),
    ),
}


def _logit_transform(causal_lm: nn.Module) -> _LogitTransform:
    rule = _LOGIT_TRANSFORMS.get(getattr(causal_lm.config, "model_type", None))
    return rule(causal_lm) if rule is not None else _LogitTransform()


class _TransformedHead(nn.Module):
    """The LM head with the transform the model's forward applies around it; float32 logits."""

    def __init__(self, head: nn.Module, transform: _LogitTransform):
        super().__init__()
        self.head, self.transform = head, transform

    def forward(self, hidden: Tensor) -> Tensor:
        t, head = self.transform, self.head
        h = hidden * t.hidden_scale if t.hidden_scale != 1.0 else hidden
        if type(head) is nn.Linear and head.weight.dtype in (torch.bfloat16, torch.float16):  # float32 logits
            logits = _Float32Linear.apply(h.reshape(-1, h.shape[-1]), head.weight, head.bias).view(
                *h.shape[:-1], -1
            )
        else:
            logits = head(h).float()
        if t.vocab_limit is not None and t.vocab_limit < logits.shape[-1]:
            logits = logits[..., : t.vocab_limit]
        if t.logit_scale != 1.0:
            logits = logits * t.logit_scale
        if t.softcap:
            logits = torch.tanh(logits / t.softcap) * t.softcap
        return logits


def _with_logit_transform(
    head: nn.Module, causal_lm: nn.Module, temperature: float
) -> tuple[nn.Module, float]:
    """(head, temperature) whose softmax(head(h) / temperature) is the model's own sampling distribution.

    Rollout samples from the model's transformed logits, so the loss must use them too. A positive
    logit multiplier s folds into the temperature (logits·s/T = logits/(T/s)), and so does a hidden
    multiplier before a bias-free linear head, which keeps the fast chunked path; anything else wraps
    the head.
    """
    t = _logit_transform(causal_lm)
    if t == _LogitTransform():
        return head, temperature
    linear_in_hidden = t.hidden_scale == 1.0 or (type(head) is nn.Linear and head.bias is None)
    scale = t.logit_scale * t.hidden_scale
    if not t.softcap and t.vocab_limit is None and linear_in_hidden and scale > 0:
        return head, temperature / scale
    return _TransformedHead(head, t), temperature


def sequence_log_probs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_length: int,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs of the last `completion_length` tokens of each row of input_ids.

    model: a causal LM (or a peft model around one) whose decoder body and output head are
    reachable through get_decoder() / get_output_embeddings(). input_ids, attention_mask (B, P+T),
    left-padded prompts followed by right-padded completions. Returns ((B, T), (B, T) or None);
    entropy_grad: the entropy carries its gradient (chunked_log_probs).
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    head, temperature = _with_logit_transform(head, causal_lm, temperature)
    # Left padding: positions count real tokens only, as generate() does.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = body(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    hidden = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
    # hidden at position j predicts token j + 1: keep only the states that predict completion tokens.
    hidden = hidden[:, -completion_length - 1 : -1]
    targets = input_ids[:, -completion_length:]
    return chunked_log_probs(
        hidden,
        head,
        targets,
        chunk_size=chunk_size,
        temperature=temperature,
        return_entropy=return_entropy,
        entropy_grad=entropy_grad,
    )
