import dataclasses

import pytest

from lora_grpo.config import ConfigError, GRPOConfig

BASE = dict(model_name_or_path="some/model")


def test_design_md_example_constructs():
    c = GRPOConfig(model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", quantization="4bit", lora_r=16,
                   num_generations=8, beta=0.04, ref_sync_steps=64, ref_sync_alpha=0.6, ref_sync_mode="exact")
    assert c.ref_rank == 32 and c.generation_batch == 64 and c.sync_enabled


def test_every_field_has_help():
    for f in dataclasses.fields(GRPOConfig):
        assert f.metadata.get("help"), f.name


def test_yaml_round_trip(tmp_path):
    c = GRPOConfig(**BASE, learning_rate=3e-5, reward_funcs=["format", {"name": "length", "kwargs": {"target_length": 9}}])
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
        ({"generation_batch_size": 30, "num_generations": 8}, "generation_batch_size=30 is not divisible by num_generations=8"),
        ({"num_generations": 1}, "num_generations=1"),
        ({"loss_type": "dappo"}, r"loss_type='dappo'.*did you mean 'dapo'"),
        ({"quantization": "4-bit"}, "quantization"),
        ({"beta": 0.0, "ref_sync_kl": 0.1}, "beta = 0"),
        ({"learning_rate": 0}, "learning_rate=0 must be > 0"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
        ({"reward_funcs": ["a", "b"], "reward_weights": [1.0]}, "reward_weights has 1"),
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
