"""float16 runs: the loss scale (optim.LossScale) keeps small gradients that float16 activations would
flush to zero, skips and halves on an overflow without ending the run, and is saved with the run."""

import pytest
import torch
from helpers import adapter_state, changed, make_trainer

from lora_grpo.batch import Batch
from lora_grpo.model.adapters import POLICY
from lora_grpo.optim import LossScale


def _gradient(trainer, batch, monkeypatch) -> torch.Tensor:
    """The step's unscaled adapter gradient, flat, in float32 (the optimizer does not step)."""
    captured = []

    def capture(*args):
        captured.extend(p.grad.detach().float().flatten() for p in trainer.params)
        trainer.state.loss_scale.update()
        return False

    monkeypatch.setattr(trainer.update, "_step_unless_nonfinite", capture)
    for p in trainer.params:
        p.grad = None
    trainer.update(batch, 8)
    monkeypatch.undo()
    return torch.cat(captured)


@pytest.mark.parametrize("advantage", [1.0, 1e-4])
def test_float16_gradients_are_float32s_with_the_loss_scale_and_underflow_without_it(
    tiny_base_dir, tmp_path, monkeypatch, advantage
):
    half = make_trainer(tiny_base_dir, tmp_path / "a", quantization="none", torch_dtype="float16", beta=0.0)
    full = make_trainer(tiny_base_dir, tmp_path / "b", quantization="none", torch_dtype="float32", beta=0.0)
    with torch.no_grad():  # the same weights (float16's), computed in float32: the independent gradient
        weights = dict(half.model.named_parameters())
        for name, p in full.model.named_parameters():
            p.copy_(weights[name].float())
    assert half.state.loss_scale.enabled and not full.state.loss_scale.enabled
    rollout = half.generate(["1+1=", "2+2="])
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25]) * advantage
    batch = Batch.from_rollout(rollout, advantages, mask_truncated_completions=False)

    exact = _gradient(full, batch, monkeypatch)
    scaled = _gradient(half, batch, monkeypatch)
    half.state.loss_scale = LossScale(False, "cpu")
    unscaled = _gradient(half, batch, monkeypatch)

    def error(g):
        return float((g - exact).norm() / exact.norm())

    flushed = float(((unscaled == 0) & (exact != 0)).float().mean())
    assert error(scaled) < 2e-3  # measured 6e-4 to 7e-4 at both sizes
    if advantage == 1.0:  # nothing small to lose: the scale changes nothing that matters
        assert error(unscaled) < 2e-3 and flushed == 0
    else:  # measured: 62% off, 12% of the entries zero
        assert error(unscaled) > 0.2 and flushed > 0.05


@pytest.mark.parametrize("quantization", ["none", "4bit"])
def test_an_overflow_skips_the_update_halves_the_scale_and_does_not_end_the_run(
    tiny_base_dir, tmp_path, quantization, caplog
):
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        quantization=quantization,
        torch_dtype="float16",
        max_steps=3,
        max_nonfinite_updates=1,  # one counted NaN/inf update would end the run
    )
    scale = trainer.state.loss_scale
    scale.load_state_dict({**scale.state_dict(), "scale": 2.0**100})  # float16 gradients overflow at once
    before = adapter_state(trainer.model, POLICY)
    with caplog.at_level("INFO", logger="lora_grpo.update"):
        trainer.train()
    history = trainer.state.log_history
    assert [m["skipped_nonfinite"] for m in history] == [1.0, 1.0, 1.0]
    assert [m["loss_scale"] for m in history] == [2.0**100, 2.0**99, 2.0**98]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)  # the loss itself was finite
    assert scale.value == 2.0**97 and trainer.state.nonfinite_in_a_row == 0
    assert not changed(before, adapter_state(trainer.model, POLICY))
    assert "float16 gradients overflowed at loss scale 1.26765e+30: update skipped" in caplog.text


def test_a_float16_run_resumes_with_its_loss_scale_exactly(tiny_base_dir, tmp_path):
    kw = dict(quantization="none", torch_dtype="float16", max_steps=4)
    full = make_trainer(tiny_base_dir, tmp_path / "a", save_steps=3, **kw)
    scale = full.state.loss_scale
    # doubling every 2 steps: a resumed run that lost the scale or its growth count logs another one
    scale.load_state_dict({**scale.state_dict(), "scale": 256.0, "growth_interval": 2})
    full.train()
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path / "b",
        resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-3"),
        **kw,
    )
    resumed.train()
    assert [m["loss_scale"] for m in full.state.log_history] == [256.0, 256.0, 512.0, 512.0]
    assert [m["loss_scale"] for m in resumed.state.log_history] == [256.0, 256.0, 512.0, 512.0]
    assert resumed.state.loss_scale.state_dict() == full.state.loss_scale.state_dict()
    assert full.state.loss_scale.value == 1024.0  # step 4 was the second of the scale 512
    assert not changed(adapter_state(full.model, POLICY), adapter_state(resumed.model, POLICY))
    assert [m["loss"] for m in full.state.log_history] == [m["loss"] for m in resumed.state.log_history]


@pytest.mark.parametrize(
    "dtype, on", [(torch.float16, True), (torch.bfloat16, False), (torch.float32, False)]
)
def test_only_a_float16_model_has_a_loss_scale(tiny_base_dir, dtype, on):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=dtype)
    scale = LossScale.for_model(model, torch.device("cpu"))
    assert scale.enabled == on
    assert scale.value == (2.0**16 if on else 1.0)
    loss = torch.tensor(0.5)
    assert scale.scale(loss).item() == (0.5 * 2**16 if on else 0.5)


def test_a_4bit_base_computing_in_float16_has_a_loss_scale_whatever_its_embeddings(tiny_base_dir):
    """bnb_4bit_compute_dtype float16 with the model loaded in float32 (a QLoRA model object a TRL script passes):
    the embeddings, norms and head float32, the 4-bit layers' forward and backward float16. Unscaled, a small
    advantage's gradients through the base came out 65% off float32's (found in review)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def loaded(compute):
        quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute)
        return AutoModelForCausalLM.from_pretrained(
            tiny_base_dir, quantization_config=quantized, dtype=torch.float32
        )

    half = loaded(torch.float16)
    assert half.get_input_embeddings().weight.dtype == torch.float32
    assert LossScale.for_model(half, torch.device("cpu")).enabled
    assert not LossScale.for_model(loaded(torch.float32), torch.device("cpu")).enabled


def test_the_loss_scale_is_made_for_the_runs_device(tiny_base_dir, monkeypatch):
    """GradScaler switches itself off for a device type that is not there: a CUDA run's scaler is CUDA's,
    a CPU run's the CPU's (this machine has no GPU: CUDA is faked present for the first)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = LossScale.for_model(model, torch.device("cuda", 0))
    assert on_gpu.enabled and on_gpu.scaler._device == "cuda"
    monkeypatch.undo()
    on_cpu = LossScale.for_model(model, torch.device("cpu"))
    assert on_cpu.enabled and on_cpu.scaler._device == "cpu"


def test_the_trl_front_door_logs_the_windows_last_loss_scale():
    """A scale is a state, not a rate: a TRL record of several steps carries the latest, as grad_norm."""
    from lora_grpo.trl.trainer import trl_record

    window = [{"step": 1, "loss_scale": 4.0, "loss": 1.0}, {"step": 2, "loss_scale": 2.0, "loss": 3.0}]
    assert trl_record(window) == {"loss_scale": 2.0, "loss": 2.0}


def test_a_first_step_without_a_row_to_train_unscales_nothing_and_goes_on(tiny_base_dir, tmp_path):
    """Every reward equal at beta 0: the step scales no loss (no forward, no backward), which is where
    GradScaler would make its scale; the step still ends, as a float32 one does."""

    def same_reward(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        reward_funcs=(same_reward,),
        quantization="none",
        torch_dtype="float16",
        beta=0.0,
        max_steps=2,
    )
    trainer.train()
    history = trainer.state.log_history
    assert [m["zero_advantage_skipped"] for m in history] == [1.0, 1.0]
    assert [(m["skipped_nonfinite"], m["loss_scale"]) for m in history] == [(0.0, 2.0**16)] * 2


def test_a_step_that_raised_after_unscaling_leaves_the_scale_ready_for_the_next_train(
    tiny_base_dir, tmp_path
):
    """An out-of-memory error in the optimizer's step, between unscale and update: the next train() on the same
    trainer unscales again (GradScaler refuses a second unscale_ before an update) at the same scale."""
    from lora_grpo.run.failures import StepFailed

    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", torch_dtype="float16", max_steps=2)
    real, calls = trainer.optimizer.step, []

    def out_of_memory_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    trainer.optimizer.step = out_of_memory_once
    with pytest.raises(StepFailed, match="out of memory"):
        trainer.train()
    assert trainer.state.loss_scale.value == 2.0**16
    trainer.train()
    assert [m["loss_scale"] for m in trainer.state.log_history] == [2.0**16, 2.0**16]
    assert len(calls) == 3


def test_logits_that_overflow_float16_mid_run_say_to_resume_in_bfloat16_or_float32(tiny_base_dir, tmp_path):
    """A float16 model whose activations overflow only on inputs the start-up check's prompts do not hold: the
    rollout's sampler meets inf / NaN probabilities. Torch's own words alone said nothing of float16, and 'fix the
    cause, then resume' resumed into the same overflow (found in review)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_grpo.run.failures import StepFailed

    base = tmp_path / "overflows"
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids("x")] = 65504.0  # float16's largest
        model.model.layers[0].self_attn.o_proj.weight.mul_(1000.0)
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    prompts = [{"prompt": "1+1="}] * 4 + [{"prompt": "x+1="}] * 4  # the second step's prompts hold the token
    trainer = make_trainer(
        str(base),
        tmp_path,
        quantization="none",
        torch_dtype="float16",
        max_steps=2,
        shuffle_dataset=False,
        train_dataset=prompts,
        prompts_per_step=4,
        save_steps=0,
    )
    with pytest.raises(StepFailed) as info:
        trainer.train()
    assert "in float16 the model's activations overflowed ±65504 on this step's prompts" in str(info.value)
    assert "resume with torch_dtype bfloat16 (on a GPU that has it) or float32" in str(info.value)
    # Greedy decoding (the eval's) took token 0 from such logits, quietly: refused too
    with pytest.raises(RuntimeError, match="the model's logits were inf or NaN while decoding greedily"):
        trainer.generate(["x+1="], 1, 0.0)
