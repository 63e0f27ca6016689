"""GGUF export of the sentencepiece families: tiny Mistral, Gemma 2, Gemma 3 and Phi-3 models with a
sentencepiece BPE tokenizer (byte fallback, ``▁`` for a space; with a space put before a text as Llama 2, Mistral
and Phi-3 do, or not, as Gemma), written and read back: the metadata each family needs, the weights (Gemma's
norms as llama.cpp scales them), the tokens as llama.cpp's sentencepiece algorithm makes them from the file's
scores (written out here from llama.cpp's description), transformers' own read-back, a trained run through the
CLI, and the models llama.cpp would compute otherwise, refused by name."""

import json

import numpy as np
import pytest
import torch
from helpers import tiny_config
from test_gguf_export import (
    CHATML,
    F16_BOUND,
    ROUNDED_BOUND,
    fields,
    logits,
    merged_reference,
    read_back,
    rounded,
    train_two_steps,
    write,
)
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from lora_grpo import export_gguf
from lora_grpo.cli import main
from lora_grpo.model.gguf_vocab import GGUFExportError, sentencepiece_scores, vocabulary_of

gguf = pytest.importorskip("gguf")

SPACE = "\u2581"
CHARACTERS = [SPACE, *"abcdefghijklmnopqrstuvwxyzAQ0123456789+=?,.:"]
# Tokens made by joining two tokens, in the order of their merges (a sentencepiece model's score order).
JOINED = [
    *(SPACE + "t", "he", SPACE + "the", SPACE + "a", "in", "12", SPACE + "1", "pp", "le", SPACE + "app"),
    *(SPACE + "apple", "th", "en", SPACE + "then", "ll", "ello", "hello", SPACE + "o", SPACE + "ok", "wo"),
    *(SPACE + "tw", SPACE + "two", "ap", "ple", "apple"),
]
SPECIALS = ["<|im_start|>", "<|im_end|>"]
# Spaces in runs, bytes outside the vocabulary (two, three and four of them a character), ties of score.
SPM_TEXTS = (
    "the 12 apples, then 1 more",
    "héllo wörld 世界 🙂 — ok?\n\n  two  spaces\ttab",
    "apple  the apple",
    "Q: 12+1= A: 13",
)
# Gemma's query scale and a window narrower than the texts, so that both layer kinds differ.
GEMMA = dict(
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
)
FAMILIES = {
    "mistral": dict(space_prefix=True, config=dict(sliding_window=None)),
    # Soft caps low enough to bite on a tiny model's logits; the full layer first, not llama.cpp's default for
    # Gemma 2 (every other layer sliding from the first), so that the file must say which layers slide.
    "gemma2": dict(
        space_prefix=False,
        config=GEMMA
        | dict(
            attn_logit_softcapping=2.0,
            final_logit_softcapping=1.5,
            layer_types=["full_attention", "sliding_attention"],
        ),
    ),
    # The sliding layers' RoPE base not llama.cpp's default (10000), so that the file must say it.
    "gemma3_text": dict(
        space_prefix=False,
        config=GEMMA
        | dict(
            final_logit_softcapping=1.5,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    "phi3": dict(space_prefix=True, config=dict(sliding_window=None, original_max_position_embeddings=128)),
}
# Gemma 3 4B to 27B: Gemma3ForConditionalGeneration, the tiny Gemma 3 as its language model beside a vision tower.
FAMILIES["gemma3"] = FAMILIES["gemma3_text"]
GGUF_NAMES = {
    "mistral": "llama",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "phi3": "phi3",
}


def sentencepiece_tokenizer(space_prefix: bool, byte_fallback: bool = True) -> PreTrainedTokenizerFast:
    """A sentencepiece BPE tokenizer as transformers writes one into tokenizer.json: the tokens, the bytes
    ``<0x00>`` ... ``<0xFF>``, and every split of a joined token into two tokens as a merge, in the joined
    tokens' order. `space_prefix`: ``▁`` before a text (Metaspace, as Llama 2, Mistral and Phi-3), else spaces
    only replaced (as Gemma). BOS before every text, ChatML specials, a user-defined <think>."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *CHARACTERS, *JOINED]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    merges = [
        (token[:cut], token[cut:])
        for token in JOINED
        for cut in range(1, len(token))
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=byte_fallback, unk_token="<unk>", fuse_unk=True)
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence(steps)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        additional_special_tokens=SPECIALS,
    )
    tokenizer.add_tokens(["<think>"])
    tokenizer.chat_template = CHATML.replace("<|im_end|>\n", "<|im_end|>")
    return tokenizer


def family_model(family: str, rows: int, **fields):
    """A tiny model of `family` (2 layers, hidden 64, 4 heads, 2 KV heads; `fields` on top of FAMILIES'), its
    norms moved off their initial values so that a norm written without Gemma's offset shows in the logits.
    "gemma3": a Gemma3ForConditionalGeneration whose language model is the tiny Gemma 3."""
    torch.manual_seed(4)
    sizes = dict(
        num_hidden_layers=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    config = tiny_config(family, rows, **(sizes | FAMILIES[family]["config"] | fields))
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def phi3_longrope(rows: int):
    """A tiny Phi-3 with LongRoPE over 3 / 4 of each head (Phi-4-mini's), an original context of 256 of 1024:
    factors short and long far apart, so that which one applies shows in the logits."""
    rope = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        partial_rotary_factor=0.75,
        long_factor=[1.0 + 3.0 * i for i in range(6)],
        short_factor=[1.0 + 0.5 * i for i in range(6)],
    )
    return family_model(
        "phi3",
        rows,
        max_position_embeddings=1024,
        original_max_position_embeddings=256,
        partial_rotary_factor=0.75,
        rope_parameters=rope,
    )


def llama_cpp_sentencepiece(
    text: str, tokens: list[str], scores: list[float], space_prefix: bool
) -> list[int]:
    """llama.cpp's sentencepiece tokenizer over a file's vocabulary (llm_tokenizer_spm): spaces as ``▁`` (one
    before the text when the file says so), the text's characters as symbols; again and again the neighbouring
    pair whose joined text is a token of the highest score (the leftmost of equals) is joined; a symbol that is no
    token is spelled in its UTF-8 bytes' ``<0xXX>`` tokens."""
    ids = {token: index for index, token in enumerate(tokens)}
    text = (" " + text if space_prefix else text).replace(" ", SPACE)
    symbols = list(text)
    while True:
        best = None
        for left in range(len(symbols) - 1):
            joined = symbols[left] + symbols[left + 1]
            if joined in ids and (best is None or scores[ids[joined]] > scores[ids[best[1]]]):
                best = (left, joined)
        if best is None:
            break
        symbols[best[0] : best[0] + 2] = [best[1]]
    out = []
    for symbol in symbols:
        out += [ids[symbol]] if symbol in ids else [ids[f"<0x{byte:02X}>"] for byte in symbol.encode()]
    return out


def read_back_as(path, config):
    """transformers' GGUF load of the file's weights and tokenizer; a Gemma's weights into its own `config`'s
    language model (transformers' Gemma readers take neither the query scale nor the layer pattern from a
    file). A multimodal Gemma 3's language model uncapped, as transformers' Gemma3ForConditionalGeneration runs
    it."""
    import copy

    text = copy.deepcopy(config.get_text_config())
    if config.model_type == "gemma3":
        text.final_logit_softcapping = None
    return read_back(path, text if text.model_type.startswith("gemma") else None)


# ------------------------------------------------------------------------------------- the vocabulary


def test_a_token_scores_minus_the_rank_of_its_first_merge_and_others_score_below_all():
    merges = [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]
    assert sentencepiece_scores(["a", "ab", "abc", "bc", "<0x41>"], merges) == [-4.0, 0.0, -1.0, -3.0, -4.0]


@pytest.mark.parametrize("space_prefix", [True, False])
def test_llama_cpps_algorithm_over_the_files_scores_gives_the_tokenizers_tokens(tmp_path, space_prefix):
    tokenizer = sentencepiece_tokenizer(space_prefix)
    path = tmp_path / "spm.gguf"
    written = write(family_model("mistral", len(tokenizer)), tokenizer, path)
    assert written.vocabulary == f"llama (sentencepiece, {'a' if space_prefix else 'no'} space before a text)"
    found, _ = fields(path)
    tokens, scores = found["tokenizer.ggml.tokens"], found["tokenizer.ggml.scores"]
    assert found["tokenizer.ggml.model"] == "llama" and found["tokenizer.ggml.pre"] == "default"
    assert found["tokenizer.ggml.add_space_prefix"] is space_prefix
    assert found["tokenizer.ggml.add_bos_token"] is True and found["tokenizer.ggml.add_eos_token"] is False
    assert tokens == list(tokenizer.convert_ids_to_tokens(range(len(tokenizer))))
    types = found["tokenizer.ggml.token_type"]
    kinds = gguf.TokenType
    assert types[0] == kinds.UNKNOWN and types[3] == types[3 + 255] == kinds.BYTE  # <0x00>, <0xFF>
    assert types[tokens.index("<|im_start|>")] == kinds.CONTROL
    assert (
        types[tokens.index("<think>")] == kinds.USER_DEFINED and types[tokens.index("▁the")] == kinds.NORMAL
    )
    for text in SPM_TEXTS:
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert llama_cpp_sentencepiece(text, tokens, scores, space_prefix) == expected, text
        spelled = tokenizer.convert_ids_to_tokens(expected)
        assert (
            text != SPM_TEXTS[1] or sum(piece.startswith("<0x") for piece in spelled) == 20
        )  # byte fallback


def test_a_bpe_without_byte_fallback_is_refused_by_name():
    with pytest.raises(
        GGUFExportError, match="the tokenizer is a BPE tokenizer without byte fallback of neither"
    ):
        vocabulary_of(sentencepiece_tokenizer(space_prefix=True, byte_fallback=False))


# ------------------------------------------------------------------------------------- the families


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_reads_back_as_the_model_stored_with_its_keys(tmp_path, family):
    tokenizer = sentencepiece_tokenizer(FAMILIES[family]["space_prefix"])
    model = family_model(family, len(tokenizer))
    path = tmp_path / f"{family}.gguf"
    written = write(model, tokenizer, path)
    arch = GGUF_NAMES[family]
    assert written.architecture == arch
    found, tensors = fields(path)
    assert found["general.architecture"] == arch and found[f"{arch}.block_count"] == 2
    expected = {
        "mistral": {"llama.rope.dimension_count": 16},
        "gemma2": {
            "gemma2.attention.key_length": 16,
            "gemma2.attn_logit_softcapping": 2.0,
            "gemma2.final_logit_softcapping": 1.5,
            "gemma2.attention.sliding_window": 4,
            "gemma2.attention.sliding_window_pattern": [False, True],
        },
        "gemma3_text": {
            "gemma3.attention.key_length": 16,
            "gemma3.rope.freq_base": 1e6,
            "gemma3.rope.freq_base_swa": 100.0,
            "gemma3.final_logit_softcapping": 1.5,
            "gemma3.attention.sliding_window": 4,
            "gemma3.attention.sliding_window_pattern": [True, False],
        },
        "phi3": {"phi3.rope.scaling.original_context_length": 128, "phi3.attention.sliding_window": 0},
    }["gemma3_text" if family == "gemma3" else family]
    if family == "gemma3":  # transformers' Gemma3ForConditionalGeneration never caps its logits
        del expected["gemma3.final_logit_softcapping"]
        assert "gemma3.final_logit_softcapping" not in found
    assert {key: found.get(key) for key in expected} == expected
    assert "gemma3.attn_logit_softcapping" not in found
    if family.startswith("gemma"):
        # Gemma scales by 1 + weight, llama.cpp by the weight: the file's norms are the model's plus one.
        reader = gguf.GGUFReader(str(path))
        stored = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
        hf = model.get_decoder().layers[0].input_layernorm.weight.detach().numpy()
        assert np.allclose(np.asarray(stored.data), hf + 1.0, atol=1e-6)
        assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= set(tensors)
        # The language model's alone (no vision tower, no projector): 11 a layer, Gemma 3's q / k norms 13
        assert len(tensors) == 2 + 2 * (11 if family == "gemma2" else 13)
    back, back_tokenizer = read_back_as(path, model.config)
    ids = tokenizer(" ".join(SPM_TEXTS))["input_ids"]
    assert len(ids) > 20  # past the window of 4
    assert torch.allclose(logits(back, ids), logits(rounded(model, "f16"), ids), atol=ROUNDED_BOUND)
    for text in SPM_TEXTS:
        assert back_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text


@pytest.mark.parametrize(
    "family, change, refusal",
    [
        (
            "gemma2",
            dict(attn_logit_softcapping=None),
            "this gemma2 model leaves a logit soft cap unset (attn_logit_softcapping None, final_logit_softcapping "
            "1.5), and llama.cpp's Gemma 2 always applies both",
        ),
        (
            "gemma2",
            dict(query_pre_attn_scalar=256),
            "this gemma2 model scales its queries by query_pre_attn_scalar 256, and llama.cpp by 16 (the head size",
        ),
        (
            "gemma3_text",
            dict(attn_logit_softcapping=30.0),
            "this gemma3_text model caps its attention logits (attn_logit_softcapping 30.0); llama.cpp's Gemma 3 "
            "does not",
        ),
    ],
)
def test_a_model_llama_cpp_would_compute_otherwise_is_refused_before_loading(
    tmp_path, capsys, monkeypatch, family, change, refusal
):
    from peft import LoraConfig, get_peft_model

    import lora_grpo.export

    tokenizer = sentencepiece_tokenizer(space_prefix=False)
    model = family_model(family, len(tokenizer))
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(GGUFExportError) as refused:
        write(model, tokenizer, tmp_path / "refused.gguf")
    assert str(refused.value).startswith(refusal) and "`lora-grpo merge RUN --out DIR`" in str(refused.value)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")

    def loaded(*args, **kwargs):
        raise AssertionError("the base was loaded before the refusal")

    monkeypatch.setattr(lora_grpo.export, "merge_policy", loaded)
    out = tmp_path / "refused.gguf"
    base = f"model_name_or_path={tmp_path / 'base'}"
    assert main(["export", str(tmp_path / "adapter"), "--gguf", str(out), "--set", base]) == 1
    err = capsys.readouterr().err
    assert refusal in err and "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("family", ["gemma3_text", "gemma3"])
def test_a_gemma3_base_trains_through_the_cli_and_its_run_exports_as_its_merged_policy(tmp_path, family):
    """The whole path on Gemma 3 (1B's text model, and 4B-27B's with a vision tower) with a sentencepiece
    tokenizer: two GRPO steps through the CLI, the run exported and read back as peft's own merge of its
    adapter."""
    tokenizer = sentencepiece_tokenizer(space_prefix=False)
    family_model(family, len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    run = train_two_steps(tmp_path, str(tmp_path / "base"))
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    exported = export_gguf(run, tmp_path / "gemma3.gguf")
    assert exported.merge_gap < 1e-4 and "gemma3" in exported.summary
    assert "tokenizer llama (sentencepiece, no space before a text)" in exported.summary
    merged = merged_reference(str(tmp_path / "base"), run / "adapter")
    back, _ = read_back_as(tmp_path / "gemma3.gguf", merged.config)
    ids = tokenizer("Q: 12+1= A: 13 then the apple")["input_ids"]
    from_file = logits(back, ids)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    assert (from_file - logits(merged, ids)).abs().max() < F16_BOUND
    assert (from_file - logits(base, ids)).abs().max() > 20 * F16_BOUND  # the trained adapter is in the file


def test_phi3_longrope_is_written_as_llama_cpps_two_factor_tensors_and_cos_sin_scale(tmp_path):
    import math

    tokenizer = sentencepiece_tokenizer(space_prefix=True)
    model = phi3_longrope(len(tokenizer))
    path = tmp_path / "phi3.gguf"
    write(model, tokenizer, path)
    found, _ = fields(path)
    assert found["phi3.rope.dimension_count"] == 12 and found["phi3.context_length"] == 1024
    assert found["phi3.rope.scaling.original_context_length"] == 256
    # sqrt(1 + ln(1024 / 256) / ln 256) = 1.1180: the scale for a context 4 times the original, as Phi-3 computes it
    assert math.isclose(
        found["phi3.rope.scaling.attn_factor"], math.sqrt(1 + math.log(4) / math.log(256)), rel_tol=1e-6
    )
    # No type and no factor: llama.cpp would divide every frequency by the factor
    assert "phi3.rope.scaling.type" not in found and "phi3.rope.scaling.factor" not in found
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    rope = model.config.rope_parameters
    for kind in ("long", "short"):
        stored = tensors[f"rope_factors_{kind}.weight"]
        assert stored.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.asarray(stored.data).tolist() == rope[f"{kind}_factor"]


def test_longrope_is_refused_for_an_architecture_llama_cpp_reads_it_not_for(tmp_path):
    from transformers import LlamaForCausalLM

    tokenizer = sentencepiece_tokenizer(space_prefix=True)
    rope = dict(rope_type="longrope", rope_theta=1e4, long_factor=[2.0] * 8, short_factor=[1.0] * 8)
    config = tiny_config(
        "llama",
        len(tokenizer),
        num_hidden_layers=1,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        rope_parameters=rope,
    )
    with pytest.raises(GGUFExportError) as refused:
        write(LlamaForCausalLM(config), tokenizer, tmp_path / "llama.gguf")
    assert str(refused.value).startswith(
        "the model's RoPE scaling 'longrope' is not written by this export (it writes linear, yarn, llama3; "
        "longrope for phi3 only)"
    )
