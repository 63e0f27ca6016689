"""Section 11, paged_adamw_8bit: 3 steps with bitsandbytes' paged 8-bit AdamW in a worker process with
a time limit (CUDA managed memory can hang): the adapter moves, 8-bit paged states."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import torch

from benchmarks._common import even_token_share, run_worker, token_prompts
from benchmarks.gpu_check.common import tiny_config
from benchmarks.gpu_check.harness import Run, Stopped, worker_command, worker_options


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
    command = worker_command(
        "--paged-worker", str(rank), "--model", path, "--scratch", str(run.root / "paged")
    )
    print(f"3 steps with paged_adamw_8bit in a fresh process (limit {limit:.0f} s)", flush=True)
    try:
        found = run_worker(command, "the paged_adamw_8bit run", timeout=limit, **worker_options())
    except subprocess.TimeoutExpired:
        raise Stopped(
            f"the paged_adamw_8bit run (CUDA managed memory) did not finish within {limit:.0f} s "
            + ("(what the --budget left)" if limit < cap else "(its cap: a hang?)")
        ) from None
    run.findings.update(found)
    losses = found["losses"]
    print(
        f"{found['optimizer']} on {found['device']}: {found['tensors_moved']}/{found['tensors']} policy tensors "
        f"moved; of {found['states']} states {found['eight_bit_states']} 8-bit, {found['paged_states']} paged; "
        f"losses {[f'{x:.4f}' for x in losses]}"
    )
    run.expect(found["optimizer"] == "PagedAdamW8bit", "bitsandbytes' PagedAdamW8bit")
    run.expect(all(math.isfinite(x) for x in losses), "finite losses")
    run.expect(found["tensors_moved"] > 0, "the policy adapter moved")
    run.expect(found["eight_bit_states"] > 0, "8-bit states for the large LoRA tensors")
    if run.cuda:
        run.expect(
            found["paged_states"] > 0,
            "paged states (CUDA unified memory) for the tensors of 100,000 entries or more",
        )
    else:
        run.not_here("paged states: bitsandbytes pages only on CUDA (a CPU falls back to unpaged)")
