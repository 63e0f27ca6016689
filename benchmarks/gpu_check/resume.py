"""Section 7, resume: a 4-bit run against the same run resumed from its step-2 checkpoint on the same
device (tensor by tensor), and the checkpoint resumed by a CPU-only worker process."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import torch

from benchmarks._common import even_token_share, run_child
from benchmarks.gpu_check.common import tiny_config, tiny_prompts
from benchmarks.gpu_check.harness import Run, worker_command, worker_options


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
    run.findings.update({"max_delta": delta, "max_weight": scale, "equal": equal, "mode": mode})
    if equal is None:  # kernels that sum in a varying order: the same run up to their rounding
        run.expect(
            delta <= 1e-3 * scale,
            f"resumed on {where} ≈ the uninterrupted run after 3 steps: max |Δ| {delta:.3g} ≤ 1e-3 × "
            f"max |w| {scale:.3g} ({mode})",
        )
    else:
        run.expect(
            equal,
            f"resumed on {where} equals the uninterrupted run after 3 steps, tensor by tensor "
            f"(max |Δ| {delta:.3g}; {mode})",
        )
    checkpoint = run.root / "resume-same-device" / "checkpoint-2"
    if not checkpoint.exists():
        checkpoint = run.root / "resume-loose" / "checkpoint-2"
    print(f"the {where} run's {checkpoint.name}, resumed by a CPU-only process:")
    options = worker_options({**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    cap = 240.0
    limit = run.limit(cap)
    try:
        result = run_child(
            worker_command("--resume-on-cpu", str(checkpoint), "--model", path), timeout=limit, **options
        )
    except subprocess.TimeoutExpired:
        run.over_time("the CPU resume", limit, cap)
        return
    lines = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if "resumed on" in line or "sampling generator" in line or "Error" in line
    ]
    print("\n".join(lines[-6:]))
    run.expect(result.returncode == 0, f"the CPU resume ran (exit {result.returncode})")
    if result.returncode != 0:
        run.findings["cpu_resume_stderr"] = result.stderr[-2000:]
