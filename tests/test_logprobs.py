import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lora_grpo.algo.logprobs import chunked_log_probs, sequence_log_probs
from lora_grpo.model.adapters import POLICY, REFERENCE


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
    logp, entropy = chunked_log_probs(
        hidden, head, targets, chunk_size=chunk_size, temperature=temperature, return_entropy=True
    )
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
    (g,) = torch.autograd.grad(logp.sum(), hidden)
    (rg,) = torch.autograd.grad(ref_logp.sum(), hidden)
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


# ---- the model's own post-head logit transforms, and the load-time check --------------------------

_TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
)


def _hyperclovax():
    from transformers import HyperCLOVAXConfig, HyperCLOVAXForCausalLM

    return HyperCLOVAXForCausalLM(HyperCLOVAXConfig(**_TINY, logits_scaling=4.0))  # multiplies: ×4


def _falcon_h1():
    # On CPU the mamba mixer falls back to transformers' reference PyTorch kernels.
    from transformers import FalconH1Config, FalconH1ForCausalLM

    return FalconH1ForCausalLM(
        FalconH1Config(
            **_TINY,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=4,
            lm_head_multiplier=3.0,
        )
    )


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(GraniteConfig(**_TINY, logits_scaling=4.0))  # divides: ÷4


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(**_TINY, final_logit_softcapping=2.0))
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # large logits, so the cap matters
    return model


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM

    return CohereForCausalLM(CohereConfig(**_TINY, logit_scale=0.25))


def _minicpm3():
    # hidden states ÷ (hidden_size / dim_model_base) = ÷4 before the head
    from transformers import MiniCPM3Config, MiniCPM3ForCausalLM

    tiny = {k: v for k, v in _TINY.items() if k != "head_dim"} | {
        "num_key_value_heads": 2
    }  # MLA: no grouping
    return MiniCPM3ForCausalLM(
        MiniCPM3Config(
            **tiny,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=16,
            dim_model_base=8,
        )
    )


def _cohere2_vision():
    # Its text config carries a logit_scale its forward never applies: no transform.
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    return Cohere2VisionForConditionalGeneration(
        Cohere2VisionConfig(
            text_config=dict(model_type="cohere2", **_TINY, logit_scale=0.25),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
        )
    )


_LOGIT_TRANSFORM_MODELS = {
    "hyperclovax": _hyperclovax,
    "falcon_h1": _falcon_h1,
    "granite": _granite,
    "gemma2": _gemma2,
    "cohere": _cohere,
    "minicpm3": _minicpm3,
    "cohere2_vision": _cohere2_vision,
}


def _batch(vocab=64, pad=0):
    # Left-padded prompts (lengths 3 and 5) followed by completions of length 4, the first one
    # right-padded after 3 tokens.
    ids = torch.randint(1, vocab, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[0, -1] = 0
    return ids.masked_fill(mask == 0, pad), mask


def _model_log_probs(model, ids, mask, completion_length, temperature=1.0):
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    logits = logits[:, -completion_length - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -completion_length:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", list(_LOGIT_TRANSFORM_MODELS))
def test_sequence_log_probs_apply_the_models_own_logit_transform(name, temperature):
    torch.manual_seed(0)
    model = _LOGIT_TRANSFORM_MODELS[name]().eval()
    assert model.config.model_type == name
    ids, mask = _batch()
    real = mask[:, -4:].bool()
    logp, _ = sequence_log_probs(model, ids, mask, 4, chunk_size=3, temperature=temperature)
    ref = _model_log_probs(model, ids, mask, 4, temperature)
    torch.testing.assert_close(logp[real], ref[real], rtol=0, atol=1e-5)

    # and the same gradients, with the transform folded into the temperature or wrapped around the head
    params = [p for p in model.parameters() if p.requires_grad]
    w = torch.randn(2, 4) * real
    grads = torch.autograd.grad((logp * w).sum(), params, allow_unused=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
    for g, rg in zip(grads, ref_grads):
        if rg is not None:
            torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-5)


def _tiny_llama(dtype=torch.float32, config_cls=None, model_cls=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    config_cls, model_cls = config_cls or LlamaConfig, model_cls or LlamaForCausalLM
    return model_cls(config_cls(**_TINY)).to(dtype)


def _with_adapters(base):
    from peft import LoraConfig, get_peft_model

    def lora():  # init_lora_weights=False: random, non-zero B, so each adapter changes the logits
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    model = get_peft_model(base, lora(), adapter_name=POLICY)
    model.add_adapter(REFERENCE, lora())
    model.set_adapter(POLICY)
    for n, p in model.named_parameters():
        p.requires_grad_(f".{POLICY}." in n)
    return model


def test_check_log_probs_passes_for_each_adapter_and_restores_the_model():
    from lora_grpo.startup import check_log_probs

    torch.manual_seed(0)
    model = _with_adapters(_tiny_llama()).train()
    ids, mask = _batch()
    with torch.no_grad():
        per_adapter = {}
        for name in (POLICY, REFERENCE):
            model.set_adapter(name)
            per_adapter[name] = sequence_log_probs(model.eval(), ids, mask, 4)[0]
        model.set_adapter(POLICY)
        model.train()
    assert (per_adapter[POLICY] - per_adapter[REFERENCE]).abs().max() > 1e-3  # the adapters matter
    flags = {n: p.requires_grad for n, p in model.named_parameters()}

    diff = check_log_probs(model, ids, mask, completion_length=4)

    assert isinstance(diff, float) and 0 <= diff < 1e-5
    assert model.training and all(m.training for m in model.modules())
    assert model.active_adapter == POLICY
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    # a plain transformers model, and adapters the model does not have, are fine too
    assert check_log_probs(model.get_base_model(), ids, mask) < 1e-5
    assert check_log_probs(model, ids, mask, adapters=(REFERENCE, "missing")) < 1e-5


def test_check_log_probs_passes_for_a_known_transform():
    from lora_grpo.startup import check_log_probs

    torch.manual_seed(0)
    assert check_log_probs(_hyperclovax(), *_batch(), completion_length=4, temperature=0.7) < 1e-5


def _tripled_llama(dtype=torch.float32):
    """A model type lora_grpo does not know, whose forward multiplies its logits by 3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class TripledConfig(LlamaConfig):
        model_type = "tripled_llama"

    class TripledForCausalLM(LlamaForCausalLM):
        config_class = TripledConfig

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3
            return out

    return _tiny_llama(dtype, TripledConfig, TripledForCausalLM)


def test_check_log_probs_rejects_an_unknown_logit_transform():
    from lora_grpo.startup import check_log_probs

    torch.manual_seed(0)
    model = _with_adapters(_tripled_llama()).train()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(
        ValueError, match=r"model type 'tripled_llama'.*max difference [0-9.]+ nats.*please report"
    ):
        check_log_probs(model, *_batch())
    assert model.training and model.active_adapter == POLICY
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="tripled_llama"):
        check_log_probs(model.get_base_model().eval(), *_batch())


def test_check_log_probs_tolerance_in_bfloat16():
    from transformers import HyperCLOVAXConfig, HyperCLOVAXForCausalLM

    from lora_grpo.startup import check_log_probs

    torch.manual_seed(0)
    ids, mask = _batch()
    # ×3 is not exact in bf16: the model rounds its scaled logits, we scale in float32.
    model = HyperCLOVAXForCausalLM(HyperCLOVAXConfig(**_TINY, logits_scaling=3.0)).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # logits of tens, as in real models, where bf16 rounding is coarse
    diff = check_log_probs(model, ids, mask)
    assert 0 < diff < 1  # rounding noise, within the bf16 tolerance

    tripled = _tripled_llama(torch.bfloat16)
    with torch.no_grad():
        tripled.lm_head.weight.mul_(10)
    with pytest.raises(ValueError, match="tripled_llama.*bfloat16"):
        check_log_probs(tripled, ids, mask)


def test_a_hidden_scale_before_an_adapter_wrapped_head():
    # MiniCPM3 scales the hidden states before its head; with a LoRA on lm_head the head is no plain
    # nn.Linear, so the scale cannot fold into the temperature and wraps the head instead.
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        _minicpm3(), LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False)
    ).eval()
    ids, mask = _batch()
    real = mask[:, -4:].bool()
    logp, entropy = sequence_log_probs(
        model, ids, mask, 4, chunk_size=3, temperature=0.7, return_entropy=True
    )
    ref = _model_log_probs(model, ids, mask, 4, temperature=0.7)
    torch.testing.assert_close(logp[real], ref[real], rtol=0, atol=1e-5)
    assert (entropy > 0).all()


def test_check_log_probs_names_nan_logits_as_such():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_grpo.startup import check_log_probs

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    ids = torch.randint(0, 40, (1, 6))
    with pytest.raises(ValueError, match=r"own logits are NaN/inf .*torch_dtype bfloat16 or float32"):
        check_log_probs(model, ids, torch.ones_like(ids))


# Failed before the fix it guards (code review): log-probs ignored the model's own logit transform
# (here Gemma-2's final logit softcapping).
def test_log_probs_apply_the_models_logit_softcapping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,
        max_position_embeddings=64,
    )
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # large logits, so the cap matters
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones_like(ids)
    logp, _ = sequence_log_probs(model, ids, mask, 4, chunk_size=3)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1).logits
    ref = torch.log_softmax(logits[:, -5:-1].float(), -1).gather(-1, ids[:, -4:, None]).squeeze(-1)
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)


# ---- float32 logits from a bf16 head; the entropy's gradient ----------------------------------------


def _dense_float64(hidden, weight, bias, targets, temperature):
    """log p[target] and entropy from float64 logits of the same (possibly bf16) numbers."""
    logits = hidden.double() @ weight.double().t()
    logits = (logits if bias is None else logits + bias.double()) / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("sliced", [False, True], ids=["one-cast", "weight-cast-in-slices"])
@pytest.mark.parametrize("generic", [False, True], ids=["chunked-linear", "transformed-head"])
def test_bf16_head_log_probs_match_float64(monkeypatch, sliced, generic):
    """Failed before the fix (defect 5): the head's matmul returned bf16 logits, rounded to 2⁻⁸ of
    themselves (here up to ~0.1 nats at |z| ≈ 30), and was cast to float32 afterwards."""
    from lora_grpo.algo import logprobs

    if sliced:  # a vocabulary larger than one cast: the weight goes to float32 in slices of 7 rows
        monkeypatch.setattr(logprobs, "_CAST_ELEMENTS", 7 * 32)
    torch.manual_seed(0)
    head, targets = nn.Linear(32, 200, bias=True).to(torch.bfloat16), torch.randint(0, 200, (2, 6))
    with torch.no_grad():
        head.weight.mul_(12)  # logits of tens, as in real models
    hidden = torch.randn(2, 6, 32).to(torch.bfloat16)
    ref, _ = _dense_float64(hidden, head.weight, head.bias, targets, 0.9)
    assert ref.abs().max() > 5 and (hidden.double() @ head.weight.double().t()).abs().max() > 25
    wrapped = (
        logprobs._TransformedHead(head, logprobs._LogitTransform(softcap=1e6)) if generic else head
    )  # cap ≈ identity
    logp, _ = chunked_log_probs(hidden, wrapped, targets, chunk_size=5, temperature=0.9)
    assert logp.dtype == torch.float32 and (logp.double() - ref).abs().max() < 1e-4
    # what the old path computed: bf16 logits, then float32
    rounded = (
        torch.log_softmax((head(hidden).float() / 0.9).double(), -1)
        .gather(-1, targets[..., None])
        .squeeze(-1)
    )
    assert (rounded - ref).abs().max() > 1e-2  # so the check above can tell the two apart


def test_bf16_head_gradients_flow_in_float32_and_match_float64():
    from lora_grpo.algo.logprobs import _LogitTransform, _TransformedHead

    torch.manual_seed(0)
    head, targets = nn.Linear(16, 40).to(torch.bfloat16), torch.randint(0, 40, (1, 8))
    hidden = torch.randn(1, 8, 16).to(torch.bfloat16).requires_grad_(True)
    for wrapped in (head, _TransformedHead(head, _LogitTransform(softcap=1e6))):
        logp, _ = chunked_log_probs(hidden, wrapped, targets, chunk_size=3)
        grads = torch.autograd.grad(logp.sum(), [hidden, head.weight, head.bias])
        h64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (hidden, head.weight, head.bias))
        ref, _ = _dense_float64(h64, w64, b64, targets, 1.0)
        ref_grads = torch.autograd.grad(ref.sum(), [h64, w64, b64])
        for g, rg in zip(grads, ref_grads):
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(
                g.double(), rg, rtol=2e-2, atol=2e-2
            )  # bf16 gradients: their own rounding


@pytest.mark.parametrize("generic", [False, True], ids=["chunked-linear", "checkpointed-generic-head"])
def test_entropy_gradient_matches_dense_float64(generic):
    torch.manual_seed(0)
    linear = nn.Linear(16, 50, bias=True)
    head, targets = nn.Sequential(linear) if generic else linear, torch.randint(0, 50, (2, 7))
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    up_logp, up_entropy = torch.randn(2, 7), torch.randn(2, 7)  # random upstream gradients on both outputs
    logp, entropy = chunked_log_probs(
        hidden, head, targets, chunk_size=3, temperature=0.7, return_entropy=True, entropy_grad=True
    )
    params = [hidden, linear.weight, linear.bias]
    grads = torch.autograd.grad((logp * up_logp + entropy * up_entropy).sum(), params)

    h64, w64, b64 = (t.detach().double().requires_grad_(True) for t in params)
    ref_logp, ref_entropy = _dense_float64(h64, w64, b64, targets, 0.7)
    # the entropy part alone is not zero: the test would see a dropped term
    only_entropy = torch.autograd.grad((ref_entropy * up_entropy).sum(), h64, retain_graph=True)[0]
    assert only_entropy.abs().max() > 1e-2
    ref_grads = torch.autograd.grad((ref_logp * up_logp + ref_entropy * up_entropy).sum(), [h64, w64, b64])
    for got, expected in [(logp, ref_logp), (entropy, ref_entropy), *zip(grads, ref_grads)]:
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


def test_without_entropy_grad_the_entropy_stays_a_metric():
    head, hidden, targets = (
        nn.Linear(8, 20),
        torch.randn(1, 4, 8, requires_grad=True),
        torch.randint(0, 20, (1, 4)),
    )
    for h in (head, nn.Sequential(head)):
        logp, entropy = chunked_log_probs(hidden, h, targets, chunk_size=3, return_entropy=True)
        assert logp.requires_grad and not entropy.requires_grad
    with pytest.raises(ValueError, match="return_entropy=True"):
        chunked_log_probs(hidden, head, targets, entropy_grad=True)


@pytest.fixture
def matmul_precision():
    """The matmul precision flags left as torch starts (they are process-wide): after the test too."""
    yield torch.backends.cuda.matmul
    torch.set_float32_matmul_precision("highest")  # the legacy value and the new per-backend ones
    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.fp32_precision = "none"


def _tf32_state():
    """(allow_tf32, the new API's cuda matmul value, the legacy precision), "raises" where torch refuses."""
    out = []
    for read in (
        lambda: torch.backends.cuda.matmul.allow_tf32,
        lambda: torch.backends.cuda.matmul.fp32_precision,
        torch.get_float32_matmul_precision,
    ):
        try:
            out.append(read())
        except (RuntimeError, AttributeError):
            out.append("raises")
    return tuple(out)


@pytest.mark.parametrize(
    "before",
    ["default", "new api ieee", "legacy tf32 on", "generic tf32 (mixed)", "generic tf32, cuda ieee"],
)
def test_tf32_around_the_head_matmul_is_on_inside_and_restored_exactly(matmul_precision, before):
    """The state of both TF32 APIs is what it was afterwards, an exception inside included; inside,
    TF32 is on and readable through both APIs (cuBLAS reads the legacy flag and raises when the two
    disagree: the new API alone would make every float32 matmul inside raise). A state torch itself
    refuses to read is left untouched."""
    from lora_grpo.algo.logprobs import _tf32_matmuls

    if not hasattr(matmul_precision, "fp32_precision") and before != "legacy tf32 on":
        pytest.skip("torch < 2.9 has only the legacy flag")
    if before == "new api ieee":
        matmul_precision.fp32_precision = "ieee"
    elif before == "legacy tf32 on":
        matmul_precision.allow_tf32 = True
    elif before.startswith("generic tf32"):
        torch.backends.fp32_precision = "tf32"
        if before.endswith("cuda ieee"):
            matmul_precision.fp32_precision = "ieee"
    state = _tf32_state()
    mixed = state[0] == "raises"
    with pytest.raises(KeyError), _tf32_matmuls(True):
        assert _tf32_state()[:2] == (state if mixed else (True, "tf32"))[:2]
        if not mixed:
            assert _tf32_state()[2] == "high"
        raise KeyError("inside")
    assert _tf32_state() == state
    with _tf32_matmuls(False):
        assert _tf32_state() == state


def test_tf32_only_where_it_is_exact_and_a_cpu_head_is_unchanged(matmul_precision, monkeypatch):
    """TF32 holds bf16 / fp16 values exactly, not float32 ones, and is a CUDA mode: a bf16 head on a
    CPU computes exactly the float32 product it computed before, with the flags untouched."""
    from lora_grpo.algo import logprobs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert logprobs._exact_in_tf32(cuda, bf16, bf16) and logprobs._exact_in_tf32(cuda, fp16, bf16)
    assert not logprobs._exact_in_tf32(cuda, fp32, bf16)  # float32 hidden states would be rounded
    assert not logprobs._exact_in_tf32(cpu, bf16, bf16)
    asked = []
    real = logprobs._tf32_matmuls
    monkeypatch.setattr(logprobs, "_tf32_matmuls", lambda enabled: asked.append(enabled) or real(enabled))
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 32).to(bf16), torch.randn(70, 32).to(bf16)
    state = _tf32_state()
    for rows in (70, 7):  # one cast of the weight, and slices of 7 rows: the same products as before
        monkeypatch.setattr(logprobs, "_CAST_ELEMENTS", rows * 32)
        before = torch.cat([hidden.float() @ weight[v : v + rows].float().t() for v in range(0, 70, rows)], 1)
        assert torch.equal(logprobs._head_logits(hidden, weight, None), before)
    assert asked == [False, False] and _tf32_state() == state
