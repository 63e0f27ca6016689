import dataclasses
import re
import subprocess
import sys

import pytest

from lora_grpo import config as config_module
from lora_grpo.config import CHOICES, ConfigError, GRPOConfig

BASE = dict(model_name_or_path="some/model")


def test_design_md_example_constructs():
    c = GRPOConfig(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct",
        quantization="4bit",
        lora_r=16,
        num_generations=8,
        beta=0.04,
        ref_sync_steps=64,
        ref_sync_alpha=0.6,
        ref_sync_mode="exact",
    )
    assert c.ref_rank == 32 and c.generation_batch == 64 and c.sync_enabled


def test_every_field_has_help():
    for f in dataclasses.fields(GRPOConfig):
        assert f.metadata.get("help"), f.name


def test_yaml_round_trip(tmp_path):
    c = GRPOConfig(
        **BASE,
        learning_rate=3e-5,
        reward_funcs=["format", {"name": "length", "kwargs": {"target_length": 9}}],
    )
    path = tmp_path / "c.yaml"
    c.to_yaml(path)
    assert GRPOConfig.from_yaml(path) == c
    # text that the recipe reader would take for a number (1e-4, a short commit hash) is written quoted
    texts = dict(run_name="1e-4", revision="4410e53", system_prompt="5E3", dataset_split="1_000")
    c = GRPOConfig(**BASE, **texts)
    c.to_yaml(path)
    assert GRPOConfig.from_yaml(path) == c and all(getattr(c, k) == v for k, v in texts.items())


def test_a_saved_configs_derived_fields_derive_again(tmp_path):
    """A step holding part of a group (generation_batch_size 24, G 4, 4 steps): prompts_per_step was filled with its
    default, saved, and the saved config.yaml refused as disagreeing with generation_batch_size (eval, merge and
    export of that run failed); and a saved ref_rank at 2 × lora_r stayed with another lora_r on top (found in
    review)."""
    path = tmp_path / "c.yaml"
    part = GRPOConfig(**BASE, generation_batch_size=24, num_generations=4, steps_per_generation=4)
    part.to_yaml(path)
    assert GRPOConfig.from_yaml(path) == part
    GRPOConfig(**BASE, lora_r=8, ref_sync_alpha=0.6).to_yaml(path)
    assert GRPOConfig.from_yaml(path, {"lora_r": 32}).ref_rank == 64
    GRPOConfig(**BASE, lora_r=8, ref_rank=24).to_yaml(path)  # given: stays
    assert GRPOConfig.from_yaml(path, {"lora_r": 16}).ref_rank == 24


def test_a_function_given_as_itself_is_saved_as_its_import_path(tmp_path):
    """GRPOConfig(reward_funcs=[fn]) trains (the trainer takes config.reward_funcs), but its config.yaml raised
    yaml's RepresenterError at train() (found in review); it is written as a recipe names a function."""
    from lora_grpo.rewards.builtins import answer_accuracy

    config = GRPOConfig(**BASE, reward_funcs=[answer_accuracy, "format"])
    config.to_yaml(tmp_path / "c.yaml")
    saved = GRPOConfig.from_yaml(tmp_path / "c.yaml")
    assert saved.reward_funcs == ["lora_grpo.rewards.builtins:answer_accuracy", "format"]


def test_yaml_reads_scientific_notation_and_rejects_unknown_keys(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model_name_or_path: m\nlearning_rate: 1e-4\n")
    assert GRPOConfig.from_yaml(path).learning_rate == 1e-4
    path.write_text("model_name_or_path: m\nlearnig_rate: 1e-4\n")
    with pytest.raises(ConfigError, match=r"unknown key.*'learnig_rate'.*did you mean 'learning_rate'"):
        GRPOConfig.from_yaml(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        GRPOConfig.from_yaml(path)
    # keys YAML reads as no text, and keyword mappings with them (tracebacks before: found in review)
    path.write_text("model_name_or_path: m\n8: 2\non: push\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown key.*8 \(YAML reads that key as the int 8, not a name: quote it\), True \(YAML reads",
    ):
        GRPOConfig.from_yaml(path)
    from lora_grpo.trl.script import config_values

    trl_recipe = tmp_path / "t.yaml"
    trl_recipe.write_text("8: 2\nfoo: 1\n")
    with pytest.raises(ConfigError, match=r"unknown keys 8 \(YAML reads .*'foo'"):
        config_values(str(trl_recipe), {"a"})
    path.write_text("model_name_or_path: m\nchat_template_kwargs: {1: true}\n")
    with pytest.raises(
        ConfigError, match=r"chat_template_kwargs=\{1: True\} must be a mapping of names \(text keys\)"
    ):
        GRPOConfig.from_yaml(path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"generation_batch_size": 30, "num_generations": 8},
            "generation_batch_size=30 is not divisible by num_generations=8",
        ),
        ({"num_generations": 1}, "num_generations=1"),
        # (named prompts_per_step, derived from it; a ZeroDivisionError with num_generations 0: found in review)
        ({"generation_batch_size": 0}, "^generation_batch_size=0 must be >= 1"),
        ({"generation_batch_size": 4, "num_generations": 0}, "^num_generations=0: GRPO compares completions"),
        ({"loss_type": "dappo"}, r"loss_type='dappo'.*did you mean 'dapo'"),
        ({"quantization": "4-bit"}, "quantization"),
        ({"beta": 0.0, "ref_sync_kl": 0.1}, "beta = 0"),
        ({"learning_rate": -1e-5}, "learning_rate=-1e-05 must be ≥ 0"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
    ],
)
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**BASE, **kwargs)


def test_a_learning_rate_of_0_is_a_baseline_run_as_in_trl():
    assert GRPOConfig(**BASE, learning_rate=0.0).learning_rate == 0.0


def test_model_is_required():
    with pytest.raises(ConfigError, match="model_name_or_path is required"):
        GRPOConfig()


def test_generation_batch_size_sets_prompts_per_step():
    assert GRPOConfig(**BASE, generation_batch_size=32, num_generations=8).prompts_per_step == 4


def test_parse_value_types():
    p = GRPOConfig.parse_value
    assert p("learning_rate", "1e-4") == 1e-4
    assert p("lora_r", "8") == 8
    assert p("gradient_checkpointing", "false") is False
    assert p("ref_sync_kl", "none") is None and p("ref_sync_kl", "0.5") == 0.5
    assert p("output_dir", "runs/1") == "runs/1"
    assert p("reward_funcs", "[format, accuracy]") == ["format", "accuracy"]
    with pytest.raises(ConfigError, match="lora_r=.eight. must be an integer"):
        p("lora_r", "eight")
    with pytest.raises(ConfigError, match="did you mean 'lora_r'"):
        p("lora_rank", "8")


def test_config_names_the_options_of_the_math_tables():
    # config.py cannot import the tables (it loads before torch), so it names their keys; they must agree.
    from lora_grpo.algo import advantages, loss, loss_types
    from lora_grpo.model import reference

    # one registry: the loss's table is loss_types' own
    assert loss.LOSS_TYPES is loss_types.LOSS_TYPES
    tables = {
        "LOSS_TYPES": loss.LOSS_TYPES,
        "IMPORTANCE_SAMPLING": loss.IMPORTANCE_SAMPLING,
        "SCALES": advantages.SCALES,
        "SYNC_MODES": reference.SYNC_MODES,
    }
    for name, table in tables.items():
        assert getattr(config_module, name) == tuple(table), name
        assert all(record.help for record in table.values()), name
    assert CHOICES["loss_type"] is config_module.LOSS_TYPES
    assert CHOICES["importance_sampling"] is config_module.IMPORTANCE_SAMPLING
    assert CHOICES["scale_rewards"] is config_module.SCALES
    assert CHOICES["ref_sync_mode"] is config_module.SYNC_MODES


@pytest.mark.parametrize("field", sorted(CHOICES))
def test_help_names_every_option(field):
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(GRPOConfig)}[field]
    words = set(re.findall(r"[\w.-]+", help_text))
    assert set(CHOICES[field]) <= words, (field, help_text)
    with pytest.raises(ConfigError, match=f"{field}='nope' is not one of"):
        GRPOConfig(**BASE, **{field: "nope"})


def test_field_help_carries_the_default():
    helps = GRPOConfig.field_help()
    assert list(helps) == [f.name for f in dataclasses.fields(GRPOConfig)]
    assert helps["lora_r"] == "rank of the policy LoRA adapter [default: 16]"
    assert helps["reward_funcs"].endswith("[default: []]")


def _fresh_import(modules: str, absent: tuple[str, ...]) -> None:
    check = f"import sys, {modules}; loaded = [m for m in {absent!r} if m in sys.modules]; assert not loaded, loaded"
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_config_imports_without_torch():
    # The CLI parses the config (and prints --help) before anything loads torch.
    _fresh_import("lora_grpo.config", ("torch",))


def test_math_modules_import_without_yaml_or_transformers():
    _fresh_import(
        "lora_grpo.algo.loss, lora_grpo.algo.advantages, lora_grpo.algo.logprobs, lora_grpo.model.reference",
        ("yaml", "transformers"),
    )


# ------------------------------------------------------------------ one type check: Python, recipes and --set


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("lora_r", 4.5, "lora_r=4.5 must be an integer, e.g. 16 (its default)"),
        ("lora_r", [4], "lora_r=[4] must be an integer, e.g. 16 (its default)"),
        ("max_steps", 1.5, "max_steps=1.5 must be an integer, e.g. 100 (its default)"),
        ("lora_r", True, "lora_r=True must be an integer"),
        ("beta", float("nan"), "beta=nan must be a finite number, e.g. 0.04 (its default)"),
        ("learning_rate", float("inf"), "learning_rate=inf must be a finite number"),
        ("use_rslora", "yes", "use_rslora='yes' must be true or false, e.g. False (its default)"),
        ("run_name", 2024, "run_name=2024 must be text or null: quote it if it is text, run_name: '2024'"),
        ("eval_pass_k", [1, 2.5], "eval_pass_k=[1, 2.5] must be a list of integers (eval_pass_k[1] is 2.5)"),
        (
            "reward_weights",
            [1.0, float("nan")],
            "reward_weights=[1.0, nan] must be a list of finite numbers or null (reward_weights[1] is nan), "
            "e.g. [1.0, 0.5]",
        ),
        ("reward_weights", [float("inf")], r"reward_weights[0] is inf"),
        ("reward_weights", ["a"], r"reward_weights[0] is 'a'"),
        ("chat_template_kwargs", None, "chat_template_kwargs=None must be a mapping"),
        # fields of several forms
        ("resume_from_checkpoint", 2024, "must be a checkpoint directory, 'latest' or true"),
        ("lora_target_modules", 5, "lora_target_modules=5 must be 'all-linear', a list of module names"),
        ("lora_target_modules", ["q_proj", 3], "lora_target_modules=['q_proj', 3] must be 'all-linear'"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_field_and_value(field, value, message):
    with pytest.raises(ConfigError) as info:
        GRPOConfig(**BASE, **{field: value})
    assert message in str(info.value) and info.value.field == field


@pytest.mark.parametrize(
    "field, text, value",
    [
        ("lora_r", "4.5", 4.5),
        ("lora_r", "[4]", [4]),
        ("max_steps", "1.5", 1.5),
        ("reward_weights", "[.nan]", [float("nan")]),
        ("reward_weights", "[a]", ["a"]),
    ],
)
def test_set_a_recipe_and_python_get_the_same_check(tmp_path, field, text, value):
    # --set, a recipe's line and GRPOConfig(...) give one message, from one check (config_checks.value_problem).
    with pytest.raises(ConfigError) as from_python:
        GRPOConfig(**BASE, **{field: value})
    with pytest.raises(ConfigError) as from_set:
        GRPOConfig.parse_value(field, text)
    path = tmp_path / "r.yaml"
    path.write_text(f"model_name_or_path: m\n{field}: {text}\n")
    with pytest.raises(ConfigError) as from_recipe:
        GRPOConfig.from_yaml(path)
    assert str(from_set.value) == str(from_python.value)
    assert str(from_recipe.value) == f"{path}, line 2: {from_python.value}"
    # the value --set put over the recipe's is not named at the recipe's line
    with pytest.raises(ConfigError) as overridden:
        GRPOConfig.from_yaml(path, {field: value})
    assert str(overridden.value) == str(from_python.value)


def test_paths_and_tuples_from_python_are_taken_as_text_and_lists(tmp_path):
    config = GRPOConfig(
        model_name_or_path=tmp_path / "base",
        output_dir=tmp_path / "run",
        reward_funcs=("format", "accuracy"),
        reward_weights=(1, 0.5),
    )
    assert config.model_name_or_path == str(tmp_path / "base") and config.output_dir == str(tmp_path / "run")
    assert config.reward_funcs == ["format", "accuracy"] and config.reward_weights == [1, 0.5]
    assert "output_dir: " in config.to_yaml()


def test_generation_batch_size_and_prompts_per_step_must_agree():
    # was: prompts_per_step=3 silently became 4
    with pytest.raises(ConfigError) as info:
        GRPOConfig(**BASE, generation_batch_size=8, prompts_per_step=3, num_generations=2)
    assert str(info.value) == (
        "'generation_batch_size' and 'prompts_per_step' can not be both configured at the same time unless they "
        "agree: generation_batch_size=8 makes 4 prompts a step (8 / num_generations=2 / steps_per_generation=1), "
        "but prompts_per_step=3: set only one of them"
    )
    agreeing = GRPOConfig(
        **BASE, generation_batch_size=8, prompts_per_step=2, num_generations=2, steps_per_generation=2
    )
    assert agreeing.prompts_per_step == 2 and agreeing.generation_batch == 8
    assert GRPOConfig(**BASE).prompts_per_step == 8
    # the saved config (both fields, agreeing) reads back
    assert GRPOConfig.from_dict(agreeing.to_dict()) == agreeing


@pytest.mark.parametrize(
    "template, message",
    [
        (
            "Q: {prompt",
            "prompt_template='Q: {prompt' is not a format string (expected '}' before end of string)",
        ),
        ("a } b", "is not a format string (Single '}' encountered in format string)"),
        ("Q: {}", "prompt_template='Q: {}': the field {} does not name a column"),
        ("Q: {0}", "the field {0} does not name a column"),
        ("Q: {q!x}", "the field {q!x} has the conversion !x, which str.format does not know"),
    ],
)
def test_a_prompt_template_that_is_not_a_format_string_over_columns_is_refused(template, message):
    with pytest.raises(ConfigError) as info:
        GRPOConfig(**BASE, prompt_template=template)
    assert message in str(info.value) and info.value.field == "prompt_template"
    assert GRPOConfig(**BASE, prompt_template="Q: {question!r} {{literal}} {row[a]}").prompt_template


def test_evals_during_training_need_eval_prompts():
    # was: trained with neither an eval nor a warning (transformers' Trainer refuses eval_strategy='steps' alone)
    from lora_grpo import GRPOTrainer

    config = GRPOConfig(model_name_or_path="never-loaded/model", eval_steps=5, reward_funcs=["format"])
    with pytest.raises(ConfigError) as info:
        GRPOTrainer(config, train_dataset=[{"prompt": "1+1="}] * 8)
    assert str(info.value) == (
        "eval_steps=5 asks for evals during training, but there are no eval prompts (transformers' Trainer "
        "likewise refuses eval_strategy='steps' without an eval_dataset): set eval_dataset (or pass "
        "eval_dataset=... to GRPOTrainer), or eval_steps=0"
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("seed", -1, "seed=-1 must be ≥ 0"),
        ("adam_beta1", 2.0, "adam_beta1=2.0 must be in [0, 1)"),
        ("adam_beta2", -1.0, "adam_beta2=-1.0 must be in [0, 1)"),
    ],
)
def test_a_value_out_of_range_is_refused_before_it_reaches_torch(field, value, message):
    """(A negative seed stopped the first rollout, a beta outside [0, 1) the optimizer's construction, each in
    torch's words, naming no field.)"""
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        GRPOConfig(**BASE, **{field: value})
    assert info.value.field == field


def test_a_set_value_a_check_across_fields_refuses_is_not_blamed_on_the_recipe(tmp_path):
    """A --set value that a check across fields refuses names the value, not the recipe file (which is valid)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: toy\nnum_generations: 4\n")
    with pytest.raises(ConfigError) as info:
        GRPOConfig.from_yaml(recipe, {"num_generations": 1})
    assert str(info.value).startswith("num_generations=1") and str(recipe) not in str(info.value)
    recipe.write_text("model_name_or_path: toy\nnum_generations: 1\n")  # the recipe's own: named
    with pytest.raises(ConfigError, match=re.escape(str(recipe))):
        GRPOConfig.from_yaml(recipe, {"max_steps": 3})
