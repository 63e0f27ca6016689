"""Time and peak memory of whole GRPO training steps: QLoRA (4-bit base) vs LoRA on a 16-bit base.

Prepared for a GPU session (4-bit CUDA kernels, throughput and peak GPU memory mean something only
there); it also runs on CPU with --shape tiny to check that it works.

What is measured, per quantization ("4bit" = ours as the recipes run it, "none" = the peer: the same
trainer on an unquantized base), on a random-init model built locally from a Qwen2Config (nothing is
downloaded; "qwen2.5-0.5b" is Qwen2.5-0.5B's shape with its 151,936-token vocabulary):

- step seconds: median of `time/step` over the measured steps (after --warmup steps), split into
  rollout / log-probs (reference, and old when num_iterations > 1) / train;
- tokens/s: completion tokens sampled per second of step;
- sync ms: the exact weight-space sync of the reference slot, timed on its own after the steps;
- peak memory: torch.cuda.max_memory_allocated over the measured steps (GPU only; "-" on CPU).

A random model never samples EOS on purpose, so every completion runs to max_completion_length:
the step does the same amount of work in both columns. The reward is a cheap function of the
completion text, so reward time is negligible.

    python benchmarks/train_step.py --shape qwen2.5-0.5b --steps 5          # on a GPU
    python benchmarks/train_step.py --shape tiny --steps 2                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from _common import MiB, add_threads_argument, environment, print_markdown_table

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def build_base(shape: str, path: str) -> None:
    """Random-init Qwen2 of `shape` and a word-level tokenizer over its whole vocabulary, saved to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SHAPES[shape])
    vocab = {f"t{i}": i for i in range(spec["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t1", unk_token="t2")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, **spec))
    with torch.no_grad():  # make EOS unsampleable: every completion has the full length
        model.lm_head.weight[1].zero_()
        model.get_input_embeddings().weight[1].zero_()
    model.to(torch.bfloat16 if torch.cuda.is_available() else torch.float32).save_pretrained(path)
    # Beside the model, not with it: transformers 5 replaces the tokenizer of a qwen2 checkpoint dir
    # by Qwen2Tokenizer, which would not read this word-level vocabulary.
    tokenizer.save_pretrained(f"{path}/tokenizer")


def token_count_reward(prompts, completions, **kwargs):
    """A cheap reward with variance inside groups: how many even-numbered tokens a completion has."""
    return [sum(int(t[1:]) % 2 == 0 for t in c.split()) / max(1, len(c.split())) for c in completions]


def run(path: str, quantization: str, args) -> dict[str, float | str]:
    from lora_grpo import GRPOConfig, GRPOTrainer
    from lora_grpo.reference import sync_reference

    prompts = [{"prompt": " ".join(f"t{3 + (i * 7 + j) % 500}" for j in range(args.prompt_length))} for i in range(64)]
    config = GRPOConfig(
        model_name_or_path=path, tokenizer_name_or_path=f"{path}/tokenizer", quantization=quantization, lora_r=16, lora_alpha=32, num_generations=args.generations,
        prompts_per_step=args.prompts, max_prompt_length=None, max_completion_length=args.completion_length,
        micro_batch_size=args.micro_batch, beta=0.04, ref_sync_steps=0, learning_rate=1e-5,
        max_steps=args.warmup + args.steps, save_steps=0, logging_steps=1000, output_dir=tempfile.mkdtemp(),
        gradient_checkpointing=True,
    )
    trainer = GRPOTrainer(config, reward_funcs=[token_count_reward], train_dataset=prompts)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for _ in range(args.warmup):
        trainer.training_step(next(trainer.batches)[1])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    steps = [trainer.training_step(next(trainer.batches)[1]) for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() / MiB if torch.cuda.is_available() else None
    start = time.perf_counter()
    sync = sync_reference(trainer.model, alpha=0.6, mode="exact")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    sync_ms = (time.perf_counter() - start) * 1000

    def med(key):
        return statistics.median(m[key] for m in steps)

    result = {
        "step": med("time/step"), "rollout": med("time/rollout"), "log_probs": med("time/log_probs"),
        "train": med("time/train"), "tokens/s": med("tokens_per_second"), "sync_ms": sync_ms,
        "sync_err": sync["sync/truncation_error"], "peak_mib": peak,
    }
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="G")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--completion-length", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--quantizations", default="4bit,none")
    add_threads_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    import bitsandbytes
    import peft
    import transformers

    print(f"# {environment(transformers, peft, bitsandbytes)}; device {device}; shape {args.shape}; "
          f"{args.prompts} prompts × G={args.generations}, prompt {args.prompt_length}, completion "
          f"{args.completion_length} tokens, micro-batch {args.micro_batch}; median of {args.steps} steps after {args.warmup}")
    with tempfile.TemporaryDirectory() as path:
        build_base(args.shape, path)
        results = {q: run(path, q, args) for q in args.quantizations.split(",")}
    peer = results.get("none")
    table = []
    for q, r in results.items():
        ratio = f"{r['step'] / peer['step']:.2f}" if peer else "-"
        mem_ratio = f"{r['peak_mib'] / peer['peak_mib']:.2f}" if peer and r["peak_mib"] else "-"
        table.append([
            f"{q} base" + (" (peer)" if q == "none" else ""), f"{r['step']:.2f}", f"{r['rollout']:.2f}",
            f"{r['log_probs']:.2f}", f"{r['train']:.2f}", f"{r['tokens/s']:.0f}", f"{r['sync_ms']:.1f}",
            f"{r['sync_err']:.1e}", "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}", ratio, mem_ratio,
        ])
    print_markdown_table(
        ["base", "step s", "rollout s", "log-probs s", "train s", "tokens/s", "sync ms", "sync err", "peak MiB",
         "step vs peer", "memory vs peer"],
        table,
        text_columns=1,
    )


if __name__ == "__main__":
    main()
