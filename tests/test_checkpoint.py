"""Checkpoints: damaged, foreign or misplaced ones get a clear error; failed writes keep the previous
checkpoint whole; resume is exact (4-bit base, LoRA dropout) and each process gets its own RNG."""

import errno
import json
import random
import shutil

import numpy as np
import pytest
import torch
from helpers import SMALL_RUN, assert_same_adapters, make_trainer

import lora_grpo.run.checkpoint as ckpt
from lora_grpo.model.adapters import POLICY, POLICY_DIR, REFERENCE_DIR
from lora_grpo.rng import rng_state, set_rng_state
from lora_grpo.run.checkpoint import CheckpointError
from lora_grpo.run.failures import StepFailed


@pytest.fixture(scope="module")
def saved_run(tiny_base_dir, tmp_path_factory):
    """A finished 2-step run with checkpoint-1 and checkpoint-2 (copied per test before damaging)."""
    root = tmp_path_factory.mktemp("saved")
    make_trainer(
        tiny_base_dir, root, quantization="none", max_steps=2, save_steps=1, save_total_limit=5
    ).train()
    return root / "run"


def resume(tiny_base_dir, tmp_path, checkpoint, **overrides):
    kw = dict(quantization="none", max_steps=3, resume_from_checkpoint=str(checkpoint))
    kw.update(overrides)
    return make_trainer(tiny_base_dir, tmp_path, **kw).train()


@pytest.fixture
def run_copy(saved_run, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(saved_run, target)
    return target


@pytest.mark.parametrize(
    "damage, match",
    [
        (
            lambda c: (c / POLICY_DIR / ckpt.ADAPTER_WEIGHTS).write_bytes(
                (c / POLICY_DIR / ckpt.ADAPTER_WEIGHTS).read_bytes()[:100]
            ),
            r"policy/adapter_model.safetensors is damaged or truncated",
        ),
        (lambda c: (c / ckpt.STATE_BLOBS).write_bytes(b"not a torch file"), r"trainer_state.pt is damaged"),
        (lambda c: (c / ckpt.STATE_JSON).write_text('{"step": 2, "batc'), r"lora_grpo_state.json is damaged"),
        (
            lambda c: (c / REFERENCE_DIR / ckpt.ADAPTER_WEIGHTS).unlink(),
            r"missing reference/adapter_model.safetensors",
        ),
        (lambda c: (c / "config.yaml").unlink(), r"missing config.yaml"),
    ],
    ids=["truncated-adapter", "corrupt-blobs", "truncated-json", "missing-adapter", "missing-config"],
)
def test_a_damaged_checkpoint_names_the_file(tiny_base_dir, tmp_path, run_copy, damage, match):
    damage(run_copy / "checkpoint-2")
    with pytest.raises(CheckpointError, match=match) as info:
        resume(tiny_base_dir, tmp_path, run_copy / "checkpoint-2")
    if "damaged" in match or "missing" in match:
        assert "checkpoint-1" in str(info.value)  # points at the one that is still good


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"lora_r": 8}, "lora_r"),
        ({"lora_target_modules": ["q_proj", "v_proj"]}, "lora_target_modules"),
        ({"ref_rank": 4}, "ref_rank"),
    ],
)
def test_a_checkpoint_of_another_config_is_refused(tiny_base_dir, tmp_path, saved_run, overrides, field):
    with pytest.raises(CheckpointError, match=rf"different config \({field}: checkpoint") as info:
        resume(tiny_base_dir, tmp_path, saved_run / "checkpoint-2", **overrides)
    assert "init_adapter=" in str(info.value)


def test_a_checkpoint_of_another_model_is_refused(tiny_base_dir, tmp_path, run_copy):
    cfg = run_copy / "checkpoint-2" / "config.yaml"
    cfg.write_text(
        cfg.read_text().replace(f"model_name_or_path: {tiny_base_dir}", "model_name_or_path: other/model")
    )
    with pytest.raises(CheckpointError, match=r"model_name_or_path: checkpoint 'other/model'"):
        resume(tiny_base_dir, tmp_path, run_copy / "checkpoint-2")


def test_a_checkpoint_of_another_process_count_resumes_and_says_so(tiny_base_dir, tmp_path, run_copy, caplog):
    """As TRL's: a checkpoint of 2 processes resumes under 1 (the adapters, optimizer, schedule and data position;
    process 1's sampling stream is left, and the line says the run is no longer the uninterrupted one's)."""
    state_file = run_copy / "checkpoint-2" / ckpt.STATE_JSON
    state = json.loads(state_file.read_text())
    state["num_processes"] = 2
    state_file.write_text(json.dumps(state))
    with caplog.at_level("WARNING", logger="lora_grpo.run.checkpoint"):
        summary = resume(tiny_base_dir, tmp_path, run_copy / "checkpoint-2")
    assert summary["steps"] == 3
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "saved by 2 process(es); this run has 1: resumed with the checkpoint's adapters" in said
    assert "the sampling streams of process 1 of that run are left" in said


def test_a_checkpoint_of_processes_that_each_held_a_shard_resumes_at_the_same_share_of_its_epoch(
    tiny_base_dir, tmp_path, run_copy, caplog
):
    """Written before every process held the whole dataset (trainer_state.json the loop's state; each of 2
    processes drew from its own len // 2 rows): its position is taken to the same share of the epoch."""
    checkpoint = run_copy / "checkpoint-2"
    state = json.loads((checkpoint / ckpt.STATE_JSON).read_text())
    rows = state["batches"]["num_rows"]
    state["num_processes"] = 2
    state["batches"].update(num_rows=rows // 2, index=1)
    (checkpoint / ckpt.STATE_JSON).unlink()
    (checkpoint / ckpt.TRAINER_STATE_JSON).write_text(json.dumps(state))  # as it was then, beside its files
    with caplog.at_level("WARNING", logger="lora_grpo.run.checkpoint"):
        summary = resume(tiny_base_dir, tmp_path, checkpoint)
    assert summary["steps"] == 3
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"written by 2 processes when each drew from its own {rows // 2} of the {rows} rows" in said
    assert f"(row 2 of {rows})" in said


def test_a_checkpoint_inside_a_generation_resumes_only_under_its_process_count(tiny_base_dir, tmp_path):
    make_trainer(
        tiny_base_dir, tmp_path, quantization="none", max_steps=2, save_steps=1, steps_per_generation=2
    ).train()
    state_file = tmp_path / "run" / "checkpoint-1" / ckpt.STATE_JSON  # the generation's second step left
    state = json.loads(state_file.read_text())
    state["num_processes"] = 2
    state_file.write_text(json.dumps(state))
    with pytest.raises(
        CheckpointError,
        match=r"saved by 2 process\(es\) inside a generation .* and this run has 1: those rows cannot be dealt out"
        r".*--nproc_per_node 2",
    ):
        resume(tiny_base_dir, tmp_path / "again", tmp_path / "run" / "checkpoint-1", steps_per_generation=2)


def test_shapes_that_differ_are_named(tiny_base_dir, tmp_path, run_copy):
    # Same config text, but the tensors are of another rank: the loader names the tensor and shapes.
    from safetensors.torch import load_file, save_file

    f = run_copy / "checkpoint-2" / POLICY_DIR / ckpt.ADAPTER_WEIGHTS
    state = load_file(str(f))
    key = next(k for k in state if "lora_A" in k)
    state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    save_file(state, str(f))
    with pytest.raises(CheckpointError, match=rf"{key} has shape .* another lora_r"):
        resume(tiny_base_dir, tmp_path, run_copy / "checkpoint-2")


def test_resume_from_a_run_dir_or_an_adapter_says_what_to_pass(tiny_base_dir, tmp_path, saved_run):
    with pytest.raises(CheckpointError, match=r"is a run directory, not a checkpoint.*checkpoint-2"):
        resume(tiny_base_dir, tmp_path, saved_run)
    with pytest.raises(CheckpointError, match=r"is an adapter, not a checkpoint.*init_adapter="):
        resume(tiny_base_dir, tmp_path, saved_run / "adapter")
    with pytest.raises(CheckpointError, match=r"does not exist"):
        resume(tiny_base_dir, tmp_path, saved_run / "checkpoint-9")
    with pytest.raises(CheckpointError, match=r"has no checkpoint-N directory"):
        resume(tiny_base_dir, tmp_path / "empty", "latest")


def test_peft_loads_a_checkpoint_itself_as_its_policy_as_from_a_trl_checkpoint(tiny_base_dir, saved_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def lora(path):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(path))
        return {k: v for k, v in model.state_dict().items() if "lora_" in k}

    checkpoint = saved_run / "checkpoint-2"
    at_root, policy = lora(checkpoint), lora(checkpoint / POLICY_DIR)
    assert at_root.keys() == policy.keys() and all(torch.equal(at_root[k], policy[k]) for k in policy)
    assert (checkpoint / ckpt.ADAPTER_WEIGHTS).read_bytes() == (
        checkpoint / POLICY_DIR / ckpt.ADAPTER_WEIGHTS
    ).read_bytes()


def test_a_checkpoint_and_the_final_adapter_hold_the_tokenizer_and_transformers_trainer_state(
    tiny_base_dir, saved_run
):
    """As TRL's checkpoints: AutoTokenizer loads a checkpoint (and the final adapter), and trainer_state.json is
    transformers' TrainerState alone (TrainerState.load_from_json failed on the loop's own fields), with the
    run's records; the loop's state is lora_grpo_state.json."""
    from transformers import AutoTokenizer, TrainerState

    base = AutoTokenizer.from_pretrained(tiny_base_dir)
    text = "12+30=42"
    for directory in (saved_run / "checkpoint-1", saved_run / "checkpoint-2", saved_run / "adapter"):
        assert AutoTokenizer.from_pretrained(directory)(text).input_ids == base(text).input_ids
    checkpoint = saved_run / "checkpoint-2"
    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    ours = json.loads((checkpoint / ckpt.STATE_JSON).read_text())
    assert (state.global_step, state.max_steps) == (2, 2)
    assert len(state.log_history) == 2 and state.log_history == ours["log_history"]
    assert {"reward/mean", "kl", "loss"} <= set(state.log_history[1])
    # the policy's model card beside it, as peft writes one: the Hub's metadata, the steps it stands at
    from huggingface_hub import ModelCard

    for directory, steps in ((saved_run / "checkpoint-1", 1), (checkpoint, 2), (saved_run / "adapter", 2)):
        card = ModelCard.load(directory / "README.md")
        assert card.data.library_name == "peft" and "lora_grpo" in card.data.tags
        assert f"| optimizer steps | {steps} |" in card.text
    # its "Use it" code, run as written, loads the trained policy
    code = card.text.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    exec(code, scope)
    from safetensors.torch import load_file

    loaded = {k.replace(".default.", "."): v for k, v in scope["model"].state_dict().items() if "lora_" in k}
    saved = load_file(str(saved_run / "adapter" / ckpt.ADAPTER_WEIGHTS))
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert "batches" in ours and not hasattr(state, "batches")


def test_transformers_trainer_state_in_the_run_directory_leaves_resume_alone(
    tiny_base_dir, tmp_path, run_copy
):
    # what save_state() writes into output_dir (open-r1's script): the run is no checkpoint for it
    shutil.copyfile(run_copy / "checkpoint-2" / "trainer_state.json", run_copy / "trainer_state.json")
    assert resume(tiny_base_dir, tmp_path, run_copy / "checkpoint-2")["steps"] == 3


def test_a_checkpoint_without_its_loop_state_names_that_file(tiny_base_dir, tmp_path, run_copy):
    # trainer_state.json beside it is transformers' alone: not the loop's state of an old checkpoint
    (run_copy / "checkpoint-2" / ckpt.STATE_JSON).unlink()
    with pytest.raises(
        CheckpointError, match=r"not a complete lora_grpo checkpoint: missing lora_grpo_state\.json"
    ):
        resume(tiny_base_dir, tmp_path, run_copy / "checkpoint-2")


def test_a_trl_checkpoint_is_named_as_one_with_the_way_to_start_from_its_adapter(
    tiny_base_dir, tmp_path, saved_run
):
    # what TRL's GRPOTrainer writes: the adapter, the tokenizer and transformers' trainer_state.json at the root
    trl_checkpoint = tmp_path / "trl-run" / "checkpoint-5"
    trl_checkpoint.mkdir(parents=True)
    for name in (ckpt.ADAPTER_WEIGHTS, ckpt.ADAPTER_CONFIG, "trainer_state.json", "tokenizer.json"):
        shutil.copyfile(saved_run / "checkpoint-2" / name, trl_checkpoint / name)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint of transformers' Trainer \(TRL's GRPOTrainer writes these\), not of lora_grpo.*"
        r"init_adapter=.*checkpoint-5",
    ):
        resume(tiny_base_dir, tmp_path, trl_checkpoint)


def test_resume_from_checkpoint_true_is_the_newest_checkpoint_as_in_transformers(
    tiny_base_dir, tmp_path, saved_run
):
    # transformers' spelling of 'latest' (issue 47: it reached Path(True) in the run directory's claim)
    shutil.copytree(saved_run, tmp_path / "run")
    assert resume(tiny_base_dir, tmp_path, True, resume_from_checkpoint=True)["steps"] == 3
    assert not (tmp_path / "run" / "previous-run-1").exists()  # the same run, continued
    with pytest.raises(
        CheckpointError,
        match=r"^No valid checkpoint found in output directory \(.*empty.*\): resume_from_checkpoint=True",
    ):
        resume(tiny_base_dir, tmp_path / "empty", True, resume_from_checkpoint=True)


@pytest.mark.parametrize("failure", [errno.ENOSPC, errno.EACCES])
@pytest.mark.parametrize("where", ["checkpoint", "final adapter"])
def test_a_failed_write_keeps_the_previous_checkpoint_and_stops_clearly(
    tiny_base_dir, tmp_path, monkeypatch, failure, where
):
    trainer = make_trainer(
        tiny_base_dir, tmp_path, quantization="none", max_steps=3, save_steps=1, save_total_limit=5
    )
    real_save = ckpt.save_adapter
    calls = {"n": 0}

    def failing_save(model, path, adapter=POLICY, **kwargs):
        # checkpoint-1 writes 2 adapters; fail inside checkpoint-2, or at the final adapter.
        calls["n"] += 1
        fail = calls["n"] == 3 if where == "checkpoint" else path.name == "adapter"
        if fail:
            raise OSError(
                failure,
                errno.errorcode[failure]
                + ": "
                + ("No space left on device" if failure == errno.ENOSPC else "Permission denied"),
            )
        return real_save(model, path, adapter, **kwargs)

    monkeypatch.setattr(ckpt, "save_adapter", failing_save)
    with pytest.raises(
        StepFailed,
        match=r"stopped: the checkpoint raised \w+Error: .*could not write .*the previous checkpoint "
        r".*checkpoint-\d is intact.*the last checkpoint, .*checkpoint-\d, is kept.*"
        r"resume_from_checkpoint='latest'",
    ) as info:
        trainer.train()
    assert info.value.stage == "checkpoint" and info.value.__cause__.errno == failure
    run = tmp_path / "run"
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    monkeypatch.setattr(ckpt, "save_adapter", real_save)
    # The newest checkpoint on disk is whole: a run resumes from it and finishes.
    summary = resume(tiny_base_dir, tmp_path, "latest", save_steps=0)
    assert summary["steps"] == 3


def test_resume_is_exact_with_a_4bit_base_and_lora_dropout(tiny_base_dir, tmp_path):
    kw = dict(quantization="4bit", lora_dropout=0.2, ref_sync_steps=3, ref_sync_alpha=0.5, max_steps=4)
    full = make_trainer(tiny_base_dir, tmp_path / "a", save_steps=2, **kw)
    full.train()
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path / "b",
        resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-2"),
        **kw,
    )
    resumed.train()
    assert_same_adapters(full.model, resumed.model)
    assert [m["loss"] for m in full.state.log_history] == [m["loss"] for m in resumed.state.log_history]


def test_rng_state_round_trips_every_generator():
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_each_process_restores_its_own_rng_slot(tiny_base_dir, tmp_path, saved_run, monkeypatch):
    # Process 1 of 2 must get slot 1 (its own dropout and sampling streams), not process 0's.
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none")
    _, blobs = ckpt.load_checkpoint_state(saved_run / "checkpoint-2")
    other = {
        **blobs["rng"][0],
        "torch": torch.manual_seed(123).get_state(),
        "sampling": torch.Generator().manual_seed(7).get_state(),
    }
    blobs["rng"] = [blobs["rng"][0], other]
    blobs["process_state"] = blobs["process_state"] * 2
    monkeypatch.setattr(
        ckpt,
        "load_checkpoint_state",
        lambda path: ({"step": 2, "batches": trainer.state.batches.state_dict(), "num_processes": 2}, blobs),
    )
    monkeypatch.setattr(ckpt, "check_compatible", lambda *a, **k: None)
    monkeypatch.setattr(type(trainer.accelerator), "process_index", property(lambda self: 1))
    trainer.load_checkpoint(saved_run / "checkpoint-2")
    assert torch.equal(torch.get_rng_state(), other["torch"])
    assert torch.equal(trainer.generator.get_state(), other["sampling"])


def test_an_adapter_with_nan_is_never_written(tiny_base_dir, tmp_path):
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none")
    with torch.no_grad():
        trainer.params[0][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN/inf"):
        ckpt.save_adapter(trainer.model, tmp_path / "nan_adapter", POLICY)
    assert not (tmp_path / "nan_adapter").exists()


def test_a_real_full_disk_gives_the_clear_error(tiny_base_dir, tmp_path):
    # Not a simulated OSError: a small tmpfs that holds checkpoint-1 but not checkpoint-2.
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        trainer = make_trainer(
            tiny_base_dir, mount, quantization="none", max_steps=3, save_steps=1, save_total_limit=5
        )
        with pytest.raises(
            StepFailed, match=r"could not write checkpoint checkpoint-\d.*No space left.*is intact"
        ) as info:
            trainer.train()
        assert info.value.__cause__.errno == errno.ENOSPC
        kept = ckpt.list_checkpoints(mount / "run")
        assert kept and not [p for p in (mount / "run").iterdir() if p.name.startswith(".")]
        ckpt.load_checkpoint_state(ckpt.resolve_checkpoint("latest", mount / "run"))  # whole and loadable
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_resume_takes_the_configs_learning_rate(tiny_base_dir, tmp_path, saved_run):
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", learning_rate=1e-4)
    trainer.load_checkpoint(saved_run / "checkpoint-2")
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [1e-4]
    assert trainer.scheduler.base_lrs == [1e-4]


def test_resuming_an_earlier_checkpoint_sets_later_ones_aside(tiny_base_dir, tmp_path, run_copy):
    # Resume from checkpoint-1 of a run that went on to checkpoint-2: rotation must keep this run's
    # new checkpoints, and 'latest' must mean this run's.
    resume(
        tiny_base_dir,
        run_copy.parent,
        run_copy / "checkpoint-1",
        output_dir=str(run_copy),
        max_steps=3,
        save_steps=1,
        save_total_limit=2,
    )
    names = sorted(p.name for p in run_copy.iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint-2", "checkpoint-2.superseded-1", "checkpoint-3"]


def test_atomic_dir_rolls_back_a_failed_replace_and_recovers_after_a_crash(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "v").write_text("1")
    real_replace = ckpt.os.replace

    def replace(src, dst):
        if str(src).startswith(str(tmp_path / ".adapter.")):  # the new dir into place
            raise OSError(errno.EIO, "I/O error")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(OSError):
        with ckpt.atomic_dir(target) as tmp:
            (tmp / "v").write_text("2")
    assert (target / "v").read_text() == "1" and not (tmp_path / "adapter.old").exists()
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    # A crash between the two renames leaves only adapter.old: the next write restores it first.
    real_replace(target, tmp_path / "adapter.old")
    with ckpt.atomic_dir(target) as tmp:
        assert (target / "v").read_text() == "1"
        (tmp / "v").write_text("3")
    assert (target / "v").read_text() == "3" and not (tmp_path / "adapter.old").exists()


def test_a_half_written_log_line_is_dropped_on_resume(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "rew')
    ckpt.truncate_log(log, 3)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'


def test_a_resume_whose_log_rewrite_fails_keeps_the_whole_log(tmp_path, monkeypatch):
    """The log was rewritten in place: a full disk (or a kill) there left it empty, and no later resume brought
    its history back (found in review). It is written beside it and then put in its place."""
    import errno
    import pathlib

    log = tmp_path / "metrics.jsonl"
    whole = '{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4}\n'
    log.write_text(whole)
    real = pathlib.Path.write_text

    def full_disk(self, text, *args, **kwargs):
        real(self, text[:5], *args, **kwargs)  # part of it, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    with pytest.raises(OSError, match=r"could not write metrics.jsonl in .*No space left on device"):
        ckpt.truncate_log(log, 3)
    monkeypatch.undo()
    assert log.read_text() == whole and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


# Failed before the fix it guards (code review): a resumed run appended its steps to the interrupted
# run's log, so steps 3 and 4 were logged twice.
def test_resume_rewrites_the_metrics_log_from_the_checkpoint(tiny_base_dir, tmp_path):
    make_trainer(tiny_base_dir, tmp_path, **SMALL_RUN, max_steps=4, save_steps=2, save_total_limit=5).train()
    run = tmp_path / "run"
    make_trainer(
        tiny_base_dir, tmp_path, **SMALL_RUN, max_steps=4, resume_from_checkpoint=str(run / "checkpoint-2")
    ).train()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_target_modules_compare_as_resolved_sets(tiny_base_dir, tmp_path, saved_run):
    # The saved run used 'all-linear'; the same modules written out (in another order) are the same run.
    import json as _json

    written = sorted(
        _json.loads((saved_run / "checkpoint-2" / POLICY_DIR / ckpt.ADAPTER_CONFIG).read_text())[
            "target_modules"
        ]
    )
    summary = resume(tiny_base_dir, tmp_path, saved_run / "checkpoint-2", lora_target_modules=written[::-1])
    assert summary["steps"] == 3


def test_a_run_targeting_modules_by_a_regular_expression_resumes(tiny_base_dir, tmp_path):
    """peft and the config take lora_target_modules as one regular expression too: its checkpoints resume."""
    targets = r".*\.(q_proj|v_proj)"
    make_trainer(
        tiny_base_dir,
        tmp_path / "a",
        quantization="none",
        max_steps=2,
        save_steps=1,
        lora_target_modules=targets,
    ).train()
    summary = resume(tiny_base_dir, tmp_path / "a", "latest", lora_target_modules=targets)
    assert summary["steps"] == 3


def test_misplaced_paths_inside_a_run_say_what_to_pass(tiny_base_dir, tmp_path, saved_run, run_copy):
    with pytest.raises(
        CheckpointError, match=r"is the policy adapter inside checkpoint .*checkpoint-2; pass the checkpoint"
    ):
        ckpt.resolve_checkpoint(saved_run / "checkpoint-2" / POLICY_DIR, saved_run)
    with pytest.raises(CheckpointError, match=r"is a file; pass a checkpoint-N directory"):
        ckpt.resolve_checkpoint(saved_run / "checkpoint-2" / ckpt.STATE_BLOBS, saved_run)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text("")
    with pytest.raises(CheckpointError, match=r"run directory without any checkpoint"):
        ckpt.resolve_checkpoint(bare, bare)
    (run_copy / "checkpoint-2" / ckpt.STATE_JSON).write_text('{"step": 2}')
    with pytest.raises(CheckpointError, match=r"lora_grpo_state.json is damaged \(no batches\)"):
        ckpt.load_checkpoint_state(run_copy / "checkpoint-2")


def test_saved_adapter_keys_match_peft_when_a_module_has_the_policy_adapters_name(tmp_path):
    # Key names come from the LoRA layers, not from matching ".default." (POLICY) in parameter names.
    from peft import LoraConfig, PeftModel, get_peft_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.default = torch.nn.Sequential(torch.nn.Linear(4, 4))
            self.norm = torch.nn.LayerNorm(4)

        def forward(self, x):
            return self.norm(self.default(x))

    torch.manual_seed(0)
    model = get_peft_model(
        Net(), LoraConfig(r=2, target_modules=["default.0"], init_lora_weights=False), adapter_name=POLICY
    )
    ckpt.save_adapter(model, tmp_path / "a", POLICY)
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "a" / ckpt.ADAPTER_WEIGHTS)))
    assert keys == {"base_model.model.default.0.lora_A.weight", "base_model.model.default.0.lora_B.weight"}
    torch.manual_seed(0)
    fresh = Net()
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "a"))
    x = torch.randn(2, 4)
    torch.testing.assert_close(loaded(x), model(x))


# ---------------------------------------------------------------------------------- safe loading, devices
def _rewrite_blobs(checkpoint, change) -> None:
    """Load a checkpoint's trainer_state.pt as the test's own trusted file, change it, write it back."""
    path = checkpoint / ckpt.STATE_BLOBS
    blobs = torch.load(path, map_location="cpu", weights_only=False)
    change(blobs)
    torch.save(blobs, path)


class _CreatesAFile:
    """A pickle payload: unpickling it calls open(marker, "w"), which creates the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# Failed before the fix (a): trainer_state.pt was read with weights_only=False, so a payload ran on resume.
def test_a_checkpoint_whose_pickle_would_run_code_is_refused_without_running_it(
    tiny_base_dir, tmp_path, run_copy
):
    marker = tmp_path / "payload-ran"
    _rewrite_blobs(run_copy / "checkpoint-2", lambda blobs: blobs.update(extra=_CreatesAFile(marker)))
    with pytest.raises(CheckpointError) as info:
        resume(tiny_base_dir, tmp_path, run_copy / "checkpoint-2")
    text = str(info.value)
    assert "checkpoint-2/trainer_state.pt holds a reference to" in text and "open" in text
    assert "refused, not loaded" in text and "checkpoint-1" in text  # the way out
    assert not marker.exists()


def test_trainer_state_is_read_onto_the_cpu_with_weights_only(saved_run, monkeypatch):
    """Defect 4: torch.load without map_location put every process's optimizer state on the device
    it was saved from (cuda:0), and a GPU checkpoint could not load on a CPU."""
    calls, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k))
    _, blobs = ckpt.load_checkpoint_state(saved_run / "checkpoint-2")
    assert calls == [{"map_location": "cpu", "weights_only": True}]
    assert isinstance(
        blobs["rng"][0]["numpy"][1], list
    )  # stored as plain ints: nothing of NumPy's to unpickle


def test_optimizer_states_go_to_their_parameters_device_but_step_stays():
    # bitsandbytes' 8-bit optimizers only cast loaded states; torch keeps 'step' on the CPU unless fused.
    params = [torch.nn.Parameter(torch.zeros(3, device="meta")), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW(params)
    saved = {
        "param_groups": [{"params": [0, 1]}],
        "state": {
            0: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.ones(3),
                "__bnb_optimizer_quant_state__": {"state1": torch.ones(3)},
            },
            1: {"step": 3, "exp_avg": torch.ones(2)},
        },
    }
    moved = ckpt.optimizer_state_on_devices(saved, optimizer)
    assert (
        moved["state"][0]["exp_avg"].is_meta
        and moved["state"][0]["__bnb_optimizer_quant_state__"]["state1"].is_meta
    )
    assert (
        moved["state"][0]["step"].device.type == "cpu" and moved["state"][1]["exp_avg"].device.type == "cpu"
    )
    assert saved["state"][0]["exp_avg"].device.type == "cpu"  # the loaded dict is not changed in place


def _cuda_generator_state(seed: int = 1234, offset: int = 96) -> torch.Tensor:
    # What torch.Generator("cuda").get_state() returns: its Philox seed and offset, 16 bytes.
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


# Failed before the fix (defect 4): "Expected a CPUGeneratorImplState of size 5056 but found 16".
def test_a_sampling_state_saved_on_cuda_resumes_on_a_cpu_reseeded_deterministically(
    tiny_base_dir, tmp_path, run_copy, caplog
):
    from lora_grpo.rng import restore_sampling

    _rewrite_blobs(
        run_copy / "checkpoint-2", lambda blobs: blobs["rng"][0].update(sampling=_cuda_generator_state())
    )
    states = []
    for attempt in ("a", "b"):
        trainer = make_trainer(tiny_base_dir, tmp_path / attempt, quantization="none", max_steps=3)
        with caplog.at_level("WARNING", logger="lora_grpo.run.checkpoint"):
            trainer.load_checkpoint(run_copy / "checkpoint-2")
        states.append(trainer.generator.get_state())
        assert trainer.state.global_step == 2
    assert torch.equal(states[0], states[1])  # every resume of that checkpoint draws alike
    lines = [r.getMessage() for r in caplog.records if r.name == "lora_grpo.run.checkpoint"]
    assert len(lines) == 2 and "from a CUDA generator (16 bytes)" in lines[0] and "reseeded" in lines[0]
    # reseeded from the seed, the process and the step: another step is another stream
    other = torch.Generator()
    assert restore_sampling(other, _cuda_generator_state(), seed=0, process_index=0, step=3) is not None
    assert not torch.equal(other.get_state(), states[0])
    same = torch.Generator()
    assert (
        restore_sampling(same, states[0], seed=0, process_index=0, step=2) is None
    )  # a CPU state: restored as is
    assert torch.equal(same.get_state(), states[0])


# Failed before the fix (defect 4): set_rng_state_all with more saved states than visible GPUs.
def test_fewer_visible_gpus_than_at_save_time_restore_the_ones_there(monkeypatch, caplog):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((state, device))
    )
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", list)
    state = {**rng_state(), "cuda": ["state of cuda:0", "state of cuda:1"]}
    with caplog.at_level("WARNING", logger="lora_grpo.rng"):
        set_rng_state(state)
    assert restored == [("state of cuda:0", 0)]
    assert any("2 CUDA devices, 1 are visible" in r.getMessage() for r in caplog.records)


def test_resume_is_exact_with_an_8bit_optimizer(tiny_base_dir, tmp_path):
    """bitsandbytes' optimizer state (its own quant-state dict) loads under weights_only=True."""
    kw = dict(quantization="none", optimizer="adamw_8bit", max_steps=3)
    full = make_trainer(tiny_base_dir, tmp_path / "a", save_steps=2, **kw)
    full.train()
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path / "b",
        resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-2"),
        **kw,
    )
    resumed.train()
    assert_same_adapters(full.model, resumed.model)


# ---------------------------------------------------------------------------------- hand-edited trainer state
def _edit_state(checkpoint, **values) -> None:
    path = checkpoint / ckpt.STATE_JSON
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


# Issue 47: "invalid literal for int()" ("two"), an AttributeError (batches null), or a run that went on from
# step -3 (metrics.jsonl then held steps -2 ... 3); none named the file.
@pytest.mark.parametrize(
    "values, named",
    [
        ({"global_step": "two"}, 'global_step is "two"; it must be an integer'),
        ({"batches": None}, "batches is null; it must be an object"),
        ({"global_step": -3}, "global_step is -3; it must be 0 or more"),
    ],
    ids=["string", "null", "negative"],
)
def test_a_hand_edited_trainer_state_names_the_file_and_the_field(
    tiny_base_dir, tmp_path, run_copy, values, named
):
    _edit_state(run_copy / "checkpoint-2", **values)
    with pytest.raises(CheckpointError) as info:
        resume(tiny_base_dir, tmp_path, run_copy / "checkpoint-2")
    text = str(info.value)
    assert f"{run_copy / 'checkpoint-2' / ckpt.STATE_JSON}: {named}" in text
    # the fix: the values the run wrote, or the checkpoint before it
    assert "Put back the values the run wrote" in text and "checkpoint-1" in text
    # refused before a step ran: nothing logged
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_hand_edited_trainer_state_through_the_cli_is_an_error_not_a_traceback(
    tiny_base_dir, tmp_path, run_copy, capsys
):
    from helpers import write_recipe

    from lora_grpo.cli import main

    _edit_state(run_copy / "checkpoint-2", global_step="two")
    recipe = write_recipe(tmp_path, tiny_base_dir, quantization="none", max_steps=3)
    resume_from = f"resume_from_checkpoint={run_copy / 'checkpoint-2'}"
    assert main(["train", str(recipe), "--set", resume_from]) == 1
    err = capsys.readouterr().err
    assert (
        f'{run_copy / "checkpoint-2" / ckpt.STATE_JSON}: global_step is "two"; it must be an integer' in err
    )
    assert "Traceback" not in err and "invalid literal" not in err


def test_a_log_line_cut_short_is_named_when_resume_drops_it(tmp_path, caplog):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n\n{"step": 2}\n[2]\n{"step": 3, "rew')
    ckpt.truncate_log(log, 3)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert f"{log}: skipped line 4 (" in caplog.text and "line 5 (not complete JSON" in caplog.text


def test_a_resumed_runs_summary_keeps_the_eval_before_training(tiny_base_dir, tmp_path):
    """The eval before training runs at step 0 only: a run resumed from a checkpoint wrote accuracy_before and
    kl_to_base_before as null (found in review). The checkpoint keeps it (TrainState.eval_before)."""
    from helpers import PROMPTS

    kw = dict(quantization="none", max_steps=4, save_steps=2, eval_dataset=PROMPTS[:4])
    make_trainer(tiny_base_dir, tmp_path / "a", **kw).train()
    uninterrupted = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    make_trainer(
        tiny_base_dir,
        tmp_path / "a",
        **kw,
        resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-2"),
    ).train()
    resumed = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    assert uninterrupted["accuracy_before"] is not None
    for key in ("accuracy_before", "kl_to_base_before", "eval_before"):
        assert resumed[key] == uninterrupted[key], key


def test_a_run_resumed_from_a_checkpoint_elsewhere_logs_its_earlier_steps_too(tiny_base_dir, tmp_path):
    """The cloud flow: only the checkpoint reaches the next machine. metrics.jsonl (and the plot, and what is
    pushed) held the resumed steps alone, while log_history held them all (found in review); and the eval before
    training, which the checkpoint keeps (TrainState.eval_before)."""
    from helpers import PROMPTS

    kw = dict(quantization="none", max_steps=4, save_steps=2, eval_dataset=PROMPTS[:4])
    make_trainer(tiny_base_dir, tmp_path / "one", **kw).train()
    shutil.copytree(tmp_path / "one" / "run" / "checkpoint-2", tmp_path / "downloaded" / "last-checkpoint")
    make_trainer(
        tiny_base_dir,
        tmp_path / "two",
        **kw,
        resume_from_checkpoint=str(tmp_path / "downloaded" / "last-checkpoint"),
    ).train()
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    first = [
        json.loads(line) for line in (tmp_path / "one" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [s for s in steps if s > 0] == [1, 2, 3, 4, 4]  # (the eval after training at 4)
    assert steps == [r["step"] for r in first] and steps[0] == 0
    again = [
        json.loads(line) for line in (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["reward/mean"] for r in again[1:3]] == [r["reward/mean"] for r in first if r["step"] in (1, 2)]
    assert again[0] == first[0]  # the eval before training
