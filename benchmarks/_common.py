"""Helpers shared by the benchmark scripts in this folder.

The scripts run as `python benchmarks/X.py`, so this folder is on sys.path and they import these
helpers with `from _common import ...`.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

MiB = 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the --dtype choices

# Qwen2 shapes of the whole-step benchmarks (train_step, vs_trl, limit). "qwen2.5-0.5b" is
# Qwen2.5-0.5B (its 151,936-token vocabulary: for a GPU); "qwen2.5-0.5b-cpu" is the same body with
# a vocabulary of 8,192, so that a step fits a CPU run.
QWEN2_SHAPES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True),  # 0.09 M parameters
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False),  # 20 M
    "qwen2.5-0.5b-cpu": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                             num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True),  # 365 M
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),  # 494 M
}


# ------------------------------------------------------------------ setup


def add_threads_argument(parser, help: str = "torch.set_num_threads (see the docstring)") -> None:
    """Add --threads (default ONE torch thread; the scripts pass it to torch.set_num_threads)."""
    parser.add_argument("--threads", type=int, default=1, help=help)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """"2x256,8x256" -> [(2, 256), (8, 256)]: comma-separated AxB pairs of whole numbers."""
    out = []
    for item in text.split(","):
        a, b = item.strip().lower().split("x")
        out.append((int(a), int(b)))
    return out


def build_qwen2(shape: str, path, dtype: torch.dtype = torch.float32) -> None:
    """Save a random-init Qwen2 of QWEN2_SHAPES[shape] (seed 0) to `path`, and a word-level tokenizer
    over its vocabulary ("t0" pad, "t1" EOS, "t2" unknown, ...) to `path`/tokenizer.

    The tokenizer lives beside the model, not with it: transformers 5 reads a qwen2 checkpoint
    dir's tokenizer as Qwen2Tokenizer, which would not load this vocabulary.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    spec = QWEN2_SHAPES[shape]
    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(spec["vocab_size"])}, unk_token="t2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t1", unk_token="t2")
    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=None, **spec)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(f"{path}/tokenizer")


def token_prompts(vocab_size: int, length: int, count: int = 64) -> list[dict[str, str]]:
    """`count` prompts of `length` pseudo-random tokens of build_qwen2's vocabulary (none special)."""
    return [{"prompt": " ".join(f"t{3 + (i * 7919 + j * 104729) % (vocab_size - 3)}" for j in range(length))}
            for i in range(count)]


def even_token_share(prompts, completions, **kwargs):
    """A cheap reward with variance inside groups: the share of even-numbered tokens in a completion."""
    return [sum(int(t[1:]) % 2 == 0 for t in c.split()) / max(1, len(c.split())) for c in completions]


def grpo_steps(trainer, n: int) -> list[tuple[dict, float]]:
    """n steps of a lora_grpo trainer as train() runs them (the step, then a sync when the schedule
    says so), without its reporting: [(the step's metrics, seconds of the step and its sync)]."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        _, rows = next(trainer.state.batches)
        metrics = trainer.training_step(rows)
        trainer.state.global_step += 1
        if trainer.state.sync_schedule.due(trainer.state.global_step, epoch_ended=False, kl=metrics.get("kl")):
            trainer.sync_reference()
        out.append((metrics, time.perf_counter() - start))
    return out


# ------------------------------------------------------------------ measurements


def peak_temporary_bytes(fn) -> int:
    """Peak of (bytes allocated − bytes freed) by torch's CPU allocator while `fn()` runs, from 0."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:  # nbytes < 0 for a free
        live += nbytes
        peak = max(peak, live)
    return peak


def median_seconds(fn, repeats: int, before=None) -> tuple[float, object]:
    """One untimed warm-up call, then the median of `repeats` timed calls; also the last result.

    `before()`, if given, runs untimed before every call (the warm-up included).
    """
    if before:
        before()
    result = fn()
    times = []
    for _ in range(repeats):
        if before:
            before()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


# ------------------------------------------------------------------ report


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def environment(*modules) -> str:
    """Versions, threads and CPU for a header line.

    "torch V[, name V ...]; threads N; CPU name (C cores, load average L)", where `modules` are
    imported modules besides torch (e.g. transformers, peft), named with their __version__.
    """
    versions = ", ".join(f"{m.__name__} {m.__version__}" for m in (torch, *modules))
    return (f"{versions}; threads {torch.get_num_threads()}; CPU {cpu_name()} ({os.cpu_count()} cores, "
            f"load average {load_average():.1f})")


def print_markdown_table(header: list[str], table: list[list[str]], text_columns: int = 2) -> None:
    """Print a markdown table: the first `text_columns` columns left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]

    def line(cells):
        padded = [c.ljust(w) if i < text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in table:
        print(line(row))
