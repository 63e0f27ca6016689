"""Helpers shared by the benchmark scripts in this folder.

The scripts run as `python benchmarks/X.py`, so this folder is on sys.path and they import these
helpers with `from _common import ...`; the studies in studies/ put this folder on sys.path first, and
the GPU check (a package, run as `python -m benchmarks.gpu_check`) imports `benchmarks._common`.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

MiB = 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the --dtype choices

# Qwen2 shapes of the whole-step benchmarks (train_step, vs_trl, limit, gpu_check). "qwen2.5-0.5b" is
# Qwen2.5-0.5B (its 151,936-token vocabulary: for a GPU); "qwen2.5-0.5b-cpu" is the same body with
# a vocabulary of 8,192, so that a step fits a CPU run; "qwen2.5-1.5b" is Qwen2.5-1.5B (GPU only).
QWEN2_SHAPES = {
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        tie_word_embeddings=True,
    ),  # 0.09 M parameters
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),  # 20 M
    "qwen2.5-0.5b-cpu": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=8192,
        tie_word_embeddings=True,
    ),  # 365 M
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),  # 494 M
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),  # 1.54 B
}


# ------------------------------------------------------------------ setup


def add_threads_argument(parser, help: str = "torch.set_num_threads (see the docstring)") -> None:
    """Add --threads (default ONE torch thread; the scripts pass it to torch.set_num_threads)."""
    parser.add_argument("--threads", type=int, default=1, help=help)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """ "2x256,8x256" -> [(2, 256), (8, 256)]: comma-separated AxB pairs of whole numbers."""
    out = []
    for item in text.split(","):
        a, b = item.strip().lower().split("x")
        out.append((int(a), int(b)))
    return out


def build_qwen2(
    shape: str,
    path,
    dtype: torch.dtype = torch.float32,
    chat_template: str | None = None,
    device: str | torch.device = "cpu",
    **overrides,
) -> None:
    """Save a random-init Qwen2 of QWEN2_SHAPES[shape] (seed 0; `overrides` replace its fields, e.g.
    num_hidden_layers) to `path`, and a word-level tokenizer over its vocabulary (ids 0-2 "<pad>",
    "<eos>", "<unk>", then "t3", "t4", ... one word per id; with `chat_template` if given) to
    `path`/tokenizer. `device`: where the weights are initialised ("cuda": a 1.5B model in seconds,
    where a CPU takes far longer; other random values than a CPU's, from the same seed).

    The special tokens are not "t0"-"t2": a tokenizer matches its special tokens inside words, so
    "t1305" would split into "t1" (EOS) and an unknown "305". The tokenizer lives beside the model,
    not with it: transformers 5 reads a qwen2 checkpoint dir's tokenizer as Qwen2Tokenizer, which
    would not load this vocabulary.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    spec = {**QWEN2_SHAPES[shape], **overrides}
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, spec["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    config = Qwen2Config(
        max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=None, **spec
    )
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(path)
    del model
    tokenizer.save_pretrained(f"{path}/tokenizer")


def load_peer_model(path: str, base: str, compute: torch.dtype = torch.float32, device_map=None):
    """The peer's (TRL's) model from `path` as lora_grpo loads it: in `compute` (float32 by default),
    or NF4 with double quantisation computing in `compute` (base "4bit"), on `device_map` (None: the
    CPU), with lora_grpo's keep_4bit_weights_fixed: on a CPU with AVX512-BF16, bitsandbytes
    otherwise repacks the weights into a kernel without autograd after the first no-grad forward
    (issue 7), and the two trainers would not run the same code."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from lora_grpo.model.load import keep_4bit_weights_fixed

    quantization = None
    if base == "4bit":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_use_double_quant=True,
        )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=compute, quantization_config=quantization, device_map=device_map
    )
    keep_4bit_weights_fixed(model)
    return model


def trl_step_timer(sequences: int):
    """A TrainerCallback for TRL's trainer and the lists it fills: (callback, step seconds, completion
    tokens per step). A step is timed start to next start, as train_steps times ours; the tokens are
    each logged completions/mean_length × `sequences`."""
    from transformers import TrainerCallback

    times: list[float] = []
    tokens: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            now = time.perf_counter()
            if hasattr(self, "start"):
                times.append(now - self.start)
            self.start = now

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * sequences)

    return StepTimes(), times, tokens


def mean_std(values: list[float], fmt: str = ".3f") -> str:
    """mean ± std (sample) over seeds; a seed without a value (NaN: it never reached a target) is left
    out of both and counted: "0.500 ± 0.100 (1 seed never)"."""
    import math

    missed = sum(math.isnan(v) for v in values)
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "never"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    text = f"{format(statistics.mean(values), fmt)} ± {format(spread, fmt)}"
    return text + (f" ({missed} seed{'s' if missed > 1 else ''} never)" if missed else "")


CHILDREN: set = set()  # the worker processes running now (gpu_check ends them when its deadline stops it)


def run_child(command: list[str], timeout: float | None = None, **kwargs):
    """subprocess.run(command, capture_output=True, text=True, **kwargs), the process listed in
    CHILDREN while it runs; past `timeout` seconds it is killed and subprocess.TimeoutExpired raised
    (with what it printed)."""
    import subprocess

    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    ) as child:
        CHILDREN.add(child)
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            raise subprocess.TimeoutExpired(command, timeout, out, err) from None
        finally:
            CHILDREN.discard(child)
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def run_worker(command: list[str], what: str, timeout: float | None = None, **kwargs) -> dict:
    """Run a benchmark's worker in a fresh process and return the JSON of its last "RESULT " line
    (subprocess.TimeoutExpired after `timeout` seconds; `kwargs` go to subprocess.Popen: cwd, env)."""
    import json

    done = run_child(command, timeout=timeout, **kwargs)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def token_prompts(vocab_size: int, length: int, count: int = 64) -> list[dict[str, str]]:
    """`count` prompts of `length` pseudo-random tokens of build_qwen2's vocabulary (none special)."""
    return [
        {"prompt": " ".join(f"t{3 + (i * 7919 + j * 104729) % (vocab_size - 3)}" for j in range(length))}
        for i in range(count)
    ]


def even_token_share(prompts, completions, **kwargs):
    """A cheap reward with variance inside groups: the share of even-numbered tokens in a completion."""
    return [sum(int(t[1:]) % 2 == 0 for t in c.split()) / max(1, len(c.split())) for c in completions]


def train_steps(trainer) -> list[tuple[dict, float]]:
    """Run trainer.train() as a user does (reporting, syncs, logging included) and return
    [(step metrics, seconds from this step's start to the next one's)], one per step but the last
    (whose interval would hold the end of training: the final save and plot). Its stdout is kept quiet."""
    import contextlib
    import io

    begins = []
    trainer.hooks.append(
        lambda event, _trainer, **_: begins.append(time.perf_counter()) if event == "step_begin" else None
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    history = [m for m in trainer.state.log_history if "time/train" in m]
    return [(m, b - a) for m, a, b in zip(history, begins, begins[1:])]


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
    return (
        f"{versions}; threads {torch.get_num_threads()}; CPU {cpu_name()} ({os.cpu_count()} cores, "
        f"load average {load_average():.1f})"
    )


def print_markdown_table(header: list[str], table: list[list[str]], text_columns: int = 2) -> None:
    """Print a markdown table: the first `text_columns` columns left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]

    def line(cells):
        padded = [
            c.ljust(w) if i < text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "| " + " | ".join(padded) + " |"

    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in table:
        print(line(row))
