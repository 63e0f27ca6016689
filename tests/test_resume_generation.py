"""Resume from a checkpoint inside a generation is exact: with one rollout feeding several optimizer steps
(steps_per_generation, num_iterations), with and without dynamic sampling, one or two micro-batches per
step, a run resumed from any step's checkpoint ends bit for bit where the uninterrupted run ends (both
adapters, the optimizer, every step's record, the sampling and torch RNGs). So does a run stopped by
SIGTERM, or by a failure, between two steps of one generation."""

import os
import signal

import pytest
import torch
from helpers import PROMPTS, make_trainer

from lora_grpo.model.adapters import POLICY, REFERENCE
from lora_grpo.run.failures import StepFailed
from lora_grpo.run.stopping import TrainingInterrupted


def half_constant(prompts, completions, **kwargs):
    """Prompts of even i score 1 whatever the completion (no signal: dynamic sampling drops them); the
    others a digit share."""
    return [
        1.0 if int(p.split("+")[0]) % 2 == 0 else sum(ch.isdigit() for ch in c) / max(1, len(c))
        for p, c in zip(prompts, completions)
    ]


# 4 steps of 2 prompts × 2 completions of 4 tokens, fp32; LoRA dropout (the torch RNG matters in every
# update); a KL to a reference that is soft-synced after step 3 (inside a generation but for num_iterations).
RUN = dict(
    quantization="none",
    num_generations=2,
    prompts_per_step=2,
    max_prompt_length=32,
    max_completion_length=4,
    seed=42,
    gradient_checkpointing=False,
    learning_rate=1e-2,
    lora_dropout=0.1,
    beta=0.04,
    ref_sync_steps=3,
    ref_sync_alpha=0.5,
    max_steps=4,
    train_dataset=[{"prompt": row["prompt"]} for row in PROMPTS[:12]],
    reward_funcs=[half_constant],
)
GENERATIONS = {
    "steps_per_generation=2": dict(steps_per_generation=2),
    "steps_per_generation=4": dict(steps_per_generation=4),
    "num_iterations=2": dict(num_iterations=2),
}
# Gradient accumulation: a step's 4 sequences in one micro-batch or in two.
ACCUMULATION = {"GA=1": dict(micro_batch_size=4), "GA=2": dict(micro_batch_size=2)}
SAMPLING = {"plain": {}, "dynamic": dict(dynamic_sampling=True)}
CASES = [
    (generation, sampling, accumulation)
    for generation in GENERATIONS
    for sampling in SAMPLING
    for accumulation in ACCUMULATION
]


def settings(case) -> dict:
    generation, sampling, accumulation = case
    return {**RUN, **GENERATIONS[generation], **SAMPLING[sampling], **ACCUMULATION[accumulation]}


def _is_timing(key: str) -> bool:
    return key.startswith("time/") or key.endswith("seconds") or key == "tokens_per_second"


def finished(trainer) -> dict:
    """What a run ends with, copied (the trainer and its model are dropped)."""
    optimizer = trainer.optimizer.state_dict()
    return {
        "adapters": {
            adapter: {
                n: p.detach().clone() for n, p in trainer.model.named_parameters() if f".{adapter}." in n
            }
            for adapter in (POLICY, REFERENCE)
        },
        "optimizer": {
            (index, key): value.clone()
            for index, slot in optimizer["state"].items()
            for key, value in slot.items()
            if torch.is_tensor(value)
        },
        "scheduler": trainer.scheduler.state_dict(),
        "history": [
            {k: v for k, v in record.items() if not _is_timing(k)} for record in trainer.state.log_history
        ],
        "sampling_rng": trainer.generator.get_state().clone(),
        "torch_rng": torch.get_rng_state().clone(),
        "data": trainer.state.batches.state_dict(),
    }


def assert_same_run(got: dict, expected: dict) -> None:
    for adapter in (POLICY, REFERENCE):
        for name, tensor in expected["adapters"][adapter].items():
            assert torch.equal(got["adapters"][adapter][name], tensor), f"{adapter}: {name}"
    assert got["optimizer"].keys() == expected["optimizer"].keys()
    for key, tensor in expected["optimizer"].items():
        assert torch.equal(got["optimizer"][key], tensor), f"optimizer state {key}"
    assert got["scheduler"] == expected["scheduler"]
    assert got["history"] == expected["history"]
    assert torch.equal(got["sampling_rng"], expected["sampling_rng"])
    assert torch.equal(got["torch_rng"], expected["torch_rng"])
    assert got["data"] == expected["data"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_base_dir, tmp_path_factory):
    """case -> (what the uninterrupted run ends with, its run dir with a checkpoint after every step);
    each case's run trains once per module, when a test first asks for it."""
    runs = {}

    def get(case):
        if case not in runs:
            root = tmp_path_factory.mktemp("uninterrupted")
            trainer = make_trainer(tiny_base_dir, root, **settings(case), save_steps=1, save_total_limit=0)
            trainer.train()
            runs[case] = (finished(trainer), root / "run")
        return runs[case]

    return get


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_resume_from_any_step_equals_the_uninterrupted_run(
    tiny_base_dir, tmp_path, uninterrupted, case, step
):
    expected, run = uninterrupted(case)
    resumed = make_trainer(
        tiny_base_dir, tmp_path, **settings(case), resume_from_checkpoint=str(run / f"checkpoint-{step}")
    )
    resumed.train()
    assert resumed.state.global_step == 4
    assert_same_run(finished(resumed), expected)


def test_a_checkpoint_inside_a_generation_holds_its_steps_left(uninterrupted):
    from lora_grpo.run.checkpoint import load_checkpoint_state

    _, run = uninterrupted(("steps_per_generation=4", "plain", "GA=1"))
    left = []
    for step in (1, 2, 3, 4):
        _, blobs = load_checkpoint_state(run / f"checkpoint-{step}")
        generation = blobs["process_state"][0]["generation"]
        left.append(len(generation["steps"]))
        for saved in generation["steps"]:
            assert saved["input_ids"].device.type == "cpu" and saved["input_ids"].shape[0] == 4
            assert saved["old_logp"] is not None  # the rollout is trained on after its first update
    assert left == [3, 2, 1, 0]  # a generation of 4 steps; the last checkpoint ends it


def test_the_resume_says_it_continues_inside_a_generation(tiny_base_dir, tmp_path, uninterrupted, capsys):
    case = ("num_iterations=2", "plain", "GA=1")
    _, run = uninterrupted(case)
    resumed = make_trainer(
        tiny_base_dir, tmp_path, **settings(case), resume_from_checkpoint=str(run / "checkpoint-1")
    )
    resumed.train()
    assert "at step 1, inside a generation: its 1 step(s) left train on the checkpoint's rollout" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("generation", ["steps_per_generation=2", "num_iterations=2"])
def test_sigterm_inside_a_generation_keeps_a_checkpoint_that_resumes_exactly(
    tiny_base_dir, tmp_path, uninterrupted, generation
):
    case = (generation, "plain", "GA=1")
    expected, _ = uninterrupted(case)
    trainer = make_trainer(tiny_base_dir, tmp_path, **settings(case), save_steps=0)
    original = trainer.timed_update

    def update_then_signal(batch):
        out = original(batch)
        if trainer.state.global_step == 0:  # arrives during step 1, the generation's first
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.timed_update = update_then_signal
    with pytest.raises(TrainingInterrupted) as info:
        trainer.train()
    assert info.value.checkpoint == tmp_path / "run" / "checkpoint-1"
    resumed = make_trainer(tiny_base_dir, tmp_path, **settings(case), resume_from_checkpoint="latest")
    resumed.train()
    assert_same_run(finished(resumed), expected)


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_a_failure_in_a_generations_second_step_keeps_the_first_and_resumes_exactly(
    tiny_base_dir, tmp_path, uninterrupted, sampling, monkeypatch
):
    case = ("steps_per_generation=2", sampling, "GA=2")
    expected, _ = uninterrupted(case)
    trainer = make_trainer(tiny_base_dir, tmp_path, **settings(case), save_steps=0)
    real_accumulate = trainer.update.accumulate

    def accumulate(*args, **kwargs):  # after a micro-batch's backward, before the optimizer step
        out = real_accumulate(*args, **kwargs)
        if trainer.state.global_step == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out

    monkeypatch.setattr(trainer.update, "accumulate", accumulate)
    with pytest.raises(StepFailed, match=r"^step 2/4 stopped: the update raised RuntimeError") as info:
        trainer.train()
    assert info.value.checkpoint == tmp_path / "run" / "checkpoint-1"
    monkeypatch.undo()
    resumed = make_trainer(tiny_base_dir, tmp_path, **settings(case), resume_from_checkpoint="latest")
    resumed.train()
    assert_same_run(finished(resumed), expected)
