"""The offline toy task and tiny base model, used by the default recipe and the tests.

Everything here is built locally: a character-level tokenizer and a small Llama-style causal LM
(the Qwen2 block without its q/k/v biases). Not a Qwen2 config on purpose: transformers 5 loads
every qwen2 checkpoint's tokenizer as Qwen2Tokenizer (byte-level BPE), which would silently
replace this character tokenizer when the saved model is loaded back with AutoTokenizer.
Nothing is downloaded.

The toy task is two-digit addition ("57+68=" -> "125"). ``ensure_toy_base`` pre-trains a ~0.5M
parameter model on it in well under a minute of CPU, on deliberately wrong targets (carries
dropped 65% of the time), and caches it; ``toy_problems``, ``toy_reward`` and ``greedy_accuracy``
are the data, reward and metric a GRPO run uses to fix it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..base_cache import default_cache_dir
from ..rollout import generate_rollout
from .pretrain import (
    BASE_FILES,
    base_dirname,
    base_problem,
    base_settings,
    ensure_cached_base,
    pretrain_tiny_model,
)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# One token per character. "<think>" etc. are spelled out character by character.
CHARS = list("0123456789+-*=?:. \n<>/abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,!'()")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tokenizer(chars: list[str] = CHARS, chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with <pad>=0, <eos>=1, <unk>=2, then one id per character of
    `chars`, and a tiny chat template (the calculator task passes its own characters and template)."""
    vocab = {t: i for i, t in enumerate([PAD, EOS, UNK] + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tok.chat_template = chat_template
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
) -> LlamaForCausalLM:
    """A randomly initialised Llama-style model sized for the tokenizer (deterministic by seed)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
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
    return LlamaForCausalLM(config)


def save_tiny_base(path, **model_kwargs) -> str:
    """Write a tiny random model and its tokenizer to ``path`` (loadable by from_pretrained)."""
    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------------------------------------
# The toy task: two-digit addition, prompt "07+45=", completion "052<eos>" (3 digits, zero-padded).
#
# Why this task: the pretraining targets carry a *systematic* error. With probability ``noise``
# a problem's target is its carry-free sum (each column mod 10: "57+68=" -> "15" instead of
# "125"). For problems without any carry both targets agree; for problems with a carry (~70% of
# pairs) a well-fit model puts ~noise on the wrong answer and ~(1 - noise) on the right one. With
# noise > 0.5 greedy decoding picks the wrong answer on carry problems (base greedy accuracy
# ~35-40%, the no-carry share plus a few) while sampling at temperature 1 still finds the right
# answer often (pass@8 ~0.9), which is exactly the signal GRPO needs: it only has to flip one
# well-separated preference, the same one on every carry problem.
# ---------------------------------------------------------------------------------------------

TOY_FORMAT_VERSION = 2  # bump when the task or the training code changes what a seed produces
NUM_DIGITS = 2  # operands are 00..99, written zero-padded so every prompt has the same length
EVAL_PERCENT = 20  # share of (a, b) pairs held out for evaluation, chosen by a hash of the pair


@functools.cache
def _split_pairs(split: str) -> tuple[tuple[int, int], ...]:
    """The operand pairs of a split: the EVAL_PERCENT% of all pairs with the smallest hash are held
    out (a fixed set, independent of any seed), the rest are train; both in ascending order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    top = 10**NUM_DIGITS
    pairs = [(a, b) for a in range(top) for b in range(top)]
    ranked = sorted(pairs, key=lambda p: hashlib.sha256(f"{p[0]}+{p[1]}".encode()).digest())
    n_eval = len(pairs) * EVAL_PERCENT // 100
    chosen = ranked[:n_eval] if split == "eval" else ranked[n_eval:]
    return tuple(sorted(chosen))


def format_prompt(a: int, b: int) -> str:
    """The prompt text of one problem, e.g. ``format_prompt(7, 45) == "07+45="``."""
    return f"{a:0{NUM_DIGITS}d}+{b:0{NUM_DIGITS}d}="


def format_completion(value: int) -> str:
    """The target completion text (before <eos>) of a sum: zero-padded to a fixed width, "052".

    A fixed width gives every answer digit a fixed position, which a tiny model learns much faster.
    """
    return f"{value:0{NUM_DIGITS + 1}d}"


def carry_free_sum(a: int, b: int) -> int:
    """Column-wise sum with every carry dropped: ``carry_free_sum(57, 68) == 15`` (not 125)."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def toy_problems(n: int, seed: int = 0, split: str = "train"):
    """``n`` addition problems as a ``datasets.Dataset`` with columns "prompt" and "answer".

    "prompt" is plain text such as "07+45=", "answer" the correct sum as a string ("52"). Train and
    eval draw from disjoint sets of operand pairs (a fixed hash-based 80/20 split). Deterministic
    by ``seed``; pairs are distinct while ``n`` is at most the split's size (8000 / 2000 pairs),
    beyond that they repeat.
    """
    import datasets

    pairs = _split_pairs(split)
    gen = torch.Generator().manual_seed(seed)
    if n <= len(pairs):
        idx = torch.randperm(len(pairs), generator=gen)[:n]
    else:
        idx = torch.randint(len(pairs), (n,), generator=gen)
    chosen = [pairs[i] for i in idx.tolist()]
    return datasets.Dataset.from_dict(
        {"prompt": [format_prompt(a, b) for a, b in chosen], "answer": [str(a + b) for a, b in chosen]}
    )


_ANSWER_RE = re.compile(r"\s*(-?\d+)\s*")


def parse_answer(completion) -> int | None:
    """The integer a completion states, or None when it is not exactly one integer.

    Text after an end-of-sequence marker is ignored, so "52", " 52\\n" and "52<eos><pad>" all give
    52, while "5 2", "52x" and "" give None. A conversational completion (a list of messages) is
    read from its last message's content.
    """
    if isinstance(completion, list):
        completion = completion[-1]["content"] if completion else ""
    text = str(completion).split(EOS, 1)[0].replace(PAD, "")
    match = _ANSWER_RE.fullmatch(text)
    return int(match.group(1)) if match else None


def toy_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """Correctness reward: 1.0 when the completion's integer equals the "answer" column, else 0.0.

    The trainer calls it by keyword (TRL's contract, see lora_grpo.rewards): ``completions`` (text
    or conversational) and the ``answer`` column; ``prompts`` is unused, and stays the first
    parameter only so that existing positional calls (``greedy_accuracy``) keep working.
    """
    scores = []
    for completion, truth in zip(completions, answer, strict=True):
        value = parse_answer(completion)
        scores.append(1.0 if value is not None and value == int(truth) else 0.0)
    return scores


def greedy_accuracy(model, tokenizer, dataset, *, max_new_tokens: int = 4, batch_size: int = 64) -> float:
    """Share in [0, 1] of ``dataset`` rows whose greedy completion parses to the "answer" column.

    Uses the trainer's own sampler (temperature 0, one completion per prompt), which is tested
    token for token against transformers' greedy ``generate``. Works for a peft model too.
    """
    if len(dataset) == 0:
        return 0.0
    scores = []
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        rollout = generate_rollout(
            model,
            tokenizer,
            list(rows["prompt"]),
            num_generations=1,
            max_prompt_length=None,
            max_completion_length=max_new_tokens,
            temperature=0.0,
        )
        scores += toy_reward(rollout.prompts, rollout.completions, rows["answer"])
    return sum(scores) / len(scores)


def _encode_targets(tokenizer, pairs, answers) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (len(pairs), T): "prompt answer<eos>" right-padded; labels are -100
    on the prompt and the padding, so the loss is over the completion (answer and <eos>) only."""
    prompt_len = 2 * NUM_DIGITS + 2
    texts = [format_prompt(a, b) + format_completion(ans) for (a, b), ans in zip(pairs, answers)]
    seqs = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    width = prompt_len + NUM_DIGITS + 2  # the longest sum has NUM_DIGITS + 1 digits, then <eos>
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, prompt_len : len(s)] = ids[i, prompt_len : len(s)]
    return ids, labels


def pretrain_toy_base(
    out_dir,
    *,
    seed: int = 0,
    steps: int = 1000,
    batch_size: int = 128,
    learning_rate: float = 1e-3,
    warmup_steps: int = 50,
    weight_decay: float = 0.01,
    noise: float = 0.65,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    log_every: int = 100,
) -> str:
    """Build the tokenizer and a tiny model, pre-train it on noisy toy sums, save both to ``out_dir``.

    Plain next-token cross-entropy on "prompt answer<eos>" over the train split's pairs, with the
    completion as target; with probability ``noise`` a problem's answer is its carry-free sum (see
    the section comment). AdamW, linear warmup then cosine decay to 10%. Deterministic by ``seed``
    (on a fixed thread count); the caller's RNG state is left untouched. Also writes
    ``toy_pretrain.json`` (settings, per-step losses, seconds). Prints a line every ``log_every``
    steps (0: silent). Returns ``str(out_dir)``.
    """
    settings = {k: v for k, v in locals().items() if k != "out_dir"}  # the arguments, for the record
    out_dir = Path(out_dir)
    tokenizer = make_tokenizer()
    pairs = _split_pairs("train")
    true_ids, labels_true = _encode_targets(tokenizer, pairs, [a + b for a, b in pairs])
    noisy_ids, labels_noisy = _encode_targets(tokenizer, pairs, [carry_free_sum(a, b) for a, b in pairs])

    def batch_loss(model, gen):
        idx = torch.randint(len(pairs), (batch_size,), generator=gen)
        use_noisy = (torch.rand(batch_size, generator=gen) < noise)[:, None]
        ids = torch.where(use_noisy, noisy_ids[idx], true_ids[idx])
        labels = torch.where(use_noisy, labels_noisy[idx], labels_true[idx])
        return model(input_ids=ids, labels=labels).loss

    return pretrain_base(
        out_dir,
        tokenizer,
        batch_loss,
        settings,
        version=TOY_FORMAT_VERSION,
        record=TOY_RECORD,
        label="toy pretrain",
    )


def pretrain_base(
    out_dir, tokenizer, batch_loss, settings: dict, *, version: int, record: str, label: str
) -> str:
    """Pre-train a tiny model for ``tokenizer`` on ``batch_loss`` (pretrain.pretrain_tiny_model) and
    write it (write_base) to ``out_dir`` with the record ``record``: the settings, ``version`` as
    format_version, the per-step losses and the seconds. ``settings``: the task's pretraining
    arguments (seed, steps, learning_rate, warmup_steps, weight_decay if it has one, log_every and
    the model's sizes). Returns ``str(out_dir)``; the one path the offline tasks' bases are built by."""

    def build_model():
        return make_tiny_model(
            tokenizer,
            hidden_size=settings["hidden_size"],
            num_layers=settings["num_layers"],
            num_heads=settings["num_heads"],
            num_kv_heads=settings["num_kv_heads"],
            intermediate_size=settings["intermediate_size"],
            seed=settings["seed"],
        )

    model, losses, seconds = pretrain_tiny_model(
        build_model,
        batch_loss,
        seed=settings["seed"],
        steps=settings["steps"],
        learning_rate=settings["learning_rate"],
        warmup_steps=settings["warmup_steps"],
        **({"weight_decay": settings["weight_decay"]} if "weight_decay" in settings else {}),
        log_every=settings["log_every"],
        label=label,
    )
    written = {"settings": settings, "format_version": version, "losses": losses, "seconds": seconds}
    return write_base(model, tokenizer, Path(out_dir), record, written)


def write_base(model, tokenizer, out_dir: Path, record_name: str, record: dict) -> str:
    """Write a pre-trained toy base: weights, config, generation config, tokenizer and its record.

    Not model.save_pretrained: under torch.distributed transformers 5 writes config and weights
    only on global rank 0 (even with is_main_process=True), and whoever calls this builds a
    whole private copy. The model is small and unsharded: one safetensors file and its config.
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / record_name).write_text(json.dumps(record))
    return str(out_dir)


def toy_base_settings(seed: int = 0, **overrides) -> dict:
    """All pretraining settings (defaults of ``pretrain_toy_base`` with ``overrides``) plus seed."""
    params = inspect.signature(pretrain_toy_base).parameters
    unknown = set(overrides) - set(params)
    if unknown:
        raise TypeError(f"unknown pretraining settings: {sorted(unknown)}")
    settings = {k: p.default for k, p in params.items() if k != "out_dir"}
    settings.update(overrides, seed=seed)
    return settings


def toy_base_dirname(seed: int = 0, **overrides) -> str:
    """Cache subdirectory name, e.g. "toy_base-v1-3f2a9c1d0b7e": a hash of every setting and the seed."""
    return base_dirname("toy_base", TOY_FORMAT_VERSION, base_settings(pretrain_toy_base, seed, overrides))


TOY_RECORD = "toy_pretrain.json"
# What a cache entry must hold to be used; an entry missing any of them is rebuilt.
TOY_BASE_FILES = (*BASE_FILES, TOY_RECORD)


def toy_base_problem(path) -> str | None:
    """Why the toy base at ``path`` is unusable ("missing config.json, model.safetensors", ...), or
    None when it is complete: every file of ``TOY_BASE_FILES``, the current format version, and a
    config that ``AutoConfig`` loads (pretrain.base_problem). Cheap: no weights are read."""
    return base_problem(path, TOY_RECORD, TOY_FORMAT_VERSION)


def ensure_toy_base(cache_dir=None, seed: int = 0, **overrides) -> str:
    """Path of the pre-trained toy base (model + tokenizer), training it on first use (~1 min).

    Cached under ``cache_dir`` (default ``$LORA_GRPO_CACHE`` or ``~/.cache/lora_grpo``) in a
    subdirectory named by a hash of all pretraining settings and the seed (see
    ``toy_base_dirname``). Trains into a temporary directory beside it and renames it into place,
    so a crash never leaves a half-written cache entry; an existing entry that is incomplete (see
    ``toy_base_problem``) is rebuilt. ``overrides`` are ``pretrain_toy_base`` settings.

    Under torch.distributed (world size > 1) every process must call this: the local main process
    (LOCAL_RANK 0; the cache is per machine) builds while the others wait at a barrier
    (pretrain.ensure_cached_base).
    """
    return ensure_cached_base(
        pretrain_toy_base,
        name="toy_base",
        version=TOY_FORMAT_VERSION,
        record=TOY_RECORD,
        cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
        seed=seed,
        overrides=overrides,
        label="toy pretrain",
    )
