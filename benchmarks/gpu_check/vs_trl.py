"""Section 12, against TRL + PEFT: step time (split into generation, rewards with reference log-probs,
and the update) and peak allocated and reserved memory of lora_grpo and of TRL's GRPOTrainer with a
peft LoraConfig, on the same random 4-bit model, prompts, reward and settings: both at their defaults,
and again with gradient checkpointing set alike (on, TRL's default: ours forced on).

Each trainer runs in a fresh worker process (two in all: ours trains its two variants one after the
other in its process). A worker prints one "STEP {json}" line as each step ends and one
"VARIANT {json}" line as each variant ends, and stops itself (after the step that would leave too
little of its time) before the parent's time limit; the parent records each worker's figures the
moment it ends, and from a worker its limit killed it reads the lines it printed, so a timeout of
the second keeps the first's figures, and the steps the second finished.

A step is timed from its start to its end (ours: the step_begin hook to the log event after the
step's sync and logging; TRL: on_step_begin to on_step_end, the optimizer step included), the CUDA
stream synchronised; the first step of a variant, which compiles or warms up, is left out of the
medians. The split: ours from its step metrics (time/rollout: sampling and rewards; time/log_probs:
the reference log-probs; time/train: the update); TRL's by timing its own methods on the trainer
(`_generate`: sampling; `_generate_and_score_completions` less `_generate`: rewards and the
reference log-probs; the rest of the step: the update)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks._common import (
    QWEN2_SHAPES,
    MiB,
    even_token_share,
    load_peer_model,
    run_worker,
    token_prompts,
)
from benchmarks.gpu_check.common import TARGETS
from benchmarks.gpu_check.harness import Late, Run, Skip, Stopped, process_age, worker_command, worker_options

# What each worker trains, in order: (variant, gradient_checkpointing; None: the trainer's default).
VARIANTS = {
    "ours": [("ours", None), ("ours_checkpointing", True)],
    "trl": [("trl", None)],
}
# The variants compared: (the name of the comparison, ours, TRL's).
PAIRS = [("defaults", "ours", "trl"), ("checkpointing alike (on)", "ours_checkpointing", "trl")]
# Seconds each worker may take at most (the budget may leave it less): ours compiles its decode in
# its first step (~50 s on the H200) and trains twice; TRL's first GPU run did not finish 5 steps of
# 64 + 128 tokens in 95 s, so it is sized smaller and stops itself when its steps are slow.
CAPS = {"ours": 120.0, "trl": 70.0}
# Seconds a worker keeps before its limit to end cleanly (its last lines printed).
SELF_STOP = 6.0
# Seconds that must be left after a variant's first step for its second step to start (estimated, not
# measured: a 0.5B step after the first took 8.9 s on the H200 at 64 + 128 tokens).
FIRST_RESERVE = 10.0
# A second variant of ours: loading its trainer (~7 s on the H200), and its first step's share of the first
# variant's (the decode re-traced for the new model; inductor's compiled code is cached in the process).
LOAD_S, RETRACE_SHARE = 7.0, 0.3
FIELDS = ("step_s", "generation_s", "scoring_s", "update_s")


def peer_settings(run: Run) -> dict:
    """The same work for both trainers: prompts, G, lengths, LoRA, beta, steps (the first not counted). Two
    timed steps on a GPU: ours' worker (its cap, CAPS) then fits its second variant, by the estimates."""
    if run.args.cpu:
        return dict(shape="tiny", prompts=2, generations=4, prompt=8, completion=8, steps=2, rank=8)
    return dict(shape="qwen2.5-0.5b", prompts=2, generations=8, prompt=64, completion=64, steps=2, rank=16)


def emit(kind: str, payload: dict) -> None:
    """One line for the parent, on the process's own stdout (ours trains with sys.stdout redirected)."""
    print(f"{kind} {json.dumps(payload)}", file=sys.__stdout__, flush=True)


def sync(cuda: bool) -> float:
    """The clock, after the CUDA stream's work is done."""
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


class Steps:
    """One variant's steps as they end: each emitted at once; `more()` says whether another step fits
    in the worker's time (`deadline`: seconds from the process's start, None for no limit)."""

    def __init__(self, variant: str, sequences: int, deadline: float | None):
        self.variant, self.sequences, self.deadline = variant, sequences, deadline
        self.done: list[dict] = []

    def add(self, **figures) -> None:
        figures = {"variant": self.variant, "step": len(self.done) + 1, **figures}
        self.done.append(figures)
        emit("STEP", figures)

    def more(self) -> bool:
        """Judged by the latest step after the first: the first compiles ours' decode (~50 s on the H200),
        which no later step repeats; after the first alone, another fits where FIRST_RESERVE is left."""
        if self.deadline is None or not self.done:
            return True
        if len(self.done) == 1:
            return process_age() + FIRST_RESERVE < self.deadline
        return process_age() + 1.5 * self.done[-1]["step_s"] < self.deadline


def room_for_another(deadline: float | None, figures: dict) -> bool:
    """Whether another variant fits in the worker's time after one whose summary is `figures`: loading its
    trainer, its first step (a re-trace of the decode, not a whole compile: RETRACE_SHARE of the first
    variant's first step) and two steps, or the FIRST_RESERVE its Steps.more() wants after its first step."""
    if deadline is None:
        return True
    first, step = figures.get("first_step_s", math.nan), figures.get("step_s", math.nan)
    if not (math.isfinite(first) and math.isfinite(step)):
        return process_age() < deadline - FIRST_RESERVE
    # after its first step the variant's Steps.more() wants FIRST_RESERVE left: two steps or that, the longer
    return process_age() + LOAD_S + RETRACE_SHARE * first + max(FIRST_RESERVE, 2 * step) < deadline


def summarize(steps: list[dict]) -> dict:
    """Medians of a variant's steps but the first (compile, warm-up), its first step's seconds and the
    completion tokens per second over the timed steps."""
    timed = steps[1:]
    figures: dict = {"steps_timed": len(timed), "first_step_s": steps[0]["step_s"] if steps else math.nan}
    for field in FIELDS:
        values = [s[field] for s in timed if s.get(field) is not None]
        figures[field] = statistics.median(values) if values else math.nan
    seconds = sum(s["step_s"] for s in timed)
    figures["tokens_per_s"] = sum(s["tokens"] for s in timed) / seconds if timed and seconds else math.nan
    return figures


def memory_figures(cuda: bool, loaded: float) -> dict:
    """The variant's peaks (CUDA: the allocator's since the variant's start, and the allocated peak
    above the loaded model; CPU: the process's resident-set peak)."""
    if cuda:
        return {
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / MiB,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / MiB,
            "above_loaded_mib": (torch.cuda.max_memory_allocated() - loaded) / MiB,
            # What the reserved peak was kept under: lora_grpo's expandable segments, or torch's default.
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        }
    import resource

    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def ours_variant(variant, checkpointing, path, s, prompts, cuda, deadline) -> dict:
    from lora_grpo import GRPOConfig, GRPOTrainer

    sequences = s["prompts"] * s["generations"]
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
        **({} if checkpointing is None else {"gradient_checkpointing": checkpointing}),
    )
    trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
    loaded = torch.cuda.memory_allocated() if cuda else 0
    steps = Steps(variant, sequences, deadline)
    began: list[float] = []

    def hook(event, trainer, **payload):
        if event == "step_begin":
            began.append(sync(cuda))
        elif event == "log" and began:
            m = payload["logs"]
            steps.add(
                step_s=sync(cuda) - began[-1],
                generation_s=m.get("time/rollout"),
                scoring_s=m.get("time/log_probs"),
                update_s=m.get("time/train"),
                tokens=m["completion_length/mean"] * sequences,
            )
            if not steps.more():
                trainer.stop_requested = True

    trainer.hooks.append(hook)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    sizes = {
        "micro_batch_size": trainer.micro_batch_size,
        "gradient_checkpointing": bool(trainer.gradient_checkpointing),
    }
    return {**summarize(steps.done), **sizes, **memory_figures(cuda, loaded)}


def trl_variant(variant, checkpointing, path, s, prompts, cuda, deadline) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sequences = s["prompts"] * s["generations"]
    compute = torch.bfloat16 if cuda else torch.float32
    model = load_peer_model(path, "4bit", compute=compute, device_map={"": 0 if cuda else "cpu"})
    steps = Steps(variant, sequences, deadline)
    # The seconds of the step running now: sampling, and sampling with rewards and reference log-probs.
    inside = {"generate": 0.0, "generate_and_score": 0.0, "tokens": 0.0}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            inside.update(generate=0.0, generate_and_score=0.0, tokens=0.0, start=sync(cuda))

        def on_step_end(self, args, state, control, **kwargs):
            seconds = sync(cuda) - inside["start"]
            steps.add(
                step_s=seconds,
                generation_s=inside["generate"],
                scoring_s=inside["generate_and_score"] - inside["generate"],
                update_s=seconds - inside["generate_and_score"],
                tokens=inside["tokens"],
            )
            if not steps.more():
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=sequences,
        gradient_accumulation_steps=1,
        num_generations=s["generations"],
        max_completion_length=s["completion"],
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
        **({} if checkpointing is None else {"gradient_checkpointing": checkpointing}),
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
        callbacks=[StepTimes()],
    )
    # TRL 1.16's own methods, timed on this trainer (trl/trainer/grpo_trainer.py): `_generate` samples
    # (it returns the completions' ids second), `_generate_and_score_completions` calls it, then scores
    # the rewards and the reference log-probs.
    generate, generate_and_score = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(*args, **kwargs):
        start = sync(cuda)
        out = generate(*args, **kwargs)
        inside["generate"] += sync(cuda) - start
        inside["tokens"] += sum(len(ids) for ids in out[1])
        return out

    def timed_generate_and_score(*args, **kwargs):
        start = sync(cuda)
        out = generate_and_score(*args, **kwargs)
        inside["generate_and_score"] += sync(cuda) - start
        return out

    trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_generate_and_score
    loaded = torch.cuda.memory_allocated() if cuda else 0
    trainer.train()
    sizes = {
        "micro_batch_size": sequences,
        "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
    }
    return {**summarize(steps.done), **sizes, **memory_figures(cuda, loaded)}


def peer_run(which: str, path: str, settings: dict, cuda: bool) -> dict:
    """One worker's runs (section 12): its variants one after the other, each emitted as it ends;
    returns {variant: figures}. settings["seconds"]: the seconds from the process's start the worker
    may take (it stops itself SELF_STOP before)."""
    s = settings
    deadline = s["seconds"] - SELF_STOP if s.get("seconds") else None
    prompts = token_prompts(QWEN2_SHAPES[s["shape"]]["vocab_size"], s["prompt"], count=16 * s["prompts"])
    results = {}
    for variant, checkpointing in VARIANTS[which]:
        if results and not room_for_another(deadline, list(results.values())[-1]):
            break
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        train = ours_variant if which == "ours" else trl_variant
        results[variant] = train(variant, checkpointing, path, s, prompts, cuda, deadline)
        emit("VARIANT", {"variant": variant, **results[variant]})
    return results


def read_partial(output: str) -> dict:
    """What a worker killed at its limit printed: {variant: figures}, a variant that did not end
    summarised from its steps and marked partial."""
    finished, steps = {}, {}
    for line in (output or "").splitlines():
        kind, _, text = line.partition(" ")
        if kind in ("STEP", "VARIANT"):
            figures = json.loads(text)
            variant = figures.pop("variant")
            if kind == "STEP":
                steps.setdefault(variant, []).append(figures)
            else:
                finished[variant] = figures
    for variant, done in steps.items():
        if variant not in finished:
            finished[variant] = {**summarize(done), "partial": True}
    return finished


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
        f"up to {settings['steps']} timed steps after one; at their defaults, and with gradient checkpointing "
        "on in both"
    )
    results: dict = {}
    stopped = None
    for which in ("ours", "trl"):
        # The dry run on a (shared, loaded) CPU: three times the GPU's caps, which plan a GPU's time.
        cap = CAPS[which] * (3 if run.args.cpu else 1)
        limit = run.limit(cap)
        command = worker_command(
            "--peer-worker",
            which,
            "--model",
            path,
            "--peer-settings",
            json.dumps({**settings, "seconds": limit}),
        )
        print(f"the {which} worker (limit {limit:.0f} s)", flush=True)
        try:
            got = run_worker(command, f"the {which} run", timeout=limit, **worker_options())
        except subprocess.TimeoutExpired as e:
            got = read_partial(e.stdout)
            stopped = (which, limit, cap)
        except RuntimeError as e:
            # A worker that failed: the other still runs, and the section fails below.
            got = {}
            run.findings[f"{which}_error"] = str(e)[-2000:]
            print(e, flush=True)
        # Recorded the moment the worker ends: a later worker's timeout keeps these.
        results.update(got)
        run.findings.update(got)
        for variant, figures in got.items():
            print(f"{variant}: {figures}", flush=True)
        # Ours ended at its limit: TRL's worker still runs in what the budget leaves (run.limit caps it).
    report(run, results)
    if stopped:
        which, limit, cap = stopped
        run.over_time(f"the {which} run", limit, cap)
    missing = [v for _, variants in VARIANTS.items() for v, _ in variants if v not in results]
    failed = [w for w in VARIANTS if f"{w}_error" in run.findings]
    run.expect(not failed, f"every worker ran ({', '.join(failed) or 'none'} failed)")
    if missing and not stopped and not failed:
        raise Stopped(f"{', '.join(missing)} not started: too little of its worker's time left")
    # A worker that ended well but stopped a variant after its first step (Steps.more: no time for another) ran
    # out of time, not into a fault: the rerun, not a failure.
    untimed = [v for v, figures in results.items() if not figures.get("steps_timed")]
    if untimed and not failed:
        raise Stopped(
            f"{', '.join(untimed)} stopped after the first step: too little of its worker's time left"
        )
    run.expect(
        all(math.isfinite(results[v]["step_s"]) for v in results) and not missing,
        "every variant ran timed steps",
    )


def report(run: Run, results: dict) -> None:
    """The table of the variants measured, and ours / TRL's for each pair measured."""
    if not results:
        return
    memory = ("peak_allocated_mib", "peak_reserved_mib") if run.cuda else ("peak_rss_mib",)
    columns = ("gradient_checkpointing", "steps_timed", "first_step_s", *FIELDS, "tokens_per_s", *memory)
    print("| variant | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for variant, figures in results.items():
        cells = [figures.get(c) for c in columns]
        text = [f"{c:,.2f}" if isinstance(c, float) else str(c) for c in cells]
        print(f"| {variant}{' (partial)' if figures.get('partial') else ''} | " + " | ".join(text) + " |")
    ratios = {}
    for name, ours, peer in PAIRS:
        if ours in results and peer in results:
            a, b = results[ours], results[peer]
            ratios[name] = {
                field: a[field] / b[field]
                for field in (*FIELDS, *memory)
                if all(
                    isinstance(x.get(field), (int, float)) and math.isfinite(x[field]) and x[field]
                    for x in (a, b)
                )
            }
            print(f"ours / TRL, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios[name].items()))
    run.findings["ours_over_trl"] = ratios
