"""The TRL front door: `from lora_grpo.trl import GRPOConfig, GRPOTrainer` runs TRL's documented GRPO
scripts with only the import changed, counts steps as TRL does (checked against the pinned TRL where
it is installed), and maps or refuses every field of TRL's GRPOConfig by name."""

import dataclasses
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS

from lora_grpo.config import ConfigError
from lora_grpo.trl import FIELDS
from lora_grpo.trl import GRPOConfig as OurConfig
from lora_grpo.trl.config import EXTENSIONS


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


# ------------------------------------------------------------------------------ the config
def test_every_field_of_trls_config_is_mapped_or_refused_by_name():
    trl = pytest.importorskip("trl")
    theirs = {f.name: _default(f) for f in dataclasses.fields(trl.GRPOConfig)}
    ours = {f.name: _default(f) for f in dataclasses.fields(OurConfig)}
    assert trl.__version__ == "1.16.0"
    assert set(theirs) == set(ours) - set(EXTENSIONS)  # the same 191 names, and our extensions
    assert {k: v for k, v in ours.items() if k in theirs and v != theirs[k]} == {}  # with TRL's defaults
    assert not set(EXTENSIONS) & set(theirs)  # an extension TRL took up would need its own entry
    unlisted = sorted(set(theirs) - set(FIELDS))
    assert not unlisted, f"fields of TRL's GRPOConfig with no entry in lora_grpo.trl.FIELDS: {unlisted}"
    assert {f.how for f in FIELDS.values()} == {"mapped", "flow", "no effect", "trainer", "refused"}
    assert all(f.why for f in FIELDS.values())


def test_the_guide_counts_each_fate_as_the_table_has_it():
    import collections

    text = " ".join((Path(__file__).parents[1] / "docs" / "guides" / "from-trl.md").read_text().split())
    counts = collections.Counter(f.how for f in FIELDS.values())
    said = {
        "mapped": r"(\d+) act through a lora_grpo field",
        "flow": r"(\d+) through transformers' flow",
        "no effect": r"(\d+) change nothing here",
        "trainer": r"(\d+) act in the front door's trainer",
        "refused": r"(\d+) are refused by name",
    }
    assert {how: int(re.search(pattern, text).group(1)) for how, pattern in said.items()} == dict(counts)


@pytest.mark.parametrize(
    "field, value",
    [
        ("optim_args", "betas=(0.9,0.95)"),
        ("torch_compile", True),
        ("neftune_noise_alpha", 5.0),
    ],
)
def test_a_refused_field_set_away_from_its_default_names_itself_and_why(
    tiny_base_dir, tmp_path, field, value
):
    from lora_grpo.trl import GRPOTrainer

    try:
        args = OurConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})
    except ValueError as e:  # transformers itself refuses some combinations on this machine (fp16 on CPU)
        pytest.skip(f"TrainingArguments refuses {field}={value} here: {e}")
    with pytest.raises(ConfigError, match=re.escape(f"{field}={value!r}: {FIELDS[field].why}")):
        GRPOTrainer(model=tiny_base_dir, reward_funcs=_length_reward, args=args, train_dataset=_dataset(8))


def test_trackio_fields_reach_transformers_trackio_callback_as_in_trl(tiny_base_dir, tmp_path, monkeypatch):
    # TRL leaves trackio_space_id to transformers' TrackioCallback: ignored without trackio in report_to, the
    # Space the dashboard syncs to with it (the deployment itself needs the network: trackio.init stops here)
    trackio = pytest.importorskip("trackio")
    from lora_grpo.trl import GRPOTrainer

    space = {"trackio_space_id": "me/dashboard", "trackio_bucket_id": "me/bucket"}
    args = OurConfig(output_dir=str(tmp_path / "none"), use_cpu=True, max_steps=1, report_to="none", **space)
    trainer = GRPOTrainer(
        model=tiny_base_dir, reward_funcs=_length_reward, args=args, train_dataset=_dataset(8)
    )
    assert trainer.train().global_step == 1

    class Reached(Exception):
        pass

    def init(**kwargs):
        raise Reached(kwargs)

    monkeypatch.setattr(trackio, "init", init)
    args = OurConfig(
        output_dir=str(tmp_path / "trackio"), use_cpu=True, max_steps=1, report_to="trackio", **space
    )
    trainer = GRPOTrainer(
        model=tiny_base_dir, reward_funcs=_length_reward, args=args, train_dataset=_dataset(8)
    )
    with pytest.raises(Reached) as reached:
        trainer.train()
    called = reached.value.args[0]
    assert (called["space_id"], called["bucket_id"]) == ("me/dashboard", "me/bucket")


def test_a_field_read_only_under_a_switch_is_refused_only_with_the_switch_on():
    from lora_grpo.trl.translate import check_refused

    switched = {name: f for name, f in FIELDS.items() if f.only_with}
    assert list(switched) == ["vllm_structured_outputs_regex"]
    (name, f), value = switched.popitem(), "[0-9]+"
    check_refused(OurConfig(output_dir="x", use_cpu=True, **{name: value}))  # use_vllm off: nothing to refuse
    with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r}: {f.why}")):
        check_refused(OurConfig(output_dir="x", use_cpu=True, **{name: value, f.only_with: True}))


@pytest.mark.parametrize(
    "engine",
    [
        {"use_vllm": True, "vllm_mode": "server"},
        {"use_transformers_continuous_batching": True},
        {"use_liger_kernel": True, "liger_kernel_config": {"rms_norm": True}},
        {"model_init_kwargs": {"use_kernels": True}},
    ],
)
def test_a_script_asking_for_another_generation_engine_trains_the_same_run_and_is_told(
    tiny_base_dir, tmp_path, caplog, engine
):
    """lora_grpo's sampler stands in for vLLM and transformers' continuous batching, transformers' layers for Liger's
    kernels: one warning, the same records and adapter as the script without them (same seed)."""
    import logging

    from lora_grpo.trl import GRPOTrainer

    def trained(out, **settings):
        args = OurConfig(output_dir=out, use_cpu=True, max_steps=2, logging_steps=1, beta=0.04, **settings)
        trainer = GRPOTrainer(
            model=tiny_base_dir, reward_funcs=_length_reward, args=args, train_dataset=_dataset(8)
        )
        trainer.train()
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}
        return [(r["loss"], r["reward"], r["kl"]) for r in trainer.state.log_history if "kl" in r], weights

    with caplog.at_level(logging.WARNING):
        records, weights = trained(str(tmp_path / "engine"), **engine)
    switch = next(iter(engine))
    told = [m for m in caplog.messages if m.startswith(f"{switch}=True: lora_grpo ")]
    if switch == "model_init_kwargs":
        told = [m for m in caplog.messages if m.startswith("model_init_kwargs use_kernels=True: lora_grpo ")]
    assert len(told) == 1 and told[0].endswith("to silence this.")
    plain_records, plain_weights = trained(str(tmp_path / "plain"))
    assert len(records) == 2 and records == plain_records
    assert weights.keys() == plain_weights.keys() and all(
        torch.equal(weights[k], plain_weights[k]) for k in weights
    )


def test_an_unset_top_k_or_min_p_is_the_models_generation_configs_as_in_trls_generate():
    """TRL builds GenerationConfig(top_k=None, min_p=None) and transformers' generate fills what is None from the
    model's generation_config, then its own defaults (top_k 50): open-r1's top_k: null samples top-20 from a Qwen
    model, and TRL's default min_p None takes a model's min_p. Read as 'off' here before (found in review)."""
    from transformers import GenerationConfig

    from lora_grpo.trl.translate import to_native

    def native(generation_defaults=None, **fields):
        config = to_native(
            OurConfig(output_dir="x", use_cpu=True, **fields),
            model_name_or_path="toy",
            generation_defaults=generation_defaults,
        )
        return config.top_k, config.min_p

    assert native(top_k=None) == (50, 0.0)  # no generation_config of the model's: transformers' defaults
    assert native(top_k=0) == (0, 0.0) and native(top_k=20) == (20, 0.0)
    qwen_like = GenerationConfig(top_k=20, min_p=0.1, top_p=0.8)
    assert native(qwen_like, top_k=None) == (20, 0.1)
    assert native(qwen_like, top_k=5, min_p=0.0) == (5, 0.0)  # what the script sets wins


def test_generation_kwargs_fill_unset_values_as_generate_and_keep_the_losss_temperature():
    """generation_kwargs as TRL merges them into its GenerationConfig (found in review): a None value is unset,
    filled by generate from the model's generation_config then transformers' defaults (it was refused as 'not a
    finite number'); a temperature override samples there while TRL's loss divides by `temperature`, which
    lora_grpo's single temperature cannot do, so a differing one is refused, not taken for the loss too;
    cache_implementation 'dynamic' is transformers' default cache, as None."""
    from transformers import GenerationConfig

    from lora_grpo.config import ConfigError
    from lora_grpo.trl.translate import to_native

    qwen_like = GenerationConfig(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)

    def native(generation_defaults=qwen_like, **fields):
        return to_native(
            OurConfig(output_dir="x", use_cpu=True, **fields),
            model_name_or_path="toy",
            generation_defaults=generation_defaults,
        )

    config = native(generation_kwargs={"top_p": None, "repetition_penalty": None})
    assert (config.top_p, config.repetition_penalty, config.temperature) == (0.8, 1.05, 1.0)
    config = native(GenerationConfig(), generation_kwargs={"top_p": None, "repetition_penalty": None})
    assert (config.top_p, config.repetition_penalty) == (1.0, 1.0)  # generate's own defaults
    assert native(generation_kwargs={"top_p": 0.9}).top_p == 0.9
    assert native(temperature=0.5, generation_kwargs={"temperature": 0.5}).temperature == 0.5
    with pytest.raises(ConfigError, match=r"generation_kwargs temperature 0.5 with temperature=1: in TRL"):
        native(generation_kwargs={"temperature": 0.5})
    with pytest.raises(ConfigError, match=r"generation_kwargs temperature 0.7 with temperature=1"):
        native(generation_kwargs={"temperature": None})  # the model's 0.7
    assert native(cache_implementation="dynamic").decode_mode == native().decode_mode == "auto"
    assert native(cache_implementation="static").decode_mode == "static"
    with pytest.raises(ConfigError, match="cache_implementation='offloaded'"):
        native(cache_implementation="offloaded")


def test_a_loss_that_depends_on_the_micro_batch_takes_trls_micro_batch():
    """Where TRL's objective depends on which completions share a micro-step (a token mean per micro-batch, the
    high-entropy quantile, the entropy bonus), a micro-batch is per_device_train_batch_size rows, as in TRL;
    elsewhere the gradient does not depend on it and the memory plan sizes it."""
    from lora_grpo.trl.translate import to_native

    def micro_batch(**fields):
        args = OurConfig(
            output_dir="x", use_cpu=True, per_device_train_batch_size=2, num_generations=2, **fields
        )
        return to_native(args, model_name_or_path="toy").micro_batch_size

    assert micro_batch() == "auto" and micro_batch(loss_type="grpo") == "auto"
    assert micro_batch(loss_type="bnpo") == 2
    assert micro_batch(top_entropy_quantile=0.5) == 2
    assert micro_batch(entropy_coef=0.01) == 2
    assert micro_batch(use_adaptive_entropy=True) == 2


def test_trls_best_model_metric_names_are_the_native_eval_metrics():
    from lora_grpo.trl.translate import best_metric

    assert best_metric(None) is None
    assert best_metric("reward") == best_metric("eval_reward") == "eval/reward"
    assert best_metric("eval_rewards/exact/mean") == "eval/exact"  # TRL's name of a reward function's mean
    assert best_metric("completions/mean_length") == "eval/completion_length"
    assert best_metric("eval_pass@1") == "eval/pass@1"
    assert best_metric("eval_hard_reward", ["easy", "hard"]) == "eval/hard/reward"  # a named eval set's
    with pytest.raises(ConfigError, match=r"metric_for_best_model='loss' .*reports no eval_loss.*'reward'"):
        best_metric("loss")


def test_load_best_model_at_end_with_transformers_default_metric_says_what_to_name(tiny_base_dir, tmp_path):
    from lora_grpo.trl import GRPOTrainer

    strategies = {"eval_strategy": "steps", "save_strategy": "steps"}
    args = OurConfig(output_dir=str(tmp_path), use_cpu=True, load_best_model_at_end=True, **strategies)
    assert args.metric_for_best_model == "loss"  # transformers' default
    with pytest.raises(ConfigError, match="reports no eval_loss"):
        GRPOTrainer(
            model=tiny_base_dir,
            reward_funcs=_length_reward,
            args=args,
            train_dataset=_dataset(8),
            eval_dataset=_dataset(4),
        )


def test_batch_sizes_that_split_a_group_over_processes_are_refused_clearly(tiny_base_dir, tmp_path):
    from lora_grpo.trl import GRPOTrainer

    args = OurConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=3,
        num_generations=4,
    )
    with pytest.raises(
        ConfigError, match="steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"
    ):
        GRPOTrainer(model=tiny_base_dir, reward_funcs=_length_reward, args=args, train_dataset=_dataset(8))


# ------------------------------------------------------------------------------ TRL's scripts
def _length_reward(completions, **kwargs):
    return [-abs(6 - len(c if isinstance(c, str) else c[-1]["content"])) / 6.0 for c in completions]


def _dataset(n, conversational=False):
    from datasets import Dataset

    rows = PROMPTS[:n]
    if conversational:
        return Dataset.from_list(
            [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
        )
    return Dataset.from_list(rows)


# Each script is TRL's documented example, with its import line `from trl import ...` and the
# small changes a CPU and a tiny local model need (TRL needs them too: use_cpu, lengths).
SCRIPTS = {
    "quickstart": """
        from trl import GRPOConfig, GRPOTrainer
        def reward_len(completions, **kwargs):
            return [-abs(6 - len(c)) for c in completions]
        training_args = GRPOConfig(output_dir=OUT, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                                   max_completion_length=6, max_steps=3, report_to="none", save_strategy="no")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=training_args, train_dataset=DATA)
        trainer.train()
    """,
    "custom_rewards": """
        from trl import GRPOConfig, GRPOTrainer
        def digits(completions, answer, **kwargs):
            return [float(a in c) for c, a in zip(completions, answer)]
        def short(completions, trainer_state, **kwargs):
            share = min(1.0, trainer_state.global_step / max(1, trainer_state.max_steps))
            return [-len(c) / 10 * share for c in completions]
        args = GRPOConfig(output_dir=OUT, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=2, reward_weights=[1.0, 0.5], logging_steps=1,
                          save_strategy="no")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=[digits, short], args=args, train_dataset=DATA)
        trainer.train()
    """,
    "peft_sync_ref_model": """
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, use_cpu=True, per_device_train_batch_size=4, num_generations=4, beta=0.04,
                          max_completion_length=6, max_steps=4, sync_ref_model=True, ref_model_sync_steps=2,
                          ref_model_mixup_alpha=0.6, learning_rate=1e-3, logging_steps=1, save_strategy="no")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=REWARD, args=args, train_dataset=DATA,
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     task_type="CAUSAL_LM"))
        trainer.train()
        trainer.save_model(OUT)
    """,
    "qlora_loaded_model": """
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        model = AutoModelForCausalLM.from_pretrained(MODEL, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
        args = GRPOConfig(output_dir=OUT, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=2, logging_steps=1, save_strategy="no")
        trainer = GRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(MODEL), reward_funcs=REWARD,
                              args=args, train_dataset=DATA, peft_config=LoraConfig(r=4, target_modules="all-linear"))
        trainer.train()
    """,
    "conversational": """
        from trl import GRPOConfig, GRPOTrainer
        def reward(completions, **kwargs):
            return [-abs(6 - len(c[0]["content"])) for c in completions]
        args = GRPOConfig(output_dir=OUT, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=2, logging_steps=1, save_strategy="no")
        trainer = GRPOTrainer(model=MODEL, reward_funcs=reward, args=args, train_dataset=CHAT_DATA)
        trainer.train()
    """,
    "callbacks": """
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                EVENTS.append(("step_end", state.global_step))
                if state.global_step == 2:
                    control.should_training_stop = True
            def on_log(self, args, state, control, logs=None, **kwargs):
                EVENTS.append(("log", state.global_step, sorted(logs)))
            def on_save(self, args, state, control, **kwargs):
                EVENTS.append(("save", state.global_step))
        args = GRPOConfig(output_dir=OUT, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=5, logging_steps=1, save_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=REWARD, args=args, train_dataset=DATA, callbacks=[Stop()])
        trainer.train()
    """,
    "resume": """
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=OUT, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=2, save_steps=2, logging_steps=1)
        GRPOTrainer(model=MODEL, reward_funcs=REWARD, args=args, train_dataset=DATA).train()
        args = GRPOConfig(output_dir=OUT, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=4, save_steps=2, logging_steps=1)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=REWARD, args=args, train_dataset=DATA)
        trainer.train(resume_from_checkpoint=True)
    """,
}


def run_script(name, library, tiny_base_dir, out):
    source = textwrap.dedent(SCRIPTS[name]).replace("from trl import", f"from {library} import")
    scope = {
        "MODEL": tiny_base_dir,
        "OUT": str(out),
        "DATA": _dataset(16),
        "CHAT_DATA": _dataset(16, conversational=True),
        "REWARD": _length_reward,
        "EVENTS": [],
    }
    exec(compile(source, f"<{name} under {library}>", "exec"), scope)
    return scope


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_trls_documented_scripts_run_with_only_the_import_changed(tiny_base_dir, tmp_path, name):
    scope = run_script(name, "lora_grpo.trl", tiny_base_dir, tmp_path / "run")
    trainer = scope["trainer"]
    state = trainer.state
    expected = {"callbacks": 2, "resume": 4}.get(name, trainer.args.max_steps)
    assert state.global_step == expected
    logged = [r for r in state.log_history if "loss" in r and "train_loss" not in r]  # the logging steps
    assert "train_loss" in state.log_history[-1]  # transformers' closing record
    if name == "quickstart":  # logging_steps 10 (TRL's default) in a 3-step run: nothing logged, as in TRL
        assert logged == []
    else:
        assert logged and {"reward", "reward_std", "learning_rate", "grad_norm", "epoch", "step"} <= set(
            logged[-1]
        )
        assert all(r["step"] == i + 1 for i, r in enumerate(logged)) or name == "resume"
    # TRL refuses this script; here the LoRA reference slot syncs every 2 steps
    if name == "peft_sync_ref_model":
        syncs = [r for r in trainer.native.state.log_history if r.get("sync/event")]
        assert [r["sync/reason"] for r in syncs] == ["steps", "steps"]
        assert (tmp_path / "run" / "adapter_config.json").exists() and (
            tmp_path / "run" / "adapter_model.safetensors"
        ).exists()
        assert json.loads((tmp_path / "run" / "adapter_config.json").read_text())["r"] == 4
        assert (tmp_path / "run" / "metrics.jsonl").exists() and (
            tmp_path / "run" / "adapter"
        ).is_dir()  # kept beside it
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(tmp_path / "run")
        )  # standard
    if name == "callbacks":
        events = scope["EVENTS"]
        assert [e for e in events if e[0] == "step_end"] == [
            ("step_end", 1),
            ("step_end", 2),
        ]  # should_training_stop
        assert ("save", 1) in events and ("save", 2) in events
        assert "reward" in [e for e in events if e[0] == "log"][0][2]
    if name == "resume":
        assert state.log_history[0]["step"] == 1  # the resumed run carries the first run's log history
    if name == "qlora_loaded_model":
        assert getattr(trainer.model.get_base_model(), "is_loaded_in_4bit", False)


# Counting against the pinned TRL: each run's optimizer steps (callback on_step_end calls), generation
# rounds (reward function calls), final global_step and epoch.
COUNTING = [
    dict(per_device_train_batch_size=4, num_generations=4, num_train_epochs=1),
    dict(
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_steps=5,
    ),
    dict(
        per_device_train_batch_size=2,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_train_epochs=1.5,
    ),
]


def _count(library, tiny_base_dir, out, settings):
    import importlib

    from transformers import TrainerCallback

    lib = importlib.import_module(library)
    rounds, steps = [], []

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append((state.global_step, round(state.epoch, 6)))

    def reward(completions, **kwargs):
        rounds.append(len(completions))
        return [float(len(c) % 3) for c in completions]

    args = lib.GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        max_completion_length=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        **settings,
    )
    trainer = lib.GRPOTrainer(
        model=tiny_base_dir, reward_funcs=reward, args=args, train_dataset=_dataset(16), callbacks=[Count()]
    )
    trainer.train()
    return {
        "global_step": trainer.state.global_step,
        "steps": steps,
        "rounds": rounds,
        "epoch": round(trainer.state.epoch, 6),
        "max_steps": trainer.state.max_steps,
    }


@pytest.mark.parametrize(
    "settings", COUNTING, ids=["epochs", "accumulation+iterations", "steps_per_generation"]
)
def test_step_counting_equals_trls(tiny_base_dir, tmp_path, settings):
    pytest.importorskip("trl")
    ours = _count("lora_grpo.trl", tiny_base_dir, tmp_path / "ours", settings)
    theirs = _count("trl", tiny_base_dir, tmp_path / "trl", settings)
    assert ours == theirs


# ------------------------------------------------------------------------------ models and arguments
def _one_step(tmp_path, **fields):
    """One step of 4 completions of 4 tokens with a KL term, nothing saved; `fields` on top (any of these too)."""
    return OurConfig(
        **{
            "output_dir": str(tmp_path / "run"),
            "use_cpu": True,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 4,
            "max_steps": 1,
            "beta": 0.04,
            "save_strategy": "no",
            **fields,
        }
    )


def test_a_peft_model_is_the_warm_start_and_the_initial_reference(tiny_base_dir, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lora_grpo.model.adapters import POLICY, REFERENCE
    from lora_grpo.model.reference import delta_weight
    from lora_grpo.trl import GRPOTrainer

    warm = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"),
    )
    with torch.no_grad():
        for name, p in warm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter: ΔW ≠ 0
    expected = {
        n: delta_weight(m, "default")
        for n, m in warm.named_modules()
        if hasattr(m, "lora_A") and "default" in m.lora_A
    }
    trainer = GRPOTrainer(
        model=warm, reward_funcs=_length_reward, args=_one_step(tmp_path), train_dataset=_dataset(8)
    )
    layers = {n: m for n, m in trainer.model.named_modules() if hasattr(m, "lora_A") and POLICY in m.lora_A}
    assert layers.keys() == expected.keys()
    for name, module in layers.items():
        torch.testing.assert_close(delta_weight(module, POLICY), expected[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(delta_weight(module, REFERENCE), expected[name], rtol=1e-5, atol=1e-6)


def test_a_peft_config_with_a_rank_pattern_trains_with_a_reference_slot_that_holds_it(
    tiny_base_dir, tmp_path
):
    """A LoraConfig whose rank_pattern gives a module a rank above r (as TRL takes it): the reference slot is
    twice the largest rank, so a hard sync copies every layer exactly."""
    import torch
    from peft import LoraConfig

    from lora_grpo.model.adapters import POLICY, REFERENCE
    from lora_grpo.model.reference import delta_weight
    from lora_grpo.trl import GRPOTrainer

    args = _one_step(tmp_path, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=1.0)
    peft_config = LoraConfig(
        r=4, lora_alpha=8, rank_pattern={"q_proj": 16}, target_modules=["q_proj", "v_proj"]
    )
    trainer = GRPOTrainer(
        model=tiny_base_dir,
        reward_funcs=_length_reward,
        args=args,
        train_dataset=_dataset(8),
        peft_config=peft_config,
    )
    trainer.train()
    layers = [(n, m) for n, m in trainer.model.named_modules() if hasattr(m, "lora_A") and POLICY in m.lora_A]
    assert {m.lora_A[POLICY].weight.shape[0] for n, m in layers if "q_proj" in n} == {16}
    assert {m.lora_A[REFERENCE].weight.shape[0] for _, m in layers} == {32}
    for _, module in layers:  # synced after the step: the slot holds the policy exactly
        torch.testing.assert_close(
            delta_weight(module, REFERENCE), delta_weight(module, POLICY), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("use_dora", True, "use_dora=True"),
        ("bias", "all", "bias='all'"),
        ("init_lora_weights", "pissa", "init_lora_weights='pissa'"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("alora_invocation_tokens", [14], "alora_invocation_tokens=[14]: a LoRA variant"),
    ],
)
def test_a_lora_config_the_reference_slot_cannot_mirror_is_refused_by_name(
    tiny_base_dir, tmp_path, field, value, match
):
    from peft import LoraConfig

    from lora_grpo.trl import GRPOTrainer

    args = OurConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4)
    with pytest.raises(ConfigError, match=re.escape(match)):
        GRPOTrainer(
            model=tiny_base_dir,
            reward_funcs=_length_reward,
            args=args,
            train_dataset=_dataset(8),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"], **{field: value}),
        )


def test_trls_own_config_object_is_read_by_field_name(tiny_base_dir, tmp_path):
    trl = pytest.importorskip("trl")
    from lora_grpo.trl import GRPOTrainer

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        beta=0.02,
        sync_ref_model=True,
        ref_model_sync_steps=1,
    )
    trainer = GRPOTrainer(
        model=tiny_base_dir, reward_funcs=_length_reward, args=args, train_dataset=_dataset(8)
    )
    native = trainer.native.config
    assert (native.beta, native.ref_sync_steps, native.ref_sync_alpha, native.learning_rate) == (
        0.02,
        1,
        0.6,
        1e-6,
    )
    trainer.train()
    assert trainer.state.global_step == 2


def test_the_trl_recipe_cli_runs_a_trl_grpo_recipe(tiny_base_dir, tmp_path):
    import yaml

    from lora_grpo.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for split, rows in (("train", PROMPTS[:8]), ("test", PROMPTS[8:12])):
        (data / f"{split}.jsonl").write_text(
            "".join(json.dumps({"prompt": r["prompt"], "solution": r["answer"]}) + "\n" for r in rows)
        )
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": tiny_base_dir,
                "dataset_name": str(data),
                "reward_funcs": ["accuracy_reward", "think_format_reward"],
                "use_peft": True,
                "lora_r": 4,
                "lora_alpha": 8,
                "lora_target_modules": ["q_proj", "v_proj"],
                "lora_dropout": 0.0,
                "output_dir": str(tmp_path / "run"),
                "per_device_train_batch_size": 4,
                "num_generations": 4,
                "max_completion_length": 4,
                "logging_steps": 1,
                "save_strategy": "no",
                "use_cpu": True,
                "dtype": "float32",
            }
        )
    )
    assert (
        main(["trl", "--config", str(recipe), "--max_steps", "2"]) == 0
    )  # flags override the YAML, as TRL's parser
    run = tmp_path / "run"
    assert (run / "adapter_model.safetensors").exists() and json.loads(
        (run / "adapter_config.json").read_text()
    )["r"] == 4
    assert (run / "metrics.jsonl").exists()


def test_the_trl_recipe_cli_says_a_failed_step_in_one_line(tiny_base_dir, tmp_path, monkeypatch, capsys):
    """The front door raises the step's own error (as TRL); the CLI prints lora_grpo's note, not a traceback."""
    from lora_grpo.cli import main

    (tmp_path / "scorer.py").write_text(
        "class ScorerDown(Exception):\n    pass\n\n\n"
        "def unreachable(completions, trainer_state, **kwargs):\n"
        "    if trainer_state.global_step == 1:\n"
        "        raise ScorerDown('the scoring service is unreachable')\n"
        "    return [0.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    recipe = _trl_recipe(
        tmp_path,
        tiny_base_dir,
        str(_jsonl(tmp_path / "train.jsonl", PROMPTS[:8])),
        reward_funcs=["scorer.unreachable"],
    )
    assert main(["trl", "--config", str(recipe), "--max_steps", "2"]) == 1
    err = capsys.readouterr().err
    assert (
        "lora-grpo: error: step 2/2 stopped: after 1 of 2 optimizer steps: reward function 'unreachable' raised "
        in err
    )
    assert "ScorerDown: the scoring service is unreachable" in err and "Traceback" not in err
    # the resume, in this command's words, as printed: it trains on from checkpoint-1 once the scorer is back
    resume = f"lora-grpo trl --config {recipe} --max_steps 2 --resume_from_checkpoint latest"
    assert resume in err
    (tmp_path / "scorer.py").write_text(
        "def unreachable(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    sys.modules.pop("scorer", None)
    assert main(resume.split()[1:]) == 0
    assert (
        json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    )


# ------------------------------------------------------------------------------ the TRL CLI's inputs
def _trl_recipe(tmp_path, tiny_base_dir, data, name="grpo.yaml", **fields):
    """A TRL GRPO recipe tmp_path/`name` on the tiny base and `data` (a dataset_name), writing to tmp_path/run."""
    import yaml

    recipe = tmp_path / name
    values = {
        "model_name_or_path": tiny_base_dir,
        "dataset_name": str(data),
        "reward_funcs": ["accuracy_reward"],
        "output_dir": str(tmp_path / "run"),
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 4,
        "max_steps": 1,
        "logging_steps": 1,
        "save_steps": 1,
        "use_cpu": True,
        "report_to": "none",
        **fields,
    }
    recipe.write_text(yaml.safe_dump(values))
    return recipe


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "solution": r["answer"]}) + "\n" for r in rows)
    )
    return path


def _trls_script(data, tmp_path, tiny_base_dir, **fields):
    """The exception TRL's own grpo script raises on these inputs (before it loads a model)."""
    pytest.importorskip("trl")
    from trl import GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments, main
    from trl.scripts.utils import DatasetMixtureConfig

    script = {k: fields.pop(k) for k in ("reward_funcs",) if k in fields}
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", **fields)
    with pytest.raises(Exception) as info:
        main(
            GRPOScriptArguments(dataset_name=str(data), **script),
            args,
            ModelConfig(model_name_or_path=tiny_base_dir),
            DatasetMixtureConfig(),
        )
    return info.value


def _trls_parser_error(recipe):
    """The exception TRL's own parser raises reading `recipe` as `trl grpo --config` does, or None."""
    pytest.importorskip("trl")
    from trl import GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig, TrlParser

    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    try:
        parser.parse_args_and_config(["--config", str(recipe)], fail_with_unknown_args=False)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever TRL raises is what is compared
        return e
    return None


def test_a_trl_recipe_file_is_read_as_trls_parser_reads_it_and_its_errors_name_line_and_fix(
    tiny_base_dir, tmp_path, capsys, monkeypatch
):
    from lora_grpo.cli import main
    from lora_grpo.trl.script import parse

    data = _jsonl(tmp_path / "data.jsonl", PROMPTS[:8])
    good = _trl_recipe(tmp_path, tiny_base_dir, data)

    def refused(text):
        recipe = tmp_path / "bad.yaml"
        recipe.write_text(text)
        assert main(["trl", "--config", str(recipe)]) == 2
        return recipe, capsys.readouterr().err

    # `env:` is set in the environment, as TRL's parser does
    monkeypatch.delenv("LORA_GRPO_TEST_ENV", raising=False)
    (tmp_path / "env.yaml").write_text(good.read_text() + "env: {LORA_GRPO_TEST_ENV: 7}\n")
    _, args, _, _ = parse(["--config", str(tmp_path / "env.yaml")])
    assert args.max_steps == 1 and __import__("os").environ["LORA_GRPO_TEST_ENV"] == "7"
    # an empty file: TRL's sentence first
    recipe, err = refused("# nothing yet\n")
    assert str(_trls_parser_error(recipe)) == f"Config file {recipe} must contain a YAML mapping."
    assert err.startswith(
        f"lora-grpo: config error: Config file {recipe} must contain a YAML mapping. {recipe}: a recipe is a mapping"
    )
    # an env that is not a mapping: TRL's sentence first, then the fix
    recipe, err = refused(good.read_text() + "env: 3\n")
    assert str(_trls_parser_error(recipe)) == "`env` field should be a dict in the YAML file."
    assert "`env` field should be a dict in the YAML file." in err and "NAME: value" in err
    # a syntax error: the line and column, where TRL's parser prints PyYAML's scanner error
    recipe, err = refused(good.read_text() + "reward_funcs: [accuracy_reward\n")
    line = len(good.read_text().splitlines()) + 1
    assert f"{recipe}, line {line + 1}" in err and f"starts at line {line}" in err
    # a tag builds nothing
    recipe, err = refused(good.read_text() + "max_steps: !!python/object/apply:os.getcwd []\n")
    assert f"line {line}" in err and "tag" in err
    # a misspelt key: TRL's script drops it silently (fail_with_unknown_args=False); refused here, named
    recipe, err = refused(good.read_text() + "num_generation: 4\n")
    assert _trls_parser_error(recipe) is None
    assert "'num_generation' (did you mean 'num_generations'?)" in err
    # a misspelt key inside a dataset mixture's entry: TRL's sentence first, then the key's name
    recipe, err = refused(
        good.read_text() + f"datasets: [{{path: json, data_files: {data}, colums: [prompt]}}]\n"
    )
    trls = str(_trls_parser_error(recipe))
    assert trls == "DatasetConfig.__init__() got an unexpected keyword argument 'colums'"
    assert err.startswith(f"lora-grpo: config error: {trls}. datasets[0]: 'colums' (did you mean 'columns'?)")
    assert main(["trl", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file" in capsys.readouterr().err


def test_the_recipe_scripts_dataclasses_are_trls_field_by_field():
    pytest.importorskip("trl")
    from trl import ModelConfig, ScriptArguments
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig

    from lora_grpo.trl import script, script_data

    for theirs, ours in (
        (ScriptArguments, script.ScriptArguments),
        (GRPOScriptArguments, script.GRPOScriptArguments),
        (ModelConfig, script.ModelConfig),
        (DatasetMixtureConfig, script_data.DatasetMixtureConfig),
    ):
        assert {f.name: _default(f) for f in dataclasses.fields(theirs)} == {
            f.name: _default(f) for f in dataclasses.fields(ours)
        }, theirs.__name__


# ------------------------------------------------------------------------------ TRL's dataset mixtures
def _sources(tmp_path):
    """Two datasets of different extra columns, each a directory holding train.jsonl: a (10 rows, a `source`
    column) and b (6 rows, a `level` column)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for where, rows, extra in ((a, PROMPTS[:10], "source"), (b, PROMPTS[10:16], "level")):
        where.mkdir()
        (where / "train.jsonl").write_text(
            "".join(
                json.dumps({"prompt": r["prompt"], "solution": r["answer"], extra: 1}) + "\n" for r in rows
            )
        )
    return a, b


def _mixture(a, b, fractions=(None, None), columns=("prompt", "solution")):
    entries = [{"path": "json", "data_files": str(a / "train.jsonl")}, {"path": str(b)}]
    for entry, fraction in zip(entries, fractions, strict=True):
        entry["columns"] = list(columns)
        if fraction is not None:
            entry["fraction"] = fraction
    return entries


def _trls_mixture(recipe, *flags):
    """TRL's own parser and get_dataset over a recipe (what `trl grpo --config recipe` loads), or its error."""
    from trl import GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig, TrlParser, get_dataset

    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    *_, mixture = parser.parse_args_and_config(
        ["--config", str(recipe), *flags], fail_with_unknown_args=False
    )
    try:
        return get_dataset(mixture)
    except ValueError as e:
        return e


def _our_mixture(recipe, *flags):
    from lora_grpo.trl.script import parse
    from lora_grpo.trl.script_data import script_dataset

    script, args, _, mixture = parse(["--config", str(recipe), *flags])
    return script_dataset(script, mixture, args.seed)


def _our_api_mixture(recipe):
    """lora_grpo.trl's TrlParser and get_dataset, as a script importing them in TRL's place calls them."""
    from lora_grpo.trl import (
        DatasetMixtureConfig,
        GRPOConfig,
        ModelConfig,
        ScriptArguments,
        TrlParser,
        get_dataset,
    )

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    *_, mixture = parser.parse_args_and_config(["--config", str(recipe)], fail_with_unknown_args=False)
    return get_dataset(mixture)


def test_a_dataset_mixture_loads_what_trls_get_dataset_loads(tiny_base_dir, tmp_path):
    pytest.importorskip("trl")
    a, b = _sources(tmp_path)
    cases = {
        # whole, concatenated in order
        "whole": _mixture(a, b),
        # shares 0.75 / 0.25: the largest mixture that repeats no row is 13.3, so 10 and 3 rows
        "fractions": _mixture(a, b, fractions=(0.75, 0.25)),
        # shares normalised (1 : 3): 2 and 6 rows
        "unnormalised": _mixture(a, b, fractions=(1, 3)),
        # one column of each
        "columns": _mixture(a, b, columns=("prompt",)),
    }
    sizes = {"whole": 16, "fractions": 13, "unnormalised": 8, "columns": 16}
    for case, entries in cases.items():
        recipe = _trl_recipe(tmp_path, tiny_base_dir, a, name=f"{case}.yaml", datasets=entries)
        theirs, ours, api = _trls_mixture(recipe), _our_mixture(recipe), _our_api_mixture(recipe)
        assert list(ours) == list(theirs) == list(api) == ["train"], case
        assert ours["train"].to_list() == theirs["train"].to_list() == api["train"].to_list(), case
        assert len(ours["train"]) == sizes[case], case
    # a data file as an entry's path (TRL reads only hub names, builders and directories): the file is the "train"
    # split, which `split` may slice
    recipe = _trl_recipe(
        tmp_path,
        tiny_base_dir,
        a,
        name="file.yaml",
        datasets=[{"path": str(a / "train.jsonl"), "split": "train[:3]"}],
    )
    assert len(_our_mixture(recipe)["train"]) == 3
    # the command line's --datasets: paths, as TRL's parser reads them
    recipe = _trl_recipe(tmp_path, tiny_base_dir, a, name="flags.yaml")
    theirs, ours = (
        _trls_mixture(recipe, "--datasets", str(a), str(b)),
        _our_mixture(recipe, "--datasets", str(a), str(b)),
    )
    assert ours["train"].to_list() == theirs["train"].to_list() and len(ours["train"]) == 16
    # test_split_size: the same sizes as TRL's split; drawn with the run's seed, the same split every time
    # (TRL's draws fresh entropy); the two splits hold the mixture's rows between them
    recipe = _trl_recipe(
        tmp_path, tiny_base_dir, a, name="split.yaml", datasets=_mixture(a, b), test_split_size=0.25
    )
    theirs, ours, again = _trls_mixture(recipe), _our_mixture(recipe), _our_mixture(recipe)
    assert (
        {k: len(v) for k, v in ours.items()}
        == {k: len(v) for k, v in theirs.items()}
        == {"train": 12, "test": 4}
    )
    assert all(ours[k].to_list() == again[k].to_list() for k in ("train", "test"))
    whole = list(_our_mixture(tmp_path / "whole.yaml")["train"]["prompt"])
    assert sorted([*ours["train"]["prompt"], *ours["test"]["prompt"]]) == sorted(whole)
    other_seed = _our_mixture(recipe, "--seed", "7")
    assert other_seed["test"].to_list() != ours["test"].to_list()


def test_a_wrong_mixture_is_refused_with_trls_sentence_first_and_the_fix(tiny_base_dir, tmp_path, capsys):
    pytest.importorskip("trl")
    from trl import GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.grpo import main as trls_script
    from trl.scripts.utils import DatasetMixtureConfig

    from lora_grpo.cli import main

    a, b = _sources(tmp_path)

    def refused(**fields):
        recipe = _trl_recipe(tmp_path, tiny_base_dir, a, name="bad.yaml", **fields)
        assert main(["trl", "--config", str(recipe)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and not (tmp_path / "run").exists()
        (line,) = [line for line in err.splitlines() if line.startswith("lora-grpo:")]
        return recipe, line.removeprefix("lora-grpo: config error: ")

    # a share on one entry only: TRL's sentence, then the shares
    recipe, err = refused(datasets=_mixture(a, b, fractions=(0.5, None)))
    trls = str(_trls_mixture(recipe))
    assert trls == "`fraction` must be set for either all datasets in the mixture or none of them."
    assert err.startswith(f"{trls} Fractions now: [0.5, None]")
    # an entry without a path
    recipe, err = refused(datasets=[{"data_files": str(a / "train.jsonl")}])
    assert err.startswith(
        "DatasetConfig.__init__() missing 1 required positional argument: 'path'. datasets[0]"
    )
    # a column that is not there
    recipe, err = refused(datasets=_mixture(a, b, columns=("prompt", "soluton")))
    assert "datasets[0] (path 'json'): no column 'soluton' (did you mean 'solution'?)" in err
    # a column of two types does not mix (columns that one dataset lacks are filled with None, as in TRL)
    c = tmp_path / "c"
    c.mkdir()
    (c / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "solution": 2}) + "\n")
    recipe, err = refused(datasets=[{"path": str(a)}, {"path": str(c)}])
    assert err.startswith("the datasets do not mix (The features can't be aligned because the key solution")
    assert "datasets[0]: ['prompt', 'solution', 'source']; datasets[1]: ['prompt', 'solution']" in err
    assert "leave it out with the entry's `columns:`" in err
    # a local file that is not JSON lines, as an entry: named at its line (was datasets' DatasetGenerationError)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "solution": "2"}\n{"prompt": \n')
    recipe, err = refused(datasets=[{"path": str(bad)}])
    assert err.startswith(f"datasets[0] (path {str(bad)!r}): cannot load {bad}: line 2, column 12: not JSON")
    # ... and as dataset_name, as `lora-grpo train` names it
    assert (
        main(["trl", "--config", str(_trl_recipe(tmp_path, tiny_base_dir, bad, name="bad_file.yaml"))]) == 1
    )
    err = capsys.readouterr().err
    assert (
        "Traceback" not in err and f"lora-grpo: error: cannot load {bad}: line 2, column 12: not JSON" in err
    )
    # a split the entry's files do not have
    recipe, err = refused(datasets=[{"path": str(a), "split": "validation"}])
    assert err.startswith(f"datasets[0] (path {str(a)!r}): Unknown split") and "set its `split:`" in err
    # an eval without a test split: test_split_size is the fix
    recipe, err = refused(datasets=_mixture(a, b), eval_strategy="steps")
    assert err.startswith(
        "the mixture (datasets:) has no split 'test' (dataset_test_split); its splits are ['train']"
    )
    assert "set test_split_size to hold part of the mixture out for evaluation" in err
    # streaming: lora_grpo shuffles a map-style dataset
    recipe, err = refused(datasets=_mixture(a, b), streaming=True)
    assert err.startswith("streaming: lora_grpo draws prompts from a map-style dataset")
    # no data at all: TRL's sentence
    with pytest.raises(ValueError) as theirs:
        trls_script(
            GRPOScriptArguments(),
            GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none"),
            ModelConfig(model_name_or_path=tiny_base_dir),
            DatasetMixtureConfig(),
        )
    recipe, err = refused(dataset_name=None)
    assert err.startswith(f"{theirs.value} Give dataset_name")


def test_a_trl_recipe_trains_and_evaluates_on_a_mixture_with_trls_warning_for_a_dataset_name_beside_it(
    tiny_base_dir, tmp_path, caplog
):
    import logging

    from lora_grpo.cli import main

    a, b = _sources(tmp_path)
    recipe = _trl_recipe(
        tmp_path, tiny_base_dir, a, datasets=_mixture(a, b), test_split_size=0.25, eval_strategy="steps"
    )
    with caplog.at_level(logging.WARNING):
        assert main(["trl", "--config", str(recipe)]) == 0
    assert (
        "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the dataset "
        "and `dataset_name` will be ignored."
    ) in caplog.messages
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(any(k.startswith("eval/") for k in r) for r in history)


def test_an_eval_strategy_without_a_test_split_names_the_dataset_the_split_and_the_fixes(
    tiny_base_dir, tmp_path, capsys
):
    from lora_grpo.cli import main

    data = tmp_path / "data"
    _jsonl(data / "train.jsonl", PROMPTS[:8])
    # TRL's script: a bare KeyError: 'test'
    assert isinstance(_trls_script(data, tmp_path, tiny_base_dir, eval_strategy="steps"), KeyError)
    for where in (data, data / "train.jsonl"):
        recipe = _trl_recipe(tmp_path, tiny_base_dir, where, eval_strategy="steps", eval_steps=1)
        assert main(["trl", "--config", str(recipe)]) == 2
        err = capsys.readouterr().err
        assert (
            f"dataset_name={str(where)!r} has no split 'test' (dataset_test_split); its splits are ['train']"
            in err
        )
        assert "set dataset_test_split to one of them" in err and "test.jsonl" in err
        assert err.rstrip().endswith("or set eval_strategy: no to train without evaluation")
        assert "Traceback" not in err
    # the first fix: a test file beside the train file
    _jsonl(data / "test.jsonl", PROMPTS[8:12])
    assert (
        main(["trl", "--config", str(_trl_recipe(tmp_path, tiny_base_dir, data, eval_strategy="steps"))]) == 0
    )
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(any(k.startswith("eval/") for k in r) for r in history)


REWARD_MODULES = {
    "my_rewards": "def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\nSCALE = 2\n",
    "broken_rewards": "import a_package_not_installed_anywhere\n",
}
BAD_REWARDS = {
    "a missing function": (
        "my_rewards.lenght",
        ["AttributeError", "'my_rewards' has no 'lenght'", "did you mean 'length'?"],
    ),
    "a missing module": (
        "no_such_rewards.length",
        ["ModuleNotFoundError", "'no_such_rewards' is not importable from here", "no_such_rewards.py"],
    ),
    "a module whose own import fails": (
        "broken_rewards.length",
        ["No module named 'a_package_not_installed_anywhere'", "Importing 'broken_rewards' raised it"],
    ),
    "not a function": ("my_rewards.SCALE", ["'my_rewards.SCALE' is a int, not a function"]),
    "an unknown name": (
        "accuracy_rewrd",
        ["is neither one of TRL's reward names (did you mean 'accuracy_reward'?)"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_REWARDS))
def test_a_reward_path_that_does_not_load_names_it_what_failed_and_the_fix(
    tiny_base_dir, tmp_path, monkeypatch, capsys, case
):
    from lora_grpo.cli import main

    name, expected = BAD_REWARDS[case]
    for module, source in REWARD_MODULES.items():
        (tmp_path / f"{module}.py").write_text(source)
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    data = _jsonl(tmp_path / "train.jsonl", PROMPTS[:8])
    assert (
        main(["trl", "--config", str(_trl_recipe(tmp_path, tiny_base_dir, data, reward_funcs=[name]))]) == 2
    )
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lora-grpo:")]
    registry = "['accuracy_reward', 'reasoning_accuracy_reward', 'think_format_reward', 'get_soft_overlong_punishment']"
    # TRL's script's sentence first (it has one for an unknown name; a path that fails to import is a raw traceback
    # there), then the path, what failed and the fix
    trls = f"Could not load reward function '{name}'. Expected one of {registry} or a valid import path."
    assert err.startswith(f"lora-grpo: config error: {trls} reward_funcs: {name!r}")
    assert all(part in err for part in expected), err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    if case == "an unknown name":
        assert str(_trls_script(data, tmp_path, tiny_base_dir, reward_funcs=[name])) == trls


def test_resume_from_checkpoint_true_in_a_trl_recipe_resumes_the_newest_checkpoint(
    tiny_base_dir, tmp_path, capsys
):
    # TRL's script passes GRPOConfig.resume_from_checkpoint to train(): True is transformers' "the last checkpoint"
    from lora_grpo.cli import main

    data = _jsonl(tmp_path / "train.jsonl", PROMPTS[:8])
    resume = _trl_recipe(
        tmp_path, tiny_base_dir, data, "resume.yaml", max_steps=2, resume_from_checkpoint=True
    )
    assert main(["trl", "--config", str(resume)]) == 1
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lora-grpo:")]
    assert err.startswith(
        f"lora-grpo: error: No valid checkpoint found in output directory ({tmp_path / 'run'})"
    )
    assert main(["trl", "--config", str(_trl_recipe(tmp_path, tiny_base_dir, data))]) == 0
    assert main(["trl", "--config", str(resume)]) == 0
    run = tmp_path / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and not (run / "previous-run-1").exists()  # one run, continued from checkpoint-1


def test_save_model_writes_beside_the_run_and_never_over_files_it_did_not_write(tiny_base_dir, tmp_path):
    from peft import PeftConfig

    from lora_grpo.run.owned_dir import TargetError
    from lora_grpo.trl import GRPOTrainer

    run = tmp_path / "run"
    args = OurConfig(
        output_dir=str(run),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        save_steps=1,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=tiny_base_dir, reward_funcs=_length_reward, args=args, train_dataset=_dataset(8)
    )
    trainer.train()
    # TRL's script: save_model(output_dir) into the run's own directory, beside its checkpoints and logs
    trainer.save_model(str(run))
    assert PeftConfig.from_pretrained(str(run)).r == 16 and (run / "tokenizer.json").is_file()
    assert "A LoRA adapter of" in (run / "README.md").read_text()  # its model card, as peft's save_pretrained
    assert (run / "checkpoint-1").is_dir() and (run / "metrics.jsonl").is_file()
    assert not [p.name for p in run.iterdir() if p.name.startswith(".adapter.")]  # no temporary dir left
    # a new directory is written whole; saving there again replaces what save_model wrote
    out = tmp_path / "exported"
    trainer.save_model(str(out))
    trainer.save_model(str(out))
    assert (out / "adapter_model.safetensors").is_file() and (out / ".lora_grpo.json").is_file()
    # a directory holding the user's files: refused, naming them and the flag; with the flag, replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(
        TargetError, match=r"save_model's output_dir .*mine.* holds files lora_grpo did not write"
    ):
        trainer.save_model(str(mine))
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == [
        "notes.txt"
    ]
    with pytest.raises(
        TargetError, match=r"notes\.txt.*add overwrite=True \(trainer\.save_model\(output_dir, "
    ):
        trainer.save_model(str(mine))
    trainer.save_model(str(mine), overwrite=True)
    assert (mine / "adapter_model.safetensors").is_file() and not (mine / "notes.txt").exists()
    # the base model is never a target, whatever the flag
    before = sorted(p.name for p in Path(tiny_base_dir).iterdir())
    for target in (tiny_base_dir, str(Path(tiny_base_dir) / "adapter")):
        with pytest.raises(TargetError, match=r"the base model"):
            trainer.save_model(target, overwrite=True)
    assert sorted(p.name for p in Path(tiny_base_dir).iterdir()) == before
    # create_model_card writes output_dir/README.md again over its own card, never over the user's README
    trainer.create_model_card(dataset_name="sums")
    trainer.create_model_card(dataset_name="sums", tags="math")
    assert "- math" in (run / "README.md").read_text()
    (run / "README.md").write_text("# my notes\n")
    trainer.save_model(str(run))  # its adapter's card joins the run's files, but not over the user's README
    assert (run / "README.md").read_text() == "# my notes\n" and (run / "adapter_model.safetensors").is_file()
    with pytest.raises(
        FileExistsError, match=r"README\.md exists and is not a model card lora_grpo wrote.*overwrite=True"
    ):
        trainer.create_model_card(dataset_name="sums")
    assert (run / "README.md").read_text() == "# my notes\n"
    trainer.create_model_card(dataset_name="sums", overwrite=True)
    assert "A LoRA adapter of" in (run / "README.md").read_text()


@pytest.mark.parametrize(
    "flags, gpu, dtype",
    [
        ({"fp16": True}, True, "float16"),
        ({"fp16": True, "use_cpu": True}, True, "auto"),  # accelerate: no fp16 on a CPU, as in TRL's run
        ({"fp16": True}, False, "auto"),
        ({"bf16": True, "use_cpu": True}, False, "bfloat16"),
        ({}, True, "auto"),
    ],
)
def test_trls_precision_flags_are_the_native_runs_dtype(tmp_path, monkeypatch, flags, gpu, dtype):
    import torch

    from lora_grpo.trl.translate import to_native

    args = OurConfig(output_dir=str(tmp_path), bf16=flags.pop("bf16", False), **flags)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert to_native(args, model_name_or_path="m").torch_dtype == dtype


@pytest.mark.parametrize(
    "init_kwargs, compute, dtype",
    [
        ({}, None, "float16"),
        ({"dtype": "float32"}, None, "float32"),  # a dtype given wins over fp16, as over bf16
        ({}, "bfloat16", "bfloat16"),  # so does a 4-bit compute dtype other than float32
        ({}, "float32", "float16"),
    ],
)
def test_fp16_on_a_gpu_gives_way_to_a_dtype_the_script_names(
    tiny_base_dir, tmp_path, monkeypatch, init_kwargs, compute, dtype
):
    import torch
    from transformers import BitsAndBytesConfig

    from lora_grpo.trl.models import build_model

    args = OurConfig(output_dir=str(tmp_path), bf16=False, fp16=True, model_init_kwargs=init_kwargs or None)
    quantization = (
        None
        if compute is None
        else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=getattr(torch, compute))
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fields, _ = build_model(tiny_base_dir, args, quantization, None, None)
    assert fields["torch_dtype"] == dtype


# TRL's script puts ModelConfig's dtype (default "float32") into model_init_kwargs, loads float32 weights and autocasts
# to bf16 / fp16's dtype; `lora-grpo trl --bf16` computed in float32 throughout (the dtype given won).
@pytest.mark.parametrize(
    "flags, dtype",
    [
        (["--bf16", "true"], "bfloat16"),
        (["--bf16", "false"], "float32"),  # neither flag: float32, as TRL's run
        (["--bf16", "true", "--dtype", "float16"], "float16"),  # a dtype other than the default still wins
    ],
)
def test_the_trl_scripts_default_dtype_gives_way_to_the_precision_flags(
    tiny_base_dir, tmp_path, monkeypatch, flags, dtype
):
    from lora_grpo.trl import script, trainer
    from lora_grpo.trl.models import build_model

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(4)))
    built = {}

    class Built(Exception):
        pass

    def the_trainer(*, args, **kwargs):  # the script's GRPOTrainer call: its args are what we check
        built["args"] = args
        raise Built

    monkeypatch.setattr(trainer, "GRPOTrainer", the_trainer)
    argv = ["--model_name_or_path", tiny_base_dir, "--dataset_name", str(tmp_path), "--use_cpu", "true"]
    with pytest.raises(Built):
        script.main(
            [*argv, "--output_dir", str(tmp_path / "run"), "--reward_funcs", "accuracy_reward", *flags]
        )
    fields, _ = build_model(tiny_base_dir, built["args"], None, None, None)
    assert fields["torch_dtype"] == dtype


# ------------------------------------------------------------------------------ what lora_grpo.trl cannot act on
def _lora_trainer(tiny_base_dir, tmp_path, **fields):
    from peft import LoraConfig

    from lora_grpo.trl import GRPOTrainer

    args = OurConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        save_strategy="no",
        report_to="none",
        **fields,
    )
    return GRPOTrainer(
        model=tiny_base_dir,
        reward_funcs=_length_reward,
        args=args,
        train_dataset=_dataset(8),
        peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"),
    )


def test_a_setting_changed_on_trainer_args_after_the_trainer_is_built_is_refused_by_name(
    tiny_base_dir, tmp_path
):
    trainer = _lora_trainer(tiny_base_dir, tmp_path, learning_rate=1e-2)
    trainer.args.max_steps, trainer.args.learning_rate = 3, 5e-3
    trainer.args.logging_steps = 2  # the flow: read again, as in TRL
    with pytest.raises(
        ConfigError, match=r"trainer.args changed .*: max_steps 2 → 3, learning_rate 0.01 → 0.005\. "
    ):
        trainer.train()
    assert trainer.state.global_step == 0  # nothing trained
    trainer.args.max_steps, trainer.args.learning_rate = 2, 1e-2
    assert trainer.train().global_step == 2


def test_what_a_script_cannot_assign_or_call_here_says_what_to_do_instead(tiny_base_dir, tmp_path):
    trainer = _lora_trainer(tiny_base_dir, tmp_path)
    for name in ("train_dataset", "eval_dataset", "optimizer", "lr_scheduler"):
        with pytest.raises(
            AttributeError, match=rf"trainer.{name} = \.\.\.: lora_grpo builds the run's {name}"
        ):
            setattr(trainer, name, None)
    with pytest.raises(
        AttributeError, match="get_train_dataloader: not in lora_grpo.trl; lora_grpo has no DataLoader"
    ):
        trainer.get_train_dataloader()
    with pytest.raises(AttributeError, match="'GRPOTrainer' object has no attribute 'no_such_thing'"):
        trainer.no_such_thing  # noqa: B018 - the attribute access is the test
    assert not hasattr(trainer, "no_such_thing")


def test_training_another_adapter_than_the_policy_is_refused(tiny_base_dir, tmp_path):
    from peft import LoraConfig

    trainer = _lora_trainer(tiny_base_dir, tmp_path)
    trainer.model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    trainer.model.set_adapter("other")
    with pytest.raises(
        ConfigError, match="active adapter is 'other' .* trainer.model.set_adapter\\('default'\\)"
    ):
        trainer.train()


class _ScorerDown(Exception):
    pass


def test_a_step_that_raises_keeps_the_last_step_and_raises_the_error_itself_with_a_note(
    tiny_base_dir, tmp_path
):
    """As TRL, the script sees the error the step raised, its own type; lora_grpo's note says what was kept and how
    to resume, and resuming finishes the run. A reward function's values that break the contract are lora_grpo's
    RewardFunctionError (a ValueError), as before."""
    from lora_grpo.rewards.scoring import RewardFunctionError
    from lora_grpo.trl import GRPOTrainer

    down = {"at": 1}

    def scorer(completions, trainer_state, **kwargs):
        if trainer_state.global_step == down["at"]:
            raise _ScorerDown("the scoring service is unreachable")
        return [float(len(c) % 3) for c in completions]

    args = OurConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=3, logging_steps=1, save_strategy="no")
    trainer = GRPOTrainer(model=tiny_base_dir, reward_funcs=scorer, args=args, train_dataset=_dataset(8))
    with pytest.raises(_ScorerDown) as raised:
        trainer.train()
    (note,) = raised.value.__notes__
    assert note.startswith(
        "lora_grpo: step 2/3 stopped: after 1 of 3 optimizer steps: reward function 'scorer' "
    )
    assert f"checkpoint written to {tmp_path / 'checkpoint-1'}" in note
    assert note.endswith("then resume: trainer.train(resume_from_checkpoint=True)")
    down["at"] = None
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3

    def miscounts(completions, **kwargs):
        return [1.0]

    args = OurConfig(output_dir=str(tmp_path / "b"), use_cpu=True, max_steps=1, save_strategy="no")
    trainer = GRPOTrainer(model=tiny_base_dir, reward_funcs=miscounts, args=args, train_dataset=_dataset(8))
    with pytest.raises(RewardFunctionError, match="reward function 'miscounts' returned 1 value"):
        trainer.train()


def test_a_callbacks_should_epoch_stop_is_said_once_and_the_run_goes_on(tiny_base_dir, tmp_path, caplog):
    import logging

    from transformers import TrainerCallback

    from lora_grpo.trl import GRPOTrainer

    class EndEpochs(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_epoch_stop = True

    args = OurConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=3, save_strategy="no")
    trainer = GRPOTrainer(
        model=tiny_base_dir,
        reward_funcs=_length_reward,
        args=args,
        train_dataset=_dataset(8),
        callbacks=[EndEpochs],
    )
    with caplog.at_level(logging.WARNING):
        trainer.train()
    said = [m for m in caplog.messages if m.startswith("A callback set control.should_epoch_stop")]
    assert len(said) == 1 and trainer.state.global_step == 3


def test_a_misspelt_vllm_mode_is_refused_in_trls_words(tiny_base_dir, tmp_path):
    from lora_grpo.trl import GRPOTrainer

    args = OurConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_mode="colocat")
    with pytest.raises(
        ValueError, match=re.escape("vllm_mode must be either 'server' or 'colocate', got 'colocat'")
    ):
        GRPOTrainer(model=tiny_base_dir, reward_funcs=_length_reward, args=args, train_dataset=_dataset(8))


def test_get_quantization_config_is_trls():
    pytest.importorskip("trl")
    import trl

    import lora_grpo.trl as ours

    for fields in ({"load_in_4bit": True, "dtype": "bfloat16", "bnb_4bit_quant_storage": "bfloat16"}, {}):
        theirs = trl.get_quantization_config(trl.ModelConfig(**fields))
        mine = ours.get_quantization_config(ours.ModelConfig(**fields))
        if theirs is None:
            assert mine is None
            continue
        for key in (
            "bnb_4bit_compute_dtype",
            "bnb_4bit_quant_storage",
            "bnb_4bit_quant_type",
            "load_in_4bit",
        ):
            assert getattr(mine, key) == getattr(theirs, key), key


def test_the_cli_says_what_is_missing_for_a_path_that_is_not_there_or_a_config_flag_without_a_file(
    tmp_path, capsys
):
    from lora_grpo.cli import main

    for command in (["eval", str(tmp_path / "typo")], ["merge", str(tmp_path / "typo"), "--out", "x"]):
        assert main(command) == 1
        assert f"{tmp_path / 'typo'} does not exist or is no directory" in capsys.readouterr().err
    assert main(["trl", "--output_dir", str(tmp_path), "--config"]) == 2
    assert "--config needs the path of a TRL GRPO recipe (YAML)" in capsys.readouterr().err


def test_an_eval_at_an_epochs_end_reaches_metrics_jsonl(tiny_base_dir, tmp_path):
    """eval_strategy epoch: the evals transformers' flow asks for at an epoch's end were in log_history but not in
    metrics.jsonl or metrics.png (found in review); a step strategy's were in both."""
    from lora_grpo.trl import GRPOTrainer

    args = OurConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        bf16=False,
        max_completion_length=4,
        per_device_train_batch_size=4,
        num_generations=4,
        num_train_epochs=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        eval_strategy="epoch",
    )
    trainer = GRPOTrainer(
        model=tiny_base_dir,
        reward_funcs=_length_reward,
        args=args,
        train_dataset=_dataset(2),
        eval_dataset=_dataset(4),
    )
    trainer.train()
    logged = [r["step"] for r in trainer.state.log_history if "eval_reward" in r]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [2, 4] and [r["step"] for r in records if "eval/reward" in r] == logged


def test_a_reward_model_named_by_a_string_loads_with_the_model_init_kwargs_as_in_trl(
    tiny_base_dir, tmp_path, monkeypatch
):
    """TRL loads it with the policy's model_init_kwargs (revision, trust_remote_code, attn_implementation, a
    quantization) and its tokenizer at that revision; the front door loaded it with none of them (found in review)."""
    from helpers import tiny_reward_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from lora_grpo.trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_base_dir)
    tiny_reward_model(tokenizer).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    loads = []
    for auto in (AutoModelForSequenceClassification, AutoTokenizer):
        real = auto.from_pretrained.__func__

        def spy(cls, path, *args, real=real, **kwargs):
            loads.append((cls.__name__, str(path), kwargs))
            return real(cls, path, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(spy))
    init = {"trust_remote_code": True, "attn_implementation": "eager", "revision": None}
    args = OurConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        model_init_kwargs=init,
    )
    GRPOTrainer(model=tiny_base_dir, reward_funcs=str(tmp_path / "rm"), args=args, train_dataset=_dataset(8))
    model_load = next(
        k for name, path, k in loads if name.endswith("SequenceClassification") and "rm" in path
    )
    assert model_load == {"num_labels": 1, **init}
    tokenizer_load = next(k for name, path, k in loads if name == "AutoTokenizer" and path.endswith("rm"))
    assert tokenizer_load == {"revision": None, "trust_remote_code": True}


class StrictTask:
    """An environment whose reset() takes exactly its dataset's fields, as TRL calls it."""

    tasks: list = []

    def reset(self, task):
        StrictTask.tasks.append(task)
        return f"Solve {task}."

    def get_reward(self):
        return 0.0


def test_an_environment_of_a_dataset_without_prompts_is_reset_with_its_fields_alone(
    qwen_tool_base_dir, tmp_path
):
    """TRL's multi-environment form, a routing dataset without a prompt column: TRL calls reset(task=...); the
    front door passed its stand-in empty prompt too, and reset(self, task) raised (found in review)."""
    from datasets import Dataset

    from lora_grpo.trl import GRPOTrainer

    args = _one_step(tmp_path, beta=0.0, report_to="none")
    rows = Dataset.from_list([{"environment": "task", "task": f"t{i}"} for i in range(4)])
    StrictTask.tasks = []
    GRPOTrainer(
        model=qwen_tool_base_dir, args=args, train_dataset=rows, environment_factory={"task": StrictTask}
    ).train()
    assert StrictTask.tasks and set(StrictTask.tasks) <= {f"t{i}" for i in range(4)}


def test_a_callback_failing_in_on_log_keeps_its_step_and_the_resume_logs_it_once(tiny_base_dir, tmp_path):
    """A tracker or a callback that raises in on_log kept no step at all (the step end had begun to change the
    state; found in review): the step is kept with its end pending, and the resumed run's TRL records are the
    uninterrupted run's, the failed step's once."""
    from transformers import TrainerCallback

    from lora_grpo.trl import GRPOTrainer

    class TrackerDown(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise ConnectionError("the tracker is down")

    def trainer(out, callbacks=()):
        args = _one_step(out, logging_steps=1, learning_rate=1e-2, max_steps=3)
        return GRPOTrainer(
            model=tiny_base_dir,
            reward_funcs=_length_reward,
            args=args,
            train_dataset=_dataset(8),
            callbacks=list(callbacks),
        )

    def records(t):
        return [
            (r["step"], r.get("reward"), r.get("loss"))
            for r in t.state.log_history
            if "train_runtime" not in r
        ]

    full = trainer(tmp_path / "full")
    full.train()
    failing = trainer(tmp_path / "failed", [TrackerDown()])
    with pytest.raises(
        Exception, match=r"step 2/3 stopped: the log raised ConnectionError: the tracker is down"
    ):
        failing.train()
    assert (tmp_path / "failed" / "run" / "checkpoint-2").is_dir()
    resumed = trainer(tmp_path / "failed")
    resumed.train(resume_from_checkpoint=True)
    assert records(resumed) == records(full)


def test_a_model_that_is_no_model_nor_name_is_refused_naming_it(tmp_path):
    """model=123 was read as a model and its tokenizer then loaded from 'model' (found in review)."""
    from lora_grpo.trl import GRPOTrainer

    with pytest.raises(TypeError, match=r"model=123 \(int\): give a hub id or a local path \(str\)"):
        GRPOTrainer(
            model=123, reward_funcs=_length_reward, args=_one_step(tmp_path), train_dataset=_dataset(8)
        )
