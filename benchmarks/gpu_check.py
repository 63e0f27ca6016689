"""The GPU check: what only a GPU can show about lora_grpo, in two commands of a lent machine's visit.

Nothing is downloaded: the models are random-init Qwen2s built locally (_common.build_qwen2), in
Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (their bodies and 151,936-token vocabularies) for the
recipes' sections and in small shapes elsewhere, and the calculator task's tiny base, pre-trained
where the bundle was built (benchmarks/gpu_bundle.py copies it into gpu_bundle/calculator-base;
lora_grpo.tasks.calculator) and loaded by path here. Each section prints what it measured and one "ok:" or
"FAIL:" line per threshold; a missed threshold fails its section after the rest of it has run, an
error fails it where it happens, and the next section runs either way. The exit status is the
number of failed sections.

 1. devices      what device.py decides here: torch_dtype auto, whether decode_mode auto compiles.
 2. memory, 0.5B qwen2.5-0.5b-gsm8k-qlora's settings (4-bit base, LoRA r 16, 8 prompts × G 8, 256 + 384
                 tokens, micro_batch_size / gradient_checkpointing auto) for --steps steps and an eval
                 at the end (a greedy decode and the kl_to_base samples and forwards of 64 token prompts),
                 on an emulated 8 GB card (below). Per step the allocator's allocated and reserved
                 bytes around the rollout, the update (log-probs, loss, backward, optimizer step) and
                 the eval, and the compiled decode's kept caches, against the memory plan's figures
                 (memory/probe.py) and beside memory_estimate's figures for the same sizes; inductor's
                 cudagraph-skip counter over the run.
 3. decode       on section 2's trained model: tokens/s of the eager and the compiled sampler
                 (greedy, the recipe's shape), the rows that draw the same tokens, and whether each
                 compiled choice is the eager model's own argmax up to rounding (a teacher-forced
                 forward over the compiled rollout: the largest margin by which another token beat the
                 one chosen); what dynamo recorded (graphs, graph breaks, e.g. at bitsandbytes' 4-bit
                 layers, recompiles; TORCH_LOGS-style lines go to stderr).
 4. memory, 1.5B section 2 for qwen2.5-1.5b-gsm8k-calculator-qlora (4 prompts × G 8, 384 + 512 tokens)
                 without its calculator (the tool's replies fill the same max_completion_length slots
                 of the same cache; section 9 runs tools).
 5. decode after updates  a 4-bit "small" model trained 2 steps with the compiled decode (lora_B off
                 zero, optimizer steps, a sync between the rollouts: hard in float32, soft in bf16),
                 then compiled against eager greedy decoding in both dtypes, as in section 3; the
                 training decode's cudagraph skips must be 0.
 6. bf16 KL      the KL between identical adapters, on a bf16 base (must be exactly 0) and on a 4-bit
                 base with bf16 compute (|KL| < 1e-6), after a hard sync, and between nearby adapters:
                 lora_grpo's log-probs of a bf16 model (float32 head) against the same weights in
                 float32 and against log-probs from the model's own bf16 logits (defect 5 of issue 16);
                 on CUDA, the bf16 head's float32 matmul on TF32 (logprobs._tf32_matmuls) against
                 float64, and the TF32 flag restored.
 7. resume       a 4-bit run of 3 steps against the same run resumed from its step-2 checkpoint on
                 the same device (every adapter tensor equal; CUDA in deterministic mode, as attention
                 backward kernels otherwise are not), and the checkpoint resumed by a CPU-only process
                 (CUDA_VISIBLE_DEVICES="") for one more step.
 8. pytest -m gpu the suite's GPU tests, in a subprocess (a time cap inside the budget).
 9. tools        the calculator task with the compiled decode, on the bundled base: 2 training steps
                 that call the tool, then sampled tool rollouts compiled against eager (rows with the
                 same tokens, calls).
10. reward model a tiny sequence-classification reward model (a RewardModel loaded from a path) in a
                 4-bit run with 'auto' sizes: on the run's device and dtype, finite rewards, its
                 scoring forwards within the plan's rows.
11. paged_adamw_8bit  3 steps with bitsandbytes' paged 8-bit AdamW, in a worker process with a time
                 limit (CUDA managed memory can hang): the adapter moves, 8-bit paged states.
12. vs TRL       step time and peak memory of lora_grpo and of TRL's GRPOTrainer + a peft LoraConfig
                 (TRL's defaults: gradient checkpointing on, one micro-batch), the same random 0.5B
                 4-bit model, prompts, reward and settings, each in a fresh process; when TRL
                 imports. A measurement: it fails only when a run fails.

The emulated 8 GB card (sections 2 and 4): torch's allocator is capped by
set_per_process_memory_fraction at 8 GiB less the 0.5 GiB CUDA context that memory_estimate (and
the recipes' headers) assume, and the free memory the plan reads, lora_grpo.memory.probe.available_bytes
(the function memory/probe.py imports from device.py, replaced here as the tests replace it), is that cap
less what is allocated. The thresholds, in bytes over the model as loaded (the plan's reference):
allocated peak of each rollout ≤ plan.rollout + plan.optimizer; of each update ≤ plan.optimizer +
plan.kept + the probed pass at the chosen size; of the eval ≤ plan.need; the kept caches ≤
plan.kept, and what stays allocated after the first rollout ≤ plan.kept + 8 MiB (the rollout's own
tensors); reserved peaks (which keep every stage's cached blocks) ≤ plan.need; no cudagraph skips.

With --cpu (the dry run, tests/test_gpu_bundle.py) every section runs its code on a CPU in a tiny
shape, "static" standing in for "compiled" (the same fixed-shape decoder without torch.compile:
inductor on a CPU takes tens of seconds a shape, and tests/test_fast_decode.py covers it), what only
CUDA has skipped and listed under the section's "skipped_parts" (section 8 skips whole), TRL run in
this process.

The order (SECTIONS): the cheap sections first (1, 7, 8, 10, 11, 6: small models, no compiled
decode), then those that compile a decode (2, 3, 4, 5, 9, 12); ESTIMATES holds each one's expected
seconds on an H200 (estimates: no GPU has run this yet), printed as the plan at the start.
--budget (default 300) is a hard deadline in seconds of wall time from the process's start: a
section that would start past it is skipped (so are sections 8 and 12 with less than 60 / 120 s of
it left), child processes (sections 7, 8, 11, 12) get what it leaves, and at the deadline a
watchdog thread records the running section as stopped, the ones not started as skipped, writes the
summary and exits with the number of failed sections (a stop is no failure; SIGTERM does the same;
a section stuck in C code holding the GIL is ended by faulthandler 10 s later, exit 1). The last
line printed, summary.txt's last line and summary.json's "rerun" are the command for the sections
stopped or skipped for want of time (--only those, --budget 150; section 3 brings section 2).
--only 2,4: run those sections alone. With --out DIR, summary.json (each section: status, seconds,
reason, rerun, findings; "running" while one runs), summary.txt (one line per section) and log.txt
(everything printed, line-buffered) are written there, the summary as each section starts and ends.
The device-time plan of a lent machine's visit (start-up, install, the two commands): benchmarks/README.md.

    python3 benchmarks/gpu_check.py --out DIR  # on one CUDA GPU (the lent machine: benchmarks/README.md)
    python3 benchmarks/gpu_check.py --cpu      # a dry run on a CPU with tiny shapes (checks the script)
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from _common import (
    CHILDREN,
    QWEN2_SHAPES,
    MiB,
    build_qwen2,
    environment,
    even_token_share,
    load_peer_model,
    run_child,
    run_worker,
    token_prompts,
    train_steps,
    trl_step_timer,
)
from gpu_bundle import CALCULATOR_BASE

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / "gpu_bundle"  # what benchmarks/gpu_bundle.py builds (and the lent machine is sent)
GiB = 2**30
CARD = 8 * GiB  # the emulated card of sections 2 and 4 (the recipes' "8 GB GPU")
STAYS_SLACK = 8 * MiB  # what a rollout leaves allocated besides the kept caches: its own tensors
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARGS = None  # the parsed arguments of this run (main)
SUMMARY: dict[str, dict] = {}  # section → {"status", "seconds", "findings", "reason"}
RUNNING: dict = {}  # the section running now: {"section", "since" (clock time), "at_s" (into the run)}
FINDINGS: dict = {}  # the running section's findings (what summary.json reports of it)
LOCK = threading.RLock()  # SUMMARY, RUNNING and the summary files: the main thread's and the watchdog's
MARGIN = 2.0  # seconds before the deadline at which a child process is ended, so its section records it
GRACE = 10.0  # seconds past the deadline at which faulthandler ends a process its watchdog could not
IMPORTED = time.perf_counter()


def process_age() -> float:
    """Seconds since this process started (Linux: /proc, so the interpreter's start-up and the imports
    count; elsewhere since this module's imports finished)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - IMPORTED


class Skip(Exception):
    """A section that cannot run here (a package missing, an earlier section's result missing): skipped."""


class Late(Skip):
    """A section with too little of the budget left to start: skipped, and named in the rerun command."""


class Stopped(Exception):
    """A section whose own time limit (what the budget left it) ran out: stopped, and named in the rerun."""


def expect(ok: bool, what: str) -> bool:
    """One threshold of the running section, printed; a miss fails the section once the rest has run."""
    print(f"{'ok' if ok else 'FAIL'}: {what}", flush=True)
    if not ok:
        FINDINGS.setdefault("failures", []).append(what)
    return ok


def not_here(what: str) -> None:
    """A part of the running section that only CUDA has, left out of this (CPU) run and listed."""
    print(f"(skipped here: {what})", flush=True)
    FINDINGS.setdefault("skipped_parts", []).append(what)


def over_time(what: str, limit: float, cap: float) -> None:
    """A child process killed at its time limit: stopped (to rerun) when the budget set the limit,
    a failure when its own cap did."""
    if limit < cap:
        raise Stopped(f"{what} stopped at the deadline ({limit:.0f} s of the --budget were left for it)")
    expect(False, f"{what} finished within {cap:.0f} s")


def mib(value) -> str:
    return "-" if value is None else f"{value / MiB:,.1f}"


class Run:
    """What the sections share: the arguments, the device, the scratch folder, the clock, the models
    built so far, and what a section leaves for a later one (section 2's trainer for section 3)."""

    def __init__(self, args, device: torch.device, root: str):
        self.args, self.device, self.root = args, device, Path(root)
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter() - process_age()  # the budget counts from the process's start
        self.results: dict = {}
        self._models: dict = {}

    def selected(self, number: int) -> bool:
        """Whether section `number` is to run (--only)."""
        return not self.args.only or number in self.args.only

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.args.budget - self.elapsed()

    def limit(self, cap: float) -> float:
        """A child process's time limit: `cap` seconds, or what the budget leaves less MARGIN."""
        return max(1.0, min(cap, self.left() - MARGIN))

    def shape(self, shape: str) -> str:
        """The shape to use: the tiny one in the CPU dry run."""
        return "tiny" if self.args.cpu else shape

    def model(self, shape: str, dtype: torch.dtype | None = None) -> str:
        """The path of a random Qwen2 of `shape` (built once): bf16 on a GPU unless `dtype`."""
        dtype = dtype or (torch.bfloat16 if self.cuda else torch.float32)
        key = (shape, dtype)
        if key not in self._models:
            path = self.root / f"{shape}-{str(dtype).removeprefix('torch.')}"
            start = time.perf_counter()
            build_qwen2(shape, path, dtype, device=self.device)
            print(
                f"(built a random {shape} in {str(dtype).removeprefix('torch.')}: {time.perf_counter() - start:.1f} s)"
            )
            self._models[key] = str(path)
        return self._models[key]


def release(run: Run) -> None:
    """On a GPU: collect what was dropped, and give the allocator's cached blocks back to the device
    (on a CPU reference counting frees the tensors; a collection over a loaded trainer takes ~0.4 s)."""
    if run.cuda:
        gc.collect()
        torch.cuda.empty_cache()


def no_plots() -> None:
    """Every run here ends without its metrics.png: not what this checks, and matplotlib costs a CPU
    second or two a run (reporting.RunReporter.plot, replaced for this process)."""
    from lora_grpo.run.reporting import RunReporter

    RunReporter.plot = lambda self: None


def fresh_compiler(run: Run) -> None:
    """Dynamo's caches and the CUDA graph trees reset, as in a fresh process: a user's process compiles
    one model, and dynamo's recompile limit (8 per code object) counts every model of this one."""
    if run.cuda:
        torch._dynamo.reset()
        release(run)


class Memory:
    """CUDA allocator figures of one device; on a CPU only the resident set (peaks: None)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def now(self) -> tuple[float, float | None]:
        """(allocated, reserved) bytes; on a CPU (resident set, None)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        import psutil

        return psutil.Process().memory_info().rss, None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> tuple[float, float] | None:
        """(allocated, reserved) peaks since the last reset_peak; None on a CPU."""
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)


class CudagraphSkips:
    """Inductor's cudagraph_skips counter over a block (`count`), and the reasons it logged (`reasons`:
    the warnings of its "cudagraphs" artifact loggers, caught without turning those logs on)."""

    def __enter__(self):
        self.reasons: list[str] = []
        self.loggers = []
        if torch.cuda.is_available():
            importlib.import_module("torch._inductor.cudagraph_utils")  # creates the loggers listened to

            reasons = self.reasons

            class Collect(logging.Handler):
                def emit(self, record):
                    reasons.append(record.getMessage()[:300])

            self.handler = Collect(level=logging.WARNING)
            names = [n for n in list(logging.root.manager.loggerDict) if n.endswith(".__cudagraphs")]
            self.loggers = [logging.getLogger(n) for n in names]
            for logger in self.loggers:
                logger.addHandler(self.handler)
        self.start = self._count()
        return self

    def __exit__(self, *exc):
        self.count = self._count() - self.start
        for logger in self.loggers:
            logger.removeHandler(self.handler)
        return False

    @staticmethod
    def _count() -> int:
        return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


# ------------------------------------------------------------------------------ 1. devices
def check_devices(run: Run) -> None:
    import bitsandbytes
    import peft
    import transformers

    from lora_grpo.device import _triton_installed, auto_dtype, compile_pays, describe_gpu

    device = run.device
    print(environment(transformers, peft, bitsandbytes))
    print(f"device: {describe_gpu(device) if run.cuda else 'CPU'}; Triton installed: {_triton_installed()}")
    dtype, why = auto_dtype()
    print(f"torch_dtype auto → {str(dtype).removeprefix('torch.')} ({why})")
    import lora_grpo

    # Where each package came from: the bundle installed beside the image (/tmp/site), the image, the checkout.
    places = {
        m.__name__: str(Path(m.__file__).parent.parent)
        for m in (torch, transformers, peft, bitsandbytes, lora_grpo)
    }
    print("imported from: " + ", ".join(f"{name} {place}" for name, place in places.items()))
    FINDINGS.update(
        {
            "imported_from": places,
            "versions": {m.__name__: m.__version__ for m in (torch, transformers, peft, bitsandbytes)},
            "torch_dtype_auto": str(dtype).removeprefix("torch."),
        }
    )
    for candidate in (torch.bfloat16, torch.float32):
        pays, why = compile_pays(device, candidate)
        name = str(candidate).removeprefix("torch.")
        print(f"decode_mode auto for {name} → {'compiled' if pays else 'eager'} ({why})")
        FINDINGS[f"decode_mode_auto_{name}"] = "compiled" if pays else "eager"


# ------------------------------------------------------------------------------ 2, 4. memory
def recipe_config(run: Run, recipe: str, path: str, out: str, **overrides):
    """The recipe's settings on the local random model and token prompts (no hub, no chat template,
    no tools), an eval at the end only (with the optimizer states: the eval's worst moment)."""
    from lora_grpo import GRPOConfig
    from lora_grpo.cli import recipe_file

    with recipe_file(recipe) as file:
        fields = dict(
            model_name_or_path=path,
            tokenizer_name_or_path=f"{path}/tokenizer",
            dataset=None,
            dataset_config=None,
            eval_dataset=None,
            eval_limit=0,
            use_chat_template=False,
            system_prompt=None,
            prompt_column="prompt",
            reward_funcs=[],
            reward_weights=None,
            tools=[],
            max_steps=run.args.steps,
            save_steps=0,
            eval_steps=0,
            eval_on_start=False,
            eval_on_end=True,
            logging_steps=1,
            output_dir=out,
            disable_tqdm=True,
        )
        if run.args.cpu:  # the dry run: the recipe's structure at a size a CPU runs in seconds
            fields.update(
                prompts_per_step=2, num_generations=4, max_prompt_length=16, max_completion_length=16
            )
        fields.update(overrides)
        return GRPOConfig.from_yaml(file, fields)


@contextmanager
def emulated_card(run: Run, card: float = CARD):
    """An 8 GB card on a larger GPU (the module docstring); on a CPU only the plan's figure changes."""
    import lora_grpo.memory.probe as memory
    from lora_grpo.memory.estimate import CUDA_CONTEXT

    usable = card - CUDA_CONTEXT
    real = memory.available_bytes
    release(run)  # blocks cached past the cap would stay reserved under it

    def available(device: torch.device) -> tuple[float, str]:
        if device.type == "cuda":
            return float(usable - torch.cuda.memory_allocated(device)), (
                f"free GPU memory of an emulated {card / GiB:.0f} GiB card"
            )
        return float(usable), f"available RAM (emulated: {card / GiB:.0f} GiB less a CUDA context)"

    if run.cuda:
        total = torch.cuda.get_device_properties(run.device).total_memory
        torch.cuda.set_per_process_memory_fraction(usable / total, run.device)
        print(
            f"emulated card: the allocator capped at {mib(usable)} MiB of {mib(total)} MiB "
            f"({usable / total:.4f}); allocated already: {mib(torch.cuda.memory_allocated(run.device))} MiB"
        )
    else:
        not_here("the allocator cap of an 8 GB card (set_per_process_memory_fraction)")
    memory.available_bytes = available
    try:
        yield usable
    finally:
        memory.available_bytes = real
        if run.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, run.device)


def instrument(trainer, memory: Memory, rows: list[dict], evals: list[dict]) -> None:
    """Record memory around each rollout (trainer.generate), from its end to the end of the step
    (log-probs, the update, a sync), and around each eval (trainer.evaluate)."""
    from lora_grpo.rollout import fast_decode

    generate, evaluate = trainer.generate, trainer.evaluate

    def measured_generate(*a, **k):
        before = memory.now()
        memory.reset_peak()
        rollout = generate(*a, **k)
        rows.append(
            {
                "before": before,
                "after": memory.now(),
                "rollout_peak": memory.peak(),
                "kept": fast_decode.kept_cache_bytes(trainer.model),
            }
        )
        memory.reset_peak()
        return rollout

    def measured_evaluate(*a, **k):
        before = memory.now()
        memory.reset_peak()
        metrics = evaluate(*a, **k)
        evals.append({"before": before, "peak": memory.peak()})
        memory.reset_peak()
        return metrics

    def step_end(event, _trainer, **_payload):
        if event == "step_end" and rows:
            rows[-1]["update_peak"] = memory.peak()

    trainer.generate, trainer.evaluate = measured_generate, measured_evaluate
    trainer.hooks.append(step_end)


def check_recipe_memory(run: Run, recipe: str, shape: str, keep: bool = False) -> None:
    from lora_grpo import GRPOTrainer
    from lora_grpo.memory.estimate import CUDA_CONTEXT, SLACK, run_memory
    from lora_grpo.memory.probe import MemoryBudgetError
    from lora_grpo.rollout import fast_decode

    # What an earlier section left for a later one (section 2's trainer for section 3) is dropped:
    # on the emulated card it would count as this section's memory. A trainer that ran sits in
    # reference cycles (its hooks, the measured methods): collected here on any device, not only
    # by release()'s collection on a GPU, so the CPU dry run frees it too.
    run.results.clear()
    gc.collect()
    fresh_compiler(run)
    shape = run.shape(shape)
    path = run.model(shape)
    memory = Memory(run.device)
    config = recipe_config(run, recipe, path, f"{run.root}/{recipe}")
    vocab = QWEN2_SHAPES[shape]["vocab_size"]
    prompts = token_prompts(vocab, config.max_prompt_length, count=64 + config.generation_batch)
    train, held_out = prompts[:64], prompts[64:]  # the eval: one decode of the rollout's rows
    start = memory.now()[0]
    with emulated_card(run), CudagraphSkips() as skips:
        trainer = GRPOTrainer(
            config, reward_funcs=[even_token_share], train_dataset=train, eval_dataset=held_out
        )
        release(run)  # the allocator holds what the loaded model uses, no more
        loaded = memory.now()[0]
        print(
            f"{recipe} settings on a random {shape}: {config.prompts_per_step} prompts × G {config.num_generations}, "
            f"{config.max_prompt_length} + {config.max_completion_length} tokens, quantization {config.quantization}, "
            f"torch_dtype {config.torch_dtype}, decode_mode {config.decode_mode}; eval of {len(held_out)} prompts"
        )
        print(
            f"loaded model + adapters: {mib(loaded - start)} MiB {'allocated' if memory.cuda else 'resident'}"
        )
        rows: list[dict] = []
        evals: list[dict] = []
        instrument(trainer, memory, rows, evals)
        trainer.train()
        overall = memory.now()
    plan = trainer.memory_plan
    mode = fast_decode.resolve_decode_mode(config.decode_mode, trainer.model, run.device)
    FINDINGS.update(
        {"shape": shape, "decode": mode, "loaded_mib": (loaded - start) / MiB, "steps": len(rows)}
    )
    if plan is None:
        raise RuntimeError("no memory plan: the recipe's sizes should be 'auto'")
    print("plan:", plan.describe(config.micro_batch_size == "auto", config.gradient_checkpointing == "auto"))
    pass_bytes = plan.measured[plan.gradient_checkpointing][plan.micro_batch_size]
    print(
        f"plan figures over the loaded model (MiB): rollout {mib(plan.rollout)} (kept caches {mib(plan.kept)} of "
        f"it), training pass {mib(pass_bytes)}, optimizer states {mib(plan.optimizer)}, need {mib(plan.need)}, "
        f"budget {mib(plan.budget)}"
    )
    print(
        "| step | allocated before rollout | reserved before | allocated after | rollout peak − loaded "
        "(alloc / reserved) | kept caches | update peak − loaded (alloc / reserved) | step s |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def over(peak, i):
        return None if peak is None else peak[i] - loaded

    for step, (row, metrics) in enumerate(zip(rows, trainer.state.log_history), 1):
        (a0, r0), (a1, _) = row["before"], row["after"]
        rollout, update = row["rollout_peak"], row.get("update_peak")
        print(
            f"| {step} | {mib(a0)} | {mib(r0)} | {mib(a1)} | {mib(over(rollout, 0))} / {mib(over(rollout, 1))} | "
            f"{mib(row['kept'])} | {mib(over(update, 0))} / {mib(over(update, 1))} | "
            f"{metrics.get('time/step', float('nan')):.2f} |"
        )
    for e in evals:
        print(f"eval: peak − loaded {mib(over(e['peak'], 0))} allocated / {mib(over(e['peak'], 1))} reserved")
    kept = max((row["kept"] for row in rows), default=0)
    stays = rows[0]["after"][0] - rows[0]["before"][0] if rows else 0  # what the first rollout left allocated
    FINDINGS.update(
        {
            "micro_batch_size": plan.micro_batch_size,
            "gradient_checkpointing": plan.gradient_checkpointing,
            "plan_mib": {
                "rollout": plan.rollout / MiB,
                "kept": plan.kept / MiB,
                "pass": pass_bytes / MiB,
                "optimizer": plan.optimizer / MiB,
                "need": plan.need / MiB,
                "budget": plan.budget / MiB,
            },
            "kept_caches_mib": kept / MiB,
            "stays_after_first_rollout_mib": stays / MiB,
            "cudagraph_skips": skips.count,
            "cudagraph_skip_reasons": skips.reasons[:5],
        }
    )
    try:  # memory_estimate's figures at the sizes the probe chose: what the recipes' headers are made of
        estimate = run_memory(
            config,
            trainer.model.get_base_model().config,
            CARD,
            dtype=trainer.model.get_input_embeddings().weight.dtype,
            mode=mode,
            longest_prompt=trainer.prompt_lengths["train_dataset"].longest,
            eval_longest_prompt=trainer.prompt_lengths["train_dataset"].longest,  # the same token prompts
            micro_batch_size=plan.micro_batch_size,
            gradient_checkpointing=plan.gradient_checkpointing,
        )
        estimated_pass = estimate.plan.measured[plan.gradient_checkpointing][plan.micro_batch_size]
        print(
            f"memory_estimate at these sizes (MiB): weights + adapters {mib(estimate.weights + estimate.adapters)} "
            f"(loaded here {mib(loaded - start)}), training pass {mib(estimated_pass)} (probed {mib(pass_bytes)}), "
            f"rollout {mib(estimate.plan.rollout)}, total with {SLACK - 1:.0%} slack and the {mib(CUDA_CONTEXT)} MiB "
            f"context {mib(estimate.total)}"
            + (f" (measured: peak reserved {mib(overall[1])} + the context)" if memory.cuda else "")
        )
        FINDINGS["estimate_mib"] = {
            "weights_and_adapters": (estimate.weights + estimate.adapters) / MiB,
            "pass": estimated_pass / MiB,
            "total": estimate.total / MiB,
        }
    except MemoryBudgetError as e:
        print(f"memory_estimate at these sizes refuses the run: {e}")
        FINDINGS["estimate_mib"] = f"refused: {str(e)[:300]}"
    if memory.cuda:
        FINDINGS["reserved_at_end_mib"] = overall[1] / MiB
        check_against_plan(plan, rows, evals, loaded, kept, stays, pass_bytes)
        expect(
            skips.count == 0,
            f"the training decode ran as CUDA graphs (cudagraph skips: {skips.count}; {skips.reasons[:2]})",
        )
    else:
        not_here("allocator peaks against the plan (CUDA only; a CPU's resident set is not the allocator's)")
    expect(bool(rows) and len(evals) == 1, f"{len(rows)} rollouts and {len(evals)} eval measured")
    if keep:
        run.results["recipe"] = (trainer, train)


def check_against_plan(plan, rows, evals, loaded, kept, stays, pass_bytes) -> None:
    """The thresholds of sections 2 and 4 (the module docstring), each peak over the loaded model."""
    opt = plan.optimizer

    def worst(key, i, items):
        values = [item[key][i] - loaded for item in items if item.get(key) is not None]
        return max(values, default=0.0)

    rollout_a, rollout_r = worst("rollout_peak", 0, rows), worst("rollout_peak", 1, rows)
    update_a, update_r = worst("update_peak", 0, rows), worst("update_peak", 1, rows)
    eval_a, eval_r = worst("peak", 0, evals), worst("peak", 1, evals)
    FINDINGS["measured_mib"] = {
        "rollout_allocated": rollout_a / MiB,
        "rollout_reserved": rollout_r / MiB,
        "update_allocated": update_a / MiB,
        "update_reserved": update_r / MiB,
        "eval_allocated": eval_a / MiB,
        "eval_reserved": eval_r / MiB,
    }
    expect(
        rollout_a <= plan.rollout + opt,
        f"rollout allocated {mib(rollout_a)} ≤ plan rollout {mib(plan.rollout)} + optimizer {mib(opt)} MiB",
    )
    expect(
        update_a <= opt + plan.kept + pass_bytes,
        f"update allocated {mib(update_a)} ≤ optimizer {mib(opt)} + kept {mib(plan.kept)} + pass {mib(pass_bytes)} MiB",
    )
    expect(eval_a <= plan.need, f"eval allocated {mib(eval_a)} ≤ plan need {mib(plan.need)} MiB")
    expect(kept <= plan.kept, f"kept caches {mib(kept)} ≤ plan kept {mib(plan.kept)} MiB")
    expect(
        stays <= plan.kept + STAYS_SLACK,
        f"left allocated by the first rollout {mib(stays)} ≤ plan kept {mib(plan.kept)} + {mib(STAYS_SLACK)} MiB",
    )
    for what, value in (("rollout", rollout_r), ("update", update_r), ("eval", eval_r)):
        expect(value <= plan.need, f"{what} reserved {mib(value)} ≤ plan need {mib(plan.need)} MiB")


# ------------------------------------------------------------------------------ 3, 5. decode
@torch.no_grad()
def greedy_margin(model, rollout, rows: int = 4) -> tuple[float, float]:
    """(the largest margin by which the model's own logits, in one teacher-forced forward over a greedy
    rollout's tokens with the policy adapter, prefer another token to the one the decode chose; the
    largest |logit|). 0 for a decode that followed those logits exactly: a decode whose kernels round
    otherwise shows near-ties here, a wrong decode margins of the logits' own scale."""
    from lora_grpo.model.adapters import POLICY, use_adapter

    ids, mask, chosen = rollout.input_ids, rollout.attention_mask, rollout.completion_ids
    width, margin, largest = chosen.shape[1], 0.0, 0.0
    with use_adapter(model, POLICY):
        for s in range(0, ids.shape[0], rows):
            m = mask[s : s + rows]
            positions = (m.long().cumsum(-1) - 1).clamp(min=0)
            logits = (
                model(
                    input_ids=ids[s : s + rows],
                    attention_mask=m,
                    position_ids=positions,
                    logits_to_keep=width + 1,
                )
                .logits[:, :-1]
                .float()
            )
            real = rollout.completion_mask[s : s + rows].bool()
            gap = logits.max(-1).values - logits.gather(-1, chosen[s : s + rows, :, None]).squeeze(-1)
            if real.any():
                margin = max(margin, gap[real].max().item())
                largest = max(largest, logits[real].abs().max().item())
            del logits
    return margin, largest


def greedy_verdict(model, eager, fast) -> tuple[float, float, float, float]:
    """Two greedy rollouts of the same prompts, by the eager sampler and another: (the share of rows
    with the same tokens, the eager and the other decode's greedy_margin, the other's tolerance: the
    logits' rounding, 8 ulps of the largest, or 4 times the eager decode's own margin)."""
    same = (eager.completion_ids == fast.completion_ids).all(1).float().mean().item()
    (m_eager, z_eager), (m_fast, z_fast) = greedy_margin(model, eager), greedy_margin(model, fast)
    dtype = model.get_input_embeddings().weight.dtype
    tolerance = 1e-3 + 8 * torch.finfo(dtype).eps * max(z_eager, z_fast)
    return same, m_eager, m_fast, max(tolerance, 4 * m_eager)


def compare_greedy(
    model, tokenizer, texts, device, mode: str, num_generations: int, prompt: int, completion: int
):
    """Greedy rollouts of `texts` by the eager sampler and by `mode`, and their greedy_verdict."""
    from lora_grpo.rollout import generate_rollout

    def sample(decode_mode):
        return generate_rollout(
            model,
            tokenizer,
            texts,
            num_generations=num_generations,
            max_prompt_length=prompt,
            max_completion_length=completion,
            temperature=0.0,
            generator=torch.Generator(device=device),
            decode_mode=decode_mode,
        )

    return greedy_verdict(model, sample("eager"), sample(mode))


def check_decode(run: Run) -> None:
    from lora_grpo.device import now
    from lora_grpo.rollout import fast_decode, generate_rollout

    got = run.results.pop("recipe", None)
    if got is None:
        raise Skip("needs section 2's trained model")
    trainer, prompts = got
    cfg, device = trainer.config, run.device
    fast = "compiled" if run.cuda else "static"
    texts = [p["prompt"] for p in prompts[: cfg.prompts_per_step]]
    rollouts = {}
    for mode, attempts in (("eager", ("first",)), (fast, ("first", "second"))):
        for attempt in attempts:
            start = now(device)
            rollout = generate_rollout(
                trainer.model,
                trainer.tokenizer,
                texts,
                num_generations=cfg.num_generations,
                max_prompt_length=cfg.max_prompt_length,
                max_completion_length=cfg.max_completion_length,
                temperature=0.0,
                generator=torch.Generator(device=device),
                decode_mode=mode,
            )
            seconds = now(device) - start
            rollouts[mode] = rollout
            tokens = int(rollout.completion_mask.sum())
            FINDINGS[f"{mode}_{attempt}_tokens_per_s"] = tokens / seconds
            print(
                f"{mode:8s} {attempt:6s} call: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s"
                + (" (the shape training compiled)" if mode == "compiled" and attempt == "first" else "")
            )
    if not run.cuda:
        not_here("the compiled sampler (CUDA graphs): 'static' stands in")
    why = fast_decode.unavailable(trainer.model)
    expect(why is None, f"the {fast} sampler ran {fast} ({why or 'not refused'})")
    print(f"kept caches {mib(fast_decode.kept_cache_bytes(trainer.model))} MiB")
    same, m_eager, m_fast, tolerance = greedy_verdict(trainer.model, rollouts["eager"], rollouts[fast])
    FINDINGS.update({"same_rows": same, "margin_eager": m_eager, "margin_fast": m_fast})
    print(
        f"greedy rows with the same tokens, {fast} vs eager: {same:.0%} (bf16 kernels and attention over padded "
        "slots may flip near-ties on a GPU)"
    )
    expect(
        m_fast <= tolerance,
        f"each {fast} greedy token is the eager model's argmax up to rounding: margin {m_fast:.3g} ≤ {tolerance:.3g} "
        f"(eager's own {m_eager:.3g})",
    )
    counters = torch._dynamo.utils.counters
    breaks = sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])
    FINDINGS["graph_breaks"] = sum(v for _, v in breaks)
    FINDINGS["graph_break_reasons"] = [reason[:200] for reason, _ in breaks[:5]]
    print(
        f"dynamo: {counters['stats'].get('unique_graphs', 0)} graphs, {sum(v for _, v in breaks)} graph breaks; "
        f"frames {dict(counters['frames'])} (more compiled frames than graphs: recompiles, see the stderr lines)"
    )
    for reason, count in breaks[:8]:
        print(f"  graph break ×{count}: {reason[:200]}")
    del trainer


def check_decode_after_updates(run: Run) -> None:
    from lora_grpo import GRPOTrainer
    from lora_grpo.model.adapters import POLICY, lora_layers
    from lora_grpo.rollout import fast_decode

    shape = run.shape("small")
    path = run.model(shape, torch.float32)
    fast = "compiled" if run.cuda else "static"
    if not run.cuda:
        not_here("the compiled sampler and its cudagraph skips: 'static' stands in")
    prompts = token_prompts(QWEN2_SHAPES[shape]["vocab_size"], 16, count=32)
    completion = 8 if run.args.cpu else 32
    for dtype, alpha in (("float32", 1.0), ("bfloat16", 0.6)):
        fresh_compiler(run)
        config = tiny_config(
            path,
            f"{run.root}/after-updates-{dtype}",
            torch_dtype=dtype,
            decode_mode=fast,
            lora_r=16,
            lora_alpha=32,
            prompts_per_step=4,
            micro_batch_size=16,
            max_completion_length=completion,
            ref_sync_steps=1,
            ref_sync_alpha=alpha,
            max_steps=2,
            save_steps=0,
        )
        with CudagraphSkips() as skips:
            trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
            trainer.train()
        history = trainer.state.log_history
        lora_b = max(m.lora_B[POLICY].weight.abs().max().item() for _, m in lora_layers(trainer.model))
        why = fast_decode.unavailable(trainer.model)
        print(
            f"{dtype}: 2 steps, sync alpha {alpha} after each; max |lora_B| {lora_b:.3g}; cudagraph skips "
            f"{skips.count}; decode {fast}: {why or 'ran'}"
        )
        expect(lora_b > 0, f"{dtype}: lora_B is off zero after the optimizer steps")
        expect(history[0].get("sync/event") == 1.0, f"{dtype}: a sync between the two rollouts")
        expect(why is None, f"{dtype}: the {fast} sampler ran {fast} ({why or 'not refused'})")
        if run.cuda:
            expect(skips.count == 0, f"{dtype}: the training decode ran as CUDA graphs ({skips.reasons[:2]})")
        texts = [p["prompt"] for p in prompts[:4]]
        same, m_eager, m_fast, tolerance = compare_greedy(
            trainer.model, trainer.tokenizer, texts, run.device, fast, 4, None, completion
        )
        print(f"{dtype}: greedy rows with the same tokens, {fast} vs eager: {same:.0%}")
        FINDINGS[dtype] = {
            "same_rows": same,
            "margin_eager": m_eager,
            "margin_fast": m_fast,
            "cudagraph_skips": skips.count,
            "cudagraph_skip_reasons": skips.reasons[:5],
            "lora_b_max": lora_b,
        }
        if dtype == "float32":
            expect(same >= 0.9, f"float32: {same:.0%} of greedy rows the same (≥ 90%)")
        expect(
            m_fast <= tolerance,
            f"{dtype}: each {fast} greedy token is the eager model's argmax up to rounding: margin "
            f"{m_fast:.3g} ≤ {tolerance:.3g}",
        )
        del trainer
        release(run)


# ------------------------------------------------------------------------------ 6. bf16 KL
def check_bf16_kl(run: Run) -> None:
    from transformers import AutoModelForCausalLM

    from lora_grpo import GRPOConfig
    from lora_grpo.algo.logprobs import sequence_log_probs
    from lora_grpo.algo.loss import k3_kl
    from lora_grpo.model.adapters import POLICY, REFERENCE, lora_layers, use_adapter
    from lora_grpo.model.load import attach_adapters, keep_4bit_weights_fixed, load_model
    from lora_grpo.model.reference import sync_reference

    device, shape = run.device, run.shape("qwen2.5-0.5b")
    path = run.model(shape)
    cfg = GRPOConfig(model_name_or_path=path, lora_r=16, lora_alpha=32, gradient_checkpointing=False)
    models = {}
    for dtype in (torch.bfloat16, torch.float32):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        models[dtype] = attach_adapters(base, cfg).eval()
    bf16, fp32 = models[torch.bfloat16], models[torch.float32]
    four_bit, _ = load_model(
        GRPOConfig(
            model_name_or_path=path,
            tokenizer_name_or_path=f"{path}/tokenizer",
            quantization="4bit",
            torch_dtype="bfloat16",
            lora_r=16,
            lora_alpha=32,
            gradient_checkpointing=False,
        ),
        device_map={"": device},
    )
    keep_4bit_weights_fixed(four_bit)
    four_bit.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for model in (bf16, four_bit):
            for _, module in lora_layers(model):
                weight = module.lora_B[POLICY].weight
                weight.copy_(torch.randn(weight.shape, generator=g) * 0.02)
            sync_reference(model, 1.0)  # the reference slot: an exact copy of the policy, other factors
    batch, length, completion = (4, 64, 32) if run.args.cpu else (16, 256, 128)
    ids = torch.randint(3, QWEN2_SHAPES[shape]["vocab_size"], (batch, length), generator=g).to(device)
    mask = torch.ones_like(ids)

    def logp(model, adapter):
        with use_adapter(model, adapter), torch.no_grad():
            return sequence_log_probs(model, ids, mask, completion)[0]

    def own_logits_logp(model, adapter):  # log-probs from the model's own (bf16-rounded) logits
        with use_adapter(model, adapter), torch.no_grad():
            logits = (
                model(input_ids=ids, attention_mask=mask, logits_to_keep=completion + 1)
                .logits[:, :-1]
                .float()
            )
            return torch.log_softmax(logits, -1).gather(-1, ids[:, -completion:, None]).squeeze(-1)

    def kl(a, b) -> float:
        return k3_kl(a, b).mean().item()

    same = kl(logp(bf16, POLICY), logp(bf16, POLICY))
    same_4bit = kl(logp(four_bit, POLICY), logp(four_bit, POLICY))
    synced, synced_4bit = (kl(logp(m, POLICY), logp(m, REFERENCE)) for m in (bf16, four_bit))
    FINDINGS.update(
        {
            "kl_same_bf16": same,
            "kl_same_4bit": same_4bit,
            "kl_synced_bf16": synced,
            "kl_synced_4bit": synced_4bit,
        }
    )
    expect(same == 0, f"bf16 KL(policy ‖ the same policy) = {same:.3e}: exactly 0")
    expect(
        abs(same_4bit) < 1e-6,
        f"4-bit base, bf16 compute: KL(policy ‖ the same policy) = {same_4bit:.3e}: |KL| < 1e-6",
    )
    print(
        f"KL(policy ‖ reference right after a hard sync): bf16 {synced:.3e}, 4-bit {synced_4bit:.3e} (other factor "
        "shapes; the trainer skips this forward: reference_is_policy)"
    )
    with torch.no_grad():
        for _, module in lora_layers(bf16):  # a nearby reference: the policy's B moved by noise of std 0.005
            weight = module.lora_B[REFERENCE].weight
            weight.add_(torch.randn(weight.shape, generator=g).to(weight) * 0.005)
        fp32_params = dict(fp32.named_parameters())
        for name, p in bf16.named_parameters():
            if "lora_" in name:
                fp32_params[name].copy_(p.float())  # the same adapters (float32 in both) on the float32 base
    exact = kl(logp(fp32, POLICY), logp(fp32, REFERENCE))
    ours = kl(logp(bf16, POLICY), logp(bf16, REFERENCE))
    rounded = kl(own_logits_logp(bf16, POLICY), own_logits_logp(bf16, REFERENCE))
    FINDINGS.update({"kl_nearby_fp32": exact, "kl_nearby_ours_bf16": ours, "kl_nearby_bf16_logits": rounded})
    print(
        f"nearby adapters, KL per token: float32 model {exact:.4e}; bf16 model with lora_grpo's float32 head "
        f"{ours:.4e} ({ours / exact - 1:+.1%}); bf16 from the model's own bf16 logits {rounded:.4e} "
        f"({rounded / exact - 1:+.1%})"
    )
    del bf16, fp32, four_bit, models
    release(run)
    if run.cuda:
        check_tf32_head(run)
    else:
        not_here("the bf16 head's float32 matmul on TF32 (a CUDA mode)")


def check_tf32_head(run: Run) -> None:
    """A Qwen2.5-sized bf16 head through logprobs._head_logits (TF32 on CUDA) against float64, beside
    the same matmul in IEEE float32; the process's TF32 flag as it was."""
    from lora_grpo.algo.logprobs import _head_logits

    g = torch.Generator(device=run.device).manual_seed(0)
    hidden = torch.randn(256, 896, generator=g, device=run.device).to(torch.bfloat16)
    weight = (torch.randn(151936, 896, generator=g, device=run.device) * 0.05).to(torch.bfloat16)
    flag = torch.backends.cuda.matmul.allow_tf32
    ours = _head_logits(hidden, weight, None)
    ieee = hidden.float() @ weight.float().t()
    exact = hidden.double() @ weight.double().t()
    err_ours, err_ieee = (
        (ours.double() - exact).abs().max().item(),
        (ieee.double() - exact).abs().max().item(),
    )
    scale = exact.abs().max().item()
    FINDINGS.update({"tf32_head_error": err_ours, "ieee_head_error": err_ieee, "head_logit_scale": scale})
    print(
        f"bf16 head, float32 logits: max error TF32 {err_ours:.3g}, IEEE float32 {err_ieee:.3g} "
        f"(|logits| ≤ {scale:.3g})"
    )
    expect(  # exact products, float32 sums in another order: IEEE's error, not TF32's 2⁻¹¹ of each input
        err_ours <= max(4 * err_ieee, 1e-6 * scale),
        "the TF32 head matmul is as exact as IEEE float32 for bf16 inputs (≤ 4× its error)",
    )
    expect(torch.backends.cuda.matmul.allow_tf32 == flag, f"the TF32 flag restored ({flag})")


# ------------------------------------------------------------------------------ 7. resume
def tiny_config(path: str, out: str, **overrides):
    from lora_grpo import GRPOConfig

    fields = dict(
        model_name_or_path=path,
        tokenizer_name_or_path=f"{path}/tokenizer",
        quantization="4bit",
        lora_r=8,
        num_generations=4,
        prompts_per_step=2,
        max_prompt_length=None,
        max_completion_length=8,
        micro_batch_size=4,
        gradient_checkpointing=False,
        decode_mode="eager",
        beta=0.04,
        ref_sync_steps=2,
        ref_sync_alpha=0.6,
        learning_rate=1e-3,
        save_steps=1,
        logging_steps=1,
        output_dir=out,
        disable_tqdm=True,
        seed=0,
    )
    fields.update(overrides)
    return GRPOConfig(**fields)


def tiny_prompts(count: int = 16) -> list[dict]:
    return token_prompts(QWEN2_SHAPES["tiny"]["vocab_size"], 8, count=count)


def resume_here(path: str, checkpoint: str) -> None:
    """The CPU side of section 7 (run as a subprocess): resume `checkpoint` and train one more step."""
    from lora_grpo import GRPOTrainer

    step = int(Path(checkpoint).name.rsplit("-", 1)[1])
    out = str(Path(checkpoint).parent)
    config = tiny_config(path, out, max_steps=step + 1, resume_from_checkpoint=checkpoint)
    trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=tiny_prompts())
    assert trainer.accelerator.device.type == "cpu", trainer.accelerator.device
    trainer.train()
    states = trainer.optimizer.state.values()
    devices = {t.device.type for s in states for t in s.values() if isinstance(t, torch.Tensor)}
    print(
        f"resumed on {trainer.accelerator.device} at step {step}, trained to step {trainer.state.global_step}; "
        f"optimizer state on {sorted(devices)}; loss {trainer.state.log_history[-1]['loss']:.4f}"
    )


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """Both adapters' tensors (policy and reference), by name."""
    from lora_grpo.model.adapters import POLICY, REFERENCE

    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if f".{POLICY}." in n or f".{REFERENCE}." in n
    }


def run_and_resume(run: Run, path: str, tag: str) -> tuple[float, bool, float]:
    """A 3-step run (a checkpoint every step) and a second trainer resumed from its checkpoint-2 on
    the same device: (max |Δ| over both adapters' tensors, whether all are equal, their max |w|)."""
    from lora_grpo import GRPOTrainer

    out = run.root / f"resume-{tag}"
    whole = GRPOTrainer(
        tiny_config(path, str(out), max_steps=3),
        reward_funcs=[even_token_share],
        train_dataset=tiny_prompts(),
    )
    whole.train()
    again = run.root / f"resumed-{tag}"
    shutil.copytree(out / "checkpoint-2", again / "checkpoint-2")
    resumed = GRPOTrainer(
        tiny_config(path, str(again), max_steps=3, resume_from_checkpoint=str(again / "checkpoint-2")),
        reward_funcs=[even_token_share],
        train_dataset=tiny_prompts(),
    )
    resumed.train()
    a, b = adapter_tensors(whole.model), adapter_tensors(resumed.model)
    assert a.keys() == b.keys() and a, "no adapter tensors to compare"
    delta = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    scale = max(t.float().abs().max().item() for t in a.values())
    return delta, all(torch.equal(a[k], b[k]) for k in a), scale


def check_resume(run: Run) -> None:
    path = run.model("tiny", torch.float32)
    where = run.device.type
    strict = run.cuda  # CUDA's attention backward and some reductions are otherwise not deterministic
    if strict:
        torch.use_deterministic_algorithms(True)
    try:
        delta, equal, scale = run_and_resume(run, path, "same-device")
        mode = "deterministic algorithms" if strict else "a CPU"
    except RuntimeError as e:
        if not (strict and "deterministic" in str(e)):
            raise
        print(f"an op refused deterministic mode ({str(e)[:200]}); comparing without it")
        torch.use_deterministic_algorithms(False)
        delta, _, scale = run_and_resume(run, path, "loose")
        equal, mode = None, "default algorithms (deterministic mode refused)"
    finally:
        torch.use_deterministic_algorithms(False)
    FINDINGS.update({"max_delta": delta, "max_weight": scale, "equal": equal, "mode": mode})
    if equal is None:  # kernels that sum in a varying order: the same run up to their rounding
        expect(
            delta <= 1e-3 * scale,
            f"resumed on {where} ≈ the uninterrupted run after 3 steps: max |Δ| {delta:.3g} ≤ 1e-3 × "
            f"max |w| {scale:.3g} ({mode})",
        )
    else:
        expect(
            equal,
            f"resumed on {where} equals the uninterrupted run after 3 steps, tensor by tensor "
            f"(max |Δ| {delta:.3g}; {mode})",
        )
    checkpoint = run.root / "resume-same-device" / "checkpoint-2"
    if not checkpoint.exists():
        checkpoint = run.root / "resume-loose" / "checkpoint-2"
    print(f"the {where} run's {checkpoint.name}, resumed by a CPU-only process:")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cap = 240.0
    limit = run.limit(cap)
    try:
        result = run_child(
            [sys.executable, __file__, "--resume-on-cpu", str(checkpoint), "--model", path],
            timeout=limit,
            env=env,
        )
    except subprocess.TimeoutExpired:
        over_time("the CPU resume", limit, cap)
        return
    lines = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if "resumed on" in line or "sampling generator" in line or "Error" in line
    ]
    print("\n".join(lines[-6:]))
    expect(result.returncode == 0, f"the CPU resume ran (exit {result.returncode})")
    if result.returncode != 0:
        FINDINGS["cpu_resume_stderr"] = result.stderr[-2000:]


# ------------------------------------------------------------------------------ 8. pytest -m gpu
def check_pytest_gpu(run: Run) -> None:
    if not run.cuda:
        raise Skip("CUDA only: without a GPU every test it selects is skipped")
    if run.left() < 60:
        raise Late(f"{run.left():.0f} s of the budget left: too little for the GPU tests' subprocess")
    files = [str(p) for p in sorted((REPO / "tests").glob("test_*.py")) if "pytest.mark.gpu" in p.read_text()]
    cap = 240.0
    limit = run.limit(cap)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    print(" ".join(command[2:]), f"(limit {limit:.0f} s)")
    try:
        done = run_child(command, timeout=limit, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as e:
        print((e.stdout or "")[-3000:])
        over_time("pytest -m gpu", limit, cap)
        return
    output = done.stdout + done.stderr
    print("\n".join(output.splitlines()[-30:]))
    tally = [
        line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)
    ]
    counts = {
        k: int(n)
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", tally[-1] if tally else "")
    }
    FINDINGS.update({"counts": counts, "exit": done.returncode, "files": [Path(f).name for f in files]})
    expect(done.returncode == 0, f"pytest -m gpu passed (exit {done.returncode}, {counts})")
    expect(
        counts.get("passed", 0) >= 1 and not counts.get("skipped"),
        "every selected GPU test ran (none skipped)",
    )


# ------------------------------------------------------------------------------ 9. tools
def check_tools(run: Run) -> None:
    from lora_grpo import GRPOConfig, GRPOTrainer
    from lora_grpo.rollout import fast_decode, generate_rollout
    from lora_grpo.tasks import calculator
    from lora_grpo.tasks.toy import make_tiny_model

    fresh_compiler(run)
    bundled = BUNDLE / CALCULATOR_BASE
    if (bundled / "config.json").is_file():  # pre-trained where the bundle was built, not on this CPU
        base = str(bundled)
        print(f"the calculator base from the bundle: {base}")
    elif run.args.cpu:  # a random tiny model with the task's tokenizer: pre-training takes minutes here
        base = run.root / "calculator-random"
        tokenizer = calculator.make_tokenizer()
        make_tiny_model(tokenizer, max_positions=256).save_pretrained(base)
        tokenizer.save_pretrained(base)
        base = str(base)
        not_here("the pre-trained calculator base (no bundle here; a random one rarely calls)")
    else:
        raise RuntimeError(
            f"no calculator base in {bundled}: build the bundle where the checkout is (python "
            "benchmarks/gpu_bundle.py, which pre-trains it there) and carry gpu_bundle/; pre-training it "
            "here would spend the GPU's time on this machine's CPU"
        )
    FINDINGS["base"] = base
    fast = "compiled" if run.cuda else "static"
    completion = 48 if run.args.cpu else 112
    config = GRPOConfig(
        model_name_or_path=base,
        quantization="none",  # as the toy-calculator recipe: this 0.3M base does not survive 4-bit
        torch_dtype="float32",
        lora_r=8,
        lora_alpha=16,
        tools=["lora_grpo.tasks.calculator:calculator"],
        max_tool_calling_iterations=1,
        tool_timeout=5.0,
        num_generations=4 if run.args.cpu else 8,
        prompts_per_step=2 if run.args.cpu else 4,
        max_prompt_length=48,
        max_completion_length=completion,
        micro_batch_size=8,
        gradient_checkpointing=False,
        decode_mode=fast,
        learning_rate=1e-3,
        beta=0.04,
        ref_sync_steps=1,
        ref_sync_alpha=0.6,
        max_steps=2,
        save_steps=0,
        logging_steps=1,
        output_dir=str(run.root / "tools"),
        disable_tqdm=True,
        seed=0,
    )
    with CudagraphSkips() as skips:
        trainer = GRPOTrainer(
            config,
            reward_funcs=[calculator.calculator_reward],
            train_dataset=calculator.calculator_problems(64),
        )
        trainer.train()
    history = trainer.state.log_history
    calls = [m.get("tools/call_frequency", 0.0) for m in history]
    why = fast_decode.unavailable(trainer.model)
    print(
        f"training: tools/call_frequency per step {calls}; cudagraph skips {skips.count}; decode {fast}: {why or 'ran'}"
    )
    expect(all(math.isfinite(m["loss"]) for m in history), "finite losses")
    expect(why is None, f"the {fast} sampler ran {fast} with tools ({why or 'not refused'})")
    if run.cuda:
        expect(sum(calls) > 0, "the training rollouts called the tool")
        expect(skips.count == 0, f"the training decode ran as CUDA graphs ({skips.reasons[:2]})")
    box = trainer.sampler.toolbox
    rows = calculator.calculator_problems(8, split="eval")
    texts = [box.render_prompt(m) for m in rows["prompt"]]

    def sample(mode):
        return generate_rollout(
            trainer.model,
            trainer.tokenizer,
            texts,
            num_generations=4,
            max_prompt_length=None,
            max_completion_length=completion,
            temperature=1.0,
            generator=torch.Generator(device=run.device).manual_seed(0),
            decode_mode=mode,
            tools=box,
            max_tool_calling_iterations=1,
        )

    eager, fast_rollout = sample("eager"), sample(fast)
    same = (eager.completion_ids == fast_rollout.completion_ids).all(1).float().mean().item()
    counted = {name: int(r.tool_calls.sum()) for name, r in (("eager", eager), (fast, fast_rollout))}
    FINDINGS.update(
        {
            "training_call_frequency": calls,
            "same_rows": same,
            "tool_calls": counted,
            "cudagraph_skips": skips.count,
        }
    )
    print(
        f"sampled tool rollouts (T = 1, one seed), {fast} vs eager: {same:.0%} of rows the same; calls {counted}"
    )
    expect(same >= 0.9, f"{same:.0%} of sampled float32 tool rollouts the same in both samplers (≥ 90%)")


# ------------------------------------------------------------------------------ 10. reward model
def check_reward_model(run: Run) -> None:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from lora_grpo import GRPOTrainer
    from lora_grpo.rewards import RewardModel

    path = run.model("tiny", torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(f"{path}/tokenizer")
    reward_path = run.root / "reward"
    torch.manual_seed(1)
    spec = Qwen2Config(
        **QWEN2_SHAPES["tiny"], num_labels=1, pad_token_id=0, eos_token_id=1, bos_token_id=None
    )
    Qwen2ForSequenceClassification(spec).save_pretrained(reward_path)  # float32 on disk
    scorer = RewardModel(str(reward_path), tokenizer=tokenizer)
    seen: list[int] = []
    scorer.model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(
            int((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[0])
        ),
        with_kwargs=True,
    )
    config = tiny_config(
        path, str(run.root / "reward-run"), micro_batch_size="auto", max_steps=2, save_steps=0
    )
    trainer = GRPOTrainer(config, reward_funcs=[scorer], train_dataset=tiny_prompts())
    trainer.hooks.append(
        lambda event, _t, **_: seen.clear() if event == "train_begin" else None
    )  # the probe's are planned
    trainer.train()
    plan = trainer.memory_plan
    dtype = trainer.model.get_input_embeddings().weight.dtype
    parameter = next(scorer.model.parameters())
    means = [m.get(f"rewards/{scorer.__name__}/mean") for m in trainer.state.log_history]
    FINDINGS.update(
        {
            "rows_per_forward": sorted(set(seen)),
            "plan_forward_rows": plan.forward_rows if plan else None,
            "reward_model": f"{parameter.dtype} on {parameter.device}",
            "reward_means": means,
        }
    )
    print(
        f"reward model {scorer.__name__}: {parameter.dtype} on {parameter.device} (run: {dtype}); rows per scoring "
        f"forward {sorted(set(seen))}, plan {plan.forward_rows if plan else '-'}; rewards/mean {means}"
    )
    expect(
        parameter.device.type == run.device.type and parameter.dtype == dtype,
        "the reward model on the run's device and dtype",
    )
    expect(all(m is not None and math.isfinite(m) for m in means), "finite rewards at every step")
    expect(
        plan is not None and bool(seen) and max(seen) <= plan.forward_rows,
        "scoring forwards within the plan's rows",
    )


# ------------------------------------------------------------------------------ 11. paged_adamw_8bit
def paged_run(path: str, rank: int, out: str) -> dict:
    """Section 11's worker (a fresh process: a hang in CUDA managed memory is killed at its time
    limit): 3 steps with paged_adamw_8bit on the model at `path`; what section 11 judges."""
    from lora_grpo import GRPOTrainer
    from lora_grpo.model.adapters import POLICY

    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    config = tiny_config(path, out, optimizer="paged_adamw_8bit", lora_r=rank, max_steps=3, save_steps=0)
    trainer = GRPOTrainer(
        config, reward_funcs=[even_token_share], train_dataset=token_prompts(vocab, 8, count=16)
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if f".{POLICY}." in n}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    moved = sum(not torch.equal(before[n], after[n]) for n in before)
    states = [s for s in trainer.optimizer.state.values() if "state1" in s]
    return {
        "optimizer": type(trainer.optimizer).__name__,
        "device": trainer.accelerator.device.type,
        "tensors_moved": moved,
        "tensors": len(before),
        "states": len(states),
        "eight_bit_states": sum(s["state1"].dtype == torch.uint8 for s in states),
        "paged_states": sum(bool(getattr(s["state1"], "is_paged", False)) for s in states),
        "losses": [m["loss"] for m in trainer.state.log_history],
    }


def check_paged_adamw(run: Run) -> None:
    # bitsandbytes keeps the states of tensors under 4096 entries in 32 bits and pages only those of
    # 100,000 entries or more: rank 128 on "small" gives such LoRA tensors (down_proj's A, gate/up's B)
    shape = run.shape("small")
    path = run.model(shape, torch.float32)
    rank = 64 if shape == "tiny" else 128
    cap = 180.0
    limit = run.limit(cap)
    command = [
        sys.executable,
        __file__,
        "--paged-worker",
        str(rank),
        "--model",
        path,
        "--scratch",
        str(run.root / "paged"),
    ]
    print(f"3 steps with paged_adamw_8bit in a fresh process (limit {limit:.0f} s)", flush=True)
    try:
        found = run_worker(command, "the paged_adamw_8bit run", timeout=limit)
    except subprocess.TimeoutExpired:
        raise Stopped(
            f"the paged_adamw_8bit run (CUDA managed memory) did not finish within {limit:.0f} s "
            + ("(what the --budget left)" if limit < cap else "(its cap: a hang?)")
        ) from None
    FINDINGS.update(found)
    losses = found["losses"]
    print(
        f"{found['optimizer']} on {found['device']}: {found['tensors_moved']}/{found['tensors']} policy tensors "
        f"moved; of {found['states']} states {found['eight_bit_states']} 8-bit, {found['paged_states']} paged; "
        f"losses {[f'{x:.4f}' for x in losses]}"
    )
    expect(found["optimizer"] == "PagedAdamW8bit", "bitsandbytes' PagedAdamW8bit")
    expect(all(math.isfinite(x) for x in losses), "finite losses")
    expect(found["tensors_moved"] > 0, "the policy adapter moved")
    expect(found["eight_bit_states"] > 0, "8-bit states for the large LoRA tensors")
    if run.cuda:
        expect(
            found["paged_states"] > 0,
            "paged states (CUDA unified memory) for the tensors of 100,000 entries or more",
        )
    else:
        not_here("paged states: bitsandbytes pages only on CUDA (a CPU falls back to unpaged)")


# ------------------------------------------------------------------------------ 12. vs TRL
def peer_settings(run: Run) -> dict:
    """The same work for both trainers: prompts, G, lengths, LoRA, beta, steps (the first not counted)."""
    if run.args.cpu:
        return dict(shape="tiny", prompts=2, generations=4, prompt=8, completion=8, steps=2, rank=8)
    return dict(shape="qwen2.5-0.5b", prompts=2, generations=8, prompt=64, completion=128, steps=4, rank=16)


def peer_run(which: str, path: str, settings: dict, cuda: bool) -> dict:
    """One trainer's run (the worker of section 12): step times (start to start; the first, which
    compiles or warms up, left out) and peak memory (CUDA: the allocator's, over the whole process and
    over the loaded model; CPU: the resident set)."""
    import resource

    s = settings
    sequences = s["prompts"] * s["generations"]
    prompts = token_prompts(QWEN2_SHAPES[s["shape"]]["vocab_size"], s["prompt"], count=16 * s["prompts"])
    times: list[float] = []
    tokens: list[float] = []
    if which == "ours":
        from lora_grpo import GRPOConfig, GRPOTrainer

        config = GRPOConfig(
            model_name_or_path=path,
            tokenizer_name_or_path=f"{path}/tokenizer",
            quantization="4bit",
            lora_r=s["rank"],
            lora_alpha=2 * s["rank"],
            lora_target_modules=TARGETS,
            num_generations=s["generations"],
            prompts_per_step=s["prompts"],
            max_prompt_length=None,
            max_completion_length=s["completion"],
            beta=0.04,
            learning_rate=1e-5,
            max_steps=s["steps"] + 1,
            save_steps=0,
            logging_steps=1,
            output_dir=tempfile.mkdtemp(),
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
        loaded = torch.cuda.memory_allocated() if cuda else 0
        for metrics, seconds in train_steps(trainer):
            times.append(seconds)
            tokens.append(metrics["completion_length/mean"] * sequences)
        sizes = f"micro_batch_size {trainer.micro_batch_size}, gradient_checkpointing {trainer.gradient_checkpointing}"
    else:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        compute = torch.bfloat16 if cuda else torch.float32
        model = load_peer_model(path, "4bit", compute=compute, device_map={"": 0 if cuda else "cpu"})
        step_times, times, tokens = trl_step_timer(sequences)

        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(),
            per_device_train_batch_size=sequences,
            gradient_accumulation_steps=1,
            num_generations=s["generations"],
            max_completion_length=s["completion"],
            gradient_checkpointing=True,
            beta=0.04,
            learning_rate=1e-5,
            max_steps=s["steps"] + 1,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            bf16=cuda,
            fp16=False,
            use_cpu=not cuda,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[even_token_share],
            args=config,
            train_dataset=Dataset.from_list(prompts),
            processing_class=AutoTokenizer.from_pretrained(f"{path}/tokenizer"),
            peft_config=LoraConfig(
                r=s["rank"],
                lora_alpha=2 * s["rank"],
                lora_dropout=0.0,
                target_modules=TARGETS,
                task_type="CAUSAL_LM",
            ),
            callbacks=[step_times],
        )
        loaded = torch.cuda.memory_allocated() if cuda else 0
        trainer.train()
        sizes = f"one micro-batch of {sequences}, gradient checkpointing on"
    measured = times[1:] or times
    step = sorted(measured)[len(measured) // 2] if measured else math.nan
    result = {"step_s": step, "steps_timed": len(measured), "sizes": sizes}
    if tokens:
        result["tokens_per_s"] = (sum(tokens[-len(measured) :]) / sum(measured)) if measured else math.nan
    if cuda:
        result.update(
            peak_allocated_mib=torch.cuda.max_memory_allocated() / MiB,
            peak_reserved_mib=torch.cuda.max_memory_reserved() / MiB,
            above_loaded_mib=(torch.cuda.max_memory_allocated() - loaded) / MiB,
        )
    else:
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def check_vs_trl(run: Run) -> None:
    try:
        import trl
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        raise Skip(f"trl does not import: {type(e).__name__}: {str(e)[:200]}") from None
    if run.cuda and run.left() < 120:
        raise Late(f"{run.left():.0f} s of the budget left: too little for two fresh trainer processes")
    settings = peer_settings(run)
    path = run.model(settings["shape"])
    print(
        f"TRL {trl.__version__} against lora_grpo on a random {settings['shape']}, 4-bit: "
        f"{settings['prompts']} prompts × G {settings['generations']}, {settings['prompt']} + "
        f"{settings['completion']} tokens, LoRA r {settings['rank']} on every linear layer, beta 0.04, "
        f"{settings['steps']} timed steps after one; each at its defaults"
    )
    results = {}
    for which in ("ours", "trl"):
        if run.args.cpu:  # the dry run: both in this process (memory not compared)
            results[which] = peer_run(which, path, settings, cuda=False)
            continue
        cap = 300.0
        limit = run.limit(cap)  # the second process gets what the first left
        command = [
            sys.executable,
            __file__,
            "--peer-worker",
            which,
            "--model",
            path,
            "--peer-settings",
            json.dumps(settings),
        ]
        try:
            results[which] = run_worker(command, f"the {which} run", timeout=limit)
        except subprocess.TimeoutExpired:
            over_time(f"the {which} run", limit, cap)
            return
    if run.args.cpu:
        not_here("peak memory in fresh processes (the dry run runs both trainers in this one)")
    FINDINGS.update(results)
    ours, peer = results["ours"], results["trl"]
    for which, r in results.items():
        print(f"{which}: {r}")
    print(f"step time ours / TRL: {ours['step_s'] / peer['step_s']:.2f}")
    if run.cuda:
        print(
            f"peak allocated ours / TRL: {ours['peak_allocated_mib'] / peer['peak_allocated_mib']:.2f}; above the "
            f"loaded model: {ours['above_loaded_mib']:,.0f} vs {peer['above_loaded_mib']:,.0f} MiB"
        )
    expect(all(math.isfinite(r["step_s"]) for r in results.values()), "both trainers ran their steps")


# ------------------------------------------------------------------------------ main
# The order they run in: the cheap sections first (tiny or small models, no compiled decode), then
# the ones that compile a decode (the recipes' 24- and 28-layer 4-bit + LoRA models first); the
# numbers stay those of the docs.
SECTIONS = [
    ("1. devices", check_devices),
    ("7. resume: on the same device, and on a CPU", check_resume),
    ("8. pytest -m gpu", check_pytest_gpu),
    ("10. reward model", check_reward_model),
    ("11. paged_adamw_8bit", check_paged_adamw),
    ("6. bf16 KL", check_bf16_kl),
    (
        "2. memory: the 0.5B recipe on an emulated 8 GB card",
        lambda run: check_recipe_memory(
            run, "qwen2.5-0.5b-gsm8k-qlora", "qwen2.5-0.5b", keep=run.selected(3)
        ),
    ),
    ("3. decode: compiled vs eager, graph breaks, recompiles", check_decode),
    (
        "4. memory: the 1.5B recipe on an emulated 8 GB card",
        lambda run: check_recipe_memory(run, "qwen2.5-1.5b-gsm8k-calculator-qlora", "qwen2.5-1.5b"),
    ),
    ("5. decode after updates: compiled vs eager in float32 and bf16", check_decode_after_updates),
    ("9. tools with the compiled decode", check_tools),
    ("12. step time and peak memory against TRL + PEFT", check_vs_trl),
]
# Seconds each section is expected to take on the lent H200 (estimates: no GPU has run the check
# yet), for the plan printed at the start and the device-time plan in benchmarks/README.md.
ESTIMATES = {1: 5, 7: 25, 8: 20, 10: 10, 11: 20, 6: 20, 2: 150, 3: 20, 4: 200, 5: 60, 9: 30, 12: 90}
NEEDS = {3: 2}  # section 3 runs on section 2's trained model, in the same process


def section_number(title: str) -> int:
    return int(title.split(".")[0])


def record(title: str, status: str, seconds: float, reason: str | None, again: bool) -> None:
    """One section's entry in SUMMARY; `again`: it is named in the rerun command (stopped, or
    skipped for want of time)."""
    SUMMARY[title] = {
        "status": status,
        "seconds": round(seconds, 1),
        "reason": reason,
        "rerun": again,
        "findings": dict(FINDINGS),
    }


def run_section(title: str, check, run: Run) -> None:
    """Run one section (or skip it: not selected, past the budget, or Skip raised) and record its
    status, seconds and findings; a failure is printed with its traceback and the run goes on."""
    number = section_number(title)
    print(f"\n## {title}", flush=True)
    start = time.perf_counter()
    status, reason, again = "passed", None, False
    with LOCK:
        FINDINGS.clear()
        RUNNING.update(section=title, since=time.strftime("%H:%M:%S"), at_s=round(run.elapsed(), 1))
    if not run.selected(number):
        status, reason = "skipped", "not in --only"
    elif run.left() <= 0:
        status, reason, again = "skipped", f"past the --budget of {run.args.budget:.0f} s", True
    else:
        print(f"running: §{number} since {RUNNING['since']} ({RUNNING['at_s']} s into the run)", flush=True)
        if run.args.out:
            with LOCK:
                write_summary(run.args.out, run.elapsed())
        try:
            check(run)
            if FINDINGS.get("failures"):
                status = "failed"
        except Late as e:
            status, reason, again = "skipped", str(e), True
        except Skip as e:
            status, reason = "skipped", str(e)
        except Stopped as e:
            status, reason, again = "stopped", str(e), True
        except Exception as e:  # noqa: BLE001 - one section's failure must not hide the others' findings
            status = "failed"
            FINDINGS["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"FAILED: {title}\n{traceback.format_exc()}", flush=True)
        finally:
            release(run)
    if reason:
        print(f"({status}: {reason})", flush=True)
    with LOCK:
        record(title, status, time.perf_counter() - start, reason, again)
        RUNNING.clear()
    if number == 3:  # section 2's trainer was for section 3 alone
        run.results.pop("recipe", None)
    print(f"({time.perf_counter() - start:.1f} s)", flush=True)
    if run.args.out:
        with LOCK:
            write_summary(run.args.out, run.elapsed())


LABELS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "stopped": "STOP"}


def failed() -> list[str]:
    return [title for title, v in SUMMARY.items() if v["status"] == "failed"]


def rerun() -> str | None:
    """The second command on the lent machine: the sections this run stopped or skipped for want of
    time, in the order they run."""
    from gpu_bundle import rerun_command

    again = [section_number(title) for title, v in SUMMARY.items() if v.get("rerun")]
    again += [NEEDS[n] for n in again if n in NEEDS and NEEDS[n] not in again]
    order = [section_number(title) for title, _ in SECTIONS]
    again.sort(key=lambda n: order.index(n) if n in order else len(order))
    return rerun_command(",".join(map(str, again))) if again else None


def write_summary(out: str, seconds: float) -> None:
    """summary.json and summary.txt in `out`: the run's verdict so far, one entry per section."""
    Path(out).mkdir(parents=True, exist_ok=True)
    verdict = {
        "passed": not failed(),
        "failed": failed(),
        "skipped": [title for title, v in SUMMARY.items() if v["status"] == "skipped"],
        "stopped": [title for title, v in SUMMARY.items() if v["status"] == "stopped"],
        "rerun": rerun(),
        "seconds": round(seconds, 1),
        "budget": getattr(ARGS, "budget", None),
        "running": dict(RUNNING) or None,
        "sections": SUMMARY,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    (Path(out) / "summary.json").write_text(json.dumps(verdict, indent=2, default=str) + "\n")
    lines = []
    for title, v in SUMMARY.items():
        line = f"{LABELS[v['status']]} {title} ({v['seconds']} s)"
        detail = v["findings"].get("error") or "; ".join(v["findings"].get("failures", [])) or v["reason"]
        lines.append(line + (f": {detail[:300]}" if detail else ""))
    command = rerun()
    lines.append(f"{len(failed())} failed, {seconds:.0f} s")
    (Path(out) / "summary.txt").write_text(
        "\n".join(lines + ([f"rerun: {command}"] if command else [])) + "\n"
    )


def print_plan(run: Run) -> None:
    """The sections selected, in the order they run, with their estimated seconds, against the budget."""
    chosen = [section_number(title) for title, _ in SECTIONS if run.selected(section_number(title))]
    total = sum(ESTIMATES.get(n, 0) for n in chosen)
    print(
        f"plan: {', '.join(f'§{n} ~{ESTIMATES.get(n, 0)} s' for n in chosen)} (~{total} s estimated on an H200); "
        f"--budget {run.args.budget:g} s from the process's start, {run.elapsed():.0f} s gone",
        flush=True,
    )


def print_rerun() -> None:
    """The run's last line: the exact command for what it stopped or skipped for want of time."""
    command = rerun()
    print(
        f"rerun: {command}" if command else "rerun: none (no section was stopped or skipped for time)",
        flush=True,
    )


class Tee:
    """A stream that writes to the console and to log.txt in --out (what the lent machine returns)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text)
        return self.stream.write(text)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def stop(run: Run, why: str) -> None:
    """End the run now (the deadline's watchdog, or SIGTERM): the running section recorded as
    stopped, the selected sections not started yet as skipped (both named in the rerun command),
    the child processes killed, the summary written; the exit status is the number of failed
    sections, as at a normal end (a stopped section is not a failure)."""
    LOCK.acquire(timeout=10)  # the main thread holds it only while it writes the summary
    try:
        if RUNNING:
            title = RUNNING["section"]
            record(title, "stopped", run.elapsed() - RUNNING["at_s"], why, True)
            RUNNING.clear()
        for title, _ in SECTIONS:
            if title not in SUMMARY and run.selected(section_number(title)):
                FINDINGS.clear()
                record(title, "skipped", 0.0, f"not started: {why}", True)
        for child in list(CHILDREN):
            child.kill()
        print(f"\n{why} after {run.elapsed():.0f} s", flush=True)
        print_rerun()
        if run.args.out:
            write_summary(run.args.out, run.elapsed())
        sys.stdout.flush()
        sys.stderr.flush()
        shutil.rmtree(run.root, ignore_errors=True)  # the models built (os._exit skips the cleanup)
    finally:
        os._exit(len(failed()))


def watch(run: Run) -> threading.Timer:
    """The hard deadline: a timer thread at the budget (counted from the process's start) calls stop.
    A section stuck in C code that holds the GIL would keep that thread from running: faulthandler's
    own thread, which needs no GIL, ends the process GRACE seconds later (its tracebacks on stderr,
    exit 1; summary.json then still names the section running)."""
    timer = threading.Timer(max(0.0, run.left()), stop, (run, "stopped at the deadline"))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(max(1.0, run.left() + GRACE), exit=True, file=sys.__stderr__)
    return timer


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU with tiny shapes")
    parser.add_argument("--steps", type=int, default=2, help="training steps of sections 2 and 4")
    parser.add_argument(
        "--budget",
        type=float,
        default=300,
        help="seconds of wall time from the process's start: a hard deadline (sections past it stopped or skipped)",
    )
    parser.add_argument(
        "--only", type=lambda s: {int(x) for x in s.split(",")}, help="e.g. 2,4: these sections alone"
    )
    parser.add_argument("--out", help="write summary.json, summary.txt and log.txt to this folder")
    parser.add_argument("--resume-on-cpu", help=argparse.SUPPRESS)  # section 7's subprocess
    parser.add_argument("--peer-worker", choices=["ours", "trl"], help=argparse.SUPPRESS)  # section 12's
    parser.add_argument("--peer-settings", help=argparse.SUPPRESS)
    parser.add_argument("--paged-worker", type=int, help=argparse.SUPPRESS)  # section 11's, its LoRA rank
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global ARGS
    ARGS = args
    if args.resume_on_cpu or args.peer_worker or args.paged_worker:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        no_plots()
        if args.resume_on_cpu:
            resume_here(args.model, args.resume_on_cpu)
        elif args.paged_worker:
            print("RESULT " + json.dumps(paged_run(args.model, args.paged_worker, args.scratch)))
        else:
            result = peer_run(
                args.peer_worker, args.model, json.loads(args.peer_settings), torch.cuda.is_available()
            )
            print("RESULT " + json.dumps(result))
        return 0
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --cpu for a dry run")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        # Line-buffered: a run killed mid-section still leaves every line it printed.
        log = open(Path(args.out) / "log.txt", "w", buffering=1)  # noqa: SIM115 - open for the whole run
        sys.stdout, sys.stderr = Tee(sys.stdout, log), Tee(sys.stderr, log)
    if not args.cpu:
        # Section 7's deterministic mode needs it before cuBLAS starts (a 32 MiB workspace, Hopper's default).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("lora_grpo").setLevel(logging.INFO)  # what 'auto' chose, in one line each
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    torch._logging.set_logs(graph_breaks=True, recompiles=True)  # TORCH_LOGS="graph_breaks,recompiles"
    no_plots()
    with tempfile.TemporaryDirectory() as root:
        run = Run(args, device, root)
        signal.signal(signal.SIGTERM, lambda signum, frame: stop(run, "stopped by SIGTERM"))
        deadline = watch(run)
        print_plan(run)
        for title, check in SECTIONS:
            run_section(title, check, run)
        with LOCK:  # past the last section: the watchdog has nothing left to stop
            deadline.cancel()
            faulthandler.cancel_dump_traceback_later()
        seconds = run.elapsed()
    print(
        f"\n{len(failed())} section(s) failed{': ' + ', '.join(failed()) if failed() else ''}; "
        f"{sum(v['status'] == 'skipped' for v in SUMMARY.values())} skipped, "
        f"{sum(v['status'] == 'stopped' for v in SUMMARY.values())} stopped; {seconds:.0f} s in all"
    )
    print_rerun()
    if args.out:
        write_summary(args.out, seconds)
    return len(failed())


if __name__ == "__main__":
    sys.exit(main())
