"""Section 12, against TRL + PEFT: step time and peak memory of lora_grpo and of TRL's GRPOTrainer
with a peft LoraConfig on the same random 4-bit model, prompts, reward and settings, each trainer in
a fresh worker process."""

from __future__ import annotations

import json
import math
import subprocess
import tempfile

import torch

from benchmarks._common import (
    QWEN2_SHAPES,
    MiB,
    even_token_share,
    load_peer_model,
    run_worker,
    token_prompts,
    train_steps,
    trl_step_timer,
)
from benchmarks.gpu_check.common import TARGETS
from benchmarks.gpu_check.harness import Late, Run, Skip, worker_command, worker_options


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
        command = worker_command(
            "--peer-worker", which, "--model", path, "--peer-settings", json.dumps(settings)
        )
        try:
            results[which] = run_worker(command, f"the {which} run", timeout=limit, **worker_options())
        except subprocess.TimeoutExpired:
            run.over_time(f"the {which} run", limit, cap)
            return
    if run.args.cpu:
        run.not_here("peak memory in fresh processes (the dry run runs both trainers in this one)")
    run.findings.update(results)
    ours, peer = results["ours"], results["trl"]
    for which, r in results.items():
        print(f"{which}: {r}")
    print(f"step time ours / TRL: {ours['step_s'] / peer['step_s']:.2f}")
    if run.cuda:
        print(
            f"peak allocated ours / TRL: {ours['peak_allocated_mib'] / peer['peak_allocated_mib']:.2f}; above the "
            f"loaded model: {ours['above_loaded_mib']:,.0f} vs {peer['above_loaded_mib']:,.0f} MiB"
        )
    run.expect(all(math.isfinite(r["step_s"]) for r in results.values()), "both trainers ran their steps")
