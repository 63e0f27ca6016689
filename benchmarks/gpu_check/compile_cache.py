"""Section 15, compile once per machine: a fresh process with the 0.5B recipe's shapes finds what an
earlier one compiled in lora_grpo's compile cache (lora_grpo/rollout/compile_cache.py, issue 48) and
does not pay step 1's compile again: its step 1 − step 2 ≤ 15 s (the first GPU run, before the
cache: 57.8 − 8.9 s).

The worker process trains 2 steps of qwen2.5-0.5b-gsm8k-qlora's settings (section 2's, without the
emulated card and the eval, which decode in the same reserved shape) on the same random model, with
an empty inductor cache of its own (TORCHINDUCTOR_CACHE_DIR), so that only lora_grpo's cache can
carry a compile from one process to the next. The cache is the one section 2 filled in this run
(this machine's lora_grpo cache directory); when section 2 did not run here, a first worker fills it
(its step 1 pays the compile: the figure to compare). What the warm worker
loaded, and inductor's graph-cache hits and misses in it, are recorded.

Beside it, whether the allocator setting lora_grpo makes when it is imported (expandable segments,
device.use_expandable_segments) took effect in this process: the allocator's segments say so.

On --cpu the recipe decodes with "static" (no compile), so the stand-in checks the files alone: a
tiny function compiled by inductor here, saved to a fresh cache, and read back by a fresh process.

    python -m benchmarks.gpu_check.compile_cache --model DIR --out DIR   # the worker (one process)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks._common import QWEN2_SHAPES, even_token_share, run_worker, token_prompts
from benchmarks.gpu_check.harness import Late, Run, no_plots, worker_options
from benchmarks.gpu_check.recipe_memory import recipe_config

RECIPE = "qwen2.5-0.5b-gsm8k-qlora"
SHAPE = "qwen2.5-0.5b"
# What step 1 may cost over step 2 in a process that finds its compile in the cache: dynamo still
# traces the step (a few seconds) and CUDA graphs are recorded; inductor and Triton build nothing.
WARM_EXTRA_S = 15.0
# A worker's cap: loading, the probe, a compile (~50 s), two steps.
WORKER_CAP_S = 240.0
# What a worker needs of the budget (estimated: the process's start ~10 s, loading and the probe ~10 s,
# step 1 ~20 s with the cache and ~58 s without, step 2 ~9 s).
NEEDS_S = {"cold": 100.0, "warm": 50.0}


def worker(model: str, out: str, shape: str = SHAPE) -> dict:
    """Two training steps of the recipe in this (fresh) process: each step's seconds, the artifacts
    lora_grpo's compile cache loaded, inductor's graph-cache hits and misses, the cache's files.
    shape: the model's (QWEN2_SHAPES); "tiny" runs the recipe's structure at a CPU's size."""
    from lora_grpo import GRPOTrainer
    from lora_grpo.rollout import compile_cache

    loaded: list[int] = []
    load = compile_cache.load

    def counted(device):
        loaded.append(load(device))
        return loaded[-1]

    # fast_decode calls compile_cache.load through the module: the count of what it loaded
    compile_cache.load = counted
    no_plots()
    config = recipe_config(
        SimpleNamespace(args=SimpleNamespace(steps=2, cpu=shape == "tiny")),
        RECIPE,
        model,
        out,
        eval_on_end=False,
    )
    prompts = token_prompts(QWEN2_SHAPES[shape]["vocab_size"], config.max_prompt_length, count=64)
    trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    inductor = torch._dynamo.utils.counters["inductor"]
    folder = compile_cache.cache_dir(trainer.accelerator.device)
    return {
        "step_s": [m["time/step"] for m in trainer.state.log_history if "time/step" in m],
        "loaded_artifacts": sum(loaded),
        "fxgraph_cache_hits": int(inductor["fxgraph_cache_hit"]),
        "fxgraph_cache_misses": int(inductor["fxgraph_cache_miss"]),
        "cache_files": len(list(folder.glob("*.bin"))),
        "cache": str(folder),
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        **expandable_segments(),
    }


def expandable_segments() -> dict:
    """How many of this process's allocator segments are expandable (CUDA; {} elsewhere). A tensor is held
    while the snapshot is taken: a process that has allocated nothing yet (section 15 rerun alone) maps no
    segment to look at."""
    if not torch.cuda.is_available():
        return {}
    held = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    segments = torch.cuda.memory_snapshot()
    del held
    return {
        "segments": len(segments),
        "expandable_segments": sum(bool(s.get("is_expandable")) for s in segments),
    }


def fresh_process(run: Run, args: list[str], what: str, inductor_dir: str, cap: float) -> dict:
    """A worker of this module in a fresh process with its own empty inductor cache."""
    from lora_grpo.rollout import compile_cache

    # Triton's cache in the inductor cache too (where torch puts it when the variable is unset; the check sets it
    # to its shared folder): only lora_grpo's cache may carry a compile over
    env = dict(
        os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, TRITON_CACHE_DIR=str(Path(inductor_dir) / "triton")
    )
    env.pop(compile_cache.SWITCH, None)
    limit = run.limit(cap)
    command = [sys.executable, "-m", "benchmarks.gpu_check.compile_cache", *args]
    try:
        return run_worker(command, what, timeout=limit, **worker_options(env))
    except subprocess.TimeoutExpired:
        run.over_time(what, limit, cap)
        raise


def check_compile_cache(run: Run) -> None:
    from lora_grpo.device import allocator_setting
    from lora_grpo.rollout import compile_cache

    if run.args.cpu:
        return cpu_stand_in(run)
    here = expandable_segments()
    print(f"this process's CUDA allocator: {allocator_setting()}; {json.dumps(here)}")
    run.findings["allocator"] = {"setting": allocator_setting(), **here}
    if "set by lora_grpo" in allocator_setting():
        run.expect(here["expandable_segments"] > 0, "lora_grpo's expandable_segments setting took effect")
    folder = compile_cache.cache_dir(run.device)
    before = len(list(folder.glob("*.bin"))) if folder.is_dir() else 0
    print(f"lora_grpo's compile cache: {folder} ({before} files from this run's earlier sections)")
    # Section 2 compiled the recipe's decode in this process (other sections' files hold other shapes).
    compiled = any(
        name.startswith("2.") and entry["status"] in ("passed", "failed")
        for name, entry in run.summary.items()
    )
    stages = ["warm"] if compiled and before else ["cold", "warm"]
    if run.left() < sum(NEEDS_S[stage] for stage in stages):
        raise Late(
            f"{run.left():.0f} s of the budget left: too little for {len(stages)} fresh 0.5B processes"
        )
    path = run.model(SHAPE)
    with tempfile.TemporaryDirectory(dir=run.root) as scratch:
        for stage in stages:
            inductor_dir = tempfile.mkdtemp(prefix=f"inductor-{stage}-", dir=scratch)
            args = ["--model", path, "--out", tempfile.mkdtemp(prefix=f"run-{stage}-", dir=scratch)]
            try:
                result = fresh_process(run, args, f"the {stage} process", inductor_dir, WORKER_CAP_S)
            except subprocess.TimeoutExpired:
                return
            # recorded as it ends: a later worker's timeout keeps it
            run.findings[stage] = result
            print(f"{stage} process: {json.dumps(result)}")
    warm, steps = run.findings["warm"], run.findings["warm"]["step_s"]
    if not run.expect(len(steps) >= 2, f"the warm process ran 2 steps ({len(steps)})"):
        return
    extra = steps[0] - steps[1]
    run.findings["warm_step1_minus_step2_s"] = round(extra, 1)
    cold = run.findings.get("cold")
    if cold is not None and len(cold["step_s"]) >= 2:
        run.findings["cold_step1_minus_step2_s"] = round(cold["step_s"][0] - cold["step_s"][1], 1)
        print(f"step 1 − step 2: cold {cold['step_s'][0] - cold['step_s'][1]:.1f} s, warm {extra:.1f} s")
        run.expect(cold["cache_files"] >= 1, "the cold process wrote the compile cache")
    run.expect(warm["loaded_artifacts"] >= 1, f"the warm process loaded {warm['loaded_artifacts']} artifacts")
    run.expect(
        extra <= WARM_EXTRA_S,
        f"a fresh process's step 1 − step 2 = {extra:.1f} s ≤ {WARM_EXTRA_S:.0f} s "
        f"(inductor graph cache: {warm['fxgraph_cache_hits']} hits, {warm['fxgraph_cache_misses']} misses)",
    )


@contextlib.contextmanager
def environment(**values: str | None):
    """os.environ with `values` set (None: removed) inside the block, as it was after it."""

    def put(settings: dict) -> None:
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    before = {name: os.environ.get(name) for name in values}
    put(values)
    try:
        yield
    finally:
        put(before)


def cpu_stand_in(run: Run) -> None:
    """The dry run: inductor on a tiny function, saved to a fresh cache, read back by a fresh process."""
    from lora_grpo.rollout import compile_cache

    cache = tempfile.mkdtemp(prefix="compile-cache-", dir=run.root)
    # the cache on (whatever the caller set), in a folder of its own
    switch = {"LORA_GRPO_CACHE": cache, compile_cache.SWITCH: None}
    try:
        with environment(**switch):
            torch._dynamo.reset()
            compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)
            compiled(torch.ones(8))
            saved = compile_cache.save(run.device)
            env = worker_options(dict(os.environ))
        run.expect(saved is not None and saved.is_file(), f"inductor's artifacts written to {saved}")
        command = [sys.executable, "-m", "benchmarks.gpu_check.compile_cache", "--read-back"]
        result = run_worker(command, "the read-back process", timeout=run.limit(120), **env)
        print(f"read back by a fresh process: {json.dumps(result)}")
        run.findings.update(result)
        run.expect(
            result["loaded_artifacts"] >= 1, f"a fresh process loaded {result['loaded_artifacts']} artifacts"
        )
        run.not_here("a fresh process's step 1 against step 2 (the dry run decodes uncompiled)")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--out")
    parser.add_argument("--read-back", action="store_true")
    args = parser.parse_args(argv)
    if args.read_back:
        from lora_grpo.rollout import compile_cache

        result = {"loaded_artifacts": compile_cache.load(torch.device("cpu"))}
    else:
        result = worker(args.model, args.out)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
