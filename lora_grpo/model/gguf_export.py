"""A merged transformers model and its tokenizer, written as one GGUF file that llama.cpp loads as a chat model.

Written with the gguf package's own pieces: ``GGUFWriter`` for the file, ``get_tensor_name_map`` /
``MODEL_TENSORS`` for the tensor names of the architecture, ``gguf.quants.quantize`` for Q8_0. What goes in:

- **The weights**, named as llama.cpp names them; matrices in float16 (``f16``) or Q8_0 (``q8_0``; a matrix
  whose rows are not a whole number of Q8_0 blocks stays float16), vectors (norms, biases) in float32, as
  llama.cpp's own converter does. No ``output.weight`` when the embeddings are tied.
- **Llama's q and k rows in llama.cpp's rotary order**: llama.cpp rotates pairs of neighbouring rows where
  transformers rotates the two halves of each head, so its converter permutes q and k (per query head, per
  KV head) and transformers' GGUF reader (``LlamaTensorProcessor``) undoes exactly that. Qwen2 and Qwen3
  (whose per-head q / k norms are written as they are) need nothing.
- **The architecture's numbers**: context length, embedding and feed-forward sizes, blocks, heads and KV
  heads, RoPE base, RMS-norm epsilon, vocabulary size, and the RoPE scaling when set: linear or YaRN as
  metadata, Llama 3's (``rope_type: llama3``) as llama.cpp reads it, a ``rope_freqs`` tensor of what each
  frequency is divided by (the model's own frequencies against plain RoPE's).
- **The tokenizer** (byte-level BPE, llama.cpp's ``gpt2`` model): every token (added ones typed control when
  special, user-defined otherwise; ids the model has and the tokenizer lacks as unused ``[PAD{id}]``), the
  merges, the BOS / EOS / pad / unknown ids, whether it adds BOS, its pre-tokenizer's name
  (``tokenizer.ggml.pre``: which regex splits text before the merges: GPT-2's, SmolLM's, Qwen2's or Llama
  3's) and the chat template.
- **Where it came from**: ``general.name``, ``general.base_model.*`` naming the base (names, never a path
  of this machine) and a description saying it was trained with lora_grpo.

The file is written to the path given; the caller places it (export.py writes it beside the target and
renames it into place).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf_check import gguf_package
from .loading import loading


class GGUFExportError(ValueError):
    """A model or tokenizer that cannot be written as a GGUF file: the message names what and the fix."""


@dataclass(frozen=True)
class Architecture:
    """What differs between the architectures written: llama.cpp's name, and whether q / k are permuted."""

    gguf_name: str
    rotary_rows_interleaved: bool


# By transformers' model_type. Others are refused by name (supported_architectures says which these are).
ARCHITECTURES = {
    "llama": Architecture(gguf_name="llama", rotary_rows_interleaved=True),
    "qwen2": Architecture(gguf_name="qwen2", rotary_rows_interleaved=False),
    "qwen3": Architecture(gguf_name="qwen3", rotary_rows_interleaved=False),
}
GGUF_TYPES = ("f16", "q8_0")
# The way out for what this export does not write, ending its refusals.
CONVERT_INSTEAD = (
    "write a transformers checkpoint with `lora-grpo merge RUN --out DIR` and convert that with llama.cpp's "
    "convert_hf_to_gguf.py"
)
# The rope_type values written: linear and yarn as llama.cpp's metadata, llama3 as its rope_freqs tensor
# (longrope's two factor tensors are not written).
ROPE_SCALING = ("linear", "yarn", "llama3")
# YaRN's optional numbers (transformers' rope_parameters key, the writer's method), written when the model sets them.
YARN_NUMBERS = (
    ("extrapolation_factor", "add_rope_scaling_yarn_ext_factor"),
    ("attention_factor", "add_rope_scaling_yarn_attn_factor"),
    ("beta_fast", "add_rope_scaling_yarn_beta_fast"),
    ("beta_slow", "add_rope_scaling_yarn_beta_slow"),
)
# Llama 3's split before the merges (its tokenizer.json's Split regex), which llama.cpp calls llama-bpe.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Provenance:
    """What the file says about where its weights came from: a name, the base's name and hub repository
    (when it has one), and a line for general.description."""

    name: str
    base_name: str
    base_repo: str | None
    description: str


@dataclass(frozen=True)
class WrittenGGUF:
    """What write_gguf wrote: the architecture, its pre-tokenizer, the tensors and the ones kept in float16
    in a q8_0 file."""

    architecture: str
    pre_tokenizer: str
    tensors: int
    kept_f16: tuple[str, ...]


def supported_architectures() -> str:
    return ", ".join(f"{name} ({ARCHITECTURES[name].gguf_name})" for name in ARCHITECTURES)


def architecture_of(config) -> Architecture:
    """The entry of ARCHITECTURES for a transformers config; GGUFExportError naming the supported ones."""
    found = ARCHITECTURES.get(config.model_type)
    if found is None:
        kind = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise GGUFExportError(
            f"exporting a {kind} (model_type {config.model_type!r}) as GGUF is not supported; supported "
            f"model types: {supported_architectures()}. For this model, {CONVERT_INSTEAD}"
        )
    return found


def write_gguf(
    model, tokenizer, path: str | Path, *, gguf_type: str, provenance: Provenance, pre: str | None = None
) -> WrittenGGUF:
    """Write `model` (a plain transformers causal LM, adapters merged) and `tokenizer` to the GGUF file
    `path`. `pre` overrides the pre-tokenizer name read from the tokenizer (a base read from a GGUF keeps
    its file's name: transformers' reader drops splits it does not know, such as SmolLM's digits)."""
    gguf = gguf_package()
    config = model.config
    arch = architecture_of(config)
    if gguf_type not in GGUF_TYPES:
        raise GGUFExportError(
            f"gguf_type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}; pick one of them"
        )
    pre = pre or pre_tokenizer_name(tokenizer)
    rows = model.get_input_embeddings().weight.shape[0]
    writer = gguf.GGUFWriter(str(path), arch.gguf_name)
    _general(writer, gguf, gguf_type, provenance)
    _hyperparameters(writer, gguf, config, rows)
    _tokenizer(writer, gguf, tokenizer, rows, pre)
    tensors, kept = _tensors(writer, gguf, model, arch, gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return WrittenGGUF(architecture=arch.gguf_name, pre_tokenizer=pre, tensors=tensors, kept_f16=tuple(kept))


def _general(writer, gguf, gguf_type: str, provenance: Provenance) -> None:
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(provenance.name)
    writer.add_description(provenance.description)
    writer.add_base_model_count(1)
    writer.add_base_model_name(0, provenance.base_name)
    if provenance.base_repo:
        organization, _, _ = provenance.base_repo.partition("/")
        writer.add_base_model_organization(0, organization)
        writer.add_base_model_repo_url(0, f"https://huggingface.co/{provenance.base_repo}")
    writer.add_tags(["lora_grpo", "GRPO", "lora"])
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def rope_parameters(config) -> dict:
    """The model's RoPE settings as transformers 5 names them (``rope_parameters``: rope_type, rope_theta and
    the scaling's numbers), also from a config of transformers 4 (``rope_scaling`` beside ``rope_theta``)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _hyperparameters(writer, gguf, config, rows: int) -> None:
    heads = config.num_attention_heads
    head_dim = _head_dim(config)
    rope = rope_parameters(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim * heads != config.hidden_size:
        # llama.cpp assumes hidden_size / heads unless told
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(rows)
    scaling = rope_scaling(config)
    # Llama 3's scaling has no metadata: the rope_freqs tensor (rope_factors) is all of it.
    if scaling in ("default", "llama3"):
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType(scaling))
    writer.add_rope_scaling_factor(float(rope["factor"]))
    if original := rope.get("original_max_position_embeddings"):
        writer.add_rope_scaling_orig_ctx_len(int(original))
    if scaling == "yarn":
        for key, add in YARN_NUMBERS:
            if rope.get(key) is not None:
                getattr(writer, add)(float(rope[key]))


def rope_scaling(config) -> str:
    """The model's RoPE scaling ("default" for none); GGUFExportError for one this export does not write."""
    scaling = rope_parameters(config)["rope_type"] or "default"
    if scaling != "default" and scaling not in ROPE_SCALING:
        raise GGUFExportError(
            f"the model's RoPE scaling {scaling!r} is not written by this export (it writes "
            f"{', '.join(ROPE_SCALING)}); for this model, {CONVERT_INSTEAD}"
        )
    return scaling


def rope_factors(config) -> np.ndarray | None:
    """Llama 3's RoPE scaling as llama.cpp reads it (its ``rope_freqs`` tensor): per frequency, what plain
    RoPE's frequency is divided by to give the model's. The model's frequencies are transformers' own
    (``ROPE_INIT_FUNCTIONS["llama3"]``); None for any other RoPE."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = rope_parameters(config)
    if rope["rope_type"] != "llama3":
        return None
    dim = _head_dim(config)
    plain = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return (plain / scaled.float()).numpy().astype(np.float32)


# ----------------------------------------------------------------------------- the tokenizer
def _pre_tokenizer(tokenizer) -> tuple[dict, dict]:
    """(the backend's tokenizer.json as a dict, its pre_tokenizer); GGUFExportError when the tokenizer
    is not a byte-level BPE one (the only kind llama.cpp's gpt2 model reads)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if (spec.get("model") or {}).get("type") != "BPE" or not any(s.get("type") == "ByteLevel" for s in steps):
        kind = (spec.get("model") or {}).get("type") or type(tokenizer).__name__
        raise GGUFExportError(
            f"the tokenizer is a {kind} tokenizer without byte-level pre-tokenization; this export writes "
            f"byte-level BPE tokenizers (gpt2-style: SmolLM2, Qwen2). For this model, {CONVERT_INSTEAD}"
        )
    return spec, pre


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name for how the tokenizer splits text before its merges (``tokenizer.ggml.pre``), read
    from its pre-tokenizer: GPT-2's regex alone (gpt-2), digits split one by one before it (smollm), Qwen2's
    regex (qwen2, also Qwen3's) or Llama 3's (llama-bpe). GGUFExportError naming the split for any other."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

    _, pre = _pre_tokenizer(tokenizer)
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    regex_byte_level = steps[-1].get("type") == "ByteLevel" and steps[-1].get("use_regex", True)
    if kinds == ["ByteLevel"] and regex_byte_level:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and regex_byte_level:
        return "smollm"
    split = (steps[0].get("pattern") or {}).get("Regex") if kinds == ["Split", "ByteLevel"] else None
    if split == QWEN2_SPLIT:
        return "qwen2"
    if split == LLAMA3_SPLIT:
        return "llama-bpe"
    raise GGUFExportError(
        f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}) is none this export knows llama.cpp's "
        f"name for (GPT-2's byte-level regex: gpt-2; digits then GPT-2's: smollm; Qwen2's split: qwen2; Llama "
        f"3's split: llama-bpe). For this tokenizer, {CONVERT_INSTEAD}"
    )


def _tokenizer(writer, gguf, tokenizer, rows: int, pre: str) -> None:
    spec, _ = _pre_tokenizer(tokenizer)
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if by_id and max(by_id) >= rows:
        raise GGUFExportError(
            f"the tokenizer has token id {max(by_id)} and the model's embeddings only {rows} rows: they do not "
            "belong together; export the tokenizer the model was trained with"
        )
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(rows):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[index])
        if index in added:
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for token_id, add in (
        (tokenizer.bos_token_id, writer.add_bos_token_id),
        (tokenizer.eos_token_id, writer.add_eos_token_id),
        (tokenizer.unk_token_id, writer.add_unk_token_id),
        (tokenizer.pad_token_id, writer.add_pad_token_id),
    ):
        if token_id is not None:
            add(token_id)
    # As the tokenizer does: what it puts around a text of its own accord.
    empty = tokenizer("", add_special_tokens=True)["input_ids"]
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and empty[:1] == [tokenizer.bos_token_id])
    writer.add_add_eos_token(tokenizer.eos_token_id is not None and empty[-1:] == [tokenizer.eos_token_id])
    writer.add_add_space_prefix(False)
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = [{"name": name, "template": text} for name, text in template.items()]
    if template:
        writer.add_chat_template(template)


# ----------------------------------------------------------------------------- the tensors
def _rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows (per head: first half, second half) in llama.cpp's order (per head: pairs interleaved)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tensors(writer, gguf, model, arch: Architecture, gguf_type: str) -> tuple[int, list[str]]:
    """Add every tensor of `model` under its GGUF name; returns how many, and the matrices a q8_0 file keeps
    in float16."""
    config = model.config
    gguf_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch.gguf_name)
    names = gguf.get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    known = set(gguf.MODEL_TENSORS[gguf_arch])
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    count, kept = 0, []
    if (factors := rope_factors(config)) is not None:
        writer.add_tensor(f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS]}.weight", factors)
        count += 1
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        found = names.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None or found[0] not in known:
            raise GGUFExportError(
                f"the model's tensor {hf_name} has no name in GGUF's {arch.gguf_name} architecture: this "
                f"{type(model).__name__} is not a plain {config.model_type} model; export the model as trained, "
                "merged (no extra modules)"
            )
        name = found[1]
        count += 1
        data = tensor.detach().float().cpu().numpy()
        if arch.rotary_rows_interleaved and ".attn_q." in name:
            data = _rotary_rows(data, heads)
        elif arch.rotary_rows_interleaved and ".attn_k." in name:
            data = _rotary_rows(data, kv_heads)
        if data.ndim == 1:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif (
            gguf_type == "q8_0"
            and data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0
        ):
            quant = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            if gguf_type == "q8_0":
                kept.append(name)
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float16))
    return count, kept


def check_exportable(path: str, trust_remote_code: bool = False) -> None:
    """Refuse (GGUFExportError) a base of an architecture or RoPE scaling this export does not write, from its
    config alone: before minutes of loading and merging."""
    from transformers import AutoConfig

    with loading("merge", "base model's config", path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    architecture_of(config)
    rope_scaling(config)
