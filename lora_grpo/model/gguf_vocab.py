"""A transformers tokenizer written as the vocabulary llama.cpp reads from a GGUF file (its ``tokenizer.*`` keys).

Two kinds, told apart by the tokenizer's own model (its tokenizer.json), each one record of VOCABULARIES:

- **Byte-level BPE** (llama.cpp's ``gpt2`` model: SmolLM2, Qwen2 / 3, Llama 3): the tokens, the merges and the
  name of the split before the merges (``tokenizer.ggml.pre``: GPT-2's regex, SmolLM's digits, Qwen2's or Llama
  3's regex).
- **SentencePiece BPE** (llama.cpp's ``llama`` model: Llama 2, Mistral, Gemma, Phi-3): tokens spelled with ``▁``
  for a space and ``<0xXX>`` for the bytes of a character the vocabulary lacks. llama.cpp does not read merges for
  it: it joins, again and again, the neighbouring pair whose joined text is the token of highest score (the
  leftmost of equals), then spells what is left in bytes. A tokenizer.json has merges, not sentencepiece's scores,
  so a token's score here is minus the rank of the first merge that makes it: llama.cpp then joins in the merges'
  order. (transformers' tokenizer.json of a sentencepiece model lists, for each token in its score's order, every
  split of it into two tokens: a pair whose text is a token is a merge, so the two rules agree.) A token no merge
  makes gets a score below all of them. The merges are written as well, for readers that take them (transformers).
  Whether llama.cpp puts a ``▁`` before a text (``add_space_prefix``) is read off what the tokenizer does to "a".

Both: every row of the embeddings one token (an id the tokenizer lacks as an unused ``[PAD{id}]``), added tokens
typed control when special and user-defined otherwise, the BOS / EOS / unknown / pad ids, whether the tokenizer
adds BOS or EOS to a text of its own accord, and the chat template.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass


class GGUFExportError(ValueError):
    """A model or tokenizer that cannot be written as a GGUF file: the message names what and the fix."""


# The way out for what this export does not write, ending its refusals.
CONVERT_INSTEAD = (
    "write a transformers checkpoint with `lora-grpo merge RUN --out DIR` and convert that with llama.cpp's "
    "convert_hf_to_gguf.py"
)
SPACE = "\u2581"
BYTE_TOKENS = tuple(f"<0x{byte:02X}>" for byte in range(256))
# Llama 3's split before the merges (its tokenizer.json's Split regex), which llama.cpp calls llama-bpe.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Vocabulary:
    """One kind of tokenizer llama.cpp reads: its ``tokenizer.ggml.model``, whether a tokenizer is of this kind
    (from its tokenizer.json), and what is written for it beyond the common keys (``write`` returns the words
    the export prints)."""

    model: str
    matches: Callable[[dict], bool]
    write: Callable


def _pre_tokenizer_steps(spec: dict) -> list[dict]:
    pre = spec.get("pre_tokenizer") or {}
    return pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]


def _is_byte_level(spec: dict) -> bool:
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and any(
        s.get("type") == "ByteLevel" for s in _pre_tokenizer_steps(spec)
    )


def _is_sentencepiece(spec: dict) -> bool:
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    return (
        model.get("type") == "BPE"
        and bool(model.get("byte_fallback"))
        and not _is_byte_level(spec)
        and all(token in vocab for token in BYTE_TOKENS)
    )


def backend_spec(tokenizer) -> dict:
    """The tokenizer's tokenizer.json, as a dict ({} for a tokenizer without a tokenizers backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()) if backend is not None else {}


def vocabulary_of(tokenizer, spec: dict | None = None) -> Vocabulary:
    """The entry of VOCABULARIES the tokenizer is; GGUFExportError naming what it is otherwise. `spec`: its
    backend_spec where the caller has it (a large vocabulary's takes a quarter of a second to serialise)."""
    spec = backend_spec(tokenizer) if spec is None else spec
    for vocabulary in VOCABULARIES:
        if vocabulary.matches(spec):
            return vocabulary
    model = spec.get("model") or {}
    kind = model.get("type") or type(tokenizer).__name__
    detail = " without byte fallback" if kind == "BPE" and not model.get("byte_fallback") else ""
    raise GGUFExportError(
        f"the tokenizer is a {kind} tokenizer{detail} of neither kind llama.cpp reads that this export writes: "
        "byte-level BPE (gpt2-style: SmolLM2, Qwen2, Llama 3) or sentencepiece BPE with byte fallback (Llama 2, "
        f"Mistral, Gemma, Phi-3). For this model, {CONVERT_INSTEAD}"
    )


def pre_tokenizer_name(tokenizer, spec: dict | None = None) -> str:
    """llama.cpp's name for how a byte-level tokenizer splits text before its merges (``tokenizer.ggml.pre``),
    read from its pre-tokenizer: GPT-2's regex alone (gpt-2), digits split one by one before it (smollm), Qwen2's
    regex (qwen2, also Qwen3's) or Llama 3's (llama-bpe). GGUFExportError naming the split for any other.
    `spec`: as vocabulary_of's."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

    spec = backend_spec(tokenizer) if spec is None else spec
    if vocabulary_of(tokenizer, spec).model != "gpt2":
        raise GGUFExportError(
            "a sentencepiece tokenizer has no pre-tokenizer name: llama.cpp does not split its text"
        )
    steps = _pre_tokenizer_steps(spec)
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


def merges_of(spec: dict) -> list[tuple[str, str]]:
    """The tokenizer.json's merges as pairs (it writes them as "a b" strings or as [a, b] lists)."""
    return [
        tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["model"].get("merges", [])
    ]


def sentencepiece_scores(tokens: list[str], merges: list[tuple[str, str]]) -> list[float]:
    """Per token, the score llama.cpp's sentencepiece tokenizer ranks joins by: minus the rank of the first merge
    that makes the token; below every merge for a token none makes."""
    rank: dict[str, int] = {}
    for index, (left, right) in enumerate(merges):
        rank.setdefault(left + right, index)
    lowest = -float(len(merges))
    return [-float(rank[token]) if token in rank else lowest for token in tokens]


def _pieces(tokenizer, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])


def _byte_level(writer, gguf, tokenizer, spec: dict, tokens: list[str], types: list, pre: str | None) -> str:
    pre = pre or pre_tokenizer_name(tokenizer, spec)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in merges_of(spec)])
    writer.add_add_space_prefix(False)
    return f"gpt2, pre-tokenizer {pre}"


def _sentencepiece(
    writer, gguf, tokenizer, spec: dict, tokens: list[str], types: list, pre: str | None
) -> str:
    if SPACE not in "".join(_pieces(tokenizer, "a b")):
        raise GGUFExportError(
            f"the tokenizer is a sentencepiece BPE that does not spell a space as {SPACE!r} (llama.cpp's sentencepiece "
            f"tokenizer does); for this tokenizer, {CONVERT_INSTEAD}"
        )
    merges = merges_of(spec)
    space_prefix = _pieces(tokenizer, "a")[0].startswith(SPACE)
    bytes_ = set(BYTE_TOKENS)
    types = [gguf.TokenType.BYTE if token in bytes_ else kind for token, kind in zip(tokens, types)]
    if tokenizer.unk_token_id is not None:
        types[tokenizer.unk_token_id] = gguf.TokenType.UNKNOWN
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(sentencepiece_scores(tokens, merges))
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_add_space_prefix(space_prefix)
    return f"llama (sentencepiece, {'a' if space_prefix else 'no'} space before a text)"


VOCABULARIES = (
    Vocabulary(model="gpt2", matches=_is_byte_level, write=_byte_level),
    Vocabulary(model="llama", matches=_is_sentencepiece, write=_sentencepiece),
)


def write_vocabulary(writer, gguf, tokenizer, rows: int, pre: str | None = None) -> str:
    """Add the tokenizer's keys for a model of `rows` embedding rows; returns what was written, in words.
    `pre` overrides a byte-level tokenizer's split name read from the tokenizer."""
    spec = backend_spec(tokenizer)
    vocabulary = vocabulary_of(tokenizer, spec)
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
    written = vocabulary.write(writer, gguf, tokenizer, spec, tokens, types, pre)
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
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = [{"name": name, "template": text} for name, text in template.items()]
    if template:
        writer.add_chat_template(template)
    return written
