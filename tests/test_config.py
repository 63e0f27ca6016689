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


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"generation_batch_size": 30, "num_generations": 8},
            "generation_batch_size=30 is not divisible by num_generations=8",
        ),
        ({"num_generations": 1}, "num_generations=1"),
        ({"loss_type": "dappo"}, r"loss_type='dappo'.*did you mean 'dapo'"),
        ({"quantization": "4-bit"}, "quantization"),
        ({"beta": 0.0, "ref_sync_kl": 0.1}, "beta = 0"),
        ({"learning_rate": 0}, "learning_rate=0 must be > 0"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
    ],
)
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**BASE, **kwargs)


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
    with pytest.raises(ConfigError, match="expected int"):
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
