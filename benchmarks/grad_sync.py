"""Gradient averaging across processes: one all-reduce per LoRA tensor vs one flat all-reduce per step.

Runs itself under torchrun (2 CPU processes, gloo) and times both ways of averaging the policy
adapter's gradients, for the LoRA tensor shapes of the toy model and of Qwen2.5-0.5B (all-linear),
alternating A and B, median of repeats. The trainer uses the flat one (optim.average_gradients).

    python benchmarks/grad_sync.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

# (in, out) of every LoRA-wrapped linear of one decoder layer: q, k, v, o, gate, up, down.
SHAPES = {
    "toy (2 layers, hidden 128, r 8)": (
        2,
        8,
        [(128, 128), (128, 64), (128, 64), (128, 128), (128, 512), (128, 512), (512, 128)],
    ),
    "qwen2.5-0.5b (24 layers, hidden 896, r 16)": (
        24,
        16,
        [(896, 896), (896, 128), (896, 128), (896, 896), (896, 4864), (896, 4864), (4864, 896)],
    ),
}


def lora_grads(layers: int, r: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        for fan_in, fan_out in shapes:
            out += [torch.randn(r, fan_in, generator=g), torch.randn(fan_out, r, generator=g)]
    return out


def worker(repeats: int) -> None:
    from accelerate import Accelerator

    from lora_grpo.optim import average_gradients

    acc = Accelerator(cpu=True)
    for name, (layers, r, shapes) in SHAPES.items():
        grads = lora_grads(layers, r, shapes)
        params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]

        def per_tensor():
            for p, g in zip(params, grads):
                p.grad = acc.reduce(g.clone(), "mean")

        def flat():
            for p, g in zip(params, grads):
                p.grad = g.clone()
            average_gradients(params, acc)

        times = {"per tensor": [], "flat": []}
        for _ in range(repeats):
            for label, fn in (("per tensor", per_tensor), ("flat", flat)):  # alternate A and B
                acc.wait_for_everyone()
                start = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - start)
        if acc.is_main_process:
            a, b = (statistics.median(times[k]) * 1e3 for k in ("per tensor", "flat"))
            numel = sum(t.numel() for t in grads)
            print(
                f"{name}: {len(grads)} tensors, {numel / 1e6:.2f} M values | per tensor {a:.2f} ms | "
                f"flat {b:.2f} ms | flat / per tensor {b / a:.2f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        return worker(args.repeats)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        __file__,
        "--repeats",
        str(args.repeats),
    ]
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
