"""Per-token log-probs of given tokens, from hidden states through the LM head, in chunks.

A (batch, length, vocab) float32 logits tensor is the largest thing in a GRPO step (8 × 1024 ×
152k × 4 bytes = 5 GB for Qwen2.5). Here the head runs on `chunk_size` tokens at a time and only
the gathered log-prob (and the log-sum-exp) of each token is kept; the backward pass recomputes
each chunk's logits. Peak extra memory is O(chunk_size × vocab), independent of batch × length.
"""

from __future__ import annotations

import torch
from torch import nn

Tensor = torch.Tensor


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    # One fresh (chunk, V) float32 block; every later step works in place on it.
    logits = (hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """log_softmax(h Wᵀ + b)[target] for each row of h; saves only (N,) log-sum-exps for backward.

    At most about two (chunk, V) blocks are alive at once: each chunk's logits are transformed in
    place and dropped before the next chunk's matmul.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, want_entropy):
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
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            # d logp[target] / d logits = onehot(target) − softmax, then chain through 1/temperature;
            # built in place in the recomputed logits' storage.
            g = _chunk_logits(h, weight, bias, ctx.temperature).sub_(lse[start:end, None]).exp_().neg_()
            g.scatter_add_(-1, targets[start:end, None], torch.ones_like(g[:, :1]))
            g.mul_(grad_logp[start:end, None] / ctx.temperature)
            if need_h:
                grad_h[start:end] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w += g.t() @ h.float()
            if need_b:
                grad_b += g.sum(0)
            del g
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def _generic_head_log_probs(hidden, head, targets, chunk_size, temperature, want_entropy):
    # Any head module (e.g. one wrapped by an adapter): checkpoint each chunk so only one chunk's
    # logits live at a time, in forward and in backward.
    from torch.utils.checkpoint import checkpoint

    def chunk_fn(h, t):
        logits = head(h).float() / temperature
        return logits.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    pieces, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        pieces.append(checkpoint(chunk_fn, h, t, use_reentrant=False) if torch.is_grad_enabled() else chunk_fn(h, t))
        if want_entropy:
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
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `targets` under softmax(head(hidden) / temperature).

    hidden (B, T, H) — the hidden states that predict targets (B, T) (already shifted by one).
    Returns (logp (B, T) float32, entropy (B, T) float32 or None). Entropy is a no-grad metric.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    batch, length, dim = hidden.shape
    flat_h, flat_t = hidden.reshape(-1, dim), targets.reshape(-1)
    weight = getattr(head, "weight", None)
    plain_linear = type(head) is nn.Linear and weight is not None and weight.is_floating_point()
    if plain_linear:
        logp, entropy = _ChunkedLinearLogProbs.apply(
            flat_h, weight, head.bias, flat_t, chunk_size, temperature, return_entropy
        )
    else:
        logp, entropy = _generic_head_log_probs(flat_h, head, flat_t, chunk_size, temperature, return_entropy)
    logp = logp.view(batch, length)
    return logp, (entropy.view(batch, length) if return_entropy else None)


class _TransformedHead(nn.Module):
    """The LM head followed by the logit transform some CausalLM forwards apply after it."""

    def __init__(self, head: nn.Module, scale: float, softcap: float | None):
        super().__init__()
        self.head, self.scale, self.softcap = head, scale, softcap

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden).float() * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _with_logit_transform(head: nn.Module, config) -> nn.Module:
    """Match the model's own forward: Cohere's logit_scale, Granite's logits_scaling, Gemma 2/3's
    final_logit_softcapping. Rollout samples from those logits, so the loss must use them too."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = float(getattr(text_config, "logit_scale", None) or 1.0) / float(getattr(text_config, "logits_scaling", None) or 1.0)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return head if scale == 1.0 and not softcap else _TransformedHead(head, scale, softcap)


def sequence_log_probs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_length: int,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs of the last `completion_length` tokens of each row of input_ids.

    model: a causal LM (or a peft model around one) whose decoder body and output head are
    reachable through get_decoder() / get_output_embeddings(). input_ids, attention_mask (B, P+T),
    left-padded prompts followed by right-padded completions. Returns ((B, T), (B, T) or None).
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    head = _with_logit_transform(head, causal_lm.config)
    # Left padding: positions count real tokens only, as generate() does.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hidden = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
    # hidden at position j predicts token j + 1: keep only the states that predict completion tokens.
    hidden = hidden[:, -completion_length - 1 : -1]
    targets = input_ids[:, -completion_length:]
    return chunked_log_probs(
        hidden, head, targets, chunk_size=chunk_size, temperature=temperature, return_entropy=return_entropy
    )
