"""On a CUDA device: QLoRA through bitsandbytes' CUDA 4-bit kernels (the rest of the suite runs its CPU
path). Skipped without a GPU; `pytest -m gpu` runs only these."""

import pytest
import torch
from helpers import PROMPTS, adapter_state, assert_same_4bit, changed, frozen_4bit, make_trainer

from lora_grpo.batch import Batch
from lora_grpo.model.adapters import POLICY, reference_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_qlora_run_on_cuda_moves_the_policy_keeps_the_base_and_hard_syncs_exactly(tiny_base_dir, tmp_path):
    # float32 compute (GPUs default to bfloat16): the reference slot holds the policy's ΔW in other
    # factors, and in bfloat16 their rounding differs by far more than the 1e-5 checked here.
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        quantization="4bit",
        torch_dtype="float32",
        max_steps=2,
        ref_sync_steps=2,
        ref_sync_alpha=1.0,
    )
    model = trainer.model
    base_before, policy_before = frozen_4bit(model), adapter_state(model, POLICY)
    assert all(
        t.is_cuda for k, t in base_before.items() if k.endswith(".weight")
    )  # the CUDA kernels, not CPU
    trainer.train()

    assert changed(policy_before, adapter_state(model, POLICY))
    assert_same_4bit(base_before, frozen_4bit(model))
    # Step 2 trained against the initial reference (KL > 0), then the reference was hard-synced.
    assert trainer.state.log_history[1]["kl"] > 0 and trainer.state.log_history[1]["sync/event"] == 1.0
    rollout = trainer.generate([row["prompt"] for row in PROMPTS[:2]])
    batch = Batch(
        rollout.input_ids,
        rollout.attention_mask,
        rollout.completion_mask,
        torch.zeros(rollout.input_ids.shape[0], device=rollout.input_ids.device),
    )
    policy = trainer.log_probs(batch)
    with reference_forward(model):
        reference = trainer.log_probs(batch)
    assert policy.is_cuda
    torch.testing.assert_close(reference, policy, rtol=0, atol=1e-5)


def test_bf16_log_probs_on_cuda_keep_float32_logits():
    """The float32 head of a bf16 model (defect 5 of issue 16) on the CUDA matmuls: against float64."""
    from torch import nn

    from lora_grpo.algo.logprobs import chunked_log_probs

    torch.manual_seed(0)
    head = nn.Linear(64, 5000, bias=False).cuda().to(torch.bfloat16)
    with torch.no_grad():
        head.weight.mul_(8)
    hidden = torch.randn(4, 32, 64, device="cuda").to(torch.bfloat16)
    targets = torch.randint(0, 5000, (4, 32), device="cuda")
    logp, _ = chunked_log_probs(hidden, head, targets, chunk_size=50)
    logits = hidden.double() @ head.weight.double().t()
    ref = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert logits.abs().max() > 16  # logits where bf16 rounding costs tenths of a nat
    assert (logp.double() - ref).abs().max() < 1e-4


def test_bf16_qlora_run_on_cuda_kl_is_zero_between_identical_adapters(tiny_base_dir, tmp_path):
    from lora_grpo.algo.loss import k3_kl

    trainer = make_trainer(
        tiny_base_dir, tmp_path, quantization="4bit", torch_dtype="bfloat16", max_steps=2, decode_mode="eager"
    )
    trainer.train()
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in trainer.state.log_history)
    rollout = trainer.generate([row["prompt"] for row in PROMPTS[:2]])
    batch = Batch(
        rollout.input_ids,
        rollout.attention_mask,
        rollout.completion_mask,
        torch.zeros(rollout.input_ids.shape[0], device=rollout.input_ids.device),
    )
    first, second = trainer.log_probs(batch), trainer.log_probs(batch)
    assert first.dtype == torch.float32 and torch.equal(
        first, second
    )  # deterministic: identical adapters, KL 0
    assert k3_kl(first, second).abs().max().item() == 0.0


def test_a_float16_qlora_run_on_cuda_scales_its_loss_with_cudas_scaler(tiny_base_dir, tmp_path):
    """What a T4 runs (torch_dtype float16): the 4-bit CUDA kernels computing in float16, the compiled decode
    that decode_mode auto picks for float16 on a GPU Triton serves, the loss scaled by CUDA's GradScaler
    (tests/test_float16.py checks the arithmetic on a CPU)."""
    from lora_grpo.rollout import fast_decode

    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="4bit", torch_dtype="float16", max_steps=2)
    base_before, policy_before = frozen_4bit(trainer.model), adapter_state(trainer.model, POLICY)
    scale = trainer.state.loss_scale
    assert scale.enabled and scale.scaler._device == "cuda"
    trainer.train()
    history = trainer.state.log_history
    assert [m["skipped_nonfinite"] for m in history] == [0.0, 0.0]
    assert [m["loss_scale"] for m in history] == [2.0**16, 2.0**16]
    assert all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all() for m in history)
    assert changed(policy_before, adapter_state(trainer.model, POLICY))
    assert_same_4bit(base_before, frozen_4bit(trainer.model))
    assert fast_decode.kept_cache_bytes(trainer.model) > 0  # the compiled decode keeps its caches; eager none


def greedy(model, tokenizer, prompts, num_generations: int, max_new: int, decode_mode: str):
    """A greedy rollout on CUDA with `decode_mode`."""
    from lora_grpo.rollout import generate_rollout

    return generate_rollout(
        model,
        tokenizer,
        prompts,
        num_generations=num_generations,
        max_prompt_length=None,
        max_completion_length=max_new,
        temperature=0.0,
        generator=torch.Generator(device="cuda"),
        decode_mode=decode_mode,
    )


def test_compiled_decode_on_cuda_matches_eager_in_float32_and_the_plan_counts_its_caches(
    tiny_base_dir, tmp_path
):
    from lora_grpo.rollout import fast_decode

    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        quantization="none",
        torch_dtype="float32",
        decode_mode="compiled",
        micro_batch_size="auto",
        gradient_checkpointing="auto",
        max_steps=1,
    )
    plan = trainer.plan_memory()
    prompts = [row["prompt"] for row in PROMPTS[:2]]

    eager, compiled = (
        greedy(trainer.model, trainer.tokenizer, prompts, 4, 6, mode) for mode in ("eager", "compiled")
    )
    assert fast_decode.unavailable(trainer.model) is None, fast_decode.unavailable(trainer.model)
    assert torch.equal(eager.completion_ids, compiled.completion_ids)
    kept = fast_decode.kept_cache_bytes(trainer.model)
    assert 0 < kept <= plan.kept  # what stays allocated is within what the plan counted


def test_a_sliding_window_model_decodes_compiled_on_cuda_as_eager_does_past_its_window():
    """Tiny Gemma 3 (a sliding layer of a 6-token window beside a full layer), float32 on CUDA: the
    compiled decode (a static cache of every slot, the model's own sliding masks, CUDA graphs) samples
    the eager sampler's greedy tokens, with prompts and completions longer than the window."""
    from helpers import sliding_window_model

    from lora_grpo.rollout import fast_decode
    from lora_grpo.tasks.toy import make_tokenizer

    tok = make_tokenizer()
    model = sliding_window_model(tok, "gemma3", window=6, eos_boost=1.0).to("cuda")
    prompts = ["what is 12*3? ", "1+2+3+4+5=", "7", "hi there"]

    eager, compiled = (greedy(model, tok, prompts, 2, 12, mode) for mode in ("eager", "compiled"))
    assert fast_decode.unavailable(model) is None, fast_decode.unavailable(model)
    assert compiled.completion_ids.shape[1] > 6
    assert torch.equal(eager.completion_ids, compiled.completion_ids)
