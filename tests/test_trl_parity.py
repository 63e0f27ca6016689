"""The TRL front door measured by TRL itself: each script runs under the pinned TRL and under
lora_grpo.trl, with only the import line changed, and the same assertions hold for both (the records
of log_history, the eval metric names per named set, the errors' types and TRL's sentences, the
warnings, reproducibility). Where the two differ on purpose, README's "where we differ" says why."""

import ast
import inspect
import json
import logging
import math
import re
import textwrap

import pytest
import torch
from helpers import PROMPTS, QWEN_RESPONSE_TEMPLATE, load_4bit, run_torchrun, tiny_reward_model

trl = pytest.importorskip("trl")

LIBRARIES = ["trl", "lora_grpo.trl"]
TIME_KEYS = ("runtime", "per_second", "step_time", "time/", "tokens_per_second")


def length_reward(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[-1]["content"]) % 3) for c in completions]


def dataset(n, start=0, conversational=False):
    from datasets import Dataset

    rows = PROMPTS[start : start + n]
    if conversational:
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    return Dataset.from_list(rows)


def run(library, source, **scope):
    """Run `source` (a TRL script: `from trl import ...`) with the import pointed at `library`."""
    code = textwrap.dedent(source).replace("from trl import", f"from {library} import")
    scope = {"length_reward": length_reward, "dataset": dataset, **scope}
    exec(compile(code, f"<script under {library}>", "exec"), scope)
    return scope


ARGS = (
    "use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4, max_completion_length=4, "
    "save_strategy='no', report_to='none'"
)


# ------------------------------------------------------------------------------ log_history
@pytest.mark.parametrize("library", LIBRARIES)
def test_the_last_logging_window_reaches_the_closing_record(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=5, logging_steps=2)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    history = scope["trainer"].state.log_history
    assert [r["step"] for r in history if "loss" in r and "train_loss" not in r] == [2, 4]
    last = history[-1]
    assert last["step"] == 5
    # step 5's metrics, merged into transformers' closing record as TRL's log() merges them (here also its loss,
    # grad_norm and learning_rate, which TRL leaves out of that record)
    assert {
        "reward",
        "reward_std",
        "rewards/length_reward/mean",
        "entropy",
        "completions/mean_length",
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "train_loss",
        "epoch",
    } <= set(last)
    assert 0.0 <= last["reward"] <= 2.0


# ------------------------------------------------------------------------------ reward functions
def exact_keywords(prompts, completions, completion_ids, answer, trainer_state, log_extra, log_metric):
    """Every keyword TRL passes (a dataset with an `answer` column), no **kwargs: legal under TRL's contract."""
    exact_keywords.calls += 1
    return [float(len(c) % 3) for c in completions]


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_reward_naming_exactly_trls_keywords_trains(tiny_base_dir, tmp_path, library):
    exact_keywords.calls = 0
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=exact_keywords, args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        exact_keywords=exact_keywords,
    )
    assert exact_keywords.calls == 1


def by_position(completions, **kwargs):
    """0, 1, 2, 3 in each group of 4, whatever was sampled."""
    return [float(i % 4) for i in range(len(completions))]


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_logged_reward_std_is_the_sample_std(tiny_base_dir, tmp_path, library):
    import statistics

    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=by_position, args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        by_position=by_position,
    )
    record = scope["trainer"].state.log_history[0]
    expected = statistics.stdev([0.0, 1.0, 2.0, 3.0])  # n - 1, as TRL's nanstd: 1.29, not 1.12
    assert record["reward_std"] == pytest.approx(expected) and record[
        "rewards/by_position/std"
    ] == pytest.approx(expected)


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_trainer_state_of_a_run_that_does_not_evaluate(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    state = scope["trainer"].state
    assert (state.eval_steps, state.save_steps, state.logging_steps, state.max_steps) == (500, 500, 1, 1)
    assert state.total_flos == 0.0 and isinstance(state.total_flos, float)


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_kl_is_logged_only_with_a_kl_term(tiny_base_dir, tmp_path, library, beta):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1, beta={beta})
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    assert ("kl" in scope["trainer"].state.log_history[0]) == bool(beta)


def never(completions, **kwargs):
    return [None] * len(completions)


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_reward_that_applied_to_nothing_in_a_window_is_logged_as_none(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=2)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=[never, length_reward], args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        never=never,
    )
    record = scope["trainer"].state.log_history[0]
    assert record["rewards/never/mean"] is None and record["rewards/never/std"] is None
    assert isinstance(record["rewards/length_reward/mean"], float)


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_reward_models_chat_template_gets_the_runs_chat_template_kwargs(tiny_base_dir, tmp_path, library):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if flag %}FLAG{% endif %}"
    judge = tiny_reward_model(tok)
    seen = []
    judge.register_forward_pre_hook(
        lambda module, args, kwargs: seen.extend(
            tok.decode(ids[mask.bool()]) for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"])
        ),
        with_kwargs=True,
    )
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, chat_template_kwargs={{"flag": True}})
        trainer = GRPOTrainer(model=MODEL, reward_funcs=JUDGE, reward_processing_classes=TOK, args=args,
                              train_dataset=dataset(4, conversational=True))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        JUDGE=judge,
        TOK=tok,
    )
    # the step's 4 completions, scored last (lora_grpo's start-up also runs the model on a probe of its own)
    # prompt, completion, then what the kwargs add
    assert all(text.endswith("\nFLAG") for text in seen[-4:]), seen[-4:]


@pytest.mark.parametrize("library", LIBRARIES)
def test_report_to_sends_trackers_trls_records_through_transformers_callbacks(
    tiny_base_dir, tmp_path, library
):
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / library
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS.replace("report_to='none'", "report_to='tensorboard'")}, max_steps=3,
                          logging_steps=2)
        GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8)).train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(out),
    )
    (events,) = {str(Path(f).parent) for f in Path(out).glob("runs/**/events.out.tfevents.*")}
    accumulator = EventAccumulator(events)
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    # TRL's names under transformers' train/ prefix, at the logging steps (2, and 3: the closing record's window)
    assert {"train/reward", "train/loss", "train/learning_rate", "train/train_loss"} <= set(scalars)
    assert not {"reward/mean", "reward", "lr"} & set(scalars)
    assert [e.step for e in accumulator.Scalars("train/reward")] == [2, 3]


@pytest.mark.parametrize("library", LIBRARIES)
def test_log_completions_sends_a_completions_table_to_wandb(tiny_base_dir, tmp_path, library, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    # wandb reads its environment once a process; an earlier test's wandb would put this run's files in
    # the working directory (the clone), whatever WANDB_DIR says now
    wandb.teardown()
    from wandb.sdk.wandb_run import Run

    tables, log = [], Run.log

    # every log of the run (wandb.init binds the module's wandb.log to it)
    def spy(run, data, *args, **kwargs):
        tables.extend(v for k, v in data.items() if k == "completions")
        return log(run, data, *args, **kwargs)

    monkeypatch.setattr(Run, "log", spy)
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS.replace("report_to='none'", "report_to='wandb'")}, max_steps=1,
                          logging_steps=1, log_completions=True)
        GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8)).train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    wandb.finish()
    # TRL's log() sends one at each logging step and one with the closing record; here one per rollout
    assert tables and all(isinstance(t, wandb.Table) for t in tables)
    assert {"prompt", "completion", "advantage"} <= set(tables[0].columns) and len(tables[0].data) == 4


# ------------------------------------------------------------------------------ callbacks
EVENTS = [
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_save",
]


def recorder(seen: list):
    """A TrainerCallback that records (event, global_step) for every event of EVENTS."""
    from transformers import TrainerCallback

    def record(name):
        return lambda self, args, state, control, **kwargs: seen.append(
            (name.removeprefix("on_"), state.global_step)
        )

    return type("Recorder", (TrainerCallback,), {name: record(name) for name in EVENTS})()


def _step(n, substeps=0, then=("log",)):
    return [
        ("step_begin", n - 1),
        *[("substep_end", n - 1)] * substeps,
        ("pre_optimizer_step", n - 1),
        ("optimizer_step", n - 1),
        ("step_end", n),
        *[(e, n) for e in then],
    ]


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize(
    "case, fields, expected",
    [
        (  # max_steps inside the epoch, 2 micro-batches a step, nothing saved
            "accumulation",
            "per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, save_strategy='no'",
            [("epoch_begin", 0), *_step(1, 1), *_step(2, 1), ("epoch_end", 2)],
        ),
        (  # two whole epochs of two steps, a checkpoint every step (the last one once)
            "epochs",
            "num_train_epochs=2, save_strategy='steps', save_steps=1",
            [
                ("epoch_begin", 0),
                *_step(1, then=("log", "save")),
                *_step(2, then=("log", "save")),
                ("epoch_end", 2),
                ("epoch_begin", 2),
                *_step(3, then=("log", "save")),
                *_step(4, then=("log", "save")),
                ("epoch_end", 4),
            ],
        ),
    ],
)
def test_callbacks_see_transformers_events_in_its_order(
    tiny_base_dir, tmp_path, library, case, fields, expected
):
    seen = []
    args = ARGS.replace("per_device_train_batch_size=4, ", "").replace("save_strategy='no', ", "")
    batch = "" if "per_device_train_batch_size" in fields else "per_device_train_batch_size=4, "
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {args}, {batch}{fields}, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(2),
                              callbacks=[RECORDER])
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        RECORDER=recorder(seen),
    )
    last = expected[-1][1]
    assert seen == [("init_end", 0), ("train_begin", 0), *expected, ("log", last), ("train_end", last)]


@pytest.mark.parametrize("library", LIBRARIES)
def test_on_pre_optimizer_step_sees_the_steps_gradients_before_the_weights_move(
    tiny_base_dir, tmp_path, library
):
    import torch
    from transformers import TrainerCallback

    seen = []

    class Watch(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            trained = [p for p in model.parameters() if p.requires_grad]
            self.before = [p.detach().clone() for p in trained]
            seen.append(("pre", all(p.grad is not None for p in trained)))

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            trained = [p for p in model.parameters() if p.requires_grad]
            seen.append(("post", any(not torch.equal(a, b) for a, b in zip(self.before, trained))))

    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, learning_rate=1e-2)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=by_position, args=args, train_dataset=dataset(8),
                              callbacks=[WATCH])
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        WATCH=Watch(),
        by_position=by_position,
    )
    assert seen == [("pre", True), ("post", True)]


STOP_AT_1 = """
class Stop(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == 1
"""
ASK_AT_EPOCH_END = """
class Ask(TrainerCallback):
    def on_epoch_end(self, args, state, control, **kwargs):
        control.should_save = control.should_evaluate = True
"""


@pytest.mark.parametrize(
    "fields, callback, prompts",
    [
        ("num_iterations=2, max_steps=4, save_strategy='no'", None, 2),
        ("steps_per_generation=2, per_device_train_batch_size=2, max_steps=4, save_strategy='no'", None, 2),
        ("num_train_epochs=2, save_strategy='epoch'", None, 2),
        ("num_train_epochs=2, logging_strategy='epoch', save_strategy='no'", None, 2),
        ("max_steps=3, save_strategy='no', eval_strategy='epoch'", None, 8),  # the run ends inside its epoch
        ("save_strategy='steps', save_steps=1, eval_strategy='epoch'", STOP_AT_1, 8),
        ("save_strategy='steps', save_steps=100", ASK_AT_EPOCH_END, 2),
    ],
    ids=["num_iterations", "steps_per_generation", "save_epoch", "log_epoch", "eval_epoch", "stop", "ask"],
)
def test_callbacks_see_trls_events_whatever_the_strategies(
    tiny_base_dir, tmp_path, fields, callback, prompts
):
    """The events TRL's own run sends a callback (with an eval set), against ours: equal, in order."""
    seen = {}
    for library in LIBRARIES:
        seen[library] = events = []
        args = ARGS.replace("save_strategy='no', ", "")
        if "per_device_train_batch_size" in fields:
            args = args.replace("per_device_train_batch_size=4, ", "")
        extra = "" if callback is None else ", " + callback.split("class ", 1)[1].split("(", 1)[0] + "()"
        run(
            library,
            f"""
            from transformers import TrainerCallback
            from trl import GRPOConfig, GRPOTrainer
            {textwrap.indent(callback or "", " " * 12).strip()}
            args = GRPOConfig(output_dir=OUT, {args}, logging_steps=1, per_device_eval_batch_size=4, {fields})
            trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(PROMPTS),
                                  eval_dataset=dataset(4, start=8), callbacks=[RECORDER{extra}])
            trainer.train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / library),
            PROMPTS=prompts,
            RECORDER=recorder(events),
        )
    assert seen["lora_grpo.trl"] == seen["trl"]


def test_evaluate_after_a_failed_train_records_its_metrics(tiny_base_dir, tmp_path):
    from lora_grpo.trl import GRPOConfig, GRPOTrainer

    calls = []

    def fails_once_in_eval(completions, **kwargs):  # the second call is step 1's eval
        calls.append(len(completions))
        if len(calls) == 2:
            raise RuntimeError("eval-time failure")
        return [float(len(c) % 3) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        save_strategy="no",
        report_to="none",
        max_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
    )
    trainer = GRPOTrainer(
        model=tiny_base_dir,
        reward_funcs=fails_once_in_eval,
        args=args,
        train_dataset=dataset(8),
        eval_dataset=dataset(4, start=8),
    )
    with pytest.raises(RuntimeError, match="eval-time failure") as raised:
        trainer.train()
    assert type(raised.value) is RuntimeError and raised.value.__notes__[0].startswith(
        "lora_grpo: step 1/2 stopped"
    )
    metrics = trainer.evaluate()
    assert "eval_runtime" in metrics and "eval_runtime" in trainer.state.log_history[-1]


class ScorerDown(Exception):
    """A reward function's own error type (its scoring service is unreachable)."""


def fails_at_step_2(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 1:
        raise ScorerDown("the scoring service is unreachable")
    return [float(len(c) % 3) for c in completions]


@pytest.mark.parametrize("library", LIBRARIES)
def test_an_error_inside_train_reaches_the_script_as_its_own_type(tiny_base_dir, tmp_path, library):
    """A script's `except` for the error a reward function (a callback, CUDA) raised catches it under both."""
    with pytest.raises(ScorerDown, match="the scoring service is unreachable") as raised:
        run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=3, logging_steps=1)
            trainer = GRPOTrainer(model=MODEL, reward_funcs=fails_at_step_2, args=args, train_dataset=dataset(16))
            trainer.train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / "run"),
            fails_at_step_2=fails_at_step_2,
        )
    assert type(raised.value) is ScorerDown


# ------------------------------------------------------------------------------ TRL's script helpers
HELPERS_SCRIPT = """
    from dataclasses import dataclass, field
    from trl import (GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config,
                     get_quantization_config)

    @dataclass
    class GRPOScriptArguments(ScriptArguments):
        reward_funcs: list[str] = field(default_factory=lambda: ["length"])

    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", CONFIG, "--max_steps", "2", "--output_dir", OUT])
    peft_config, quantization = get_peft_config(model_args), get_quantization_config(model_args)
    trainer = GRPOTrainer(model=model_args.model_name_or_path, reward_funcs=length_reward, args=training_args,
                          train_dataset=dataset(8), peft_config=peft_config, quantization_config=quantization,)
    trainer.train()
"""


@pytest.mark.parametrize("library", LIBRARIES)
def test_trls_script_helpers_on_the_import_line_parse_and_train_alike(
    tiny_base_dir, tmp_path, library, monkeypatch
):
    """The line TRL's examples write, `from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments,
    TrlParser, get_peft_config, ...`, changed to lora_grpo.trl: the YAML's defaults, its env, the flags over them,
    the LoRA config and the run are TRL's."""
    import os

    import yaml

    monkeypatch.delenv("HELPERS_TEST_VAR", raising=False)
    config = tmp_path / "grpo.yaml"
    values = dict(
        model_name_or_path=str(tiny_base_dir), use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
        lora_target_modules=["q_proj", "v_proj"], use_cpu=True, bf16=False, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, max_steps=5, logging_steps=1, save_strategy="no",
        report_to="none", env={"HELPERS_TEST_VAR": "set"},
    )  # fmt: skip
    config.write_text(yaml.safe_dump(values))
    scope = run(library, HELPERS_SCRIPT, CONFIG=str(config), OUT=str(tmp_path / library))
    training_args, model_args, peft = scope["training_args"], scope["model_args"], scope["peft_config"]
    assert (training_args.max_steps, training_args.output_dir) == (2, str(tmp_path / library))
    assert scope["script_args"].reward_funcs == ["length"] and os.environ["HELPERS_TEST_VAR"] == "set"
    assert (model_args.lora_r, peft.r, peft.lora_alpha, sorted(peft.target_modules)) == (
        4,
        4,
        8,
        ["q_proj", "v_proj"],
    )
    assert scope["quantization"] is None
    assert scope["trainer"].state.global_step == 2

    # a key no dataclass has: an error, or the remaining strings
    config.write_text(yaml.safe_dump({**values, "not_a_field": 3}))
    parser = scope["parser"]
    with pytest.raises(
        ValueError, match=re.escape("Unknown arguments from config file: ['--not_a_field', '3']")
    ):
        parser.parse_args_and_config(["--config", str(config)])
    *_, rest = parser.parse_args_and_config(
        ["--config", str(config), "--extra", "x"], return_remaining_strings=True
    )
    assert rest == ["--not_a_field", "3", "--extra", "x"]


# ------------------------------------------------------------------------------ the device cache
@pytest.mark.parametrize("library", LIBRARIES)
def test_torch_empty_cache_steps_empties_the_cache_before_each_step_it_divides(
    tiny_base_dir, tmp_path, library, monkeypatch
):
    """transformers' Trainer empties the accelerator's cache (accelerate's clear_device_cache) before each
    micro-batch of a step whose global_step torch_empty_cache_steps divides; with one micro-batch a step,
    steps 1 and 3 of 4 here (global_step 0 and 2), under both."""
    import transformers.trainer

    import lora_grpo.trl.trainer

    calls = []
    for module in (transformers.trainer, lora_grpo.trl.trainer):
        monkeypatch.setattr(module, "clear_device_cache", lambda *a, **k: calls.append(len(calls)))
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=4, torch_empty_cache_steps=2)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    assert scope["trainer"].state.global_step == 4
    assert len(calls) == 2


# ------------------------------------------------------------------------------ the prompt order
@pytest.mark.parametrize("library", LIBRARIES)
def test_the_prompt_order_follows_seed_and_not_data_seed(tiny_base_dir, tmp_path, library):
    """TRL's GRPOTrainer draws its prompts with a RepeatSampler seeded by seed: data_seed, accepted, changes
    nothing; another seed changes the order."""

    def prompts_seen(**seeds):
        seen = []

        def record(prompts, completions, **kwargs):
            seen.extend(prompts)
            return [0.0] * len(prompts)

        fields = ", ".join(f"{k}={v}" for k, v in seeds.items())
        run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=3, {fields})
            GRPOTrainer(model=MODEL, reward_funcs=record, args=args, train_dataset=dataset(16)).train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / library / fields.replace(", ", "-").replace("=", "")),
            record=record,
        )
        return seen

    first = prompts_seen(seed=5, data_seed=1)
    assert len(first) == 3 * 4
    assert prompts_seen(seed=5, data_seed=2) == prompts_seen(seed=5) == first
    assert prompts_seen(seed=6, data_seed=1) != first


@pytest.mark.parametrize("library", LIBRARIES)
def test_label_smoothing_changes_nothing_in_a_grpo_run(tiny_base_dir, tmp_path, library):
    """TRL's GRPOTrainer computes its own loss, so transformers' label smoother never runs: the same records
    with label_smoothing_factor 0.1 as without it."""

    def losses(smoothing):
        scope = run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, beta=0.04,
                              label_smoothing_factor={smoothing})
            trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
            trainer.train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / library / str(smoothing)),
        )
        return [(r["loss"], r["reward"], r["kl"]) for r in scope["trainer"].state.log_history if "kl" in r]

    plain = losses(0.0)
    assert len(plain) == 2 and losses(0.1) == plain


# what TRL reads only under a switch that is off (open-r1's recipes set vllm_gpu_memory_utilization with use_vllm off)
SWITCHED_OFF = (
    "vllm_mode='server', vllm_server_host='10.0.0.1', vllm_gpu_memory_utilization=0.7, vllm_max_model_length=2048, "
    "vllm_enable_sleep_mode=True, vllm_structured_outputs_regex='[0-9]+', liger_kernel_config={'rms_norm': True}, "
    "transformers_continuous_batching_config={'max_memory_percent': 0.3}"
)


@pytest.mark.parametrize("library", LIBRARIES)
def test_settings_of_an_engine_that_is_off_change_nothing(tiny_base_dir, tmp_path, library):
    """The vllm_*, liger and continuous-batching settings with their switches off: the run is the plain run's."""

    def records(settings):
        scope = run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, beta=0.04, {settings})
            trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
            trainer.train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / library / str(len(settings))),
        )
        return [(r["loss"], r["reward"], r["kl"]) for r in scope["trainer"].state.log_history if "kl" in r]

    plain = records("seed=42")
    assert len(plain) == 2 and records(SWITCHED_OFF) == plain


def build(library, tiny_base_dir, tmp_path, settings: str):
    """A TRL script that builds its GRPOTrainer with `settings` on top of ARGS (and does not train)."""
    return run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, {settings})
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
    )


@pytest.mark.parametrize("library", LIBRARIES)
def test_vespo_with_use_vllm_needs_a_token_level_correction_in_trls_words(tiny_base_dir, tmp_path, library):
    with pytest.raises(
        ValueError, match=re.escape("VESPO loss requires `vllm_importance_sampling_mode` to be")
    ):
        build(library, tiny_base_dir, tmp_path, "use_vllm=True, loss_type='vespo'")


@pytest.mark.parametrize("library", LIBRARIES)
def test_ligers_fused_cross_entropy_is_refused_in_trls_words_after_its_deprecation(
    tiny_base_dir, tmp_path, library
):
    settings = "use_liger_kernel=True, liger_kernel_config={'fused_linear_cross_entropy': True}"
    with (
        pytest.warns(FutureWarning, match=re.escape("`use_liger_kernel=True` is deprecated")),
        pytest.raises(
            ValueError, match=re.escape('`liger_kernel_config={"fused_linear_cross_entropy": True}` is not')
        ),
    ):
        build(library, tiny_base_dir, tmp_path, settings)


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_tokenizer_is_padded_left_when_loaded_and_left_as_it_is_when_given(
    tiny_base_dir, tmp_path, library
):
    """TRL loads the tokenizer padded and truncated on the left (saved so: it reloads so, and batched generate on
    the reloaded adapter is right), and leaves a script's own tokenizer as it is."""
    from transformers import AutoTokenizer

    scope = run(
        library,
        f"""
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1)
        loaded = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        loaded.save_model(OUT + "/saved")
        given = AutoTokenizer.from_pretrained(MODEL, padding_side="right")
        passed = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                             processing_class=given)
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
    )
    loaded = scope["loaded"].processing_class
    assert (loaded.padding_side, loaded.truncation_side) == ("left", "left")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "run" / "saved")
    assert (reloaded.padding_side, reloaded.truncation_side) == ("left", "left")
    assert scope["passed"].processing_class is scope["given"] and scope["given"].padding_side == "right"


@pytest.mark.parametrize("library", LIBRARIES)
def test_fp16_on_a_cpu_trains_in_float32_as_without_it(tiny_base_dir, tmp_path, library):
    """accelerate neither autocasts to float16 nor scales the loss on a CPU: TRL's fp16=True run there is
    its float32 run, record for record; so is ours (on a GPU ours computes in float16 with a loss scale)."""

    def records(fp16):
        scope = run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, beta=0.04, fp16={fp16})
            trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
            trainer.train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / library / str(fp16)),
        )
        trainer = scope["trainer"]
        assert trainer.model.get_input_embeddings().weight.dtype == torch.float32
        return [(r["loss"], r["reward"], r["kl"]) for r in trainer.state.log_history if "kl" in r]

    plain = records(False)
    assert len(plain) == 2 and records(True) == plain


# ------------------------------------------------------------------------------ eval sets
@pytest.mark.parametrize("library", LIBRARIES)
def test_evaluate_without_an_eval_dataset_is_refused_in_transformers_words(tiny_base_dir, tmp_path, library):
    with pytest.raises(ValueError, match=r"^Trainer: evaluation requires an eval_dataset\."):
        run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1)
            GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8)).evaluate()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / library),
        )


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_steps_train_record_comes_before_its_eval_record(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=3, logging_steps=1, eval_strategy="steps", eval_steps=2,
                          per_device_eval_batch_size=4)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              eval_dataset=dataset(4, start=8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    kinds = [
        (r["step"], "train_loss" if "train_loss" in r else "eval" if "eval_runtime" in r else "train")
        for r in scope["trainer"].state.log_history
    ]
    assert kinds == [(1, "train"), (2, "train"), (2, "eval"), (3, "train"), (3, "eval"), (3, "train_loss")]


@pytest.mark.parametrize("library", LIBRARIES)
def test_eval_on_start_evaluates_at_step_0_whatever_the_strategy(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, eval_on_start=True, per_device_eval_batch_size=4)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              eval_dataset=dataset(4, start=8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    history = scope["trainer"].state.log_history
    assert str(scope["trainer"].args.eval_strategy) == "IntervalStrategy.NO"
    assert history[0]["step"] == 0 and "eval_runtime" in history[0]
    assert not any("eval_runtime" in r for r in history[1:])


EVAL_FORMS = {
    "dataset": ("dataset(4, start=16)", [None]),
    "conversational stream": ("dataset(4, start=16, conversational=True).to_iterable_dataset()", [None]),
    "datasetdict": (
        "DatasetDict({'easy': dataset(4, start=16), 'hard': dataset(4, start=20)})",
        ["easy", "hard"],
    ),
    "dict with a stream": (
        "{'easy': dataset(4, start=16), 'hard': dataset(4, start=20).to_iterable_dataset()}",
        ["easy", "hard"],
    ),
}


@pytest.mark.parametrize("form", list(EVAL_FORMS))
@pytest.mark.parametrize("library", LIBRARIES)
def test_every_eval_dataset_form_is_evaluated_under_its_names(tiny_base_dir, tmp_path, library, form):
    source, names = EVAL_FORMS[form]
    scope = run(
        library,
        f"""
        from datasets import DatasetDict
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=1,
                          per_device_eval_batch_size=4)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              eval_dataset={source})
        trainer.train()
        again = trainer.evaluate(eval_dataset={source}, metric_key_prefix="test")
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    prefixes = ["eval" if n is None else f"eval_{n}" for n in names]
    for step in (1, 2):  # each set's record at each eval step, once (step 2 is also the run's last)
        records = [r for r in scope["trainer"].state.log_history if r["step"] == step]
        for prefix in prefixes:
            assert sum(f"{prefix}_runtime" in r for r in records) == 1, (prefix, step, records)
    assert {"test" if n is None else f"test_{n}" for n in names} == {
        k.removesuffix("_runtime") for k in scope["again"] if k.endswith("_runtime")
    }


def exact(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


@pytest.mark.parametrize("library", LIBRARIES)
def test_num_generations_eval_samples_that_many_completions_per_eval_prompt(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, num_generations_eval=2, per_device_eval_batch_size=4)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=[exact, length_reward], args=args, train_dataset=dataset(8),
                              eval_dataset=dataset(4, start=16))
        metrics = trainer.evaluate()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        exact=exact,
    )
    metrics = scope["metrics"]
    assert metrics["eval_runtime"] > 0  # TRL takes it, and so does lora_grpo (it was refused)
    if library == "lora_grpo.trl":  # the sampled completions as pass@1 and pass@2, beside the greedy scores
        assert 0.0 <= metrics["eval_pass@1"] <= metrics["eval_pass@2"] <= 1.0
        assert "eval_exact" in metrics and "eval_length_reward" in metrics


# ------------------------------------------------------------------------------ the best checkpoint
# Each eval step's reward, by plan: every completion of a step gets the same score from `planned`, which gives
# no advantage (length_reward, weighted 0.01, trains); so eval_reward is the plan's, up to 0.01 × a length.
PLAN = {2: 0.5, 4: 0.9, 6: 0.3}


def planned_by(plan: dict):
    """The reward function `planned` of a plan {step: score}."""

    def planned(completions, trainer_state, **kwargs):
        return [plan.get(trainer_state.global_step, 0.0)] * len(completions)

    return planned


planned = planned_by(PLAN)


BEST_RUN = ARGS.replace("save_strategy='no', ", "") + (
    ", max_steps=6, eval_strategy='steps', eval_steps=2, per_device_eval_batch_size=4, metric_for_best_model='reward', "
    "reward_weights=[1.0, 0.01], learning_rate=1e-2"
)


def saves_seen(seen: list):
    """A TrainerCallback that records the global_step of each on_save."""
    from transformers import TrainerCallback

    class Saves(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append(state.global_step)

    return Saves()


@pytest.mark.parametrize("library", LIBRARIES)
def test_transformers_early_stopping_stops_after_its_patience_and_ends_on_the_best(
    tiny_base_dir, tmp_path, library
):
    """EarlyStoppingCallback (patience 1) on the plan's evals: 2 best, 4 worse, so the run stops at step 4 of 6
    and ends on checkpoint-2's adapter."""
    scope = run(
        library,
        f"""
        from transformers import EarlyStoppingCallback
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {BEST_RUN}, save_strategy="steps", save_steps=2,
                          load_best_model_at_end=True)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=[planned, length_reward], args=args,
                              train_dataset=dataset(16), eval_dataset=dataset(4, start=16),
                              callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
        planned=planned_by({2: 1.0, 4: 0.0, 6: 2.0}),
    )
    state = scope["trainer"].state
    assert state.global_step == 4 and state.best_global_step == 2
    assert [r["step"] for r in state.log_history if "eval_reward" in r] == [2, 4]
    assert state.best_model_checkpoint == str(tmp_path / "run" / "checkpoint-2")


def stops_at_train_begin():
    from transformers import TrainerCallback

    class StopAtBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            control.should_training_stop = True

    return StopAtBegin()


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_stop_before_the_first_step_trains_one_and_a_spent_stop_does_not_end_a_resume(
    tiny_base_dir, tmp_path, library
):
    """transformers checks a callback's stop after a step: one asked in on_train_begin still trains step 1. A run that
    ended (its last step asks to stop) resumed in the same trainer from checkpoint-1 trains on to its end."""
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT + "/a", {ARGS.replace("save_strategy='no'", "save_steps=1")}, max_steps=3)
        stopped = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              callbacks=[stops_at_train_begin()])
        stopped.train()
        args = GRPOConfig(output_dir=OUT + "/b", {ARGS.replace("save_strategy='no'", "save_steps=1")}, max_steps=3)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        trainer.train()
        trainer.train(resume_from_checkpoint=OUT + "/b/checkpoint-1")
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
        stops_at_train_begin=stops_at_train_begin,
    )
    assert scope["stopped"].state.global_step == 1
    assert scope["trainer"].state.global_step == 3


def asks_in_on_log_and_on_evaluate(seen):
    """A callback that asks for a save in on_log at step 1, an eval in on_log at step 2 and a save in on_evaluate
    at step 2 (a "save when the eval improves" callback), recording the saves and evals it sees."""
    from transformers import TrainerCallback

    class Asks(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                control.should_save = control.should_save or state.global_step == 1
                control.should_evaluate = control.should_evaluate or state.global_step == 2

        def on_evaluate(self, args, state, control, **kwargs):
            seen.append(("evaluate", state.global_step))
            control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            seen.append(("save", state.global_step))

    return Asks()


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_save_or_an_eval_asked_in_on_log_or_on_evaluate_happens_in_that_step(
    tiny_base_dir, tmp_path, library
):
    """transformers logs, evaluates, then saves at a step's end: what on_log asks for (a save, an eval) and what
    on_evaluate asks for (a save) happen in the same step."""
    seen = []
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=3, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(12),
                              eval_dataset=dataset(4, start=12), callbacks=[CALLBACK])
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
        CALLBACK=asks_in_on_log_and_on_evaluate(seen),
    )
    assert seen == [("save", 1), ("evaluate", 2), ("save", 2)]
    assert (tmp_path / "run" / "checkpoint-1").is_dir() and (tmp_path / "run" / "checkpoint-2").is_dir()


@pytest.mark.parametrize("library", LIBRARIES)
def test_train_results_carry_the_last_logging_windows_metrics(tiny_base_dir, tmp_path, library):
    """TRL's log() adds the window's metrics into the closing record's dict, which is TrainOutput.metrics: what
    open-r1's save_metrics("train", train_result.metrics) writes to train_results.json."""
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=3, logging_steps=2)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
        metrics = trainer.train().metrics
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
    )
    window = {
        "reward",
        "reward_std",
        "entropy",
        "completions/mean_length",
        "num_tokens",
        "frac_reward_zero_std",
    }
    metrics = scope["metrics"]
    assert window <= set(metrics) and {"train_runtime", "train_loss", "epoch"} <= set(metrics)
    # transformers adds loss, grad_norm and learning_rate at a logging step only, not to the closing record
    assert not {"loss", "grad_norm", "learning_rate"} & set(metrics)
    # transformers' speed figures: 3 steps of 4 completions (per_device_train_batch_size) in train_runtime
    assert round(metrics["train_steps_per_second"] * metrics["train_runtime"]) == 3
    assert round(metrics["train_samples_per_second"] * metrics["train_runtime"]) == 12


@pytest.mark.parametrize("library", LIBRARIES)
def test_load_best_model_at_end_trains_on_to_the_best_evals_adapter(tiny_base_dir, tmp_path, library):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    scope = run(
        library,
        f"""
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {BEST_RUN}, save_strategy="steps", save_steps=2,
                          save_total_limit=2, load_best_model_at_end=True)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=[planned, length_reward], args=args,
                              train_dataset=dataset(16), eval_dataset=dataset(4, start=16),
                              peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
        planned=planned,
    )
    trainer, run_dir = scope["trainer"], tmp_path / "run"
    state = trainer.state
    evals = {r["step"]: r["eval_reward"] for r in state.log_history if "eval_reward" in r}
    assert sorted(evals) == [2, 4, 6] and max(evals, key=evals.get) == 4
    assert state.best_global_step == 4 and state.best_metric == pytest.approx(evals[4])
    assert state.best_model_checkpoint == str(run_dir / "checkpoint-4")
    # save_total_limit=2: the best and the newest
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    saved = json.loads((run_dir / "checkpoint-6" / "trainer_state.json").read_text())
    assert saved["best_global_step"] == 4 and saved["best_model_checkpoint"] == str(run_dir / "checkpoint-4")
    # the model the script holds after train() is the best checkpoint's adapter
    best = load_file(str(run_dir / "checkpoint-4" / "adapter_model.safetensors"))
    last = load_file(str(run_dir / "checkpoint-6" / "adapter_model.safetensors"))
    held = {k: v.cpu() for k, v in get_peft_model_state_dict(trainer.model).items()}
    assert held.keys() == best.keys()
    assert all(torch.equal(held[k], best[k]) for k in best)
    assert not all(torch.equal(last[k], best[k]) for k in best)


@pytest.mark.parametrize("library", LIBRARIES)
def test_save_strategy_best_saves_at_each_new_best(tiny_base_dir, tmp_path, library):
    seen = []
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {BEST_RUN}, save_strategy="best")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=[planned, length_reward], args=args,
                              train_dataset=dataset(16), eval_dataset=dataset(4, start=16), callbacks=[SAVES])
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
        planned=planned,
        SAVES=saves_seen(seen),
    )
    assert seen == [2, 4]  # step 6's eval is no improvement
    names = {p.name for p in (tmp_path / "run").glob("checkpoint-*")}
    # lora_grpo also keeps the run's last checkpoint, to resume from (no on_save: it is not the flow's)
    assert names - ({"checkpoint-6"} if library == "lora_grpo.trl" else set()) == {
        "checkpoint-2",
        "checkpoint-4",
    }
    assert scope["trainer"].state.best_model_checkpoint == str(tmp_path / "run" / "checkpoint-4")


# (the flow's evals: every 2 steps of 6, or at the end of each of 2 epochs of 8 steps)
LAST_IS_BEST = {
    "steps": ("max_steps=6, eval_strategy='steps', eval_steps=2", 16, {2: 0.5, 4: 0.7, 6: 0.9}, [2, 4, 6]),
    "epoch": ("num_train_epochs=2, eval_strategy='epoch'", 8, {8: 0.3, 16: 0.9}, [8, 16]),
}


@pytest.mark.parametrize("strategy", list(LAST_IS_BEST))
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_new_best_at_the_last_eval_is_saved_with_on_save(tiny_base_dir, tmp_path, library, strategy):
    schedule, rows, plan, saves = LAST_IS_BEST[strategy]
    seen = []
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS.replace("save_strategy='no', ", "")}, {schedule},
                          per_device_eval_batch_size=4, metric_for_best_model="reward", save_strategy="best",
                          reward_weights=[1.0, 0.01])
        trainer = GRPOTrainer(model=MODEL, reward_funcs=[planned, length_reward], args=args,
                              train_dataset=dataset({rows}), eval_dataset=dataset(4, start=16), callbacks=[SAVES])
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
        planned=planned_by(plan),
        SAVES=saves_seen(seen),
    )
    assert seen == saves


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_best_model_metric_without_eval_prompts_tracks_nothing_and_trains(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, metric_for_best_model="reward")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
    )
    state = scope["trainer"].state
    assert state.global_step == 2 and state.best_metric is None and state.best_model_checkpoint is None


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_best_model_metric_no_eval_reports_is_refused_in_transformers_words(
    tiny_base_dir, tmp_path, library
):
    # (TRL finds out at the first eval, a KeyError; lora_grpo when the trainer is built, a ValueError)
    with pytest.raises((KeyError, ValueError)) as raised:
        run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {BEST_RUN.replace("'reward'", "'accuracy'")})
            trainer = GRPOTrainer(model=MODEL, reward_funcs=[planned, length_reward], args=args,
                                  train_dataset=dataset(16), eval_dataset=dataset(4, start=16))
            trainer.train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / "run"),
            planned=planned,
        )
    assert (
        "The `metric_for_best_model` training argument is set to 'eval_accuracy', which is not found in the "
        "evaluation metrics." in str(raised.value)
    )


@pytest.mark.parametrize("library", LIBRARIES)
def test_save_strategy_best_without_a_metric_is_refused_in_transformers_words(
    tiny_base_dir, tmp_path, library
):
    with pytest.raises(
        ValueError, match=re.escape("`args.metric_for_best_model` must be provided when using 'best'")
    ):
        run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS.replace("save_strategy='no'", "save_strategy='best'")})
            trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / "run"),
        )


# ------------------------------------------------------------------------------ environments
class Counter:
    """An environment with a tool: the prompt comes from the dataset."""

    def reset(self, **row):
        self.count = 0

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count)


class Echo:
    """A second environment, with its own tool."""

    def reset(self, **row):
        self.said = ""

    def echo(self, text: str) -> str:
        """Repeat the text.

        Args:
            text: What to repeat.
        """
        self.said = text
        return text


class Riddle:
    """An environment with no tools that owns its data: reset() supplies the prompt, get_reward() scores."""

    def reset(self, **row):
        return "2+2="

    def get_reward(self) -> float:
        return 1.0


def tool_tokenizer(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.response_template = (
        QWEN_RESPONSE_TEMPLATE  # TRL reads tool calls with it (Qwen's, set by TRL for Qwen)
    )
    return tok


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_dict_of_named_environments_routes_each_row_by_its_environment_column(
    qwen_tool_base_dir, tmp_path, library
):
    from datasets import Dataset

    calls = []

    def seen(completions, environments, **kwargs):
        calls.append([type(e).__name__ for e in environments])
        return [0.0] * len(completions)

    rows = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"go {i}"}], "environment": env}
            for i, env in enumerate(["count", "echo"] * 4)
        ]
    )
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1, shuffle_dataset=False,
                          gradient_accumulation_steps=2)
        trainer = GRPOTrainer(model=MODEL, processing_class=TOKENIZER, reward_funcs=seen, args=args, train_dataset=ROWS,
                              environment_factory={{"count": Counter, "echo": Echo}})
        trainer.train()
    """,
        MODEL=qwen_tool_base_dir,
        TOKENIZER=tool_tokenizer(qwen_tool_base_dir),
        OUT=str(tmp_path / library),
        ROWS=rows,
        seen=seen,
        Counter=Counter,
        Echo=Echo,
    )
    assert calls and all(len(c) == 8 for c in calls)  # a step: two prompts × 4
    assert {name for c in calls for name in c} == {
        "Counter",
        "Echo",
    }  # both kinds of rows, each its own environment
    assert any(
        "rewards/Counter/mean" in r for r in scope["trainer"].state.log_history
    )  # Counter's get_reward


def base_with_template(base_dir, tmp_path, template: str):
    """A copy of the tool base whose tokenizer carries tests/fixtures/chat_templates/<template>.jinja."""
    import shutil
    from pathlib import Path

    base = shutil.copytree(base_dir, tmp_path / f"{template}_base")
    tok = tool_tokenizer(str(base))
    tok.chat_template = (
        Path(__file__).parent / "fixtures" / "chat_templates" / f"{template}.jinja"
    ).read_text()
    tok.save_pretrained(base)
    return base


@pytest.mark.parametrize("library", LIBRARIES)
def test_an_environment_trains_on_qwen3s_own_template(qwen_tool_base_dir, tmp_path, library):
    from datasets import Dataset

    # Qwen3's template as its tokenizer ships it: not prefix-preserving (TRL's docs' agent examples use it)
    base = base_with_template(qwen_tool_base_dir, tmp_path, "qwen3")
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": f"add {i}"}]} for i in range(4)])
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, processing_class=TOKENIZER, reward_funcs=length_reward, args=args,
                              train_dataset=ROWS, environment_factory=Counter)
        trainer.train()
    """,
        MODEL=str(base),
        TOKENIZER=tool_tokenizer(str(base)),
        OUT=str(tmp_path / library),
        ROWS=rows,
        Counter=Counter,
    )
    (record,) = [r for r in scope["trainer"].state.log_history if "loss" in r and "train_loss" not in r]
    assert math.isfinite(record["loss"]) and "rewards/Counter/mean" in record


@pytest.mark.parametrize("library", LIBRARIES)
def test_smollm2s_own_template_is_refused_for_tools_in_trls_sentence(qwen_tool_base_dir, tmp_path, library):
    from datasets import Dataset

    # SmolLM2-135M-Instruct's template as its GGUF ships it: role and content only, so no tool calls
    base = base_with_template(qwen_tool_base_dir, tmp_path, "smollm2")
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": f"add {i}"}]} for i in range(4)])
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1)
        try:
            trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=ROWS,
                                  environment_factory=Counter)
            trainer.train()
        except ValueError as e:
            refused = e
    """,
        MODEL=str(base),
        OUT=str(tmp_path / library),
        ROWS=rows,
        Counter=Counter,
    )
    assert str(scope["refused"]).startswith(
        "The provided chat template does not support tool calling. The template must be able to render a full "
        "tool-calling conversation (user -> assistant with tool_calls -> tool)."
    )
    if library != "trl":  # and names the template and the fix
        assert f"The chat template of {str(base)!r} drops the assistant's tool_calls" in str(scope["refused"])
        assert "set tokenizer.chat_template to one" in str(scope["refused"])


@pytest.mark.parametrize("library", LIBRARIES)
def test_an_environment_that_owns_its_prompts_trains_without_a_dataset(qwen_tool_base_dir, tmp_path, library):
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.extend(p[-1]["content"] for p in prompts)
        return [float(len(c[-1]["content"]) % 2) for c in completions]

    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, processing_class=TOKENIZER, reward_funcs=spy, args=args,
                              environment_factory=Riddle)
        trainer.train()
    """,
        MODEL=qwen_tool_base_dir,
        TOKENIZER=tool_tokenizer(qwen_tool_base_dir),
        OUT=str(tmp_path / library),
        Riddle=Riddle,
        spy=spy,
    )
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2
    assert len(trainer.train_dataset) == 1  # TRL's placeholder rows: one generation round's prompts
    assert any("rewards/Riddle/mean" in r for r in trainer.state.log_history)
    assert set(seen) == {"2+2="}  # the reward functions see the prompt reset() filled, as the model did


class BlockRiddle:
    """Riddle, with reset() returning content blocks (TRL joins them to the prompt's last message)."""

    def reset(self, **row):
        return [{"type": "text", "text": "2+2="}]

    def get_reward(self) -> float:
        return 1.0


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_reset_that_returns_content_blocks_joins_the_prompt_as_blocks(
    qwen_tool_base_dir, tmp_path, library
):
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.extend(p[-1]["content"] for p in prompts)
        return [0.0] * len(completions)

    tok = tool_tokenizer(qwen_tool_base_dir)
    # a template that renders a message's blocks (as text: `~` joins a list as its repr)
    tok.chat_template = tok.chat_template.replace(
        "'\\n' + message.content + '<|im_end|>'", "'\\n' ~ message.content ~ '<|im_end|>'"
    )
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, processing_class=TOKENIZER, reward_funcs=spy, args=args,
                              environment_factory=BlockRiddle)
        trainer.train()
    """,
        MODEL=qwen_tool_base_dir,
        TOKENIZER=tok,
        OUT=str(tmp_path / library),
        BlockRiddle=BlockRiddle,
        spy=spy,
    )
    # the placeholder prompt's text becomes a text block, and the reset's blocks follow it
    assert seen and all(c == [{"type": "text", "text": ""}, {"type": "text", "text": "2+2="}] for c in seen)


class Keeper:
    """An environment whose reset() names its fields (no **kwargs) and keeps what it got."""

    got = []

    def reset(self, prompt, answer):
        Keeper.got.append({"prompt": prompt, "answer": answer})

    def get_reward(self) -> float:
        return 0.0


class KeeperOfAll:
    """The same, for whatever fields come (TRL's docs' reset(self, **kwargs))."""

    got = []

    def reset(self, **kwargs):
        KeeperOfAll.got.append(kwargs)

    def get_reward(self) -> float:
        return 0.0


@pytest.mark.parametrize("library", LIBRARIES)
def test_reset_gets_the_rows_own_fields_as_trl_passes_them(qwen_tool_base_dir, tmp_path, library):
    from datasets import Dataset

    Keeper.got, KeeperOfAll.got = [], []
    rows = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"add {i}"}], "answer": str(i)} for i in range(4)]
    )
    script = f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, shuffle_dataset=False)
        trainer = GRPOTrainer(model=MODEL, processing_class=TOKENIZER, reward_funcs=length_reward, args=args,
                              train_dataset=ROWS, environment_factory=ENVIRONMENT)
        trainer.train()
    """
    common = dict(MODEL=qwen_tool_base_dir, TOKENIZER=tool_tokenizer(qwen_tool_base_dir), ROWS=rows)
    run(library, script, OUT=str(tmp_path / "named"), ENVIRONMENT=Keeper, **common)
    # a step: the first prompt's group of 4 (1 prompt: 4 rows = per_device_train_batch_size); every rollout
    # is reset with its row's own fields, the prompt as the row gave it (its messages)
    assert Keeper.got and {(g["answer"], g["prompt"][-1]["content"]) for g in Keeper.got} <= {
        (str(i), f"add {i}") for i in range(4)
    }
    assert all(g["prompt"] == [{"role": "user", "content": f"add {g['answer']}"}] for g in Keeper.got)
    run(library, script, OUT=str(tmp_path / "all"), ENVIRONMENT=KeeperOfAll, **common)
    assert KeeperOfAll.got and all(set(g) == {"prompt", "answer"} for g in KeeperOfAll.got)


class Coding:
    """A routed environment with a tool: reset() returns the task, the prompt's only text."""

    def reset(self, **row):
        self.runs = 0
        return "print 1+1"

    def run_code(self, code: str) -> str:
        """Run Python code.

        Args:
            code: The code to run.
        """
        self.runs += 1
        return "2"

    def get_reward(self) -> float:
        return float(self.runs)


class Game:
    """A routed environment without tools: reset() returns the board, get_reward() scores."""

    def reset(self, **row):
        return "guess a digit"

    def get_reward(self) -> float:
        return 0.5


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_routing_dataset_of_only_environment_names_trains_on_the_prompts_reset_returns(
    qwen_tool_base_dir, tmp_path, library
):
    # TRL's docs, "Multiple environments": the dataset's only column is `environment`; each row's prompt is an
    # empty user message that its environment's reset() fills.
    from datasets import Dataset

    seen = []

    def spy(prompts, completions, environments, **kwargs):
        seen.extend((type(e).__name__, p[-1]["content"]) for p, e in zip(prompts, environments))
        return [float(len(c[-1]["content"]) % 2) for c in completions]

    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, gradient_accumulation_steps=2)
        trainer = GRPOTrainer(model=MODEL, processing_class=TOKENIZER, reward_funcs=spy, args=args, train_dataset=ROWS,
                              environment_factory={{"coding": Coding, "game": Game}})
        trainer.train()
    """,
        MODEL=qwen_tool_base_dir,
        TOKENIZER=tool_tokenizer(qwen_tool_base_dir),
        OUT=str(tmp_path / library),
        ROWS=Dataset.from_dict({"environment": ["coding", "game"] * 4}),
        Coding=Coding,
        Game=Game,
        spy=spy,
    )
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2
    # every rollout's prompt is its own environment's reset() text
    assert set(seen) == {("Coding", "print 1+1"), ("Game", "guess a digit")}
    records = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    assert all("rewards/Coding/mean" in r and "rewards/Game/mean" in r for r in records)


def _chain(error):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def test_a_row_naming_an_unknown_environment_is_refused_with_trls_sentence(qwen_tool_base_dir, tmp_path):
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "go"}], "environment": "nope"}] * 4)
    errors = {}
    for library in LIBRARIES:
        with pytest.raises(Exception) as caught:  # noqa: PT011 - compared below, as TRL raises it
            run(
                library,
                f"""
                from trl import GRPOConfig, GRPOTrainer
                args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1)
                GRPOTrainer(model=MODEL, processing_class=TOKENIZER, reward_funcs=length_reward, args=args,
                            train_dataset=ROWS, environment_factory={{"count": Counter}}).train()
            """,
                MODEL=qwen_tool_base_dir,
                TOKENIZER=tool_tokenizer(qwen_tool_base_dir),
                OUT=str(tmp_path / library),
                ROWS=rows,
                Counter=Counter,
            )
        errors[library] = next(
            e for e in _chain(caught.value) if isinstance(e, ValueError)
        )  # a stage error may wrap it
    sentence = "Example has `environment='nope'`, which is not among the environments passed to `environment_factory`."
    assert all(str(e).startswith(sentence) for e in errors.values()), errors


REFUSALS = {
    "no train_dataset and no environment": ("reward_funcs=length_reward, args=args", ValueError),
    "a dict of environments without a dataset": (
        "reward_funcs=length_reward, args=args, environment_factory={'a': Riddle}",
        ValueError,
    ),
    "an environment's data without max_steps": (
        "reward_funcs=length_reward, args=ARGS_NO_STEPS, environment_factory=Riddle",
        ValueError,
    ),
    "no reward source": ("args=args, train_dataset=dataset(8)", ValueError),
    "reward_processing_classes of another length": (
        "reward_funcs=length_reward, reward_processing_classes=[None, None], args=args, train_dataset=dataset(8)",
        ValueError,
    ),
    "eval_strategy without eval_dataset": (
        "reward_funcs=length_reward, args=ARGS_EVAL, train_dataset=dataset(8)",
        ValueError,
    ),
    "sync_ref_model with beta 0": (
        "reward_funcs=length_reward, args=ARGS_SYNC, train_dataset=dataset(8)",
        ValueError,
    ),
    "a peft_config that is not one": (
        "reward_funcs=length_reward, args=args, train_dataset=dataset(8), peft_config={}",
        TypeError,
    ),
}


def _refusal(library, model, tokenizer, out, call):
    try:
        run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2)
            ARGS_NO_STEPS = GRPOConfig(output_dir=OUT, {ARGS})
            ARGS_EVAL = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, eval_strategy="steps",
                                   per_device_eval_batch_size=4)
            ARGS_SYNC = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, sync_ref_model=True)
            GRPOTrainer(model=MODEL, processing_class=TOKENIZER, {call})
        """,
            MODEL=model,
            TOKENIZER=tokenizer,
            OUT=out,
            Riddle=Riddle,
        )
    except Exception as e:  # noqa: BLE001 - the refusal under test
        return e
    return None


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_trl_refuses_at_construction_is_refused_with_trls_sentence(qwen_tool_base_dir, tmp_path, case):
    call, kind = REFUSALS[case]
    tokenizer = tool_tokenizer(qwen_tool_base_dir)
    theirs = _refusal("trl", qwen_tool_base_dir, tokenizer, str(tmp_path / "trl"), call)
    ours = _refusal("lora_grpo.trl", qwen_tool_base_dir, tokenizer, str(tmp_path / "ours"), call)
    assert isinstance(theirs, kind) and isinstance(ours, kind), (theirs, ours)
    sentence = re.split(r"(?<=[.!?])\s", str(theirs), maxsplit=1)[0]
    assert str(ours).startswith(sentence), (str(ours), sentence)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_trls_warning_on_sequence_level_sampling_with_a_token_summed_loss(
    tiny_base_dir, tmp_path, caplog, library, loss_type
):
    with caplog.at_level(logging.WARNING):
        run(
            library,
            f"""
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, importance_sampling_level="sequence",
                              loss_type="{loss_type}")
            GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / library),
        )
    warned = [
        r.getMessage() for r in caplog.records if "importance_sampling_level='sequence'" in r.getMessage()
    ]
    assert len(warned) == (loss_type == "dapo")
    assert all(
        "When using `importance_sampling_level='sequence'`, the `'dapo'` loss sums" in w for w in warned
    )


def math_reward(completions, task, **kwargs):
    return [float(len(c) % 2) if t == "math" else None for c, t in zip(completions, task, strict=True)]


def text_reward(completions, task, **kwargs):
    return [float(len(c) % 3) if t == "text" else None for c, t in zip(completions, task, strict=True)]


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_row_that_no_reward_function_scores_warns_in_trls_words_and_trains_on(
    tiny_base_dir, tmp_path, caplog, library
):
    from datasets import Dataset

    # TRL's multi-task pattern: each function returns None for the rows of the other task; the "chat"
    # rows are scored by neither.
    rows = [
        {"prompt": r["prompt"], "task": ("math", "text", "chat")[i % 3]} for i, r in enumerate(PROMPTS[:6])
    ]
    with caplog.at_level(logging.WARNING):
        scope = run(
            library,
            """
            from trl import GRPOConfig, GRPOTrainer
            # one epoch of 3 prompts × 4 completions per step: every task's rows are drawn
            args = GRPOConfig(output_dir=OUT, use_cpu=True, bf16=False, per_device_train_batch_size=12,
                              num_generations=4, max_completion_length=4, save_strategy="no", report_to="none",
                              max_steps=2, logging_steps=1)
            trainer = GRPOTrainer(model=MODEL, reward_funcs=[math_reward, text_reward], args=args,
                                  train_dataset=DATA)
            trainer.train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / library),
            DATA=Dataset.from_list(rows),
            math_reward=math_reward,
            text_reward=text_reward,
        )
    warned = [
        r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()
    ]
    assert warned and all(
        "All reward functions returned None for the following kwargs:\n{'task': 'chat', 'prompt': " in w
        for w in warned
    )
    assert "'task': 'chat'" in warned[0]
    steps = [r for r in scope["trainer"].state.log_history if "loss" in r and "train_loss" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["loss"]) and math.isfinite(r["reward"])
        assert 0.0 <= r["reward"] <= 2.0


@pytest.mark.parametrize("library", LIBRARIES)
def test_deepseekmaths_epsilon_of_ten_trains_and_never_clips_low(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, epsilon=10.0, num_iterations=2)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    steps = [r for r in scope["trainer"].state.log_history if "loss" in r and "train_loss" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["clip_ratio/low_mean"] == 0 for r in steps)


COMPLETION_METRICS = (
    "num_tokens",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


@pytest.mark.parametrize("library", LIBRARIES)
def test_trls_completion_metrics_have_trls_meaning(tiny_base_dir, tmp_path, library):
    from datasets import Dataset

    # The tiny model ends a completion early now and then (max 8 tokens), so both kinds of lengths occur.
    # Every metric is recomputed here from the completions TRL hands the reward function.
    seen = []

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.append([list(ids) for ids in completion_ids])
        return [float(len(ids) % 2) for ids in completion_ids]

    scope = run(
        library,
        """
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, use_cpu=True, bf16=False, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=8, save_strategy="no", report_to="none",
                          max_steps=2, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=spy, args=args, train_dataset=DATA)
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        DATA=Dataset.from_list([{"prompt": r["prompt"]} for r in PROMPTS[:4]]),
        spy=spy,
    )
    trainer = scope["trainer"]
    steps = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    assert len(steps) == 2 == len(seen)
    tok = trainer.processing_class
    prompt_tokens = [4 * len(tok(r["prompt"])["input_ids"]) for r in PROMPTS[:4]]
    total = 0
    for record, ids in zip(steps, seen, strict=True):
        assert set(COMPLETION_METRICS) <= set(record)
        lengths = [len(i) for i in ids]
        ended = [len(i) for i in ids if len(i) < 8] or [0]
        total += sum(lengths)
        assert record["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
        assert record["completions/min_length"] == min(lengths)
        assert record["completions/max_length"] == max(lengths)
        assert record["completions/clipped_ratio"] == pytest.approx(
            sum(n == 8 for n in lengths) / len(lengths)
        )
        assert record["completions/mean_terminated_length"] == pytest.approx(sum(ended) / len(ended))
        assert record["completions/min_terminated_length"] == min(ended)
        assert record["completions/max_terminated_length"] == max(ended)
    # the run's prompt and completion tokens so far (each prompt counted once per completion): the 2 steps
    # are one epoch of the 4 prompts
    assert steps[-1]["num_tokens"] == total + sum(prompt_tokens)
    assert steps[0]["num_tokens"] < steps[1]["num_tokens"]


def _token_logps(model, tokenizer, prompt, ids, temperature=1.0):
    """(T,) log-probs of completion `ids` after `prompt` under `model` as it is now, from one unpadded
    forward of softmax(logits / temperature); with grad where grad is enabled."""
    import torch

    prompt_ids = tokenizer(prompt)["input_ids"]
    logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("micro", [4, 2])
def test_clip_ratio_extremes_are_trls_on_the_same_run(tiny_base_dir, tmp_path, library, micro):
    """clip_ratio/low_min and high_max of a second pass over one generation (num_iterations 2), against
    the per-completion clipped shares computed from the model before and after the first update: the
    min (max) over each micro-step of per_device_train_batch_size completions, averaged over the micro-steps.
    TRL's micro-steps are a random split of the step (it shuffles): with 2 of 2, any of the 3 pairings."""
    import copy
    import itertools

    import torch
    from transformers import TrainerCallback

    seen, logps = [], {}

    def spy(prompts, completions, completion_ids, **kwargs):
        rewards = [float(sum((k + 1) * i for k, i in enumerate(ids)) % 11) for ids in completion_ids]
        seen.append((prompts, completion_ids, rewards))
        return rewards

    # the policy as it sampled (its weights at the start) and after the first update
    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
            self.model, self.tokenizer = model, processing_class
            self.start = copy.deepcopy(model.state_dict())

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                prompts, ids, _ = seen[0]
                now = copy.deepcopy(self.model.state_dict())
                for name, weights in [("old", self.start), ("new", now)]:
                    self.model.load_state_dict(weights)
                    with torch.no_grad():
                        logps[name] = [
                            _token_logps(self.model, self.tokenizer, p, i) for p, i in zip(prompts, ids)
                        ]

    scope = run(
        library,
        """
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, use_cpu=True, bf16=False, per_device_train_batch_size=MICRO,
                          gradient_accumulation_steps=4 // MICRO, num_generations=4, max_completion_length=6,
                          save_strategy="no", report_to="none", max_steps=2, logging_steps=1, num_iterations=2,
                          epsilon=0.05, learning_rate=0.05, beta=0.0)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=spy, args=args, train_dataset=DATA, callbacks=[PROBE])
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        DATA=dataset(2),
        MICRO=micro,
        PROBE=Probe(),
        spy=spy,
    )
    steps = [r for r in scope["trainer"].state.log_history if "loss" in r and "train_loss" not in r]
    assert len(seen) == 1 and len(steps) == 2  # one generation, trained on twice
    rewards = torch.tensor(seen[0][2])
    advantages = rewards - rewards.mean()
    low, high = [], []
    for old, new, a in zip(logps["old"], logps["new"], advantages, strict=True):
        ratio = torch.exp(new - old)
        low.append(((ratio < 1 - 0.05) & (a < 0)).float().mean().item())
        high.append(((ratio > 1 + 0.05) & (a > 0)).float().mean().item())
    assert max(high) > 0 and max(low) > 0  # the update moved some completions out of the clip range
    rows = range(4)
    if micro == 4:
        expected = [(min(low), max(high))]
    else:  # the 3 ways to cut 4 completions into 2 micro-steps of 2
        pairings = [
            (pair, tuple(r for r in rows if r not in pair)) for pair in itertools.combinations(rows, 2)
        ][:3]
        expected = [
            (
                sum(min(low[r] for r in part) for part in cut) / 2,
                sum(max(high[r] for r in part) for part in cut) / 2,
            )
            for cut in pairings
        ]
    got = (steps[1]["clip_ratio/low_min"], steps[1]["clip_ratio/high_max"])
    assert any(got == pytest.approx(e, abs=1e-6) for e in expected), (got, expected)
    # the first pass is on-policy: nothing clips
    assert steps[0]["clip_ratio/low_min"] == 0 == steps[0]["clip_ratio/high_max"]


def _dapo_gradient(model, tokenizer, seen, temperature):
    """{name: gradient} of the trainable parameters, computed here from the completions a run's first step
    scored: the dapo loss at ratio 1, −Σ_i A_i Σ_t log π(c_it) / (the step's completion tokens), with
    π from _token_logps and A the group's rewards minus their mean over their (unbiased) std + 1e-4
    (TRL's scale_rewards="group")."""
    import torch

    prompts, ids, rewards = seen
    groups = torch.tensor(rewards).view(-1, 4)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    total = sum(len(c) for c in ids)
    for prompt, completion, a in zip(prompts, ids, advantages, strict=True):
        (-a * _token_logps(model, tokenizer, prompt, completion, temperature).sum() / total).backward()
    return {n: p.grad.clone() for n, p in params.items()}


def _tiny_model(path, base):
    """The tiny base as a user passes it: a path (float32), or an NF4 model loaded with
    BitsAndBytesConfig on the portable 4-bit path (lora_grpo.model.load.keep_4bit_weights_fixed)."""
    return path if base == "fp32" else load_4bit(path, portable=True)


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("base", ["fp32", "4bit"])
def test_the_first_update_is_adams_step_on_the_dapo_gradient_of_the_completions(
    tiny_base_dir, tmp_path, library, base
):
    """One update from the completions the reward function saw, recomputed here without either trainer:
    the LoRA weights after step 1 are the start weights plus Adam's first step on the clipped gradient
    of the dapo loss, −lr·ĝ/(|ĝ| + eps) (m̂ = ĝ, v̂ = ĝ²). adam_epsilon 1 makes that step proportional
    to the gradient, so it checks the loss's scale (normaliser, advantages, temperature), not only its
    sign. One group has equal rewards: its rows have no gradient (ours leaves them out of the update).
    On a 4-bit base the gradient flows back through bitsandbytes' matmuls to every layer's LoRA B.
    There TRL casts the adapter's weights to bfloat16 (QLoRA's recommendation), so its step holds to
    bf16's rounding; ours keeps them in float32 (README's "where we differ") and holds exactly."""
    import torch
    from transformers import TrainerCallback

    quantized_trl = base == "4bit" and library == "trl"
    adapter_dtype = torch.bfloat16 if quantized_trl else torch.float32

    def assert_step(after, expected, start, name):
        if quantized_trl:  # bf16 weights and moments: within 1% of the largest move (measured: 0.4–0.8%)
            step = (expected - start).abs().max()
            assert (after - expected).abs().max() <= 1e-2 * step, name
        else:
            torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-6, msg=name)

    seen, checked = [], {}

    def spy(prompts, completions, completion_ids, **kwargs):
        # PROMPTS[0]'s group: equal rewards; the other's: the completion's place in its group
        rewards = [1.0 if p == PROMPTS[0]["prompt"] else float(i % 4) for i, p in enumerate(prompts)]
        seen.append((prompts, [list(c) for c in completion_ids], rewards))
        return rewards

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
            self.model, self.tokenizer = model, processing_class
            self.start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

        def on_step_end(self, args, state, control, **kwargs):
            params = dict(self.model.named_parameters())
            after = {n: params[n].detach().clone() for n in self.start}
            with torch.no_grad():
                for n, p in self.start.items():
                    params[n].copy_(p)
            grads = _dapo_gradient(self.model, self.tokenizer, seen[0], temperature=0.7)
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
            clip = min(1.0, 1.0 / (norm + 1e-6))  # torch's clip_grad_norm_ at max_grad_norm 1
            checked.update(norm=norm)
            for n, g in grads.items():
                expected = self.start[n] - 0.5 * (clip * g) / ((clip * g).abs() + 1.0)
                assert after[n].dtype == adapter_dtype, n
                assert_step(after[n], expected, self.start[n], n)
                checked[n] = (after[n] - self.start[n]).abs().max().item()
            with torch.no_grad():
                for n, p in after.items():
                    params[n].copy_(p)

    scope = run(
        library,
        """
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, use_cpu=True, bf16=False, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=6, temperature=0.7, save_strategy="no",
                          report_to="none", max_steps=1, logging_steps=1, learning_rate=0.5, adam_epsilon=1.0,
                          lr_scheduler_type="constant")
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=spy, args=args, train_dataset=DATA, peft_config=lora,
                              callbacks=[PROBE])
        trainer.train()
    """,
        MODEL=_tiny_model(tiny_base_dir, base),
        OUT=str(tmp_path / library),
        DATA=dataset(2),
        PROBE=Probe(),
        spy=spy,
    )
    assert len(seen) == 1 and checked["norm"] > 0
    moved = [n for n, d in checked.items() if n != "norm" and d > 0]
    assert moved and all("lora_B" in n for n in moved)  # B starts at 0, so A's first gradient is 0
    [record] = [r for r in scope["trainer"].state.log_history if "grad_norm" in r]
    assert record["grad_norm"] == pytest.approx(checked["norm"], rel=1e-2 if quantized_trl else 1e-4)


# Every metric TRL 1.16's GRPOTrainer logs (`_metrics[mode][...]`, `_metrics["train"][...]`, walked out of its
# source below): None when a plain run with beta > 0 logs it here under TRL's name; else when it is logged, or
# why it is not.
TRL_METRICS = {
    "step_time": None,
    "num_tokens": None,
    "completions/mean_length": None,
    "completions/min_length": None,
    "completions/max_length": None,
    "completions/clipped_ratio": None,
    "completions/mean_terminated_length": None,
    "completions/min_terminated_length": None,
    "completions/max_terminated_length": None,
    "rewards/{reward_func_name}/mean": None,
    "rewards/{reward_func_name}/std": None,
    "reward": None,
    "reward_std": None,
    "frac_reward_zero_std": None,
    "kl": None,
    "entropy": None,
    "clip_ratio/low_mean": None,
    "clip_ratio/high_mean": None,
    "clip_ratio/region_mean": None,
    "tools/call_frequency": "with tools (the environment tests above)",
    "tools/failure_frequency": "with tools (the environment tests above)",
    "{name}": "a reward function's log_metric (tests/test_rewards.py)",
    "policy_loss": "with an entropy bonus (tests/test_loss.py)",
    "entropy_coef": "with an entropy bonus (tests/test_loss.py)",
    "cispo_clip_ratio": "with loss_type='cispo' (tests/test_loss_variants.py)",
    "vespo/phi_seq_mean": "with loss_type='vespo' (tests/test_loss_variants.py)",
    "aux_loss": "not logged: router_aux_loss_coef is refused by name (MoE auxiliary losses are not added)",
    "sampling/sampling_logp_difference/mean": "not logged: vLLM only, and use_vllm is refused",
    "sampling/sampling_logp_difference/max": "not logged: vLLM only, and use_vllm is refused",
    "sampling/importance_sampling_ratio/min": "not logged: vLLM only, and use_vllm is refused",
    "sampling/importance_sampling_ratio/mean": "not logged: vLLM only, and use_vllm is refused",
    "sampling/importance_sampling_ratio/max": "not logged: vLLM only, and use_vllm is refused",
    "clip_ratio/low_min": None,
    "clip_ratio/high_max": None,
}


def _trl_metric_names() -> set[str]:
    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer)
    return set(re.findall(r'_metrics\[(?:mode|"train"|"eval")\]\[f?"([^"]+)"\]', source)) | set(
        re.findall(r"_metrics\[mode\]\[(name)\]", source)
    )


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_metric_trl_logs_is_logged_here_or_has_a_reason(tiny_base_dir, tmp_path, library):
    names = {"{name}" if n == "name" else n for n in _trl_metric_names()}
    assert len(names) >= 30
    assert names == set(TRL_METRICS), (
        "a TRL metric with no entry in TRL_METRICS, or an entry TRL no longer logs"
    )
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1, beta=0.1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(4))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    (record,) = [r for r in scope["trainer"].state.log_history if "loss" in r and "train_loss" not in r]
    expected = {
        n.replace("{reward_func_name}", "length_reward") for n, why in TRL_METRICS.items() if why is None
    }
    assert expected <= set(record), sorted(expected - set(record))
    absent = {n for n, why in TRL_METRICS.items() if why and why.startswith("not logged")}
    if library != "trl":
        assert not absent & set(record)


def _messages(function) -> list[str]:
    """The first string of every raise and warning in a function's source (f-strings with their fields)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found = []
    for node in ast.walk(tree):
        call = node.exc if isinstance(node, ast.Raise) else node if isinstance(node, ast.Call) else None
        if not isinstance(call, ast.Call):
            continue
        name = ast.unparse(call.func)
        if not (isinstance(node, ast.Raise) or name in ("warnings.warn", "logger.warning", "logger.warn")):
            continue
        for arg in call.args[:1]:
            pieces = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
            text = "".join(
                p.value if isinstance(p, ast.Constant) else "{" + ast.unparse(p.value) + "}"
                for p in pieces
                if isinstance(p, (ast.Constant, ast.FormattedValue))
            )
            found.append(text)
    return [t for t in found if t]


def test_every_error_and_warning_of_trls_constructor_and_config_has_a_fate_here():
    from trl.trainer.grpo_trainer import GRPOTrainer as TRLTrainer

    from lora_grpo.trl.checks import TRL_CHECKS

    starts = [start for _, start, _ in TRL_CHECKS]
    messages = _messages(TRLTrainer.__init__) + _messages(trl.GRPOConfig.__post_init__)
    assert len(messages) >= 50
    missing = [m for m in messages if not any(m.startswith(s) or s in m for s in starts)]
    assert not missing, f"TRL messages with no entry in lora_grpo.trl.checks.TRL_CHECKS: {missing}"
    assert all(fate for _, _, fate in TRL_CHECKS)


# ------------------------------------------------------------------------------ runs
def _trace(history):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)} for r in history]


@pytest.mark.parametrize("library", LIBRARIES)
def test_two_runs_of_one_script_are_identical_without_seeding_by_hand(tiny_base_dir, tmp_path, library):
    import torch

    histories = []
    for k in range(2):
        torch.manual_seed(1000 + k)  # whatever the script did before: args.seed decides
        scope = run(
            library,
            f"""
            from peft import LoraConfig
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, learning_rate=1e-2)
            trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights="gaussian", task_type="CAUSAL_LM"))
            trainer.train()
        """,
            MODEL=tiny_base_dir,
            OUT=str(tmp_path / f"{library}-{k}"),
        )
        histories.append(_trace(scope["trainer"].state.log_history))
    assert histories[0] == histories[1]
    assert histories[0][0]["grad_norm"] > 0  # the runs learned something to compare


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_failed_resume_does_not_stick_to_the_trainer(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        try:
            trainer.train(resume_from_checkpoint=True)
        except ValueError as e:
            refused = e
        trainer.train(resume_from_checkpoint=False)
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    # transformers' sentence, naming output_dir
    assert str(scope["refused"]).startswith(
        f"No valid checkpoint found in output directory ({tmp_path / library})"
    )
    assert scope["trainer"].state.global_step == 1


@pytest.mark.parametrize("library", LIBRARIES)
def test_what_trl_users_read_off_the_trainer(tiny_base_dir, tmp_path, library):
    import torch

    scope = run(
        library,
        f"""
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, beta=0.04)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=[length_reward], args=args, train_dataset=dataset(8),
                              eval_dataset=dataset(4, start=16), peft_config=LoraConfig(r=4, task_type="CAUSAL_LM"))
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    t = scope["trainer"]
    assert t.ref_model is None  # with PEFT, as in TRL: the reference is an adapter of t.model
    assert t.reward_funcs == [length_reward] and t.reward_processing_classes == [None]
    assert t.reward_func_names == ["length_reward"]
    assert t.processing_class is not None and t.args.beta == 0.04
    assert len(t.train_dataset) == 8 and len(t.eval_dataset) == 4
    g = torch.Generator().manual_seed(0)
    entropies, mask = torch.rand(3, 5, generator=g), (torch.rand(3, 5, generator=g) > 0.3).float()
    picked = t.get_high_entropy_mask(entropies, mask, 0.6)  # TRL: tokens at or above the 0.6 quantile
    expected = (entropies >= torch.quantile(entropies[mask.bool()], 0.6)) & mask.bool()
    assert torch.equal(picked, expected)
    adv, logp, old = torch.tensor([[1.0], [-1.0], [-1.0]]), torch.zeros(3, 5), torch.zeros(3, 5)
    old[2] = 1.0  # the third sequence is off-policy (mean KL 1) with a negative advantage: dropped
    keep = type(t).get_off_policy_mask(adv, logp, old, torch.ones(3, 5), 0.5)
    assert keep.tolist() == [[1.0], [1.0], [0.0]]


# ------------------------------------------------------------------------------ what scripts read off the trainer
@pytest.mark.parametrize("library", LIBRARIES)
def test_trls_own_log_completions_callback_generates_with_the_trainers_model(
    tiny_base_dir, tmp_path, library
):
    scope = run(
        library,
        f"""
        from peft import LoraConfig
        from transformers import GenerationConfig
        from trl import GRPOConfig, GRPOTrainer
        from trl.trainer.callbacks import LogCompletionsCallback
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, beta=0.04, epsilon_high=0.28)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              eval_dataset=dataset(2, start=16),
                              peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
        completions = LogCompletionsCallback(trainer, GenerationConfig(max_new_tokens=3, do_sample=False), freq=1)
        trainer.add_callback(completions)
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
    )
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2
    assert len(scope["completions"].table) == 4  # its 2 eval prompts' completions at each of the 2 steps
    # what TRL's trainer copies from its arguments, and transformers' process checks
    assert (trainer.num_generations, trainer.beta, trainer.epsilon_low, trainer.epsilon_high) == (
        4,
        0.04,
        0.2,
        0.28,
    )
    assert (trainer.max_completion_length, trainer.temperature, trainer.loss_type) == (4, 1.0, "dapo")
    assert trainer.reward_weights.tolist() == [1.0] and trainer.num_generations_eval == 4
    assert trainer.is_local_process_zero() and trainer.is_world_process_zero()
    assert trainer._get_learning_rate() == trainer.lr_scheduler.get_last_lr()[0]


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_flow_set_on_trainer_args_before_train_is_the_one_that_acts(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=4, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
        trainer.args.logging_steps = 2
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
    )
    history = scope["trainer"].state.log_history
    assert [r["step"] for r in history if "loss" in r and "train_loss" not in r] == [2, 4]


# ------------------------------------------------------------------------------ peft's own API on trainer.model
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("library", LIBRARIES)
def test_peft_sees_the_trained_policy_as_the_default_adapter(tiny_base_dir, tmp_path, library, beta):
    """What a script does with trainer.model through peft itself: save_pretrained(dir) writes the trained adapter at
    dir's root (PeftModel.from_pretrained loads it), get_peft_model_state_dict returns it, merge_and_unload merges
    it. (lora_grpo also holds its frozen reference slot, saved in a subdirectory; TRL's reference, with a KL term, is
    the base with the adapter disabled.)"""
    from huggingface_hub import ModelCard
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    scope = run(
        library,
        f"""
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, learning_rate=1e-2, beta=BETA)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
        trainer.train()
        trainer.model.save_pretrained(SAVED)
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "run"),
        SAVED=str(tmp_path / "saved"),
        BETA=beta,
    )
    model = scope["trainer"].model
    assert model.active_adapter == "default"
    trained = get_peft_model_state_dict(model)
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(tmp_path / "saved")
    )
    assert get_peft_model_state_dict(loaded).keys() == trained.keys()
    assert all(torch.equal(get_peft_model_state_dict(loaded)[k], trained[k].cpu()) for k in trained)
    # peft's card lists the trainer's tags on the model: the method and the library ("trl" or "lora_grpo")
    tags = ModelCard.load(tmp_path / "saved" / "README.md").data.tags
    assert {"grpo", "trl" if library == "trl" else "lora_grpo"} <= set(tags)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = loaded(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(merged, expected)


# ------------------------------------------------------------------------------ the hub
def pushes_begun(seen: list):
    """A TrainerCallback that records the global_step of each on_push_begin."""
    from transformers import TrainerCallback

    class Pushes(TrainerCallback):
        def on_push_begin(self, args, state, control, **kwargs):
            seen.append(state.global_step)

    return Pushes()


HUB_COMMITS = {
    # hub_strategy: what the two save steps push (path_in_repo, commit message), in order
    "end": [],
    "every_save": [(None, "Training in progress, step 1"), (None, "Training in progress, step 2")],
    "checkpoint": [
        (None, "Training in progress, step 1"),
        ("last-checkpoint", "Training in progress, step 1, checkpoint"),
        (None, "Training in progress, step 2"),
        ("last-checkpoint", "Training in progress, step 2, checkpoint"),
    ],
    "all_checkpoints": [
        (None, "Training in progress, step 1"),
        ("checkpoint-1", "Training in progress, step 1, checkpoint"),
        (None, "Training in progress, step 2"),
        ("checkpoint-2", "Training in progress, step 2, checkpoint"),
    ],
}


@pytest.mark.parametrize("strategy", list(HUB_COMMITS))
@pytest.mark.parametrize("library", LIBRARIES)
def test_push_to_hub_pushes_what_transformers_pushes(tiny_base_dir, tmp_path, library, strategy, fake_hub):
    """The repository made when the trainer is built; each save step's push by hub_strategy, in the background;
    a script's save_model() and push_to_hub() pushing output_dir: the adapter, its tokenizer and card, never a
    checkpoint at the root."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load

    seen = []
    scope = run(
        library,
        f"""
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS.replace("save_strategy='no'", "save_steps=1")}, max_steps=2,
                          push_to_hub=True, hub_model_id="me/tiny-grpo", hub_strategy=STRATEGY)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              callbacks=[PUSHES], peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
        created = list(HUB.created)
        trainer.train()
        during = list(HUB.uploads)
        trainer.save_model()
        info = trainer.push_to_hub(dataset_name="me/sums")
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        STRATEGY=strategy,
        HUB=fake_hub,
        PUSHES=pushes_begun(seen),
    )
    trainer = scope["trainer"]
    assert scope["created"] == [{"repo_id": "me/tiny-grpo", "token": None, "private": None, "exist_ok": True}]
    assert trainer.hub_model_id == "me/tiny-grpo"
    assert [(u["path_in_repo"], u["message"]) for u in scope["during"]] == HUB_COMMITS[strategy]
    # on_push_begin: each save step's push, save_model's and push_to_hub's
    assert seen == [1, 2][: 0 if strategy == "end" else 2] + [2, 2]
    model_files = {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer_config.json"}
    for upload in scope["during"]:
        assert model_files <= set(upload["files"])
        if upload["path_in_repo"]:  # the whole checkpoint, resumable from the hub
            assert "trainer_state.json" in upload["files"]
    ended = fake_hub.uploads[len(scope["during"]) :]
    assert [(u["path_in_repo"], u["message"]) for u in ended] == [
        (None, "Model save"),
        (None, "End of training"),
    ]
    assert scope["info"].commit_url.startswith("https://huggingface.co/me/tiny-grpo/commit/")
    trained = get_peft_model_state_dict(trainer.model)  # the policy: peft's "default" adapter, under both
    # the repository's root after the last save step, save_model and push_to_hub: the trained adapter
    for upload in [u for u in scope["during"] if u["path_in_repo"] is None][-1:] + ended:
        assert model_files <= set(upload["files"])
        assert not any(name.startswith("checkpoint-") for name in upload["files"])
        # its card loads the model from the repository, not from this machine's output_dir
        card = upload["files"]["README.md"].decode()
        assert '"me/tiny-grpo"' in card and str(tmp_path) not in card
        pushed = load(upload["files"]["adapter_model.safetensors"])
        assert pushed.keys() == trained.keys()
        assert all(torch.equal(pushed[k], trained[k].to(pushed[k].dtype)) for k in trained)
    # the card names the dataset given to push_to_hub
    assert "me/sums" in ended[-1]["files"]["README.md"].decode()


def pushes_and_saves(seen: list):
    """A TrainerCallback that records ("push" | "save", global_step) for on_push_begin and on_save, in order."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_push_begin(self, args, state, control, **kwargs):
            seen.append(("push", state.global_step))

        def on_save(self, args, state, control, **kwargs):
            seen.append(("save", state.global_step))

    return Recorder()


@pytest.mark.parametrize("library", LIBRARIES)
def test_push_to_hub_passes_its_token_branch_and_privacy_and_names_epochs(
    tiny_base_dir, tmp_path, library, fake_hub
):
    seen = []
    # the branch is on the hub already: transformers' pushes commit to it without creating it (lora_grpo's create
    # one that is not there, as `hf upload` does: test_hub.py)
    fake_hub.branches.add(("me/sums-grpo", "dev"))
    scope = run(
        library,
        f"""
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS.replace("save_strategy='no'", "save_strategy='epoch'")},
                          num_train_epochs=2, push_to_hub=True, hub_token="hf_write", hub_revision="dev",
                          hub_private_repo=True)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(2),
                              callbacks=[RECORDER], peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
        trainer.train()
        future = trainer.push_to_hub(blocking=False)
        info = future.result(timeout=60)
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / "sums-grpo"),
        RECORDER=pushes_and_saves(seen),
    )
    # no hub_model_id: output_dir's name, under the token's user
    assert fake_hub.created == [
        {"repo_id": "sums-grpo", "token": "hf_write", "private": True, "exist_ok": True}
    ]
    assert scope["trainer"].hub_model_id == "me/sums-grpo"
    assert [u["message"] for u in fake_hub.uploads] == [
        "Training in progress, epoch 1",
        "Training in progress, epoch 2",
        "End of training",
    ]
    assert all(u["token"] == "hf_write" and u["revision"] == "dev" for u in fake_hub.uploads)
    assert scope["info"].commit_url.startswith("https://huggingface.co/me/sums-grpo/commit/")
    # each save step's push begins before its on_save, as transformers' _save_checkpoint pushes
    assert seen == [("push", 2), ("save", 2), ("push", 4), ("save", 4), ("push", 4)]


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_push_before_training_does_not_make_the_save_steps_push(tiny_base_dir, tmp_path, library, fake_hub):
    run(
        library,
        f"""
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS.replace("save_strategy='no'", "save_steps=1")}, max_steps=2,
                          hub_model_id="me/tiny-grpo")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
        trainer.push_to_hub(commit_message="The untrained adapter")
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    assert [c["repo_id"] for c in fake_hub.created] == ["me/tiny-grpo"]
    assert [u["message"] for u in fake_hub.uploads] == ["The untrained adapter"]


# ------------------------------------------------------------------------------ lora-grpo trl
def test_the_trl_cli_reads_a_local_data_file_and_logs_trls_reward_names(tiny_base_dir, tmp_path):
    import json

    from lora_grpo.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "solution": r["answer"]}) + "\n" for r in PROMPTS[:8])
    )
    assert (
        main(
            [
                "trl",
                "--model_name_or_path",
                tiny_base_dir,
                "--dataset_name",
                str(data),
                "--reward_funcs",
                "accuracy_reward",
                "--output_dir",
                str(tmp_path / "run"),
                "--per_device_train_batch_size",
                "4",
                "--num_generations",
                "4",
                "--max_completion_length",
                "4",
                "--max_steps",
                "1",
                "--use_cpu",
                "true",
                "--save_strategy",
                "no",
                "--report_to",
                "none",
                "--logging_steps",
                "1",
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert any("accuracy_reward" in k for k in record) and not any("answer_accuracy" in k for k in record)


def test_the_offline_toy_bases_are_models_by_name(toy_base, tmp_path, monkeypatch):
    from pathlib import Path

    from lora_grpo.trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("LORA_GRPO_CACHE", str(Path(toy_base).parent))  # the session's built toy base
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        save_strategy="no",
        report_to="none",
    )
    trainer = GRPOTrainer(
        model="toy-addition", reward_funcs=length_reward, args=args, train_dataset=dataset(8)
    )
    assert trainer.native.config.model_name_or_path == "toy-addition"
    assert Path(trainer.model.get_base_model().config._name_or_path) == Path(toy_base)


# ------------------------------------------------------------------------------ train() again, resume at the end
def by_step(completions, trainer_state, **kwargs):
    """The optimizer steps done, + 0 or 1: each step's mean reward names the step."""
    return [float(trainer_state.global_step) + (i % 2) for i in range(len(completions))]


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_first_logging_window_after_a_resume_starts_at_the_resumed_step(tiny_base_dir, tmp_path, library):
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        fields = dict(output_dir=OUT, save_strategy="steps", save_steps=3, logging_steps=2)
        args = GRPOConfig({ARGS.replace("save_strategy='no', ", "")}, **fields, max_steps=3)
        GRPOTrainer(model=MODEL, reward_funcs=by_step, args=args, train_dataset=dataset(16)).train()
        args = GRPOConfig({ARGS.replace("save_strategy='no', ", "")}, **fields, max_steps=6)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=by_step, args=args, train_dataset=dataset(16))
        trainer.train(resume_from_checkpoint=True)
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
        by_step=by_step,
    )
    records = [
        (r["step"], r.get("reward")) for r in scope["trainer"].state.log_history if "train_loss" not in r
    ]
    # step 2 from the first run's checkpoint; step 4's window is step 4 alone (its rewards 3 and 4), not step 3's
    assert records == [(2, 1.0), (4, 3.5), (6, 5.0)]
    # the token count goes on from the checkpoint's (it began at 0 again: found in review)
    state = scope["trainer"].state
    tokens = [r["num_tokens"] for r in state.log_history if "num_tokens" in r]
    assert len(tokens) == 3 and tokens[0] < tokens[1] < tokens[2] == state.num_input_tokens_seen


SAVING = ARGS.replace("save_strategy='no'", "save_strategy='steps', save_steps=1")


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_second_train_starts_a_new_run_from_the_trained_weights(tiny_base_dir, tmp_path, library):
    import os

    import torch

    out = tmp_path / library
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {SAVING}, max_steps=2, logging_steps=1, learning_rate=1e-2)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
        first = trainer.train()
        history = list(trainer.state.log_history)
        weights = {{n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}}
        second = trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(out),
    )
    t, history = scope["trainer"], scope["trainer"].state.log_history
    # transformers' Trainer.train: a new TrainerState (the second run's records only), step 0 to max_steps again
    assert scope["first"].global_step == scope["second"].global_step == t.state.global_step == 2
    assert [r["step"] for r in history] == [1, 2, 2] and "train_runtime" in history[-1]
    # the LR schedule from its start; the weights trained on (not a call that trains nothing)
    assert [r["learning_rate"] for r in history[:2]] == [r["learning_rate"] for r in scope["history"][:2]]
    now = dict(t.model.named_parameters())
    assert any(not torch.equal(now[n].detach(), w) for n, w in scope["weights"].items())
    assert {"checkpoint-1", "checkpoint-2"} <= set(
        os.listdir(out)
    )  # the second run's (ours: the first's aside)


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_checkpoint_holds_the_tokenizer_and_transformers_trainer_state(tiny_base_dir, tmp_path, library):
    """What scripts read from a TRL checkpoint: AutoTokenizer loads it, TrainerState.load_from_json reads its
    trainer_state.json (the TRL records, the control's state)."""
    from transformers import AutoTokenizer, TrainerControl, TrainerState

    out = tmp_path / library
    run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1)
        args.save_strategy, args.save_steps = "steps", 1
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(out),
    )
    checkpoint = out / "checkpoint-2"
    text = "12+30=42"
    assert (
        AutoTokenizer.from_pretrained(checkpoint)(text).input_ids
        == AutoTokenizer.from_pretrained(tiny_base_dir)(text).input_ids
    )
    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    assert (state.global_step, state.max_steps, state.save_steps, state.logging_steps) == (2, 2, 1, 1)
    assert [r["step"] for r in state.log_history] == [1, 2]
    assert all({"loss", "reward", "rewards/length_reward/mean"} <= set(r) for r in state.log_history)
    assert isinstance(state.total_flos, float)
    assert state.stateful_callbacks["TrainerControl"].keys() == TrainerControl().state().keys()
    assert (
        state.stateful_callbacks["TrainerControl"]["args"].keys() == TrainerControl().state()["args"].keys()
    )


@pytest.mark.parametrize("library", LIBRARIES)
def test_open_r1s_script_tail_runs_transformers_trainer_methods(tiny_base_dir, tmp_path, capsys, library):
    """What open-r1's grpo.py calls after train(): log_metrics, save_metrics, save_state, save_model,
    create_model_card (AttributeError here before), and the trainable parameters of the policy alone."""
    import json

    from huggingface_hub import ModelCard
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, TrainerState

    out = tmp_path / library
    scope = run(
        library,
        f"""
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8),
                              peft_config=LoraConfig(r=4, task_type="CAUSAL_LM"))
        metrics = trainer.train().metrics
        metrics["train_samples"] = 8
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        trainer.save_model(args.output_dir)
        if trainer.accelerator.is_main_process:
            trainer.create_model_card(dataset_name="sums", tags=["open-r1"])
        trainable = trainer.get_num_trainable_parameters()
    """,
        MODEL=tiny_base_dir,
        OUT=str(out),
    )
    assert "***** train metrics *****" in capsys.readouterr().out
    for name in ("train_results.json", "all_results.json"):
        saved = json.loads((out / name).read_text())
        assert saved["train_samples"] == 8 and saved["train_loss"] == scope["metrics"]["train_loss"]
    state = TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert state.global_step == 2 and "train_runtime" in state.log_history[-1]
    card = ModelCard.load(out / "README.md")
    assert "open-r1" in card.data.tags and card.data.datasets in (
        "sums",
        ["sums"],
    )  # TRL's a name, ours a list
    fresh = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir), LoraConfig(r=4, task_type="CAUSAL_LM")
    )
    assert scope["trainable"] == fresh.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("library", LIBRARIES)
def test_resuming_a_checkpoint_at_max_steps_reports_its_step_and_trains_nothing(
    tiny_base_dir, tmp_path, library
):
    import os

    out = tmp_path / library
    # dataset(2): 2 steps are one epoch. At an epoch's end TRL trains nothing either; in the middle of one,
    # transformers' loop trains one step past max_steps, which this front door does not (docs/guides/from-trl.md).
    scope = run(
        library,
        f"""
        import os
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {SAVING}, max_steps=2, logging_steps=1)
        GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(2)).train()
        files = sorted(os.listdir(OUT))
        from transformers import TrainerCallback
        events = []
        class Events(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs): events.append("train_begin")
            def on_log(self, args, state, control, **kwargs): events.append("log")
            def on_train_end(self, args, state, control, **kwargs): events.append("train_end")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(2),
                              callbacks=[Events()])
        result = trainer.train(resume_from_checkpoint=True)
    """,
        MODEL=tiny_base_dir,
        OUT=str(out),
    )
    t, history = scope["trainer"], scope["trainer"].state.log_history
    assert scope["events"] == ["train_begin", "log", "train_end"]  # a callback's timer begins before it ends
    speed = scope["result"].metrics  # no step ran in this call: transformers' speed figures are 0
    assert speed["train_steps_per_second"] == 0.0 == speed["train_samples_per_second"]
    assert scope["result"].global_step == t.state.global_step == 2 and t.state.epoch == 1.0
    assert [r["step"] for r in history] == [1, 2, 2]  # the checkpoint's records, then the closing one
    assert history[-1]["train_loss"] == 0.0 == scope["result"].training_loss
    assert sorted(os.listdir(out)) == scope["files"]  # nothing written


def test_the_front_door_says_how_to_train_further_in_python(tiny_base_dir, tmp_path, capsys):
    # In the middle of an epoch (dataset(16)): nothing trained, where transformers' loop would train step 3.
    scope = run(
        "lora_grpo.trl",
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {SAVING}, max_steps=2, logging_steps=1)
        GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16)).train()
        print("-- resume --")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(16))
        result = trainer.train(resume_from_checkpoint=True)
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path),
    )
    said = capsys.readouterr().out.split("-- resume --")[1]
    assert scope["result"].global_step == 2
    assert (
        "checkpoint-2 is at step 2, the run's last (max_steps=2): nothing left to train" in said
        and "To train further, raise max_steps: set max_steps=4 in GRPOConfig, build the GRPOTrainer again with "
        "it and call trainer.train(resume_from_checkpoint=True)"
        in said
    )
    assert "--set" not in said
    assert not (tmp_path / "checkpoint-3").exists()


# ------------------------------------------------------------------------------ two processes
TWO_PROCESSES = """
import importlib, json, os, sys
from datasets import Dataset
from peft import LoraConfig

library, base, out = sys.argv[1:4]
trl = importlib.import_module(library)
rank = int(os.environ["RANK"])
seen = []

def reward(prompts, completions, log_metric, **kwargs):
    seen.extend(prompts[::4])  # a group's prompt once
    log_metric("rank", float(rank))
    if rank == 1:
        log_metric("only_rank1", 7.0)
    return [float(len(c) % 3) for c in completions]

args = trl.GRPOConfig(output_dir=f"{out}/run", use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, save_strategy="no", report_to="none",
                      logging_steps=1, num_train_epochs=4)
data = Dataset.from_list([{"prompt": f"{i}+{i % 3}="} for i in range(7)])
trainer = trl.GRPOTrainer(model=base, reward_funcs=reward, args=args, train_dataset=data,
                          peft_config=LoraConfig(r=4, task_type="CAUSAL_LM"))
trainer.train()
if trainer.is_world_process_zero():  # a common script's save, on the main process alone
    trainer.save_model(f"{out}/final")
records = [r for r in trainer.state.log_history if "rank" in r]
json.dump({"seen": seen, "rows": len(trainer.train_dataset), "records": records}, open(f"{out}/rank{rank}.json", "w"))
"""


@pytest.mark.parametrize("library", LIBRARIES)
def test_two_processes_share_the_data_pool_log_metrics_and_save_from_the_main_process(
    tiny_base_dir, tmp_path, library
):
    """Under torchrun, as under TRL: every process holds the whole dataset and the run draws every prompt (not
    fixed shards that never drew the last len % processes rows); a reward's log_metric is the mean over every
    process's values; save_model on the main process alone returns (ours waited in a barrier for the others)."""
    import json

    from peft import PeftConfig

    run_torchrun(TWO_PROCESSES, tmp_path, library, tiny_base_dir, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rows"] == ranks[1]["rows"] == 7
    assert set(ranks[0]["seen"]) | set(ranks[1]["seen"]) == {f"{i}+{i % 3}=" for i in range(7)}
    for rank in ranks:
        assert len(rank["records"]) == 12  # 4 epochs of 3 steps
        assert all(r["rank"] == 0.5 and r["only_rank1"] == 7.0 for r in rank["records"])
    assert PeftConfig.from_pretrained(str(tmp_path / "final")).r == 4


TWO_PROCESSES_PUSH = """
import importlib, json, os, sys, types
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from helpers import FakeHub

library, base, out = sys.argv[1:4]
trl = importlib.import_module(library)
rank = int(os.environ["RANK"])
hub = FakeHub().install(types.SimpleNamespace(setattr=setattr))  # this process's hub record
begun = []

class Pushes(TrainerCallback):
    def on_push_begin(self, args, state, control, **kwargs):
        begun.append(state.global_step)

args = trl.GRPOConfig(output_dir=f"{out}/run", use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, save_steps=1, max_steps=2, report_to="none",
                      push_to_hub=True, hub_model_id="me/tiny-grpo")
data = Dataset.from_list([{"prompt": f"{i}+{i % 3}="} for i in range(8)])
trainer = trl.GRPOTrainer(model=base, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=data, callbacks=[Pushes()],
                          peft_config=LoraConfig(r=4, task_type="CAUSAL_LM"))
trainer.train()
trainer.save_model(args.output_dir)  # TRL's script, on every process: save, then push
trainer.push_to_hub()
json.dump({"created": [c["repo_id"] for c in hub.created], "uploads": [u["message"] for u in hub.uploads],
           "begun": begun, "hub_model_id": trainer.hub_model_id}, open(f"{out}/rank{rank}.json", "w"))
"""


@pytest.mark.parametrize("library", LIBRARIES)
def test_two_processes_push_from_the_main_process_alone(tiny_base_dir, tmp_path, library):
    import json

    run_torchrun(TWO_PROCESSES_PUSH, tmp_path, library, tiny_base_dir, tmp_path)
    main, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert main["created"] == ["me/tiny-grpo"] and main["hub_model_id"] == "me/tiny-grpo"
    assert main["uploads"] == [
        "Training in progress, step 1",
        "Training in progress, step 2",
        "Model save",
        "End of training",
    ]
    # the other process makes no repository and pushes nothing; save_model's and push_to_hub's on_push_begin
    # run on every process, a save step's on the main one
    assert other["created"] == [] and other["uploads"] == [] and other["hub_model_id"] is None
    assert main["begun"] == [1, 2, 2, 2] and other["begun"] == [2, 2]


# ------------------------------------------------------------------------------ subclasses
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_subclass_overriding_trls_loop_is_refused_not_silently_ignored(
    tiny_base_dir, tmp_path, caplog, library
):
    """TRL's loop calls a subclass's compute_loss and _generate_and_score_completions; lora_grpo's never would, so
    such a subclass is refused by name (what replaces each here said). An override of log runs under both."""
    source = f"""
        from trl import GRPOConfig, GRPOTrainer
        calls = {{"loss": 0, "generate": 0, "log": 0}}
        class Mine(GRPOTrainer):
            def compute_loss(self, *args, **kwargs):
                calls["loss"] += 1
                return super().compute_loss(*args, **kwargs)
            def _generate_and_score_completions(self, *args, **kwargs):
                calls["generate"] += 1
                return super()._generate_and_score_completions(*args, **kwargs)
        class Logging(GRPOTrainer):
            def log(self, logs, *args, **kwargs):
                calls["log"] += 1
                return super().log(logs, *args, **kwargs)
            def evaluate(self, *args, **kwargs):
                return super().evaluate(*args, **kwargs)
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=1, logging_steps=1)
        Logging(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8)).train()
        error = None
        try:
            Mine(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8)).train()
        except TypeError as e:
            error = str(e)
    """
    with caplog.at_level(logging.WARNING):
        scope = run(library, source, MODEL=tiny_base_dir, OUT=str(tmp_path / library))
    calls, error = scope["calls"], scope["error"]
    assert calls["log"] >= 2  # the step's record and the closing one
    if library == "trl":
        assert error is None and calls["loss"] >= 1 and calls["generate"] >= 1
    else:
        assert calls["loss"] == calls["generate"] == 0
        assert error.startswith(
            "Mine overrides methods of TRL's training loop, which lora_grpo.trl never calls"
        )
        assert "_generate_and_score_completions: use reward functions" in error
        assert "compute_loss: use GRPOConfig's loss fields" in error
        said = [r.getMessage() for r in caplog.records]
        assert any("Logging overrides evaluate: it runs when your script calls it" in m for m in said)


def test_every_loop_method_refused_is_trls():
    """The names refused are methods of TRL 1.16's GRPOTrainer (or the Trainer it is), so no typo refuses nothing."""
    from lora_grpo.trl.overrides import LOOP_METHODS, SCRIPT_METHODS

    names = [name for group in LOOP_METHODS.values() for name in group] + list(SCRIPT_METHODS)
    assert [name for name in names if not hasattr(trl.GRPOTrainer, name)] == []
    assert len(names) == len(set(names))


@pytest.mark.parametrize("library", LIBRARIES)
def test_an_adaptive_entropy_bonus_logs_the_policy_loss_at_every_step(tiny_base_dir, tmp_path, library):
    """TRL logs policy_loss whenever the run has an entropy bonus; the adaptive controller's coefficient starts at
    0 (and stays there while the entropy is above its target), where it was not logged here (found in review)."""
    scope = run(
        library,
        f"""
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, {ARGS}, max_steps=2, logging_steps=1, beta=0.04, use_adaptive_entropy=True)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=length_reward, args=args, train_dataset=dataset(8))
        trainer.train()
    """,
        MODEL=tiny_base_dir,
        OUT=str(tmp_path / library),
    )
    records = [r for r in scope["trainer"].state.log_history if "loss" in r and "train_loss" not in r]
    assert len(records) == 2 and all("policy_loss" in r and r["entropy_coef"] == 0.0 for r in records)
