"""The run directory (run/run_dir.py): one live run per output_dir, a lock a crashed run cannot leave
behind for good, and no new run mixed into or written over another run's files."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from lora_grpo.run import model_card
from lora_grpo.run.run_dir import (
    LOCK_NAME,
    OutputDirError,
    OutputDirInUse,
    claim_output_dir,
    nothing_to_train,
    previous_run,
    trained_already,
)


def _finished_run(root, steps=4):
    """What a finished run leaves (as trainer.train writes it)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("max_steps: 4\n")
    (root / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": 0.1 * s}) + "\n" for s in range(1, steps + 1))
    )
    (root / "completions.jsonl").write_text('{"step": 1, "completion": "x"}\n')
    for s in (2, steps):
        (root / f"checkpoint-{s}").mkdir()
        (root / f"checkpoint-{s}" / "lora_grpo_state.json").write_text("{}")
    (root / "adapter").mkdir()
    (root / "summary.json").write_text(json.dumps({"steps": steps}))
    return root


# ----------------------------------------------------------------------------- another run's files


def test_a_new_run_into_a_finished_runs_directory_is_refused_with_the_fixes(tmp_path):
    run = _finished_run(tmp_path / "run")
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    with pytest.raises(OutputDirError) as info:
        claim_output_dir(run)
    msg = str(info.value)
    assert (
        "holds a finished run (4 steps, summary.json): summary.json, adapter/, metrics.jsonl, completions.jsonl, "
        "checkpoint-2, checkpoint-4" in msg
    )
    assert (
        "would overwrite its metrics.jsonl, completions.jsonl and summary.json and mix its checkpoints" in msg
    )
    assert (
        f"--set output_dir={run}-2" in msg and "resume_from_checkpoint=latest with a larger max_steps" in msg
    )
    assert "overwrite_output_dir=true: its files then move to" in msg and "nothing is deleted" in msg
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # untouched, and no lock left
    assert not (run / LOCK_NAME).exists()


def test_an_unfinished_run_is_refused_naming_its_last_checkpoint(tmp_path):
    run = _finished_run(tmp_path / "run")
    (run / "summary.json").unlink()
    with pytest.raises(
        OutputDirError,
        match=r"holds an unfinished run \(last checkpoint checkpoint-4\).*"
        r"continue that run: --set resume_from_checkpoint=latest;",
    ):
        claim_output_dir(run)


def test_overwrite_sets_the_previous_run_aside_and_deletes_nothing(tmp_path):
    run = _finished_run(tmp_path / "run")
    (run / "my_notes.txt").write_text("mine")  # not a run's file: stays
    # what transformers' save_metrics / save_state wrote for that run (a TRL script's) goes with it
    (run / "train_results.json").write_text("{}")
    (run / "trainer_state.json").write_text("{}")
    (run / "README.md").write_text(
        f"{model_card.MARKER}\n# run\n"
    )  # its model card goes too; a user's would stay
    with claim_output_dir(run, overwrite=True) as claim:
        assert claim.set_aside == run / "previous-run-1"
        assert "moved to" in claim.notes[0] and "nothing deleted" in claim.notes[0]
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, "my_notes.txt", "previous-run-1"]
        assert sorted(p.name for p in claim.set_aside.iterdir()) == [
            "README.md",
            "adapter",
            "checkpoint-2",
            "checkpoint-4",
            "completions.jsonl",
            "config.yaml",
            "metrics.jsonl",
            "summary.json",
            "train_results.json",
            "trainer_state.json",
        ]
    _finished_run(run)
    with claim_output_dir(run, overwrite=True) as claim:
        assert claim.set_aside == run / "previous-run-2"
    assert previous_run(run) is None


def test_an_adapter_saved_into_the_run_directory_is_set_aside_with_its_run(tmp_path):
    """The TRL front door's save_model() writes the adapter and its tokenizer at output_dir's root: a new run there
    set the run aside but left those files, which then sat beside the new run as its own (found in review)."""
    run = _finished_run(tmp_path / "run")
    saved = [
        "lora_grpo.json",
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
    ]
    for name in saved:
        (run / name).write_text("x")
        (run / "adapter" / name).write_text("x")
    (run / "vocab.txt").write_text("mine")  # not in the run's adapter/: the user's
    with claim_output_dir(run, overwrite=True) as claim:
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, "previous-run-1", "vocab.txt"]
        assert set(saved) <= {p.name for p in claim.set_aside.iterdir()}


def test_what_counts_as_a_previous_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("x: 1\n")  # a run refused at start wrote only this
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.3}\n')  # and its eval before training
    assert previous_run(run) is None
    claim_output_dir(run).release()
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "rew')  # a step half written
    assert previous_run(run)["evidence"] == ["metrics.jsonl"]
    assert previous_run(tmp_path / "absent") is None


def test_a_resume_continues_its_own_run_but_not_another(tmp_path):
    run = _finished_run(tmp_path / "run")
    claim_output_dir(run, resume_from="latest").release()
    claim_output_dir(run, resume_from=str(run / "checkpoint-2")).release()
    other = _finished_run(tmp_path / "other")
    claim_output_dir(
        tmp_path / "fresh", resume_from=str(other / "checkpoint-2")
    ).release()  # into an empty dir: fine
    with pytest.raises(OutputDirError, match=r"Resuming from a checkpoint elsewhere into it would overwrite"):
        claim_output_dir(run, resume_from=str(other / "checkpoint-2"))
    # a run set aside into previous-run-1/ lies inside run/, but resuming it would overwrite the run now there
    # (its adapter, summary and metrics; rotation deleted its checkpoints: found in review)
    with claim_output_dir(run, overwrite=True) as claim:
        assert claim.set_aside == run / "previous-run-1"
    _finished_run(run)
    earlier = run / "previous-run-1" / "checkpoint-2"
    with pytest.raises(OutputDirError, match=r"Resuming from a checkpoint elsewhere into it would overwrite"):
        claim_output_dir(run, resume_from=str(earlier))
    with claim_output_dir(run, resume_from=str(earlier), overwrite=True) as claim:
        assert claim.set_aside == run / "previous-run-2"  # the run that was there, kept


def test_an_output_dir_that_is_a_file_is_named_so(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    with pytest.raises(
        OutputDirError, match=r"output_dir '.*notes.txt' is a file, not a directory; give output_dir"
    ):
        claim_output_dir(mine)
    assert mine.read_text() == "mine"


# ----------------------------------------------------------------------------- the lock


def test_a_second_run_at_the_same_time_is_refused_and_the_lock_goes_with_the_run(tmp_path):
    first = claim_output_dir(tmp_path / "run")
    holder = json.loads(first.lock_path.read_text())
    assert holder["pid"] == os.getpid() and holder["host"] and holder["started"]
    with pytest.raises(
        OutputDirInUse,
        match=r"is in use by another run: this process \d+ on host .*started .*"
        r"Wait for it to finish, stop it, or train into another output_dir",
    ):
        claim_output_dir(tmp_path / "run")
    first.release()
    first.release()  # idempotent
    assert not first.lock_path.exists()
    with claim_output_dir(tmp_path / "run") as again:
        assert again.held and not again.notes
    assert not again.held


_HOLDER = """
import sys, time
from lora_grpo.run.run_dir import claim_output_dir
claim = claim_output_dir(sys.argv[1])
print("claimed", flush=True)
time.sleep(120)
"""


def test_a_live_process_holds_the_directory_and_a_killed_one_leaves_no_lasting_lock(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(_HOLDER))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "claimed"
        with pytest.raises(OutputDirInUse, match=rf"in use by another run: pid {proc.pid} on host"):
            claim_output_dir(tmp_path / "run")
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: no release, the lock file stays
        proc.wait(timeout=30)
    assert (tmp_path / "run" / LOCK_NAME).exists()
    with claim_output_dir(tmp_path / "run") as claim:
        assert (
            claim.notes
            and f"a lock left by pid {proc.pid}" in claim.notes[0]
            and "taken over" in claim.notes[0]
        )
        assert json.loads(claim.lock_path.read_text())["pid"] == os.getpid()


def test_without_file_locks_a_lock_whose_process_is_gone_is_stale(tmp_path, monkeypatch):
    import lora_grpo.run.run_dir as run_dir

    def no_flock(fd, op):
        raise OSError(run_dir.errno.ENOLCK, "no locks here")

    import fcntl

    monkeypatch.setattr(fcntl, "flock", no_flock)
    root = tmp_path / "run"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / LOCK_NAME).write_text(
        json.dumps({"pid": dead.pid, "host": run_dir.socket.gethostname(), "started": "earlier"})
    )
    with claim_output_dir(root) as claim:
        assert "which is no longer running; taken over" in claim.notes[0]
        with pytest.raises(OutputDirInUse, match=r"this process .*has no file locks.*delete"):
            claim_output_dir(root)
    (root / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "another-host", "started": "earlier"}))
    with pytest.raises(
        OutputDirInUse, match=r"pid 1 on host 'another-host'.*another host cannot tell.*delete"
    ):
        claim_output_dir(root)


def test_other_processes_of_a_multi_process_run_claim_nothing(tmp_path):
    run = _finished_run(tmp_path / "run")
    claim = claim_output_dir(
        run, is_main=False
    )  # the main process checks and locks; the others write nothing
    assert not claim.held and not (run / LOCK_NAME).exists()
    claim.release()


# ----------------------------------------------------------------------------- resume at the end


def test_nothing_to_train_says_what_happens_and_how_to_go_on():
    def further(max_steps):  # the entry point's words (the CLI's here)
        return f"--set max_steps={max_steps} --set resume_from_checkpoint=latest"

    assert nothing_to_train(3, 4, "runs/a/checkpoint-3", further=further) is None
    at_end = nothing_to_train(4, 4, "runs/a/checkpoint-4", further=further)
    assert at_end.startswith("checkpoint-4 is at step 4, the run's last (max_steps=4): nothing left to train")
    assert (
        "the run directory stays as it is" in at_end
        and "raise max_steps: --set max_steps=8 --set resume_from_checkpoint=latest" in at_end
    )
    past = nothing_to_train(6, 4, "checkpoint-6", further=further)
    assert "past this run's max_steps=4" in past and "resume from an earlier checkpoint" in past
    missing = nothing_to_train(4, 4, "checkpoint-4", adapter_missing=True, further=further)
    assert "stays as it is but for adapter/, which was missing and is written from its policy" in missing


def test_a_second_train_is_refused_with_how_to_go_on():
    def further(max_steps):
        return f"max_steps={max_steps}"

    done = trained_already(4, 4, "runs/a", "resume it", further)
    assert done.startswith(
        "train() was already called on this GRPOTrainer: it trained runs/a to step 4/4, so a"
    )
    assert (
        "would train nothing. To train further, raise max_steps: max_steps=8; for a new run, build a new"
        in done
    )
    stopped = trained_already(2, 4, "runs/a", "resume it", further)
    assert "to step 2/4 and stopped there. To continue it: resume it; for a new run" in stopped


def test_the_lock_is_released_when_a_refusal_follows_it(tmp_path):
    run = _finished_run(tmp_path / "run")
    for _ in range(2):  # a refused claim leaves no lock that would turn the second refusal into "in use"
        with pytest.raises(OutputDirError) as info:
            claim_output_dir(run)
        assert not isinstance(info.value, OutputDirInUse)


def test_a_dead_writers_temporary_dirs_go_at_the_next_start_but_never_a_live_runs(tmp_path):
    run = tmp_path / "run"
    live = claim_output_dir(run)
    leftover = run / ".checkpoint-2.k3j9x_"  # what a checkpoint write killed before its rename leaves
    (leftover / "policy").mkdir(parents=True)
    (leftover / "policy" / "adapter_model.safetensors").write_bytes(b"half")
    (run / ".adapter.a81b").mkdir()
    with pytest.raises(OutputDirInUse):
        claim_output_dir(run, resume_from="latest")
    assert leftover.is_dir()  # its writer may still be alive: left alone
    live.release()
    with claim_output_dir(run, resume_from="latest") as claim:
        assert not leftover.exists() and not (run / ".adapter.a81b").exists()
        assert [n for n in claim.notes if "removed 2 temporary dir(s)" in n and ".checkpoint-2.k3j9x_" in n]


@pytest.mark.parametrize(
    "code, why, fix",
    [
        (errno.EROFS, "it is on a read-only file system", "give output_dir a writable place"),
        (errno.EACCES, "this user may not write there", "or fix its permissions"),
        (errno.ENOSPC, "its disk is full", "free space there"),
    ],
)
def test_an_output_dir_that_cannot_be_written_is_refused_in_our_words(tmp_path, monkeypatch, code, why, fix):
    import lora_grpo.run.run_dir as run_dir

    real_open = run_dir.os.open

    def refuse(path, *args, **kwargs):
        if str(path).endswith(LOCK_NAME):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(run_dir.os, "open", refuse)
    with pytest.raises(
        OutputDirError,
        match=rf"^output_dir '{tmp_path}' cannot be used: {why} \(creating "
        rf"{tmp_path / LOCK_NAME} failed: .*\)\. .*{fix}",
    ) as info:
        claim_output_dir(tmp_path)
    assert info.value.__cause__.errno == code


# ----------------------------------------------------------------------------- the user's files, the base


def _files(root):
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def test_a_directory_of_the_users_files_is_refused_naming_them_and_the_fixes(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: settings\n")
    (mine / "metrics.png").write_bytes(b"my plot")
    for k in range(7):
        (mine / f"notes-{k}.txt").write_text("mine")
    # directories named like a dead run's temporary ones are the user's here: kept
    for name in (".adapter.backup", ".checkpoint-7.orig"):
        (mine / name).mkdir()
        (mine / name / "adapter_model.safetensors").write_bytes(b"my only copy")
    before = _files(mine)
    with pytest.raises(OutputDirError) as info:
        claim_output_dir(mine)
    for name in (".adapter.backup", ".checkpoint-7.orig"):
        assert (mine / name / "adapter_model.safetensors").read_bytes() == b"my only copy"
    msg = str(info.value)
    assert msg.startswith(
        f"output_dir '{mine}' holds files that are not a lora_grpo run's: config.yaml, metrics.png, notes-0.txt, "
        "notes-1.txt, notes-2.txt and 4 more."
    )
    assert "would overwrite config.yaml, metrics.png" in msg and f"--set output_dir={mine}-run" in msg
    assert "overwrite_output_dir=true: files with a run's names then move to" in msg
    assert _files(mine) == before and not (mine / LOCK_NAME).exists()
    # a file of no run's name is the user's too: refused, though nothing would be overwritten
    (other := tmp_path / "other").mkdir()
    (other / "data.csv").write_text("a,b\n")
    with pytest.raises(
        OutputDirError, match=r"holds files that are not a lora_grpo run's: data.csv\. .* among them"
    ):
        claim_output_dir(other)


def test_overwrite_moves_the_users_files_of_a_runs_names_aside_and_deletes_nothing(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: settings\n")
    (mine / "data.csv").write_text("a,b\n")
    with claim_output_dir(mine, overwrite=True) as claim:
        assert claim.set_aside == mine / "previous-run-1"
        assert "those with a run's names moved to" in claim.notes[0] and "nothing deleted" in claim.notes[0]
    assert (mine / "previous-run-1" / "config.yaml").read_text() == "my: settings\n"
    assert (mine / "data.csv").read_text() == "a,b\n"
    # from now on the directory is a run's (its previous-run-1/): no flag needed
    claim_output_dir(mine).release()
    (theirs := tmp_path / "theirs").mkdir()
    (theirs / "data.csv").write_text("a,b\n")
    (theirs / ".adapter.old").mkdir()
    with claim_output_dir(theirs, overwrite=True) as claim:
        assert claim.set_aside is None and "the others stay where they are" in claim.notes[0]
    assert _files(theirs) == {"data.csv": b"a,b\n"} and (theirs / ".adapter.old").is_dir()


def test_a_run_of_ours_is_recognised_by_its_own_files(tmp_path):
    from lora_grpo import GRPOConfig

    run = tmp_path / "run"
    run.mkdir()
    # a run that stopped before step 1 leaves the config.yaml it wrote; the user's notes beside it
    GRPOConfig(model_name_or_path="toy", output_dir=str(run)).to_yaml(run / "config.yaml")
    (run / "notes.txt").write_text("mine")
    claim_output_dir(run).release()
    assert (run / "notes.txt").read_text() == "mine"
    (run / "config.yaml").write_text("model_name_or_path: x\noutput_dir: y\n")  # a recipe of the user's
    with pytest.raises(OutputDirError, match="not a lora_grpo run's: config.yaml, notes.txt"):
        claim_output_dir(run)


def test_output_dir_is_never_the_base_inside_it_or_its_cache_whatever_the_flags(tmp_path, monkeypatch):
    from lora_grpo import GRPOConfig
    from lora_grpo.run.owned_dir import protected_paths

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("LORA_GRPO_CACHE", str(cache))
    protected = protected_paths(GRPOConfig(model_name_or_path=str(base)))
    for out, why in (
        (base, f"is the base model (model_name_or_path '{base}'): {base}"),
        (base / "runs" / "a", "lies inside the base model"),
        (cache / "run", "lies inside the cache of built bases"),
    ):
        for resume, overwrite in ((None, False), (None, True), ("latest", False)):
            with pytest.raises(
                OutputDirError, match=rf"^output_dir '{out}' {re.escape(why)}.*no flag allows writing there"
            ):
                claim_output_dir(out, protected=protected, overwrite=overwrite, resume_from=resume)
    assert _files(base) == {"config.json": b"{}"} and not (base / "runs").exists()
    claim_output_dir(tmp_path / "run", protected=protected).release()


def test_the_python_api_refuses_the_users_files_before_touching_them(tiny_base_dir, tmp_path):
    from helpers import make_trainer

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("my: settings\n")
    (run / "metrics.png").write_bytes(b"my plot")
    trainer = make_trainer(tiny_base_dir, tmp_path, max_steps=1, quantization="none")
    with pytest.raises(
        OutputDirError, match="holds files that are not a lora_grpo run's: config.yaml, metrics.png"
    ):
        trainer.train()
    assert _files(run) == {"config.yaml": b"my: settings\n", "metrics.png": b"my plot"}
    base_run = make_trainer(tiny_base_dir, tiny_base_dir, max_steps=1, quantization="none")
    with pytest.raises(OutputDirError, match=r"lies inside the base model"):
        base_run.train()
    assert not os.path.exists(os.path.join(tiny_base_dir, "run"))
