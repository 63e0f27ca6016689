"""Rollout speed: our prefix-shared sampler (eager, static-cache, compiled) vs transformers' generate.

What is measured, per setting (prompt length L, completion length T, P prompts, G samples each):

- ours   `lora_grpo.rollout.generate_rollout(model, tokenizer, prompts, num_generations=G,
          max_prompt_length=None, max_completion_length=T, temperature=1.0, generator=...)`:
          prefills the P distinct prompts once (P·L tokens), repeats the KV cache and the last
          logits G times, then decodes the P·G sequences together, one token per step.
          Three samplers (`decode_mode`, all drawing the same tokens): "eager" (a growing KV cache,
          finished rows leave the batch), "static" (the KV copied into a fixed-size static cache,
          fixed shapes every step, not compiled) and "compiled" ("static" with the one-token
          forward under torch.compile: inductor on CPU, CUDA graphs on CUDA; lora_grpo/fast_decode.py).
- peer   `model.generate(input_ids, attention_mask, do_sample=True, num_return_sequences=G,
          max_new_tokens=T, temperature=1.0, top_k=0, top_p=1.0)`: expands every prompt G times
          before the prefill (P·G·L tokens), then decodes the P·G sequences the same way.
          top_k=0 is passed because generate's default is top_k=50 and ours samples from the full
          distribution; with these settings generate adds no logits processor at all.

Both run on the same model: the trainer's own peft model, `lora_grpo.model.load.attach_adapters(base,
GRPOConfig(lora_r=16, all-linear, gradient_checkpointing=False))`, with the policy ("default") adapter active
(B is zero at init, so LoRA changes no output, but every LoRA layer does its work), in eval mode,
no gradients. Both include the same host-side work a trainer does around sampling: ours tokenizes
the prompts and decodes the completions inside generate_rollout; the peer's timed call tokenizes
the prompts before generate and batch-decodes the completion tokens after it.

Same work for both: EOS can never be sampled, so every one of the P·G sequences gets exactly T
tokens in both paths (checked after every timed call; the table's "tokens" column is the count).
The tokenizer has V + 1 ids with EOS the last one (id V), and the model's vocab_size is V, so the
LM head has no logit for EOS; generate gets eos_token_id=V and needs no min_new_tokens (which
would add a logits processor to the peer only). Prompts are P random strings of exactly L
non-special tokens (no padding).

Columns:
- time: median wall time (time.perf_counter) of `repeats` calls after two warm-up calls, the
  methods alternating call by call.
- completions/s: P·G / time.  tokens/s: generated tokens (P·G·T) / time.
- prefill tokens: the prompt tokens each path pushes through the model (ours P·L, peer P·G·L).
- ours/peer: the peer's time over ours (> 1: ours is faster), in the same run.
- first call (s): the first warm-up call's time; for "compiled" it includes compiling the step
  for this setting's shape (one graph per batch size and bucketed cache length), so
  first call − time ≈ the one-time compile cost. The "compiled" row of the first setting also pays
  dynamo's and inductor's own start-up.

Expect a large gain where the prefill dominates (long prompts, short completions) and about 1×
where decoding dominates (short prompts, long completions): both decode identically.

Threads: the default is ONE torch thread (--threads to change it); with 2 threads on a machine
whose 2 cores are shared with other busy processes, OpenMP threads wait at barriers for a
descheduled sibling and timings become noise. The header prints the load average.

The model is random-init, built locally from a Qwen2Config (nothing is downloaded), float32
compute: hidden 512, intermediate 1408, 4 layers, 8 heads, 2 KV heads, vocab 4096 (--vocab 151936:
Qwen2.5's, where the per-token (N, V) sampling work is a real share), untied head; --bases 4bit
loads the same weights in NF4 (bitsandbytes dequantises per matmul on a CPU: both paths pay it).
The tokenizer is a word-level one built here (ids: <pad>=0, <unk>=1, words 2..V−1, <eos>=V).

    python benchmarks/rollout_speed.py [--settings 256x16,128x64,16x64,16x16] [--prompts 4] [--generations 1,8]
                                       [--bases fp32,4bit] [--vocab 4096] [--repeats 5] [--threads 1]
                                       [--decoders eager,static,compiled]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
from _common import add_threads_argument, environment, load_average, parse_pairs, print_markdown_table

VOCAB = 4096  # the model's vocab; the tokenizer adds <eos> as id VOCAB
MODEL = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    tie_word_embeddings=False,
    max_position_embeddings=1024,
)
LORA_R = 16


@dataclass
class Row:
    setting: str
    method: str
    seconds: float
    completions: int
    tokens: int  # generated tokens, checked
    prefill: int  # prompt tokens pushed through the model
    first: float  # seconds of the first warm-up call (compiling included)


# ------------------------------------------------------------------ model and data


def build_tokenizer():
    """Word-level tokenizer: <pad>=0, <unk>=1, words "w2".."w{V-1}", <eos>=V (outside the model's vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}, "<eos>": VOCAB}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.padding_side = "left"
    return tok


def build_model(tokenizer, base_kind: str = "fp32"):
    """The trainer's model: a random-init Qwen2 base ("4bit": saved, then loaded as the trainer loads
    a QLoRA base, NF4 with double quantisation, float32 compute) with the policy ("default") and "reference"
    adapters."""
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config

    from lora_grpo.config import GRPOConfig
    from lora_grpo.model.load import attach_adapters, keep_4bit_weights_fixed

    torch.manual_seed(0)
    # EOS (id V) is outside the model's vocab: set on the generation config only, where both paths read it.
    config = Qwen2Config(
        **{**MODEL, "vocab_size": VOCAB},
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=None,
        bos_token_id=None,
    )
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if base_kind == "4bit":
        with tempfile.TemporaryDirectory() as tmp:
            base.save_pretrained(tmp)
            quantization = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32,
            )
            base = AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, quantization_config=quantization
            )
        keep_4bit_weights_fixed(base)  # the trainer's CPU path (lora_grpo.model.load)
    base.requires_grad_(False)
    base.generation_config.eos_token_id = tokenizer.eos_token_id
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    model = attach_adapters(
        base, GRPOConfig(model_name_or_path="local", lora_r=LORA_R, gradient_checkpointing=False)
    )
    model.eval()
    return model


def make_prompts(n: int, length: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, length), generator=g)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


# ------------------------------------------------------------------ measurements


def run_ours(model, tokenizer, prompts, G, T, seed, decode_mode="eager"):
    from lora_grpo.rollout import generate_rollout

    g = torch.Generator().manual_seed(seed)
    r = generate_rollout(
        model,
        tokenizer,
        prompts,
        num_generations=G,
        max_prompt_length=None,
        max_completion_length=T,
        temperature=1.0,
        generator=g,
        decode_mode=decode_mode,
    )
    return r.completion_mask.sum().item(), r.completion_ids.shape


def run_peer(model, tokenizer, prompts, G, T):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        do_sample=True,
        num_return_sequences=G,
        max_new_tokens=T,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    completion = out[:, enc["input_ids"].shape[1] :]
    tokenizer.batch_decode(completion, skip_special_tokens=True)
    return (completion != tokenizer.eos_token_id).sum().item(), completion.shape


def benchmark_setting(model, tokenizer, L: int, T: int, P: int, G: int, repeats: int, decoders) -> list[Row]:
    prompts = make_prompts(P, L, seed=L * 1000 + T)
    assert all(len(tokenizer(p, add_special_tokens=False)["input_ids"]) == L for p in prompts)
    setting = f"L={L}, T={T}, G={G}"
    rows = []
    torch.manual_seed(1)
    methods = [
        (f"ours, {mode}", functools.partial(run_ours, model, tokenizer, prompts, G, T, 1, mode), P * L)
        for mode in decoders
    ]
    methods.append(("peer generate", lambda: run_peer(model, tokenizer, prompts, G, T), P * G * L))
    firsts = {}
    for method, fn, _ in methods:  # two warm-up calls each; the first one's time is reported
        start = time.perf_counter()
        fn()
        firsts[method] = time.perf_counter() - start
        fn()
    times = {method: [] for method, _, _ in methods}
    for _ in range(repeats):  # the methods alternate, so a slow spell of the machine hits them alike
        for method, fn, _ in methods:
            start = time.perf_counter()
            tokens, shape = fn()
            times[method].append(time.perf_counter() - start)
            if tokens != P * G * T or tuple(shape) != (P * G, T):
                raise RuntimeError(
                    f"{method}: expected {P * G}×{T} generated tokens, got {tokens} in {tuple(shape)}"
                )
    for method, _, prefill in methods:
        rows.append(
            Row(setting, method, statistics.median(times[method]), P * G, P * G * T, prefill, firsts[method])
        )
    return rows


# ------------------------------------------------------------------ report


def print_table(rows: list[Row]) -> None:
    header = [
        "setting",
        "method",
        "prefill tokens",
        "tokens",
        "time (s)",
        "completions/s",
        "tokens/s",
        "ours/peer",
        "first call (s)",
    ]
    peer = {r.setting: r for r in rows if r.method.startswith("peer")}
    table = []
    for r in rows:
        p = peer[r.setting]
        table.append(
            [
                r.setting,
                r.method,
                str(r.prefill),
                str(r.tokens),
                f"{r.seconds:.3f}",
                f"{r.completions / r.seconds:.1f}",
                f"{r.tokens / r.seconds:.0f}",
                f"{p.seconds / r.seconds:.2f}×",
                f"{r.first:.1f}",
            ]
        )
    print_markdown_table(header, table)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--settings",
        default="256x16,128x64,16x64,16x16",
        help="comma-separated PROMPTxCOMPLETION lengths in tokens (default 256x16,128x64,16x64,16x16)",
    )
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts P per call")
    p.add_argument("--generations", default="1,8", help="samples G per prompt, comma-separated (default 1,8)")
    p.add_argument(
        "--bases", default="fp32,4bit", help="fp32 and/or 4bit (NF4, dequantised per matmul on a CPU)"
    )
    p.add_argument("--vocab", type=int, default=VOCAB, help="the model's vocabulary (Qwen2.5's: 151936)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed calls per method, alternating (median reported)"
    )
    p.add_argument(
        "--decoders",
        default="eager,static",
        help="comma-separated decode_mode values of our sampler to measure (default eager,static; "
        "compiled compiles per shape, minutes on a CPU)",
    )
    add_threads_argument(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    global VOCAB
    args = parse_args(argv)
    VOCAB = args.vocab
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices
    import peft
    import transformers

    settings = parse_pairs(args.settings)  # prompt length x completion length, in tokens
    tokenizer = build_tokenizer()
    print(
        f"# {environment(transformers, peft)}; model hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_hidden_layers']} layers, vocab {VOCAB}, float32 compute, lora_r {LORA_R} all-linear; "
        f"P={args.prompts} prompts; EOS unsampleable; {args.repeats} repeats after 2 warm-ups"
    )
    for base_kind in args.bases.split(","):
        start = time.perf_counter()
        model = build_model(tokenizer, base_kind)
        built = time.perf_counter() - start
        rows = []
        for G in [int(g) for g in args.generations.split(",")]:
            for L, T in settings:
                rows += benchmark_setting(
                    model, tokenizer, L, T, args.prompts, G, args.repeats, args.decoders.split(",")
                )
        n_lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
        print(
            f"\n## base {base_kind} (built in {built:.1f} s; {n_lora / 1e6:.2f} M LoRA parameters, both adapters)\n"
        )
        print_table(rows)
        del model
    print(f"# load average at the end {load_average():.1f}")


if __name__ == "__main__":
    main()
