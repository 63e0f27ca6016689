"""A merged transformers model and its tokenizer, written as one GGUF file that llama.cpp loads as a chat model.

Written with the gguf package's own pieces: ``GGUFWriter`` for the file, ``get_tensor_name_map`` /
``MODEL_TENSORS`` for the tensor names of the architecture, ``gguf.quants.quantize`` for Q8_0. What goes in:

- **The weights**, named as llama.cpp names them; matrices in float16 (``f16``) or Q8_0 (``q8_0``; a matrix
  whose rows are not a whole number of Q8_0 blocks stays float16), vectors (norms, biases) in float32, as
  llama.cpp's own converter does. No ``output.weight`` when the embeddings are tied. Of a multimodal model
  (Gemma 3 4B to 27B), the language model alone, as llama.cpp's converter writes it: the vision tower goes in
  llama.cpp's separate mmproj file, which this export does not write.
- **Llama's and Mistral's q and k rows in llama.cpp's rotary order**: llama.cpp rotates pairs of neighbouring
  rows where transformers rotates the two halves of each head, so its converter permutes q and k (per query
  head, per KV head) and transformers' GGUF reader (``LlamaTensorProcessor``) undoes exactly that. Qwen2, Qwen3,
  Gemma and Phi-3 need nothing (llama.cpp rotates halves for them too).
- **Gemma's norms plus one**: Gemma scales by 1 + weight, llama.cpp by the weight, so every RMS norm of Gemma 2
  and 3 is written as its weight plus one, as llama.cpp's converter does.
- **The architecture's numbers**: context length, embedding and feed-forward sizes, blocks, heads and KV
  heads, RoPE base and dimensions (Phi-4-mini rotates 3 / 4 of each head), RMS-norm epsilon, vocabulary
  size, and the RoPE scaling when set: linear or YaRN as metadata, Llama 3's (``rope_type: llama3``) as
  llama.cpp reads it, a ``rope_freqs`` tensor of what each frequency is divided by (the model's own
  frequencies against plain RoPE's), Phi-3's LongRoPE as its ``rope_factors_long`` / ``rope_factors_short``
  tensors and the scale of cos / sin. Each family's own (Architecture.family): Gemma 2's soft caps, Gemma 3's
  final soft cap and its sliding layers' RoPE base, the window and which layers slide, Phi-3's window. What
  llama.cpp would compute otherwise (a Gemma whose query scale is not the one llama.cpp takes, a soft cap
  llama.cpp's Gemma 2 or 3 applies differently) is refused by name, from the config before loading.
- **The tokenizer** (gguf_vocab.py): byte-level BPE as llama.cpp's ``gpt2`` model with the name of its split
  (SmolLM2, Qwen2 / 3, Llama 3), or sentencepiece BPE as its ``llama`` model with a score a token (Mistral,
  Gemma, Phi-3); the tokens and their types, the BOS / EOS / pad / unknown ids, whether it adds BOS, and the
  chat template.
- **Where it came from**: ``general.name``, ``general.base_model.*`` naming the base (names, never a path
  of this machine) and a description saying it was trained with lora_grpo.

The file is written to the path given; the caller places it (export.py writes it beside the target and
renames it into place).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from .gguf_check import gguf_package
from .gguf_vocab import CONVERT_INSTEAD, GGUFExportError, write_vocabulary
from .loading import loading


@dataclass(frozen=True)
class Architecture:
    """What differs between the architectures written: llama.cpp's name; whether q / k rows are permuted into
    llama.cpp's rotary order; what is added to every RMS norm's weight (Gemma's norms scale by 1 + weight,
    llama.cpp's by the weight); whether the head size is written even when it is hidden / heads (transformers'
    Gemma readers take 256 otherwise); the family's own checks and keys (``family(config, writer=None)``
    refuses what llama.cpp would compute otherwise, and with a writer adds the family's keys); whether a
    LongRoPE scaling is written (llama.cpp reads its two factor tensors for Phi-3 only); and, for a multimodal
    model, the name parts of its other towers' tensors, left out: its language model is written alone, as
    llama.cpp's converter writes it (the vision tower goes in llama.cpp's separate mmproj file)."""

    gguf_name: str
    rotary_rows_interleaved: bool = False
    norm_offset: float = 0.0
    head_size_always: bool = False
    family: Callable | None = None
    longrope: bool = False
    other_towers: tuple[str, ...] = ()


def _gemma_scale(config, name: str, layers_27b: int) -> None:
    """llama.cpp scales Gemma's queries by 1 / sqrt(head size), or by 1 / sqrt(hidden / heads) in the 27B model
    (told apart by its layer count), and reads no ``query_pre_attn_scalar``: refuse a model whose scalar is
    another."""
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    used = config.hidden_size // heads if layers == layers_27b else _head_dim(config)
    if config.query_pre_attn_scalar != used:
        raise GGUFExportError(
            f"this {name} model scales its queries by query_pre_attn_scalar {config.query_pre_attn_scalar}, and "
            f"llama.cpp by {used} (the head size; hidden / heads in the {layers_27b}-layer 27B model) whatever "
            f"the file says; for this model, {CONVERT_INSTEAD}"
        )


def _sliding_layers(writer, config) -> None:
    """The window and which layers slide (llama.cpp's pattern, as one flag a layer), from the model's own
    layer_types."""
    writer.add_sliding_window(int(config.sliding_window))
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])


def _gemma2(config, writer=None) -> None:
    """Gemma 2: both soft caps (llama.cpp caps attention and logits always, at 50 and 30 unless told), the
    window and which layers slide (llama.cpp reads the pattern; every other layer from the first unless told)."""
    if config.attn_logit_softcapping is None or config.final_logit_softcapping is None:
        raise GGUFExportError(
            "this gemma2 model leaves a logit soft cap unset (attn_logit_softcapping "
            f"{config.attn_logit_softcapping}, final_logit_softcapping {config.final_logit_softcapping}), and "
            f"llama.cpp's Gemma 2 always applies both; for this model, {CONVERT_INSTEAD}"
        )
    _gemma_scale(config, "gemma2", layers_27b=46)
    if writer is not None:
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        _sliding_layers(writer, config)


def _gemma3(config, writer=None, final_cap: bool = True) -> None:
    """Gemma 3: no attention soft cap (llama.cpp's Gemma 3 has none), the logits' cap when set and
    `final_cap` (transformers' multimodal Gemma3ForConditionalGeneration never caps, whatever its text config
    says: its file carries no cap), sliding layers with their own RoPE base and no scaling."""
    if config.attn_logit_softcapping is not None:
        raise GGUFExportError(
            f"this gemma3_text model caps its attention logits (attn_logit_softcapping "
            f"{config.attn_logit_softcapping}); llama.cpp's Gemma 3 does not; for this model, {CONVERT_INSTEAD}"
        )
    _gemma_scale(config, "gemma3_text", layers_27b=62)
    local = sliding_rope_parameters(config)
    if local["rope_type"] != "default":
        raise GGUFExportError(
            f"this gemma3_text model scales the RoPE of its sliding layers ({local['rope_type']!r}); llama.cpp's "
            f"Gemma 3 scales only the full-attention layers'; for this model, {CONVERT_INSTEAD}"
        )
    if writer is not None:
        if config.final_logit_softcapping and final_cap:
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))
        _sliding_layers(writer, config)


def _phi3(config, writer=None) -> None:
    """Phi-3: its window (which llama.cpp reads and, for Phi-3, does not apply: the file is exact for texts
    within the window, as llama.cpp's own conversion)."""
    if writer is not None:
        writer.add_sliding_window(int(config.sliding_window or 0))


# By transformers' model_type. Others are refused by name (supported_architectures says which these are).
# Mistral is llama.cpp's llama, as its converter writes it (a sliding window, Mistral 7B v0.1's, is not written).
ARCHITECTURES = {
    "llama": Architecture(gguf_name="llama", rotary_rows_interleaved=True),
    "mistral": Architecture(gguf_name="llama", rotary_rows_interleaved=True),
    "qwen2": Architecture(gguf_name="qwen2"),
    "qwen3": Architecture(gguf_name="qwen3"),
    "gemma2": Architecture(gguf_name="gemma2", norm_offset=1.0, head_size_always=True, family=_gemma2),
    "gemma3_text": Architecture(gguf_name="gemma3", norm_offset=1.0, head_size_always=True, family=_gemma3),
    # Gemma 3 4B to 27B: the language model of Gemma3ForConditionalGeneration.
    "gemma3": Architecture(
        gguf_name="gemma3",
        norm_offset=1.0,
        head_size_always=True,
        family=partial(_gemma3, final_cap=False),
        other_towers=("vision_tower.", "multi_modal_projector."),
    ),
    "phi3": Architecture(gguf_name="phi3", family=_phi3, longrope=True),
}
GGUF_TYPES = ("f16", "q8_0")
# The rope_type values written: linear and yarn as llama.cpp's metadata, llama3 as its rope_freqs tensor;
# longrope as its two factor tensors, for the architectures whose Architecture.longrope says so.
ROPE_SCALING = ("linear", "yarn", "llama3")
# YaRN's optional numbers (transformers' rope_parameters key, the writer's method), written when the model sets them.
YARN_NUMBERS = (
    ("extrapolation_factor", "add_rope_scaling_yarn_ext_factor"),
    ("attention_factor", "add_rope_scaling_yarn_attn_factor"),
    ("beta_fast", "add_rope_scaling_yarn_beta_fast"),
    ("beta_slow", "add_rope_scaling_yarn_beta_slow"),
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
    """What write_gguf wrote: the architecture, its vocabulary in words (llama.cpp's tokenizer model, and the
    pre-tokenizer of a byte-level one), the tensors and the ones kept in float16 in a q8_0 file."""

    architecture: str
    vocabulary: str
    tensors: int
    kept_f16: tuple[str, ...]


def supported_architectures() -> str:
    return ", ".join(f"{name} ({ARCHITECTURES[name].gguf_name})" for name in ARCHITECTURES)


def architecture_of(config) -> Architecture:
    """The entry of ARCHITECTURES for a transformers config, once the config passes its family's checks and its
    RoPE scaling is one written; GGUFExportError naming the supported ones or what llama.cpp would compute
    otherwise."""
    found = ARCHITECTURES.get(config.model_type)
    if found is None:
        kind = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise GGUFExportError(
            f"exporting a {kind} (model_type {config.model_type!r}) as GGUF is not supported; supported "
            f"model types: {supported_architectures()}. For this model, {CONVERT_INSTEAD}"
        )
    text = config.get_text_config()
    if found.family is not None:
        found.family(text)
    rope_scaling(text, found)
    return found


def write_gguf(
    model, tokenizer, path: str | Path, *, gguf_type: str, provenance: Provenance, pre: str | None = None
) -> WrittenGGUF:
    """Write `model` (a plain transformers causal LM, adapters merged) and `tokenizer` to the GGUF file
    `path`. `pre` overrides the pre-tokenizer name read from the tokenizer (a base read from a GGUF keeps
    its file's name: transformers' reader drops splits it does not know, such as SmolLM's digits)."""
    gguf = gguf_package()
    arch = architecture_of(model.config)
    config = model.config.get_text_config()
    if gguf_type not in GGUF_TYPES:
        raise GGUFExportError(
            f"gguf_type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}; pick one of them"
        )
    rows = model.get_input_embeddings().weight.shape[0]
    writer = gguf.GGUFWriter(str(path), arch.gguf_name)
    _general(writer, gguf, gguf_type, provenance)
    _hyperparameters(writer, gguf, config, arch, rows)
    vocabulary = write_vocabulary(writer, gguf, tokenizer, rows, pre)
    tensors, kept = _tensors(writer, gguf, model, arch, gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return WrittenGGUF(
        architecture=arch.gguf_name, vocabulary=vocabulary, tensors=tensors, kept_f16=tuple(kept)
    )


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


def rope_parameters(config, layers: str = "full_attention") -> dict:
    """The model's RoPE settings as transformers 5 names them (``rope_parameters``: rope_type, rope_theta and
    the scaling's numbers), also from a config of transformers 4 (``rope_scaling`` beside ``rope_theta``). A
    model whose layer kinds differ in RoPE (Gemma 3: ``rope_parameters`` by layer type) gives its full-attention
    layers' (those of `layers`)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if isinstance(rope.get(layers), dict):
        rope = dict(rope[layers])
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def sliding_rope_parameters(config) -> dict:
    """The RoPE of a model's sliding layers (Gemma 3's own base: ``rope_local_base_freq`` in transformers 4)."""
    if isinstance((getattr(config, "rope_parameters", None) or {}).get("sliding_attention"), dict):
        return rope_parameters(config, "sliding_attention")
    return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _hyperparameters(writer, gguf, config, arch: Architecture, rows: int) -> None:
    heads = config.num_attention_heads
    head_dim = _head_dim(config)
    rope = rope_parameters(config)
    rotary = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_dimension_count(int(head_dim * rotary))
    if head_dim * heads != config.hidden_size or arch.head_size_always:
        # llama.cpp assumes hidden_size / heads unless told
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(rows)
    if arch.family is not None:
        arch.family(config, writer)
    scaling = rope_scaling(config, arch)
    # Llama 3's scaling has no metadata: the rope_freqs tensor (rope_factors) is all of it.
    if scaling == "llama3":
        return
    # The context the RoPE was trained at, where the model says (Phi-3's config always does).
    original = rope.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", 0
    )
    if original:
        writer.add_rope_scaling_orig_ctx_len(int(original))
    if scaling == "default":
        return
    if scaling == "longrope":
        # As llama.cpp's converter writes it: no type and no factor (llama.cpp would divide every frequency by
        # it), the factor tensors (_tensors) and the scale of cos / sin, here transformers' own.
        writer.add_rope_scaling_attn_factors(longrope_factors(config)[1])
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType(scaling))
    writer.add_rope_scaling_factor(float(rope["factor"]))
    if scaling == "yarn":
        for key, add in YARN_NUMBERS:
            if rope.get(key) is not None:
                getattr(writer, add)(float(rope[key]))


def rope_scaling(config, arch: Architecture) -> str:
    """The model's RoPE scaling ("default" for none); GGUFExportError for one this export does not write for
    the architecture."""
    scaling = rope_parameters(config)["rope_type"] or "default"
    written = (*ROPE_SCALING, "longrope") if arch.longrope else ROPE_SCALING
    if scaling != "default" and scaling not in written:
        longrope = "" if arch.longrope else "; longrope for phi3 only"
        raise GGUFExportError(
            f"the model's RoPE scaling {scaling!r} is not written by this export (it writes "
            f"{', '.join(written)}{longrope}); for this model, {CONVERT_INSTEAD}"
        )
    return scaling


def longrope_factors(config) -> tuple[dict[str, np.ndarray], float]:
    """LongRoPE (Phi-3.5, Phi-3 128k, Phi-4-mini) as llama.cpp reads it: its ``rope_factors_long`` and
    ``rope_factors_short`` tensors (what each frequency is divided by beyond and within the original context)
    and the scale of cos / sin, which transformers computes (``ROPE_INIT_FUNCTIONS["longrope"]``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = rope_parameters(config)
    _, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    factors = {
        "rope_factors_long": np.asarray(rope["long_factor"], dtype=np.float32),
        "rope_factors_short": np.asarray(rope["short_factor"], dtype=np.float32),
    }
    return factors, float(attention_factor)


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


# ----------------------------------------------------------------------------- the tensors
def _rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows (per head: first half, second half) in llama.cpp's order (per head: pairs interleaved)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _language_model_name(hf_name: str) -> str:
    """A multimodal model's language-model tensor under the name of the text model's (transformers 5's
    ``model.language_model.X``, transformers 4's ``language_model.model.X`` and ``language_model.lm_head``)."""
    for prefix, plain in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.", ""),
    ):
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix) :]
    return hf_name


def _tensors(writer, gguf, model, arch: Architecture, gguf_type: str) -> tuple[int, list[str]]:
    """Add every tensor of `model` under its GGUF name; returns how many, and the matrices a q8_0 file keeps
    in float16."""
    config = model.config.get_text_config()
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
    if rope_scaling(config, arch) == "longrope":
        for name, data in longrope_factors(config)[0].items():
            writer.add_tensor(f"{name}.weight", data)
            count += 1
    for full_name, tensor in model.state_dict().items():
        if any(tower in full_name for tower in arch.other_towers):
            continue
        hf_name = _language_model_name(full_name)
        if tied and hf_name == "lm_head.weight":
            continue
        found = names.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None or found[0] not in known:
            raise GGUFExportError(
                f"the model's tensor {full_name} has no name in GGUF's {arch.gguf_name} architecture: this "
                f"{type(model).__name__} is not a plain {model.config.model_type} model; export the model as "
                "trained, merged (no extra modules)"
            )
        name = found[1]
        count += 1
        data = tensor.detach().float().cpu().numpy()
        if arch.rotary_rows_interleaved and ".attn_q." in name:
            data = _rotary_rows(data, heads)
        elif arch.rotary_rows_interleaved and ".attn_k." in name:
            data = _rotary_rows(data, kv_heads)
        if arch.norm_offset and hf_name.endswith("norm.weight"):
            data = data + arch.norm_offset
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
