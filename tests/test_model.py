"""Loading the model: the frozen 4-bit base stays bit-identical on every CPU, including the bitsandbytes
code path that CPUs with AVX512-BF16 take (forced here on any CPU, with the packed kernel stubbed); the
base's dropout is off; a warm-start adapter takes the config's dropout; tokenizers that cannot pad or stop
are refused."""

import copy

import bitsandbytes.functional as bnb_F
import bitsandbytes.nn.modules as bnb_modules
import pytest
import torch
from helpers import HYBRIDS, SMALL_RUN, assert_same_4bit, frozen_4bit, make_trainer, tiny_config

from lora_grpo.config import GRPOConfig
from lora_grpo.model.adapters import POLICY
from lora_grpo.model.load import load_model
from lora_grpo.model.reference import lora_layers
from lora_grpo.run.checkpoint import save_adapter
from lora_grpo.tasks.toy import make_tiny_model, make_tokenizer


@pytest.fixture
def avx512bf16_cpu(monkeypatch):
    """Make bitsandbytes believe this CPU has AVX512-BF16, as the machines where the defect showed.

    Linear4bit then repacks its weights on the first no-grad eval forward and runs the packed
    kernel; the stub computes what that kernel computes (dequantise the packed weights) and, like
    the real op, has no autograd.
    """
    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)

    def packed_gemv(A, B, out=None, state=None, **kwargs):
        with torch.no_grad():
            qweight, qstate = bnb_F._convert_weight_packed_for_cpu_inverse(B.clone(), copy.deepcopy(state))
            weight = bnb_F.dequantize_4bit(qweight, qstate)
            return A @ weight.t().to(A.dtype)

    monkeypatch.setattr(bnb_F, "gemv_4bit", packed_gemv)


def test_base_is_bit_identical_after_rollouts_steps_syncs_and_saves_on_the_avx512bf16_path(
    avx512bf16_cpu, tiny_base_dir, tmp_path
):
    trainer = make_trainer(
        tiny_base_dir, tmp_path, max_steps=4, save_steps=1, ref_sync_steps=2, ref_sync_alpha=0.5
    )
    before = frozen_4bit(trainer.model)
    trainer.train()  # rollouts (eval, no grad), steps, syncs, 4 checkpoints and the final adapter
    trainer.evaluate(trainer.train_dataset.select(range(4)))
    assert_same_4bit(before, frozen_4bit(trainer.model))


def test_gradients_through_the_4bit_base_survive_a_rollout(avx512bf16_cpu, tiny_base_dir, tmp_path):
    # The packed kernel has no autograd: once a rollout had repacked the weights, no gradient
    # reached the layers below a 4-bit matmul. The gradient must be the same before and after.
    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="4bit", max_grad_norm=0.0)
    torch.manual_seed(0)
    for p in trainer.params:  # non-zero B everywhere, so every layer's LoRA affects the output
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def policy_grads():
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        trainer.model(input_ids=ids).logits.float().square().mean().backward()
        return torch.cat([p.grad.flatten() for p in trainer.params])

    before = policy_grads()
    trainer.generate(["1+2="])  # an eval, no-grad forward: where bitsandbytes would repack
    after = policy_grads()
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-7)


def test_saving_an_adapter_never_serialises_the_base(tiny_base_dir, tmp_path):
    # Even with every layer in the packed CPU layout, writing an adapter must not touch the base
    # (Linear4bit._save_to_state_dict unpacks and re-quantises whatever state_dict() visits).
    model, _ = load_model(
        GRPOConfig(
            model_name_or_path=tiny_base_dir, quantization="4bit", lora_r=4, gradient_checkpointing=False
        )
    )
    for m in model.modules():
        if isinstance(m, bnb_modules.Linear4bit):
            m.weight.data, m.weight.quant_state = bnb_F._convert_weight_packed_for_cpu(
                m.weight.data, m.weight.quant_state
            )
    before = frozen_4bit(model)
    save_adapter(model, tmp_path / "policy", POLICY)
    assert_same_4bit(before, frozen_4bit(model))


def test_every_4bit_layer_is_pinned_to_the_portable_path(avx512bf16_cpu, tiny_base_dir):
    model, _ = load_model(
        GRPOConfig(
            model_name_or_path=tiny_base_dir, quantization="4bit", lora_r=4, gradient_checkpointing=False
        )
    )
    layers = [m for m in model.modules() if isinstance(m, bnb_modules.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)


def test_bitsandbytes_notice_of_its_packed_path_kernel_is_dropped_and_no_other_record(caplog):
    """On an AVX512-BF16 CPU bitsandbytes warns at import that it could not fetch the kernel of the packed path
    lora_grpo turns off (keep_4bit_weights_fixed); importing lora_grpo drops that record, from bitsandbytes'
    own logger, and passes every other."""
    import logging

    import lora_grpo  # noqa: F401 (installs the filter)

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=log.name):
        log.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
            "`pip install kernels` and the kernels >= 0.11.1",
            "Kernel repository 'kernels-community/quantization-bitsandbytes' could not verify publisher trust",
        )
        log.warning("Failed to load the CPU library")
    assert [record.getMessage() for record in caplog.records] == ["Failed to load the CPU library"]


def test_a_model_repacked_before_the_trainer_got_it_is_refused(tiny_base_dir, tmp_path):
    from lora_grpo.model.load import keep_4bit_weights_fixed

    model, _ = load_model(
        GRPOConfig(
            model_name_or_path=tiny_base_dir, quantization="4bit", lora_r=4, gradient_checkpointing=False
        )
    )
    layer = next(m for m in model.modules() if isinstance(m, bnb_modules.Linear4bit))
    layer.weight.data, layer.weight.quant_state = bnb_F._convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state
    )
    with pytest.raises(ValueError, match=r"already repacked by bitsandbytes.*Load the model again"):
        keep_4bit_weights_fixed(model)


@pytest.mark.parametrize("drop", ["pad", "pad_and_eos"])
def test_a_tokenizer_that_cannot_pad_or_stop_is_refused_at_start(tiny_base_dir, tmp_path, drop):
    from lora_grpo import GRPOTrainer
    from lora_grpo.model.load import load_tokenizer

    config = GRPOConfig(
        model_name_or_path=tiny_base_dir,
        lora_r=4,
        num_generations=2,
        prompts_per_step=2,
        max_prompt_length=32,
        max_completion_length=4,
        output_dir=str(tmp_path),
        gradient_checkpointing=False,
    )
    model, _ = load_model(config)
    tokenizer = load_tokenizer(config)
    tokenizer.pad_token = None
    if drop == "pad_and_eos":
        tokenizer.eos_token = None
        model.generation_config.eos_token_id = None
    match = (
        r"no pad token.*tokenizer.pad_token = tokenizer.eos_token"
        if drop == "pad"
        else r"no EOS token.*set tokenizer.eos_token"
    )
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(
            config,
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            train_dataset=[{"prompt": "1+2="}] * 4,
            model=model,
            tokenizer=tokenizer,
        )


def save_base_with_attention_dropout(path, p: float) -> str:
    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer)
    model.config.attention_dropout = p
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# Failed before the fix it guards (code review): the base's own dropout stayed on, so the train-mode
# loss forward disagreed with the eval-mode rollout and reference log-probs.
def test_base_model_dropout_is_off(tmp_path):
    path = save_base_with_attention_dropout(tmp_path / "drop", 0.5)
    peft_model, _ = load_model(GRPOConfig(model_name_or_path=path, lora_r=4, gradient_checkpointing=False))
    peft_model.train()
    x = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(peft_model(input_ids=x).logits, peft_model(input_ids=x).logits)


# model type → its dropout fields: families whose layers copy a probability into a float of their own when built
# (OPT's dropout, StarCoder2's residual and embedding dropout, GPT-BigCode's attn_pdrop as attn_dropout, layerdrop)
COPIED_DROPOUT = {
    "opt": dict(dropout=0.3, attention_dropout=0.3, layerdrop=0.3, word_embed_proj_dim=64, ffn_dim=96),
    "starcoder2": dict(residual_dropout=0.3, embedding_dropout=0.3, attention_dropout=0.3),
    "gpt_bigcode": dict(attn_pdrop=0.3, resid_pdrop=0.3, embd_pdrop=0.3, n_embd=64, n_head=4, n_layer=2),
}


@pytest.mark.parametrize("model_type", list(COPIED_DROPOUT))
def test_base_dropout_is_off_where_the_layers_keep_a_copy_of_it(model_type):
    from transformers import AutoModelForCausalLM

    from lora_grpo.model.load import prepare_base

    torch.manual_seed(0)
    config = tiny_config(model_type, 128, num_hidden_layers=2, **COPIED_DROPOUT[model_type])
    model = prepare_base(AutoModelForCausalLM.from_config(config)).train()
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    assert torch.equal(model(input_ids=x).logits, model(input_ids=x).logits)


# Failed before the fix it guards (code review): with the base's dropout on, the KL against an
# identical reference was > 0.
def test_trainer_kl_is_exactly_zero_against_an_identical_reference_with_a_dropout_config(tmp_path):
    trainer = make_trainer(
        save_base_with_attention_dropout(tmp_path / "drop", 0.3), tmp_path, **SMALL_RUN, max_steps=1
    )
    trainer.train()
    assert trainer.state.log_history[0]["kl"] == 0.0


# Failed before the fix it guards (code review): init_adapter kept the saved adapter's lora_dropout
# (SFT adapters often carry 0.05-0.1) instead of the config's.
def test_init_adapter_takes_the_configs_dropout(tiny_base_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    sft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir),
        LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear"),
        adapter_name=POLICY,
    )
    save_adapter(sft, tmp_path / "sft", POLICY)
    model, _ = load_model(
        GRPOConfig(
            model_name_or_path=tiny_base_dir,
            lora_r=4,
            init_adapter=str(tmp_path / "sft"),
            gradient_checkpointing=False,
        )
    )
    dropouts = [m.lora_dropout[POLICY] for _, m in lora_layers(model)]
    assert dropouts and all(not isinstance(d, torch.nn.Dropout) or d.p == 0.0 for d in dropouts)


# ---------------------------------------------------------------------------------- files we read
@pytest.fixture(scope="module")
def recipe_and_adapter(tiny_base_dir, tmp_path_factory):
    """A recipe of the tiny base, and its policy adapter saved as lora_grpo saves one (safetensors)."""
    from helpers import write_recipe

    from lora_grpo import GRPOTrainer
    from lora_grpo.cli import load_config

    root = tmp_path_factory.mktemp("adapter_files")
    recipe = write_recipe(root, tiny_base_dir, quantization="none")
    save_adapter(GRPOTrainer(load_config(str(recipe), [])).model, root / "adapter", POLICY)
    return recipe, root / "adapter"


def _as_bin(adapter, target, **extra):
    """A copy of `adapter` whose weights are an adapter_model.bin (torch.save of its tensors and `extra`)."""
    import shutil

    from safetensors.torch import load_file

    from lora_grpo.model.adapter_files import ADAPTER_WEIGHTS, PICKLED_WEIGHTS

    shutil.copytree(adapter, target)
    weights = load_file(str(target / ADAPTER_WEIGHTS))
    (target / ADAPTER_WEIGHTS).unlink()
    torch.save({**weights, **extra}, target / PICKLED_WEIGHTS)
    return target


class _CreatesAFile:
    """A pickle payload: unpickling it calls open(marker, "w"), which creates the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# Issue 47: eval and merge of an adapter_model.bin holding a pickled object stopped on torch's raw
# UnpicklingError, whose text suggests loading it with weights_only=False.
def test_a_pickled_adapter_bin_is_refused_by_eval_and_merge_without_running_it(
    recipe_and_adapter, tmp_path, capsys
):
    from lora_grpo.cli import main

    recipe, adapter = recipe_and_adapter
    marker = tmp_path / "payload-ran"
    pickled = _as_bin(adapter, tmp_path / "pickled", extra=_CreatesAFile(marker))
    for command in (["eval"], ["merge", "--out", str(tmp_path / "merged")]):
        capsys.readouterr()
        assert main([command[0], str(pickled), "--recipe", str(recipe), *command[1:]]) == 1
        err = capsys.readouterr().err
        assert f"{pickled / 'adapter_model.bin'} holds a pickled Python object (" in err, command
        assert "refused, not loaded, since unpickling it could run code" in err
        assert "save_pretrained" in err
        assert "weights_only" not in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "merged").exists()


def test_an_adapter_bin_is_read_as_tensors_only_through_the_python_api(
    recipe_and_adapter, tiny_base_dir, tmp_path
):
    from lora_grpo.model.adapter_files import AdapterFileError, read_adapter_weights, saved_tensor_shapes

    _, adapter = recipe_and_adapter
    marker = tmp_path / "payload-ran"
    plain = read_adapter_weights(_as_bin(adapter, tmp_path / "plain"))
    assert plain and all(isinstance(v, torch.Tensor) for v in plain.values())
    pickled = _as_bin(adapter, tmp_path / "pickled", extra=_CreatesAFile(marker))
    for read in (read_adapter_weights, saved_tensor_shapes):
        with pytest.raises(AdapterFileError, match="holds a pickled Python object"):
            read(pickled)
    with pytest.raises(ValueError, match="holds a pickled Python object"):
        make_trainer(tiny_base_dir, tmp_path, quantization="none", lora_r=4, init_adapter=str(pickled))
    assert not marker.exists()


def test_eval_reads_an_adapter_bin_of_tensors_and_names_a_damaged_weights_file(
    recipe_and_adapter, tmp_path, capsys
):
    from lora_grpo.cli import main
    from lora_grpo.model.adapter_files import ADAPTER_WEIGHTS, PICKLED_WEIGHTS

    recipe, adapter = recipe_and_adapter
    plain = _as_bin(adapter, tmp_path / "plain")
    assert main(["eval", str(plain), "--recipe", str(recipe)]) == 0
    for damaged, name in ((plain, PICKLED_WEIGHTS), (tmp_path / "cut", ADAPTER_WEIGHTS)):
        if not damaged.exists():
            import shutil

            shutil.copytree(adapter, damaged)
        file = damaged / name
        file.write_bytes(file.read_bytes()[:100])
        capsys.readouterr()
        assert main(["eval", str(damaged), "--recipe", str(recipe)]) == 1
        err = capsys.readouterr().err
        assert f"{file} is damaged or truncated (" in err and "save the adapter again" in err
        assert "weights_only" not in err and "Traceback" not in err


def _base_with_its_own_code(tiny_base_dir, target, marker):
    """The tiny base, made a model whose config.json asks for code of its own (auto_map); that code creates
    `marker` when it runs."""
    import json
    import shutil

    shutil.copytree(tiny_base_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = "custom_llama"
    config["auto_map"] = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomModel",
    }
    (target / "config.json").write_text(json.dumps(config))
    (target / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w')\nfrom transformers import LlamaConfig as CustomConfig\n"
    )
    (target / "modeling_custom.py").write_text("from transformers import LlamaForCausalLM as CustomModel\n")
    return target


def test_a_base_whose_weights_file_was_cut_short_is_named_in_one_line(tiny_base_dir, tmp_path, capsys):
    """A model.safetensors cut short (a download or copy that did not finish): safetensors' own error, which is
    neither OSError nor ValueError, is named with the base, its directory and the fix, not left as a traceback."""
    import shutil

    from helpers import write_recipe

    from lora_grpo.cli import main

    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    assert main(["train", str(write_recipe(tmp_path, base, quantization="none"))]) == 1
    err = capsys.readouterr().err
    assert f"could not load the policy's base model from {str(base)!r}" in err and "SafetensorError" in err
    assert "damaged or cut short" in err and "Traceback" not in err


# Issue 47: the refusal was right, but its message stopped at transformers' first line, before the one that
# names the setting, and never said trust_remote_code.
def test_a_model_with_code_of_its_own_is_refused_naming_trust_remote_code(tiny_base_dir, tmp_path, capsys):
    from helpers import write_recipe

    from lora_grpo.cli import main
    from lora_grpo.model.loading import LoadError

    marker = tmp_path / "model-code-ran"
    base = _base_with_its_own_code(tiny_base_dir, tmp_path / "custom", marker)
    with pytest.raises(LoadError) as info:
        make_trainer(str(base), tmp_path, quantization="none")
    text = str(info.value)
    assert (
        "it ships Python code of its own (config.json's auto_map: configuration_custom.CustomConfig, " in text
    )
    assert "trust_remote_code is false, so it was refused and none of that code ran" in text
    assert "set trust_remote_code: true in the recipe (--set trust_remote_code=true)" in text
    recipe = write_recipe(tmp_path, base, quantization="none")
    assert main(["train", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "trust_remote_code: true" in err and "Traceback" not in err
    assert not marker.exists()


# The loader ran out of device memory: torch's "CUDA out of memory. Tried to allocate 20.00 MiB" said neither what the
# weights take nor what to change (a 7B base in bfloat16 on an 8 GB card, quantization left at none).
@pytest.mark.parametrize("quantization", ["none", "4bit"])
def test_a_base_that_runs_out_of_memory_while_loading_says_what_its_weights_take(
    tiny_base_dir, tmp_path, monkeypatch, capsys, quantization
):
    from helpers import write_recipe
    from transformers import AutoModelForCausalLM

    from lora_grpo.cli import main
    from lora_grpo.model import load
    from lora_grpo.model.loading import LoadError

    # What the loaded base holds, counted on the real model: every nn.Linear's weight but the head's is quantized.
    real = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32)
    head = real.get_output_embeddings()
    linear = sum(m.weight.numel() for m in real.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    total = sum(p.numel() for p in real.parameters())
    need = {"none": 4 * total, "4bit": (0.5 + 1 / 64 + 4 / (64 * 256)) * linear + 4 * (total - linear)}
    room = need["4bit"] / 2  # left on the device: not even the 4-bit base fits
    GiB = 2**30

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.\nmore of torch's text")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", out_of_memory)
    monkeypatch.setattr(load, "available_bytes", lambda device: (room, "free GPU memory"))
    config_fields = {"quantization": quantization, "torch_dtype": "float32"}
    with pytest.raises(LoadError) as info:
        make_trainer(tiny_base_dir, tmp_path, **config_fields)
    assert isinstance(info.value, torch.OutOfMemoryError)  # what a script catching torch's OOM catches still
    text = str(info.value)
    assert text.startswith(
        f"could not load the policy's base model from {tiny_base_dir!r}: it ran out of memory on"
    )
    assert "(OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.)" in text
    held = "in float32" if quantization == "none" else "quantized to 4 bits"
    assert (
        f"Its weights take about {need[quantization] / GiB:.1f} GiB {held} (counted from its config)" in text
    )
    assert f"and {room / GiB:.1f} GiB of free GPU memory is left with nothing loaded" in text
    if quantization == "none":
        assert text.endswith(
            f"use quantization: 4bit (about {need['4bit'] / GiB:.1f} GiB) or quantization: 8bit (about "
            f"{(linear + 4 * (total - linear)) / GiB:.1f} GiB) or a smaller model"
        )
    else:
        assert text.endswith("use a smaller model")
    # The CLI says it in one line; the room being enough for the weights says the memory went elsewhere.
    monkeypatch.setattr(load, "available_bytes", lambda device: (4 * need["none"], "free GPU memory"))
    recipe = write_recipe(tmp_path, tiny_base_dir, **config_fields)
    capsys.readouterr()
    assert main(["train", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "lora-grpo: error: could not load the policy's base model" in err and "Traceback" not in err
    assert "they fit, so the memory went elsewhere while it loaded" in err


# model_type → the tiny config's extra fields: Qwen3 and Gemma with a head_dim apart from hidden / heads, Gemma
# with sliding-window layers narrower than a rollout, Phi-3 with fused qkv_proj and gate_up_proj
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "gemma2": {"head_dim": 32, "sliding_window": 4},
    "gemma3_text": {"head_dim": 32, "sliding_window": 4},
    # Gemma 3 4B-27B: Gemma3ForConditionalGeneration, the tiny Gemma 3 as its language model beside a vision tower
    "gemma3": {"head_dim": 32, "sliding_window": 4},
    "mistral": {"sliding_window": 4},
    "phi3": {},
    **HYBRIDS,
}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_model_family_trains_through_qlora_with_a_synced_reference(model_type, tmp_path):
    """A tiny random model of each family the docs name, 4-bit, two steps with the static decode and a hard
    sync after the first: finite losses, the policy moved, the reference slot equal to it after the sync. Every
    adapter moves: a multimodal model's sit on its language model alone, none on the vision tower."""
    from transformers import AutoModelForCausalLM

    from lora_grpo.model.adapters import REFERENCE

    tok = make_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(
        model_type,
        len(tok),
        num_hidden_layers=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **FAMILIES[model_type],
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    trainer = make_trainer(
        str(tmp_path / "base"),
        tmp_path,
        max_steps=2,
        ref_sync_steps=1,
        ref_sync_alpha=1.0,
        decode_mode="static",
    )
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not [name for name, _ in lora_layers(trainer.model) if "vision" in name]
    for _, layer in lora_layers(trainer.model):
        assert layer.lora_B[POLICY].weight.abs().sum() > 0  # B starts at 0: the policy moved
    # synced after step 1 (the slot started at B = 0, the fresh policy), then step 2 moved the policy on: the slot
    # holds step 1's policy, not step 2's
    assert trainer.state.log_history[0]["sync/event"] == 1.0
    assert all(layer.lora_B[REFERENCE].weight.abs().sum() > 0 for _, layer in lora_layers(trainer.model))
    assert any(
        not torch.equal(layer.lora_B[POLICY].weight, layer.lora_B[REFERENCE].weight)
        for _, layer in lora_layers(trainer.model)
    )
