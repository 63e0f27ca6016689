"""Run reporting: progress bar, trackers (TensorBoard read back; wandb and trackio offline),
completions.jsonl, metrics.png. CPU, offline, helpers' tiny run."""

import contextlib
import glob
import io
import json
import re
import shutil
import statistics
import struct
import sys
import time
import uuid
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import PROMPTS, digit_share, make_trainer, run_torchrun

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.config import ConfigError
from lora_grpo.run.plots import metrics_figure, plot_run
from lora_grpo.run.reporting import RunReporter, numbers_only, require_tracker_packages

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WEIGHTS = [1.0, 0.5]
FAST = dict(quantization="none", gradient_checkpointing=False)  # what is tested here is not the 4-bit path


def answer_start(completions, answer, **kwargs):
    """1 if the completion contains the answer's first digit; None (does not apply) for 1-digit answers."""
    return [None if len(a) < 2 else float(a[0] in c) for c, a in zip(completions, answer)]


# make_trainer's tiny run with two weighted reward functions, one of which returns None.
TWO_REWARDS = dict(reward_funcs=[digit_share, answer_start], reward_weights=WEIGHTS)


def run_captured(trainer):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        summary = trainer.train()
    return summary, out.getvalue(), err.getvalue()


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def tb_run(tiny_base_dir, tmp_path_factory):
    """3 steps: TensorBoard, completions every step, a sync after step 2, checkpoints at 2 and 3."""
    pytest.importorskip(
        "tensorboard", reason="the tensorboard extra is not installed (pip install 'lora_grpo[test]')"
    )
    tmp = tmp_path_factory.mktemp("tb_run")
    trainer = make_trainer(
        tiny_base_dir,
        tmp,
        **TWO_REWARDS,
        max_steps=3,
        report_to="tensorboard",
        log_completions=True,
        ref_sync_steps=2,
        save_steps=2,
        **FAST,
    )
    run = Path(trainer.config.output_dir)
    seen_at_checkpoint = []
    original = trainer.save_checkpoint

    def save_and_look(**kwargs):  # metrics.png right after each checkpoint, as the user would see it
        target = original(**kwargs)
        png = run / "metrics.png"
        seen_at_checkpoint.append((trainer.state.global_step, png.read_bytes() if png.exists() else None))
        return target

    trainer.save_checkpoint = save_and_look
    summary, out, err = run_captured(trainer)
    return SimpleNamespace(
        trainer=trainer, run=run, out=out, err=err, summary=summary, checkpoints=seen_at_checkpoint
    )


# ----------------------------------------------------------------------------- progress bar
def test_bar_on_stderr_with_reward_and_kl_and_lines_on_stdout(tb_run):
    assert "train:" in tb_run.err and "3/3" in tb_run.err
    assert "reward=" in tb_run.err and "kl=" in tb_run.err and "step_time=" in tb_run.err
    # The logging_steps lines stay, on stdout, whole (written through the bar).
    lines = [line for line in tb_run.out.splitlines() if re.match(r"step \d+/\d+", line)]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]


def test_disable_tqdm_hides_the_bar_and_log_completions_steps(tiny_base_dir, tmp_path):
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        max_steps=4,
        disable_tqdm=True,
        log_completions=True,
        log_completions_steps=2,
        **FAST,
    )
    _, out, err = run_captured(trainer)
    assert "train:" not in err and "reward=" not in err
    assert "step 4/4" in out
    records = read_jsonl(tmp_path / "run" / "completions.jsonl")
    G, prompts = trainer.config.num_generations, trainer.config.prompts_per_step
    assert [r["step"] for r in records] == [2] * (G * prompts) + [4] * (G * prompts)


def test_log_completions_steps_counts_the_steps_a_rollout_trains(tiny_base_dir, tmp_path):
    """With num_iterations 2 rollouts begin at steps 1, 3, 5 and have completions there alone: every 2nd step's
    completions were never logged, with no word (found in review). A rollout logs its completions when one of
    its steps is a multiple."""
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        max_steps=6,
        num_iterations=2,
        log_completions=True,
        log_completions_steps=2,
        **FAST,
    )
    run_captured(trainer)
    records = read_jsonl(tmp_path / "run" / "completions.jsonl")
    G, prompts = trainer.config.num_generations, trainer.config.prompts_per_step
    assert [r["step"] for r in records] == [1] * (G * prompts) + [3] * (G * prompts) + [5] * (G * prompts)


# ----------------------------------------------------------------------------- TensorBoard
def test_tensorboard_events_hold_every_step_and_the_config(tb_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    tb_dir = tb_run.run / "runs" / "lora-grpo"  # logging_dir / project
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    for key in [
        "reward/mean",
        "kl",
        "rewards/digit_share/mean",
        "rewards/answer_start/mean",
        "entropy",
        "sync/event",
    ]:
        assert key in scalars, key
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]
    logged = [m["reward/mean"] for m in read_jsonl(tb_run.run / "metrics.jsonl")]
    assert [e.value for e in events.Scalars("reward/mean")] == pytest.approx(logged, rel=1e-6)
    assert not any("reason" in tag for tag in scalars)  # strings are not scalars
    assert "completions/text_summary" in events.Tags()["tensors"]  # the completions as a markdown table
    # The config, as TensorBoard hparams (accelerate writes them in a subdirectory).
    (hparams_dir,) = {Path(p).parent for p in glob.glob(str(tb_dir / "*" / "events.*"))}
    acc = EventAccumulator(str(hparams_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["lora_r"].number_value == 4
    assert hparams["learning_rate"].number_value == pytest.approx(5e-3)
    assert hparams["report_to"].string_value == "tensorboard"
    assert json.loads(hparams["reward_weights"].string_value) == WEIGHTS  # lists as JSON text


# ----------------------------------------------------------------------------- completions.jsonl
def test_completions_have_every_field_with_the_right_values(tb_run):
    cfg = tb_run.trainer.config
    G, B = cfg.num_generations, cfg.num_generations * cfg.prompts_per_step
    records = read_jsonl(tb_run.run / "completions.jsonl")
    assert len(records) == 3 * B
    assert list(records[0]) == [
        "step",
        "prompt",
        "completion",
        "digit_share",
        "answer_start",
        "reward",
        "advantage",
        "sync",
    ]
    metrics = read_jsonl(tb_run.run / "metrics.jsonl")
    by_step = {m["step"]: m for m in metrics}
    nones = 0
    for step in range(1, 4):
        rows = [r for r in records if r["step"] == step]
        assert len(rows) == B
        assert all(r["sync"] == (step == 2) for r in rows)  # the sync after step 2
        for r in rows:
            assert r["digit_share"] == pytest.approx(
                digit_share([r["prompt"]], [r["completion"]])[0], rel=1e-6
            )
            # the weighted sum, a None counting as 0
            nones += r["answer_start"] is None
            expected = WEIGHTS[0] * r["digit_share"] + WEIGHTS[1] * (r["answer_start"] or 0.0)
            assert r["reward"] == pytest.approx(expected, abs=1e-6)
        # advantages: group normalisation, (r − mean) / (std + 1e-4), 0 for a group of equal rewards
        for g in range(0, B, G):
            group = rows[g : g + G]
            assert len({r["prompt"] for r in group}) == 1
            rewards = [r["reward"] for r in group]
            mean, std = statistics.mean(rewards), statistics.stdev(rewards)
            for r in group:
                expected = 0.0 if max(rewards) == min(rewards) else (r["reward"] - mean) / (std + 1e-4)
                assert r["advantage"] == pytest.approx(expected, abs=1e-4)
        assert statistics.mean(r["reward"] for r in rows) == pytest.approx(
            by_step[step]["reward/mean"], abs=1e-6
        )
    assert nones > 0  # the None case was exercised


def test_resume_truncates_completions_like_metrics(tb_run, tiny_base_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tb_run.run, run)
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **TWO_REWARDS,
        max_steps=3,
        log_completions=True,
        ref_sync_steps=2,
        save_steps=2,
        resume_from_checkpoint=str(run / "checkpoint-2"),
        disable_tqdm=True,
        **FAST,
    )
    run_captured(trainer)
    B = trainer.config.generation_batch
    steps = [r["step"] for r in read_jsonl(run / "completions.jsonl")]
    assert steps == [s for s in (1, 2, 3) for _ in range(B)]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


# ----------------------------------------------------------------------------- metrics.png
def test_metrics_png_after_each_checkpoint_and_after_train(tb_run):
    steps = [step for step, _ in tb_run.checkpoints]
    assert steps == [2, 3]
    assert all(png is not None and png.startswith(PNG_MAGIC) for _, png in tb_run.checkpoints)
    png = tb_run.run / "metrics.png"
    assert png.read_bytes().startswith(PNG_MAGIC)
    from matplotlib.image import imread

    height, width, _ = imread(png).shape
    assert height > 300 and width > 300
    assert not list(tb_run.run.glob(".metrics.tmp*"))  # written atomically


def records_with_syncs():
    out = []
    for step in range(1, 7):
        r = {
            "step": step,
            "reward/mean": step / 10,
            "rewards/a/mean": step / 20,
            "rewards/b/mean": 0.1,
            "kl": 0.01 * step,
            "completion_length/mean": 20.0 + step,
            "entropy": 1.0 - step / 100,
        }
        if step in (2, 5):
            r.update({"sync/event": 1.0, "sync/reason": "steps"})
        out.append(r)
    out.append({"step": 6, "eval/accuracy": 0.5, "eval/completion_length": 12.0})
    out.insert(0, {"step": 0, "eval/accuracy": 0.25, "eval/completion_length": 10.0})
    return out


def test_plot_marks_every_sync_in_every_panel():
    fig, info = metrics_figure(records_with_syncs())
    assert info.sync_steps == [2, 5]
    assert list(info.panels) == ["reward", "eval", "KL to reference", "completion length", "entropy"]
    assert info.panels["reward"] == ["reward/mean", "rewards/a/mean", "rewards/b/mean"]
    assert info.panels["eval"] == ["eval/accuracy"]  # the eval length is not an accuracy
    for ax in fig.axes:
        vertical = sorted(line.get_xdata()[0] for line in ax.get_lines() if len(set(line.get_xdata())) == 1)
        assert vertical == [2, 5], ax.get_ylabel()
    _, info = metrics_figure([r for r in records_with_syncs() if not r.get("sync/event")])
    assert info.sync_steps == []


def test_plot_run_and_keys(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records_with_syncs()))
    info = plot_run(tmp_path, keys=["kl", "entropy"])
    assert info.path == tmp_path / "metrics.png" and info.path.read_bytes().startswith(PNG_MAGIC)
    assert list(info.panels) == ["kl", "entropy"] and info.sync_steps == [2, 5]
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path / "nowhere")


def fake_reporter(tmp_path, **overrides):
    config = GRPOConfig(model_name_or_path="toy", output_dir=str(tmp_path), **overrides)
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1)
    return RunReporter(config, accelerator, ["a"], total_steps=3)


def test_a_failing_plot_is_a_warning(tmp_path):
    reporter = fake_reporter(tmp_path)
    reporter.start(0, resumed=False)
    reporter.log({"step": 1, "sync/reason": "steps"})  # nothing numeric to plot
    with pytest.warns(UserWarning, match="could not plot"):
        assert reporter.plot() is None
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    with pytest.warns(UserWarning, match="could not plot"):
        reporter.plot()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reporter.log({"step": 2, "reward/mean": 0.5})  # writes still work after a failed plot


def test_trackers_get_numbers_only():
    assert numbers_only({"step": 3, "kl": 0.1, "sync/event": 1.0, "sync/reason": "steps", "ok": True}) == {
        "kl": 0.1,
        "sync/event": 1.0,
        "ok": 1.0,
    }


# ----------------------------------------------------------------------------- missing packages, bad names
@pytest.mark.parametrize(
    "tracker, modules",
    [("wandb", ["wandb"]), ("trackio", ["trackio"]), ("tensorboard", ["tensorboard", "tensorboardX"])],
)
def test_missing_tracker_package_names_the_extra(tracker, modules, monkeypatch, tiny_base_dir, tmp_path):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ConfigError, match=rf"pip install 'lora_grpo\[{tracker}\]'"):
        require_tracker_packages([tracker])
    # at trainer start, before the model is loaded
    config = GRPOConfig(model_name_or_path=str(tmp_path / "no-such-model"), report_to=["none", tracker])
    with pytest.raises(ConfigError, match=rf"report_to includes '{tracker}'.*lora_grpo\[{tracker}\]"):
        GRPOTrainer(config, reward_funcs=[digit_share], train_dataset=PROMPTS)


def test_report_to_typo_is_a_config_error():
    with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
        GRPOConfig(model_name_or_path="toy", report_to="tensorbord")
    with pytest.raises(ConfigError, match="did you mean 'wandb'"):
        GRPOConfig(model_name_or_path="toy", report_to=["trackio", "wandb2"])
    assert GRPOConfig(model_name_or_path="toy", report_to=None).report_to is None  # = none
    with pytest.raises(ConfigError, match="log_completions_steps"):
        GRPOConfig(model_name_or_path="toy", log_completions_steps=0)


# ----------------------------------------------------------------------------- wandb, trackio (offline)
def read_wandb_records(path):
    """The records of a .wandb file (W&B's 7-byte header, then LevelDB log blocks of protobufs)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            records.append(record)
    return records


def test_wandb_offline(tiny_base_dir, tmp_path, monkeypatch):
    wandb = pytest.importorskip(
        "wandb", reason="the wandb extra is not installed (pip install 'lora_grpo[wandb]')"
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    wandb.teardown()  # wandb reads its environment once a process: this test's, not an earlier test's
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        max_steps=2,
        report_to="wandb",
        log_completions=True,
        run_name="tiny",
        disable_tqdm=True,
        **FAST,
    )
    run_captured(trainer)
    (wandb_file,) = glob.glob(str(tmp_path / "run" / "runs" / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process writes the file; under load it can still be flushing when finish() returns
    deadline = time.monotonic() + 60
    while (records := read_wandb_records(wandb_file))[-1:] == [] or records[-1].WhichOneof(
        "record_type"
    ) != "exit":
        assert time.monotonic() < deadline, f"{wandb_file} has no exit record after 60 s"
        time.sleep(0.5)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "tiny" and run.project == "lora-grpo"
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["lora_r"] == 4 and config["report_to"] == "wandb"
    history = [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    steps_with_reward = sorted(h["_step"] for h in history if "reward/mean" in h)
    assert steps_with_reward == [1, 2]
    tables = sorted(
        glob.glob(str(Path(wandb_file).parent / "files" / "media" / "table" / "completions_*.table.json"))
    )
    assert len(tables) == 2
    table = json.loads(Path(tables[0]).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "digit_share", "reward", "advantage", "sync"]
    assert len(table["data"]) == trainer.config.generation_batch


def test_trackio_offline(tiny_base_dir, tmp_path, monkeypatch):
    # trackio is local-first: it writes a SQLite file under TRACKIO_DIR and needs no network.
    if "trackio" not in sys.modules:
        monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read at import
    pytest.importorskip(
        "trackio", reason="the trackio extra is not installed (pip install 'lora_grpo[trackio]')"
    )
    from trackio.sqlite_storage import SQLiteStorage

    project = f"lora-grpo-test-{uuid.uuid4().hex[:8]}"  # unique, should TRACKIO_DIR have been fixed earlier
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        max_steps=2,
        report_to="trackio",
        project=project,
        run_name="tiny",
        log_completions=True,
        disable_tqdm=True,
        **FAST,
    )
    try:
        run_captured(trainer)
        logs = SQLiteStorage.get_logs(project, "tiny")
        assert sorted(log["step"] for log in logs if "reward/mean" in log) == [1, 2]
        tables = [log["completions"] for log in logs if "completions" in log]
        assert len(tables) == 2 and len(tables[0]["_value"]) == trainer.config.generation_batch
        assert set(tables[0]["_value"][0]) >= {
            "step",
            "prompt",
            "completion",
            "digit_share",
            "reward",
            "advantage",
            "sync",
        }
        assert SQLiteStorage.get_run_config(project, "tiny")["lora_r"] == 4
    finally:
        db = SQLiteStorage.get_project_db_path(project)
        for path in db.parent.glob(f"{db.stem}*"):
            path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- two processes
TWO_PROCESS_SCRIPT = """
import sys
from lora_grpo import GRPOConfig, GRPOTrainer

from helpers import digit_share

base, out = sys.argv[1], sys.argv[2]
prompts = [{"prompt": f"{i}+{i % 5}="} for i in range(16)]
cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4, prompts_per_step=2,
                 max_completion_length=5, micro_batch_size=4, max_steps=2, beta=0.04, ref_sync_steps=1,
                 output_dir=out + "/run", save_steps=0, gradient_checkpointing=False, log_completions=True,
                 report_to="tensorboard")
GRPOTrainer(cfg, reward_funcs=[digit_share], train_dataset=prompts).train()
"""


def test_two_processes_one_bar_one_log_and_every_completion(tiny_base_dir, tmp_path):
    pytest.importorskip(
        "tensorboard", reason="the tensorboard extra is not installed (pip install 'lora_grpo[test]')"
    )
    result = run_torchrun(TWO_PROCESS_SCRIPT, tmp_path, tiny_base_dir, tmp_path)
    assert result.stderr.count("train:   0%") == 1  # one bar, the main process's
    assert result.stdout.count("step 2/2") == 1
    run = tmp_path / "run"
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    records = read_jsonl(run / "completions.jsonl")
    per_step = 2 * 2 * 4  # processes × prompts_per_step × num_generations: gathered from both
    assert [r["step"] for r in records] == [1] * per_step + [2] * per_step
    assert len({r["prompt"] for r in records if r["step"] == 1}) == 4  # each process sampled its own prompts
    assert all(r["sync"] for r in records)  # ref_sync_steps=1
    assert len(glob.glob(str(run / "runs" / "lora-grpo" / "events.*"))) == 1  # one writer
    assert (run / "metrics.png").read_bytes().startswith(PNG_MAGIC)


# Issue 47: `lora-grpo plot` on the metrics.jsonl of a run killed mid-line failed with "Unterminated string ...
# line 1 column 27" and drew nothing.
def test_plot_draws_the_complete_lines_of_a_half_written_log_and_names_the_line_skipped(
    tmp_path, caplog, capsys
):
    from lora_grpo.cli import main

    whole = "".join(json.dumps(r) + "\n" for r in records_with_syncs())
    (tmp_path / "metrics.jsonl").write_text(whole + '{"step": 7, "reward/mean": 0.')
    cut = len(records_with_syncs()) + 1
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    assert f"{tmp_path / 'metrics.jsonl'}: skipped line {cut} (not complete JSON, " in caplog.text
    assert "a run stopped while writing it?" in caplog.text
    info = plot_run(tmp_path)
    # every complete record drawn: the syncs of the whole lines, the panels of a whole log
    assert len(info.skipped) == 1 and info.skipped[0].startswith(f"line {cut} (")
    assert info.sync_steps == [2, 5] and "entropy" in info.panels
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rew')
    capsys.readouterr()
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'} holds no complete record (skipped line 1 (not complete JSON" in err
    assert "Traceback" not in err


def test_the_log_reader_keeps_every_record_and_names_every_other_line(tmp_path):
    from lora_grpo.run.logs import read_log

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"step": 1, "kl": 0.5}\n\n[1, 2]\n{"kl": 1}\n{"step": "3"}\n\xff\xfe\n{"step": 4}\n{"step": 5'
    )
    log = read_log(path)
    assert log.records == [{"step": 1, "kl": 0.5}, {"step": 4}]
    assert log.lines == ['{"step": 1, "kl": 0.5}', '{"step": 4}']
    assert [s.split(" (")[0] for s in log.skipped] == ["line 3", "line 4", "line 5", "line 6", "line 8"]
    assert log.skipped[0] == 'line 3 (not a record: no integer "step")'
    assert log.skipped[3] == "line 6 (not UTF-8 text)"
    assert log.skipped_note().startswith("skipped line 3 (")
