"""Pushing a run to the hub (run/hub.py) where lora_grpo goes beyond transformers' push: a checkpoint pushed as it
was saved whatever happens to it after, a failed push that keeps the run going and says so, a repository the hub
refuses stopping the script before it trains, and output_dir pushed without what is not the model's. What TRL
does alike (the commits of each hub_strategy) is tests/test_trl_parity.py's. The hub is helpers.FakeHub."""

import json
import logging
import os
import shutil
import tempfile
import time

import pytest
import yaml
from helpers import PROMPTS

from lora_grpo.run.hub import HubPushError, HubRepo


def checkpoint_dir(root, step=1):
    path = root / f"checkpoint-{step}"
    (path / "policy").mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"weights of step %d" % step)
    (path / "README.md").write_text("card")
    (path / "policy" / "adapter_model.safetensors").write_bytes(b"the same weights")
    (path / "trainer_state.pt").write_bytes(b"optimizer")
    return path


def front_door(base, out, **fields):
    """lora_grpo.trl's GRPOTrainer of a tiny run into `out` that pushes to me/tiny-grpo (`fields` override)."""
    from datasets import Dataset

    from lora_grpo.trl import GRPOConfig, GRPOTrainer

    settings = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1)
    settings.update(report_to="none", push_to_hub=True, hub_model_id="me/tiny-grpo")
    args = GRPOConfig(output_dir=str(out), use_cpu=True, **{**settings, **fields})
    return GRPOTrainer(
        model=base,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_list(PROMPTS[:8]),
    )


def trl_recipe(tmp_path, base, **fields):
    """A TRL GRPO recipe (`lora-grpo trl --config`) of a tiny run on a local data file, into tmp_path/run."""
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "solution": r["answer"]}) + "\n" for r in PROMPTS[:8])
    )
    recipe = tmp_path / "grpo.yaml"
    values = dict(
        model_name_or_path=base, dataset_name=str(data), reward_funcs=["accuracy_reward"], use_cpu=True
    )
    recipe.write_text(yaml.safe_dump({**values, "output_dir": str(tmp_path / "run"), **fields}))
    return recipe


def assert_the_model_of(output_dir, pushed: dict) -> None:
    """`pushed` (an upload's files) is output_dir's model: the adapter, tokenizer, card and the run's records, not
    the prompts and answers trained on, the checkpoints or the adapter/ copy of the root's files (on disk still)."""
    model = {"adapter_model.safetensors", "adapter_config.json", "README.md", "config.yaml", "metrics.jsonl"}
    assert model <= set(pushed)
    assert (output_dir / "completions.jsonl").is_file() and "completions.jsonl" not in pushed
    assert not any(name.startswith(("adapter/", "checkpoint-")) for name in pushed)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """tempfile's directory, to see the snapshots pushes make there."""
    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


def test_a_checkpoint_is_pushed_as_it_was_saved_whatever_happens_to_it_after(tmp_path, fake_hub, private_tmp):
    saved = checkpoint_dir(tmp_path / "run")
    repo = HubRepo("me/tiny-grpo", strategy="checkpoint")
    fake_hub.hold()  # the upload has not read a byte yet when...
    repo.push_checkpoint(saved, "Training in progress, step 1")
    assert repo.busy()
    # ...rotation deletes the checkpoint, and a save of the same step writes a new one in its place (each written
    # whole in a temporary directory renamed into place, run/checkpoint.py)
    shutil.rmtree(saved)
    saved.mkdir()
    (saved / "adapter_model.safetensors").write_bytes(b"another save")
    fake_hub.release()
    repo.wait()
    root, whole = fake_hub.uploads
    # the root: the model's files as saved, not the checkpoint's own (policy/, optimizer and loop state)
    assert root["files"] == {"README.md": b"card", "adapter_model.safetensors": b"weights of step 1"}
    assert (whole["path_in_repo"], whole["message"]) == (
        "last-checkpoint",
        "Training in progress, step 1, checkpoint",
    )
    assert set(whole["files"]) == {
        "README.md",
        "adapter_model.safetensors",
        "policy/adapter_model.safetensors",
        "trainer_state.pt",
    }
    # the snapshot (beside the checkpoint, in the run's directory) is gone once pushed; the checkpoint untouched
    assert not repo.busy() and sorted(p.name for p in saved.parent.iterdir()) == ["checkpoint-1"]
    assert (saved / "adapter_model.safetensors").read_bytes() == b"another save"


def test_pushes_land_in_the_order_they_were_made(tmp_path, fake_hub):
    # step 1's upload is slow; with hub_always_push step 2's is made while it runs: the root must end on step 2
    fake_hub.slow = {"step 1": 0.5}
    repo = HubRepo("me/tiny-grpo", always_push=True)
    for step in (1, 2):
        repo.push_checkpoint(checkpoint_dir(tmp_path, step), f"step {step}")
    repo.wait()
    assert [u["message"] for u in fake_hub.uploads] == ["step 1", "step 2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2"]


def test_a_push_that_cannot_start_is_a_warning_and_leaves_nothing(tmp_path, fake_hub, monkeypatch, caplog):
    import errno
    import os

    from lora_grpo.run import hub

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub.os, "link", full)
    monkeypatch.setattr(hub.shutil, "copyfile", full)
    saved = checkpoint_dir(tmp_path)
    repo = HubRepo("me/tiny-grpo")
    with caplog.at_level(logging.WARNING, logger="lora_grpo.run.hub"):
        repo.push_checkpoint(saved, "step 1")  # does not raise: the run goes on
    assert (
        "pushing checkpoint-1 to the hub repository me/tiny-grpo failed (OSError: [Errno 28]" in caplog.text
    )
    assert os.listdir(tmp_path) == ["checkpoint-1"] and fake_hub.uploads == [] and not repo.busy()


def test_a_snapshot_goes_when_its_upload_ends_even_if_nobody_waits(tmp_path, fake_hub):
    fake_hub.hold()
    repo = HubRepo("me/tiny-grpo", strategy="all_checkpoints")
    repo.push_checkpoint(checkpoint_dir(tmp_path), "step 1")
    assert len(list(tmp_path.glob(".hub-push-checkpoint-1.*"))) == 1
    fake_hub.release()  # a run that failed after the push never calls wait(): the uploads end on their own
    for push in repo._pushes:
        for future in push.futures:
            future.result(timeout=60)
    # (a future's callbacks run in its worker just after result() returns here)
    for _ in range(100):
        if not list(tmp_path.glob(".hub-push-*")):
            break
        time.sleep(0.05)
    assert len(fake_hub.uploads) == 2 and not list(tmp_path.glob(".hub-push-*"))


def test_a_save_step_skips_its_push_while_the_last_one_uploads_unless_always_push(
    tmp_path, fake_hub, private_tmp
):
    fake_hub.hold()
    waits, always = HubRepo("me/a"), HubRepo("me/b", always_push=True)
    for repo in (waits, always):
        repo.push_checkpoint(checkpoint_dir(tmp_path / repo.repo_id), "step 1")
    assert not waits.wants() and always.wants()
    assert not HubRepo("me/c", strategy="end").wants()
    fake_hub.release()
    waits.wait()
    assert waits.wants()
    always.wait()


def test_a_failed_push_keeps_the_run_going_and_says_what_to_push(tiny_base_dir, tmp_path, fake_hub, caplog):
    fake_hub.fail = OSError("503 Service Unavailable")
    out = tmp_path / "run"
    trainer = front_door(tiny_base_dir, out, max_steps=2, save_steps=1, hub_always_push=True)
    with caplog.at_level(logging.WARNING, logger="lora_grpo.run.hub"):
        trainer.train()
    assert trainer.state.global_step == 2 and (out / "checkpoint-2").is_dir()
    warned = [r.getMessage() for r in caplog.records if r.name == "lora_grpo.run.hub"]
    assert len(warned) == 2
    assert (
        "pushing checkpoint-1 to the hub repository me/tiny-grpo failed (OSError: 503 Service Unavailable)"
        in (warned[0])
    )
    assert f"kept at {out / 'checkpoint-1'}" in warned[0] and "trainer.push_to_hub()" in warned[0]
    with pytest.raises(HubPushError) as failed:
        trainer.push_to_hub()
    message = str(failed.value)
    assert f"uploading {out} to the hub repository 'me/tiny-grpo' failed (OSError: 503" in message
    assert "hf upload me/tiny-grpo" in message and "--exclude 'checkpoint-*'" in message
    # the folder is as it was: the adapter saved, the checkpoints kept
    assert (out / "adapter_model.safetensors").is_file() and (out / "checkpoint-1").is_dir()


def test_a_repository_the_hub_refuses_stops_the_script_before_it_trains(tiny_base_dir, tmp_path, fake_hub):
    from huggingface_hub.errors import OfflineModeIsEnabled

    fake_hub.refuse = OfflineModeIsEnabled(
        "Cannot reach https://huggingface.co/api/repos/create: offline mode"
    )
    with pytest.raises(HubPushError) as refused:
        front_door(tiny_base_dir, tmp_path / "run")
    message = str(refused.value)
    assert (
        "could not create or reach the hub repository 'me/tiny-grpo' (OfflineModeIsEnabled: Cannot reach"
        in message
    )
    assert "`hf auth login`" in message and "push_to_hub=False" in message
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_the_trl_cli_pushes_after_saving_as_trls_script_and_keeps_the_completions_local(
    tiny_base_dir, tmp_path, fake_hub
):
    from lora_grpo.cli import main

    recipe = trl_recipe(
        tmp_path,
        tiny_base_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        log_completions=True,
        push_to_hub=True,
        hub_model_id="me/sums-grpo",
    )
    assert main(["trl", "--config", str(recipe)]) == 0
    assert [u["message"] for u in fake_hub.uploads] == ["Model save", "End of training"]
    pushed = fake_hub.uploads[-1]["files"]
    assert_the_model_of(tmp_path / "run", pushed)
    assert (
        str(tmp_path / "train.jsonl") in pushed["README.md"].decode()
    )  # TRL's script names its dataset_name


def test_the_trl_cli_says_in_one_line_that_the_hub_refused(tiny_base_dir, tmp_path, fake_hub, capsys):
    from lora_grpo.cli import main

    fake_hub.refuse = OSError("401 Client Error: Unauthorized")
    recipe = trl_recipe(tmp_path, tiny_base_dir, push_to_hub=True)
    assert main(["trl", "--config", str(recipe)]) == 1
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("lora-grpo:")]
    assert said == [
        "lora-grpo: error: could not create or reach the hub repository 'run' (OSError: 401 Client "
        "Error: Unauthorized). Log in (`hf auth login`) or give hub_token a token that may write there, check "
        "hub_model_id, or set push_to_hub=False to train without pushing"
    ]
    assert "Traceback" not in err


# ------------------------------------------------------------------------------ a finished run: lora-grpo push
@pytest.fixture(scope="module")
def finished_run(tiny_base_dir, tmp_path_factory):
    """A native run of 2 steps (a checkpoint at each) with its completions logged: output_dir, its trainer."""
    from helpers import make_trainer

    trainer = make_trainer(
        tiny_base_dir,
        str(tmp_path_factory.mktemp("pushed")),
        quantization="none",
        max_steps=2,
        save_steps=1,
        log_completions=True,
    )
    trainer.train()
    return trainer.output_dir, trainer


def test_a_readme_of_yours_in_output_dir_is_pushed_as_it_is(tiny_base_dir, tmp_path, fake_hub, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("# My sums model\n\nNotes of mine.\n")
    trainer = front_door(tiny_base_dir, out, save_strategy="no")
    trainer.train()
    with caplog.at_level(logging.WARNING, logger="lora_grpo.trl.trainer"):
        trainer.save_model()  # TRL's script: save, then push (its card replaces your README there)
    assert [u["message"] for u in fake_hub.uploads] == ["Model save"]
    assert fake_hub.uploads[0]["files"]["README.md"] == b"# My sums model\n\nNotes of mine.\n"
    assert (out / "README.md").read_text() == "# My sums model\n\nNotes of mine.\n"
    assert "README.md is not a model card lora_grpo wrote: pushed as it is" in caplog.text


def test_lora_grpo_push_sends_a_runs_final_adapter_with_its_records_and_a_card_for_the_hub(
    finished_run, fake_hub, private_tmp, capsys
):
    from lora_grpo.cli import main

    run, _ = finished_run
    saved_card = (run / "adapter" / "README.md").read_text()
    assert main(["push", str(run), "me/sums-grpo", "--private"]) == 0
    assert fake_hub.created == [{"repo_id": "me/sums-grpo", "token": None, "private": True, "exist_ok": True}]
    (upload,) = fake_hub.uploads
    files = upload["files"]
    assert upload["message"] == "Upload the adapter trained with lora_grpo" and upload["path_in_repo"] is None
    # the final adapter as saved, beside how it was trained; not the completions, checkpoints or adapter/ copy
    assert files["adapter_model.safetensors"] == (run / "adapter" / "adapter_model.safetensors").read_bytes()
    assert {
        "adapter_config.json",
        "tokenizer_config.json",
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
    } <= set(files)
    assert (run / "completions.jsonl").is_file() and "completions.jsonl" not in files
    assert not any("/" in name for name in files)
    # the card loads the adapter from the repository; the one on disk is untouched
    card = files["README.md"].decode()
    assert 'from_pretrained("me/sums-grpo")' in card and str(run) not in card and "# sums-grpo" in card
    assert (run / "adapter" / "README.md").read_text() == saved_card and str(run / "adapter") in saved_card
    assert list(private_tmp.iterdir()) == []
    assert capsys.readouterr().out.startswith(
        f"pushed the final adapter of the run {run} to me/sums-grpo: https://"
    )


def test_lora_grpo_push_sends_a_checkpoints_adapter_without_its_training_state(finished_run, fake_hub):
    from lora_grpo.cli import main

    run, _ = finished_run
    assert main(["push", str(run / "checkpoint-1"), "me/sums-grpo", "--revision", "step-1"]) == 0
    (upload,) = fake_hub.uploads
    assert upload["revision"] == "step-1"
    assert set(upload["files"]) >= {"adapter_model.safetensors", "adapter_config.json", "README.md"}
    assert not any(
        name.startswith(("policy/", "reference/")) or name.endswith(".pt") for name in upload["files"]
    )
    policy = run / "checkpoint-1" / "policy" / "adapter_model.safetensors"
    assert upload["files"]["adapter_model.safetensors"] == policy.read_bytes()


def test_the_native_trainer_pushes_its_final_adapter(finished_run, fake_hub):
    run, trainer = finished_run
    url = trainer.push_to_hub("me/sums-grpo", token="hf_write", private=True, revision="v1")
    (upload,) = fake_hub.uploads
    assert url.startswith("https://huggingface.co/me/sums-grpo/commit/")
    assert fake_hub.created == [
        {"repo_id": "me/sums-grpo", "token": "hf_write", "private": True, "exist_ok": True}
    ]
    assert (upload["token"], upload["revision"]) == ("hf_write", "v1")
    records = {"config.yaml", "metrics.jsonl", "summary.json", "metrics.png"}
    assert set(upload["files"]) == {p.name for p in (run / "adapter").iterdir()} | records


def test_lora_grpo_push_of_a_trl_scripts_output_dir_sends_the_model_not_the_run(
    tiny_base_dir, tmp_path, fake_hub
):
    """A TRL script saves the adapter into output_dir among the run's files (save_model): pushing that directory
    sends what push_to_hub would, never its checkpoints, completions or the adapter/ copy."""
    from lora_grpo.cli import main

    out = tmp_path / "run"
    trainer = front_door(
        tiny_base_dir, out, push_to_hub=False, max_steps=2, save_steps=1, log_completions=True
    )
    trainer.train()
    trainer.save_model()
    assert main(["push", str(out), "me/tiny-grpo"]) == 0
    (upload,) = fake_hub.uploads
    assert_the_model_of(out, upload["files"])
    assert (out / "checkpoint-2").is_dir()


def test_lora_grpo_push_refuses_a_run_that_is_training(finished_run, fake_hub, tmp_path):
    import fcntl
    import shutil

    from lora_grpo.run.hub import push_run
    from lora_grpo.run.run_dir import LOCK_NAME

    run, _ = finished_run
    busy = tmp_path / "busy"
    shutil.copytree(run, busy)
    (busy / LOCK_NAME).write_text(
        json.dumps({"pid": 4242, "host": "gpu-box", "started": "2026-12-07 05:00:00"})
    )
    fd = os.open(busy / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a live run holds it
        with pytest.raises(
            HubPushError, match="is in use by a run that is training \\(pid 4242 on host 'gpu-box'"
        ):
            push_run(busy, "me/x")
    finally:
        os.close(fd)
    assert fake_hub.created == [] and fake_hub.uploads == []
    push_run(busy, "me/x")  # the lock let go: the run has ended
    assert len(fake_hub.uploads) == 1


def test_lora_grpo_push_says_in_one_line_what_is_wrong(finished_run, fake_hub, tmp_path, capsys):
    from lora_grpo.cli import main

    run, _ = finished_run
    # a run without a final adapter, a directory without any adapter: resolve_adapter's words
    assert main(["push", str(tmp_path), "me/x"]) == 1
    assert f"{tmp_path} holds no adapter" in capsys.readouterr().err
    fake_hub.refuse = OSError("403 Forbidden: you cannot write to me/x")
    assert main(["push", str(run), "me/x"]) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lora-grpo:")]
    assert said == [
        "lora-grpo: error: could not create or reach the hub repository 'me/x' (OSError: 403 "
        "Forbidden: you cannot write to me/x). Log in (`hf auth login`) or pass --token (token=) a token that may "
        "write there, and check the repository's name"
    ]
    fake_hub.refuse, fake_hub.fail = None, OSError("Connection reset by peer")
    assert main(["push", str(run), "me/x"]) == 1
    err = capsys.readouterr().err
    assert (
        f"pushing the final adapter of the run {run} to the hub repository 'me/x' failed (OSError: Connection"
        in (err)
    )
    assert fake_hub.created and not fake_hub.uploads


# ------------------------------------------------------------------------------ a native run's hub_model_id
NATIVE_COMMITS = {
    # hub_strategy: a 2-step run's commits (path_in_repo, message); the last step's checkpoint is no save step's
    # (the run's last), its adapter reaching the root with the final push
    "every_save": [(None, "Training in progress, step 1"), (None, "End of training, step 2")],
    "checkpoint": [
        (None, "Training in progress, step 1"),
        ("last-checkpoint", "Training in progress, step 1, checkpoint"),
        ("last-checkpoint", "Training in progress, step 2, checkpoint"),
        (None, "End of training, step 2"),
    ],
    "all_checkpoints": [
        (None, "Training in progress, step 1"),
        ("checkpoint-1", "Training in progress, step 1, checkpoint"),
        ("checkpoint-2", "Training in progress, step 2, checkpoint"),
        (None, "End of training, step 2"),
    ],
    "end": [(None, "End of training, step 2")],
}


@pytest.mark.parametrize("strategy", list(NATIVE_COMMITS))
def test_a_run_with_hub_model_id_pushes_its_checkpoints_then_its_final_adapter(
    tiny_base_dir, tmp_path, fake_hub, strategy
):
    from helpers import make_trainer

    trainer = make_trainer(
        tiny_base_dir,
        str(tmp_path),
        quantization="none",
        max_steps=2,
        save_steps=1,
        hub_model_id="me/sums-grpo",
        hub_strategy=strategy,
        hub_private_repo=True,
    )
    assert fake_hub.created == []  # a trainer that only evaluates never asks the hub
    trainer.train()
    assert fake_hub.created == [{"repo_id": "me/sums-grpo", "token": None, "private": True, "exist_ok": True}]
    assert [(u["path_in_repo"], u["message"]) for u in fake_hub.uploads] == NATIVE_COMMITS[strategy]
    run, final = trainer.output_dir, fake_hub.uploads[-1]["files"]
    records = {"config.yaml", "metrics.jsonl", "summary.json", "metrics.png"}
    assert set(final) == {p.name for p in (run / "adapter").iterdir()} | records
    assert final["adapter_model.safetensors"] == (run / "adapter" / "adapter_model.safetensors").read_bytes()
    for upload in fake_hub.uploads:  # every card pushed loads the adapter from the repository
        assert 'from_pretrained("me/sums-grpo")' in upload["files"]["README.md"].decode()
        if upload["path_in_repo"]:  # a whole checkpoint: resumable from the hub
            assert "trainer_state.pt" in upload["files"]
    assert not list(run.glob(".hub-push-*"))


def test_a_final_push_that_fails_leaves_the_finished_run_and_resuming_it_pushes(
    tiny_base_dir, tmp_path, fake_hub
):
    from helpers import make_trainer

    settings = dict(quantization="none", max_steps=1, hub_model_id="me/sums-grpo")
    trainer = make_trainer(tiny_base_dir, str(tmp_path), **settings)
    fake_hub.fail = OSError("504 Gateway Time-out")
    with pytest.raises(HubPushError) as failed:
        trainer.train()
    run = trainer.output_dir
    assert str(failed.value) == (
        f"pushing the final adapter of the run {run} to the hub repository 'me/sums-grpo' failed (OSError: 504 "
        f"Gateway Time-out). Nothing on disk changed: push it again with `lora-grpo push {run} me/sums-grpo`"
    )
    assert (run / "summary.json").is_file() and (run / "adapter" / "adapter_model.safetensors").is_file()
    # resuming a run with nothing left to train pushes it (lora-grpo push does the same)
    fake_hub.fail = None
    make_trainer(tiny_base_dir, str(tmp_path), resume_from_checkpoint="latest", **settings).train()
    assert [u["message"] for u in fake_hub.uploads] == ["End of training, step 1"]


def test_a_run_that_fails_while_a_push_uploads_says_so_and_its_failure_is_warned(
    tiny_base_dir, tmp_path, fake_hub, caplog, capsys
):
    from helpers import make_trainer

    calls = []

    def breaks_at_step_2(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the grader is down")
        return [float(len(c)) for c in completions]

    fake_hub.slow, fake_hub.fail = {"Training in progress, step 1": 1.0}, OSError("502 Bad Gateway")
    trainer = make_trainer(
        tiny_base_dir,
        str(tmp_path),
        reward_funcs=(breaks_at_step_2,),
        quantization="none",
        max_steps=3,
        save_steps=1,
        hub_model_id="me/sums-grpo",
        reward_bisect_on_error=False,
    )
    with (
        caplog.at_level(logging.WARNING, logger="lora_grpo.run.hub"),
        pytest.raises(Exception, match="grader"),
    ):
        trainer.train()
    assert "the push of checkpoint-1 to me/sums-grpo is still uploading: this process ends when it has" in (
        capsys.readouterr().out
    )
    # no one waits for it now: its failure is said when its upload ends, and its snapshot goes
    for _ in range(200):
        if "pushing checkpoint-1" in caplog.text:
            break
        time.sleep(0.05)
    assert (
        "pushing checkpoint-1 to the hub repository me/sums-grpo failed (OSError: 502 Bad Gateway)"
        in caplog.text
    )
    assert "the final adapter is pushed when the run ends" in caplog.text
    assert (trainer.output_dir / "checkpoint-1").is_dir() and not list(trainer.output_dir.glob(".hub-push-*"))


def test_lora_grpo_train_with_a_repository_the_hub_refuses_stops_before_training(tmp_path, fake_hub, capsys):
    from lora_grpo.cli import main

    fake_hub.refuse = OSError("401 Client Error: Unauthorized")
    out = tmp_path / "run"
    assert main(["train", "toy-addition", "--set", f"output_dir={out}", "--set", "hub_model_id=me/sums"]) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lora-grpo:")]
    assert said == [
        "lora-grpo: error: could not create or reach the hub repository 'me/sums' (OSError: 401 Client Error: "
        "Unauthorized). Log in (`hf auth login`) or check hub_model_id, or leave it unset to train without pushing"
    ]
    assert not list(out.glob("checkpoint-*"))


def test_a_pushed_last_checkpoint_resumes_on_another_machine_as_the_run_would_have_gone_on(
    tiny_base_dir, tmp_path, fake_hub
):
    """hub_strategy checkpoint: last-checkpoint/ as `hf download --local-dir` writes it (with its .cache/) into a new
    output_dir, resumed there: the step after it equals the uninterrupted run's."""
    from helpers import assert_same_adapters, make_trainer

    settings = dict(quantization="none", save_steps=1, save_total_limit=0)
    make_trainer(
        tiny_base_dir,
        str(tmp_path / "a"),
        max_steps=2,
        hub_model_id="me/x",
        hub_strategy="checkpoint",
        **settings,
    ).train()
    pushed = [u for u in fake_hub.uploads if u["path_in_repo"] == "last-checkpoint"][-1]["files"]
    elsewhere = tmp_path / "b" / "run"
    for name, data in pushed.items():
        (elsewhere / "last-checkpoint" / name).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / "last-checkpoint" / name).write_bytes(data)
    (elsewhere / ".cache" / "huggingface").mkdir(parents=True)
    resumed = make_trainer(
        tiny_base_dir,
        str(tmp_path / "b"),
        max_steps=3,
        resume_from_checkpoint=str(elsewhere / "last-checkpoint"),
        **settings,
    )
    resumed.train()
    straight = make_trainer(tiny_base_dir, str(tmp_path / "c"), max_steps=3, **settings)
    straight.train()
    assert resumed.state.global_step == 3
    assert_same_adapters(resumed.model, straight.model)
