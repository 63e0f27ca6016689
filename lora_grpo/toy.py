"""The offline toy task and tiny base model, used by the default recipe and the tests.

Everything here is built locally: a character-level tokenizer and a small Qwen2-style causal LM.
Nothing is downloaded.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# One token per character. "<think>" etc. are spelled out character by character.
CHARS = list("0123456789+-*=?:. \n<>/abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,!'()")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with <pad>=0, <eos>=1, <unk>=2 and a tiny chat template."""
    vocab = {t: i for i, t in enumerate([PAD, EOS, UNK] + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 256,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2-style model sized for the tokenizer (deterministic by seed)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


def save_tiny_base(path, **model_kwargs) -> str:
    """Write a tiny random model and its tokenizer to ``path`` (loadable by from_pretrained)."""
    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
