"""On a CUDA device: QLoRA through bitsandbytes' CUDA 4-bit kernels (the rest of the suite runs its CPU
path). Skipped without a GPU; `pytest -m gpu` runs only these."""

import pytest
import torch

from lora_grpo.batch import Batch
from lora_grpo.model import POLICY, reference_forward

from conftest import PROMPTS, adapter_state, assert_same_4bit, changed, frozen_4bit, make_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_qlora_run_on_cuda_moves_the_policy_keeps_the_base_and_hard_syncs_exactly(tiny_base_dir, tmp_path):
    # float32 compute (GPUs default to bfloat16): the reference slot holds the policy's ΔW in other
    # factors, and in bfloat16 their rounding differs by far more than the 1e-5 checked here.
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="4bit", torch_dtype="float32", max_steps=2,
                           ref_sync_steps=2, ref_sync_alpha=1.0)
    model = trainer.model
    base_before, policy_before = frozen_4bit(model), adapter_state(model, POLICY)
    assert all(t.is_cuda for k, t in base_before.items() if k.endswith(".weight"))  # the CUDA kernels, not CPU
    trainer.train()

    assert changed(policy_before, adapter_state(model, POLICY))
    assert_same_4bit(base_before, frozen_4bit(model))
    # Step 2 trained against the initial reference (KL > 0), then the reference was hard-synced.
    assert trainer.history[1]["kl"] > 0 and trainer.history[1]["sync/event"] == 1.0
    rollout = trainer.generate([row["prompt"] for row in PROMPTS[:2]])
    batch = Batch(rollout.input_ids, rollout.attention_mask, rollout.completion_mask,
                                 torch.zeros(rollout.input_ids.shape[0], device=rollout.input_ids.device))
    policy = trainer.log_probs(batch)
    with reference_forward(model):
        reference = trainer.log_probs(batch)
    assert policy.is_cuda
    torch.testing.assert_close(reference, policy, rtol=0, atol=1e-5)
