import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lora_grpo.logprobs import chunked_log_probs, sequence_log_probs


def _reference(hidden, head, targets, temperature=1.0):
    logits = head(hidden).float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10_000])  # 10_000 > B × T = 2 × 5
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_log_softmax(chunk_size, bias, temperature):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 5))
    logp, entropy = chunked_log_probs(hidden, head, targets, chunk_size=chunk_size, temperature=temperature, return_entropy=True)
    ref_logp, ref_entropy = _reference(hidden, head, targets, temperature)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)

    w = torch.randn(2, 5)
    grads = torch.autograd.grad((logp * w).sum(), [hidden, *head.parameters()])
    ref_grads = torch.autograd.grad((ref_logp * w).sum(), [hidden, *head.parameters()])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_frozen_head_gets_no_gradient_and_hidden_does():
    head = nn.Linear(8, 20).requires_grad_(False)
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    logp, entropy = chunked_log_probs(hidden, head, torch.randint(0, 20, (1, 4)), chunk_size=2)
    assert entropy is None
    logp.sum().backward()
    assert head.weight.grad is None and hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_generic_head_path_matches():
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(8, 30))  # not a plain nn.Linear: the checkpointed path
    hidden = torch.randn(3, 4, 8, requires_grad=True)
    targets = torch.randint(0, 30, (3, 4))
    logp, entropy = chunked_log_probs(hidden, head, targets, chunk_size=5, return_entropy=True)
    ref_logp, ref_entropy = _reference(hidden, head, targets)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)
    g, = torch.autograd.grad(logp.sum(), hidden)
    rg, = torch.autograd.grad(ref_logp.sum(), hidden)
    torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_peak_tensor_scales_with_chunk_not_with_batch_times_vocab():
    B, T, H, V, chunk = 4, 64, 16, 1000, 32
    head = nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, T, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    with _LargestTensor() as mode:
        logp, _ = chunked_log_probs(hidden, head, targets, chunk_size=chunk, return_entropy=True)
        logp.sum().backward()
    # Largest intermediate: one chunk of logits (chunk × V) or the head's weight gradient (V × H);
    # never the B × T × V = 256k-element logits tensor.
    assert mode.largest <= max(chunk * V, V * H)
    assert mode.largest < B * T * V // 4


def test_sequence_log_probs_matches_full_model_forward(tiny_base_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32)
    pad = 0
    # Left-padded prompts (lengths 3 and 5) followed by completions of length 4.
    prompt = torch.tensor([[pad, pad, 5, 6, 7], [8, 9, 10, 11, 12]])
    completion = torch.randint(3, 40, (2, 4))
    input_ids = torch.cat([prompt, completion], 1)
    attention_mask = (input_ids != pad).long()
    logp, entropy = sequence_log_probs(model, input_ids, attention_mask, 4, chunk_size=3, return_entropy=True)

    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    ref = torch.log_softmax(logits[:, -5:-1].float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    assert entropy.shape == (2, 4) and (entropy > 0).all()
