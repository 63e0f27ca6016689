"""Section 6, bf16 KL: the KL between identical adapters on a bf16 and a 4-bit base, lora_grpo's
float32 head against the model's own bf16 logits, and (CUDA) the head's TF32 matmul against float64."""

from __future__ import annotations

import torch

from benchmarks._common import QWEN2_SHAPES
from benchmarks.gpu_check.harness import Run, release


def check_bf16_kl(run: Run) -> None:
    from transformers import AutoModelForCausalLM

    from lora_grpo import GRPOConfig
    from lora_grpo.algo.logprobs import sequence_log_probs
    from lora_grpo.algo.loss import k3_kl
    from lora_grpo.model.adapters import POLICY, REFERENCE, lora_layers, use_adapter
    from lora_grpo.model.load import attach_adapters, keep_4bit_weights_fixed, load_model
    from lora_grpo.model.reference import sync_reference

    device, shape = run.device, run.shape("qwen2.5-0.5b")
    path = run.model(shape)
    cfg = GRPOConfig(model_name_or_path=path, lora_r=16, lora_alpha=32, gradient_checkpointing=False)
    models = {}
    for dtype in (torch.bfloat16, torch.float32):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        models[dtype] = attach_adapters(base, cfg).eval()
    bf16, fp32 = models[torch.bfloat16], models[torch.float32]
    four_bit, _ = load_model(
        GRPOConfig(
            model_name_or_path=path,
            tokenizer_name_or_path=f"{path}/tokenizer",
            quantization="4bit",
            torch_dtype="bfloat16",
            lora_r=16,
            lora_alpha=32,
            gradient_checkpointing=False,
        ),
        device_map={"": device},
    )
    keep_4bit_weights_fixed(four_bit)
    four_bit.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for model in (bf16, four_bit):
            for _, module in lora_layers(model):
                weight = module.lora_B[POLICY].weight
                weight.copy_(torch.randn(weight.shape, generator=g) * 0.02)
            sync_reference(model, 1.0)  # the reference slot: an exact copy of the policy, other factors
    batch, length, completion = (4, 64, 32) if run.args.cpu else (16, 256, 128)
    ids = torch.randint(3, QWEN2_SHAPES[shape]["vocab_size"], (batch, length), generator=g).to(device)
    mask = torch.ones_like(ids)

    def logp(model, adapter):
        with use_adapter(model, adapter), torch.no_grad():
            return sequence_log_probs(model, ids, mask, completion)[0]

    def own_logits_logp(model, adapter):  # log-probs from the model's own (bf16-rounded) logits
        with use_adapter(model, adapter), torch.no_grad():
            logits = (
                model(input_ids=ids, attention_mask=mask, logits_to_keep=completion + 1)
                .logits[:, :-1]
                .float()
            )
            return torch.log_softmax(logits, -1).gather(-1, ids[:, -completion:, None]).squeeze(-1)

    def kl(a, b) -> float:
        return k3_kl(a, b).mean().item()

    same = kl(logp(bf16, POLICY), logp(bf16, POLICY))
    same_4bit = kl(logp(four_bit, POLICY), logp(four_bit, POLICY))
    synced, synced_4bit = (kl(logp(m, POLICY), logp(m, REFERENCE)) for m in (bf16, four_bit))
    run.findings.update(
        {
            "kl_same_bf16": same,
            "kl_same_4bit": same_4bit,
            "kl_synced_bf16": synced,
            "kl_synced_4bit": synced_4bit,
        }
    )
    run.expect(same == 0, f"bf16 KL(policy ‖ the same policy) = {same:.3e}: exactly 0")
    run.expect(
        abs(same_4bit) < 1e-6,
        f"4-bit base, bf16 compute: KL(policy ‖ the same policy) = {same_4bit:.3e}: |KL| < 1e-6",
    )
    print(
        f"KL(policy ‖ reference right after a hard sync): bf16 {synced:.3e}, 4-bit {synced_4bit:.3e} (other factor "
        "shapes; the trainer skips this forward: reference_is_policy)"
    )
    with torch.no_grad():
        for _, module in lora_layers(bf16):  # a nearby reference: the policy's B moved by noise of std 0.005
            weight = module.lora_B[REFERENCE].weight
            weight.add_(torch.randn(weight.shape, generator=g).to(weight) * 0.005)
        fp32_params = dict(fp32.named_parameters())
        for name, p in bf16.named_parameters():
            if "lora_" in name:
                fp32_params[name].copy_(p.float())  # the same adapters (float32 in both) on the float32 base
    exact = kl(logp(fp32, POLICY), logp(fp32, REFERENCE))
    ours = kl(logp(bf16, POLICY), logp(bf16, REFERENCE))
    rounded = kl(own_logits_logp(bf16, POLICY), own_logits_logp(bf16, REFERENCE))
    run.findings.update(
        {"kl_nearby_fp32": exact, "kl_nearby_ours_bf16": ours, "kl_nearby_bf16_logits": rounded}
    )
    print(
        f"nearby adapters, KL per token: float32 model {exact:.4e}; bf16 model with lora_grpo's float32 head "
        f"{ours:.4e} ({ours / exact - 1:+.1%}); bf16 from the model's own bf16 logits {rounded:.4e} "
        f"({rounded / exact - 1:+.1%})"
    )
    del bf16, fp32, four_bit, models
    release(run)
    if run.cuda:
        check_tf32_head(run)
    else:
        run.not_here("the bf16 head's float32 matmul on TF32 (a CUDA mode)")


def check_tf32_head(run: Run) -> None:
    """A Qwen2.5-sized bf16 head through logprobs._head_logits (TF32 on CUDA) against float64, beside
    the same matmul in IEEE float32; the process's TF32 flag as it was."""
    from lora_grpo.algo.logprobs import _head_logits

    g = torch.Generator(device=run.device).manual_seed(0)
    hidden = torch.randn(256, 896, generator=g, device=run.device).to(torch.bfloat16)
    weight = (torch.randn(151936, 896, generator=g, device=run.device) * 0.05).to(torch.bfloat16)
    flag = torch.backends.cuda.matmul.allow_tf32
    ours = _head_logits(hidden, weight, None)
    ieee = hidden.float() @ weight.float().t()
    exact = hidden.double() @ weight.double().t()
    err_ours, err_ieee = (
        (ours.double() - exact).abs().max().item(),
        (ieee.double() - exact).abs().max().item(),
    )
    scale = exact.abs().max().item()
    run.findings.update({"tf32_head_error": err_ours, "ieee_head_error": err_ieee, "head_logit_scale": scale})
    print(
        f"bf16 head, float32 logits: max error TF32 {err_ours:.3g}, IEEE float32 {err_ieee:.3g} "
        f"(|logits| ≤ {scale:.3g})"
    )
    run.expect(  # exact products, float32 sums in another order: IEEE's error, not TF32's 2⁻¹¹ of each input
        err_ours <= max(4 * err_ieee, 1e-6 * scale),
        "the TF32 head matmul is as exact as IEEE float32 for bf16 inputs (≤ 4× its error)",
    )
    run.expect(torch.backends.cuda.matmul.allow_tf32 == flag, f"the TF32 flag restored ({flag})")
