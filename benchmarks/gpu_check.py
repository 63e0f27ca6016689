"""The GPU check: what only a GPU can show about lora_grpo, in one run of under 8 minutes on one GPU.

Nothing is downloaded: the models are random-init Qwen2s built locally (_common.build_qwen2), the
0.5B recipe's shape (qwen2.5-0.5b: Qwen2.5-0.5B's body and 151,936-token vocabulary) in bf16 on a
GPU. Each section prints its findings and goes on when another one fails; the exit status is the
number of failed sections.

1. devices     what device.py decides here: torch_dtype auto, whether decode_mode auto compiles
               (compute capability, native bf16, Triton).
2. recipe      qwen2.5-0.5b-gsm8k-qlora's settings (4-bit base, LoRA r 16, 8 prompts × G 8,
               256 + 384 tokens, micro_batch_size / gradient_checkpointing auto) for a few steps, on
               token prompts of the recipe's prompt length: per step, memory allocated and reserved
               before and after the rollout, the rollout's and the update's peaks, and the static
               caches the compiled decode keeps, next to the memory plan's figures (memory.py).
3. decode      tokens/s of the eager and the compiled sampler on the trained model (greedy, the
               recipe's shape), how many rows draw the same tokens, and what dynamo recorded: graph
               breaks (does torch.compile break the graph at bitsandbytes' 4-bit layers?), graphs,
               recompiles. TORCH_LOGS-style graph-break and recompile lines go to stderr.
4. bf16 KL     the KL between identical adapters (must be exactly 0), after a hard sync, and between
               nearby adapters: lora_grpo's log-probs of a bf16 model (float32 head) and of the same
               weights in float32, next to log-probs from the model's own bf16 logits (what rounding
               the head's output to bf16 would give: defect 5 of issue 16).
5. resume      a tiny run on the GPU writes a checkpoint; a CPU-only process (CUDA_VISIBLE_DEVICES="")
               resumes it and trains one more step (optimizer state onto the CPU, the CUDA sampling
               state reseeded with one line).

Pass/fail: a section fails when it raises; section 2 also fails when a measured figure exceeds the
plan's (CUDA: the kept caches above plan.kept, an update's allocated peak over the loaded model above
plan.need). With --out DIR, summary.json (each section: passed, seconds, findings) and summary.txt
(one line per section) are written there: what the lent GPU machine returns.

    python benchmarks/gpu_check.py            # on one CUDA GPU
    python benchmarks/gpu_check.py --cpu      # a dry run on a CPU with the tiny shape (checks the script)
    python benchmarks/gpu_check.py --out DIR  # also the summary files
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from _common import QWEN2_SHAPES, MiB, build_qwen2, environment, even_token_share, token_prompts

RECIPE = "qwen2.5-0.5b-gsm8k-qlora"
FAILED: list[str] = []
SUMMARY: dict[str, dict] = {}  # section title → {"passed", "seconds", "findings"}
FINDINGS: dict = {}  # the running section's findings (what summary.json reports of it)


@contextmanager
def section(title: str):
    """Print the section's header and time; a failure is printed and counted, the run goes on."""
    print(f"\n## {title}", flush=True)
    start = time.perf_counter()
    FINDINGS.clear()
    passed = True
    try:
        yield
    except Exception as e:  # noqa: BLE001 - one section's failure must not hide the others' findings
        FAILED.append(title)
        passed = False
        FINDINGS["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        print(f"FAILED: {title}\n{traceback.format_exc()}", flush=True)
    SUMMARY[title] = {
        "passed": passed,
        "seconds": round(time.perf_counter() - start, 1),
        "findings": dict(FINDINGS),
    }
    print(f"({time.perf_counter() - start:.1f} s)", flush=True)


def write_summary(out: str, seconds: float) -> None:
    """summary.json and summary.txt in `out`: the run's verdict, one entry per section."""
    import json

    Path(out).mkdir(parents=True, exist_ok=True)
    verdict = {
        "passed": not FAILED,
        "failed": FAILED,
        "seconds": round(seconds, 1),
        "sections": SUMMARY,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    (Path(out) / "summary.json").write_text(json.dumps(verdict, indent=2, default=str) + "\n")
    lines = [
        f"{'PASS' if v['passed'] else 'FAIL'} {title} ({v['seconds']} s)"
        + (f": {v['findings']['error']}" if "error" in v["findings"] else "")
        for title, v in SUMMARY.items()
    ]
    (Path(out) / "summary.txt").write_text(
        "\n".join(lines + [f"{len(FAILED)} failed, {seconds:.0f} s"]) + "\n"
    )


def mib(value) -> str:
    return "-" if value is None else f"{value / MiB:,.1f}"


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
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None


# ------------------------------------------------------------------------------ 1. devices
def check_devices(device: torch.device) -> None:
    import bitsandbytes
    import peft
    import transformers

    from lora_grpo.device import (
        _triton_installed,
        auto_dtype,
        compile_pays,
        describe_gpu,
    )

    print(environment(transformers, peft, bitsandbytes))
    print(
        f"device: {describe_gpu(device) if device.type == 'cuda' else 'CPU'}; Triton installed: {_triton_installed()}"
    )
    dtype, why = auto_dtype()
    print(f"torch_dtype auto → {str(dtype).removeprefix('torch.')} ({why})")
    for candidate in (torch.bfloat16, torch.float32):
        pays, why = compile_pays(device, candidate)
        print(
            f"decode_mode auto for {str(candidate).removeprefix('torch.')} → {'compiled' if pays else 'eager'} ({why})"
        )


# ------------------------------------------------------------------------------ 2. recipe
def recipe_config(path: str, out: str, args, **overrides):
    """The recipe's settings on the local random model and token prompts (no hub, no chat template)."""
    from lora_grpo import GRPOConfig
    from lora_grpo.cli import recipe_file

    with recipe_file(RECIPE) as recipe:
        fields = dict(
            model_name_or_path=path,
            tokenizer_name_or_path=f"{path}/tokenizer",
            dataset=None,
            dataset_config=None,
            eval_dataset=None,
            use_chat_template=False,
            system_prompt=None,
            prompt_column="prompt",
            reward_funcs=[],
            reward_weights=None,
            max_steps=args.steps,
            save_steps=0,
            eval_steps=0,
            logging_steps=1,
            output_dir=out,
            disable_tqdm=True,
        )
        if args.cpu:  # the dry run: the recipe's structure at a size a CPU runs in seconds
            fields.update(
                prompts_per_step=2, num_generations=4, max_prompt_length=16, max_completion_length=16
            )
        fields.update(overrides)
        return GRPOConfig.from_yaml(recipe, fields)


def instrument(trainer, memory: Memory, rows: list[dict]) -> None:
    """Record memory around each rollout (trainer.generate) and the peak up to the end of the step."""
    from lora_grpo.rollout import fast_decode

    generate = trainer.generate

    def measured_generate(*a, **k):
        allocated, reserved = memory.now()
        memory.reset_peak()
        rollout = generate(*a, **k)
        after = memory.now()
        rows.append(
            {
                "before": (allocated, reserved),
                "after": after,
                "rollout_peak": memory.peak(),
                "kept": fast_decode.kept_cache_bytes(trainer.model),
            }
        )
        memory.reset_peak()  # from here to step_end: log-probs, the update, a sync
        return rollout

    def step_end(event, _trainer, **_payload):
        if event == "step_end" and rows:
            rows[-1]["update_peak"] = memory.peak()

    trainer.generate = measured_generate
    trainer.hooks.append(step_end)


def run_recipe(path: str, device: torch.device, args, out: str):
    from lora_grpo import GRPOTrainer

    memory = Memory(device)
    config = recipe_config(path, out, args)
    prompts = token_prompts(QWEN2_SHAPES[args.shape]["vocab_size"], config.max_prompt_length, count=64)
    trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
    loaded = memory.now()[0]
    print(
        f"{RECIPE} settings on {args.shape}: {config.prompts_per_step} prompts × G {config.num_generations}, "
        f"{config.max_prompt_length} + {config.max_completion_length} tokens, quantization {config.quantization}, "
        f"torch_dtype {config.torch_dtype}, decode_mode {config.decode_mode}"
    )
    print(f"loaded model + adapters: {mib(loaded)} MiB {'allocated' if memory.cuda else 'resident'}")
    rows: list[dict] = []
    instrument(trainer, memory, rows)
    trainer.train()
    plan = trainer.memory_plan
    if plan is not None:
        print(
            "plan:", plan.describe(config.micro_batch_size == "auto", config.gradient_checkpointing == "auto")
        )
        pass_bytes = plan.measured[plan.gradient_checkpointing][plan.micro_batch_size]
        print(
            f"plan figures over the loaded model (MiB): rollout {mib(plan.rollout)} (kept caches {mib(plan.kept)} of "
            f"it), training pass {mib(pass_bytes)}, optimizer states {mib(plan.optimizer)}, need {mib(plan.need)}, "
            f"budget {mib(plan.budget)}"
        )
    print(
        "| step | allocated before rollout | reserved before | allocated after | reserved after | rollout peak − "
        "before | kept caches | update peak − loaded | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for step, (row, metrics) in enumerate(zip(rows, trainer.state.log_history), 1):
        (a0, r0), (a1, r1) = row["before"], row["after"]
        rollout = None if row["rollout_peak"] is None else row["rollout_peak"] - a0
        update = None if row.get("update_peak") is None else row["update_peak"] - loaded
        print(
            f"| {step} | {mib(a0)} | {mib(r0)} | {mib(a1)} | {mib(r1)} | {mib(rollout)} | {mib(row['kept'])} | "
            f"{mib(update)} | {metrics.get('time/step', float('nan')):.2f} |"
        )
    print(
        "(rollout peak − before: compare with the plan's rollout less the caches already kept at step 2+; "
        "update peak − loaded: compare with kept + optimizer + training pass)"
    )
    kept = max(row["kept"] for row in rows) if rows else 0
    updates = [row["update_peak"] - loaded for row in rows if row.get("update_peak") is not None]
    FINDINGS.update(
        {
            "kept_caches_mib": kept / MiB,
            "update_peak_over_loaded_mib": max(updates, default=0) / MiB,
            **(
                {}
                if plan is None
                else {
                    "plan_kept_mib": plan.kept / MiB,
                    "plan_need_mib": plan.need / MiB,
                    "micro_batch_size": plan.micro_batch_size,
                }
            ),
        }
    )
    if plan is not None and memory.cuda:  # the thresholds: nothing measured above what the plan said
        if kept > plan.kept:
            raise RuntimeError(f"the kept caches ({mib(kept)} MiB) exceed the plan's {mib(plan.kept)} MiB")
        if updates and max(updates) > plan.need:
            raise RuntimeError(
                f"an update's peak ({mib(max(updates))} MiB over the loaded model) exceeds the plan's "
                f"need {mib(plan.need)} MiB"
            )
    return trainer, prompts


# ------------------------------------------------------------------------------ 3. decode
def check_decode(trainer, prompts, device: torch.device, args) -> None:
    from lora_grpo.device import now
    from lora_grpo.rollout import fast_decode, generate_rollout

    cfg = trainer.config
    texts = [p["prompt"] for p in prompts[: cfg.prompts_per_step]]
    results = {}
    for mode in ("eager", "compiled"):
        for attempt in ("first", "second"):
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
            tokens = int(rollout.completion_mask.sum())
            results[mode] = rollout
            print(
                f"{mode:8s} {attempt:6s} call: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s"
                + (
                    " (includes compiling, unless training compiled this shape)"
                    if mode == "compiled" and attempt == "first"
                    else ""
                )
            )
    why = fast_decode.unavailable(trainer.model)
    print(
        f"compiled sampler: {'unavailable: ' + why if why else 'ran compiled'}; "
        f"kept caches {mib(fast_decode.kept_cache_bytes(trainer.model))} MiB"
    )
    same = (
        (results["eager"].completion_ids == results["compiled"].completion_ids).all(1).float().mean().item()
    )
    print(
        f"greedy rows with the same tokens, compiled vs eager: {same:.0%} (bf16 kernels and attention over padded "
        "slots may flip near-ties on a GPU)"
    )
    counters = torch._dynamo.utils.counters
    breaks = sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])
    print(
        f"dynamo: {counters['stats'].get('unique_graphs', 0)} graphs, {sum(v for _, v in breaks)} graph breaks; "
        f"frames {dict(counters['frames'])} (more compiled frames than graphs: recompiles, see the stderr lines)"
    )
    for reason, count in breaks[:8]:
        print(f"  graph break ×{count}: {reason[:200]}")


# ------------------------------------------------------------------------------ 4. bf16 KL
def check_bf16_kl(path: str, device: torch.device, args) -> None:
    from transformers import AutoModelForCausalLM

    from lora_grpo import GRPOConfig
    from lora_grpo.adapters import POLICY, REFERENCE, lora_layers, use_adapter
    from lora_grpo.logprobs import sequence_log_probs
    from lora_grpo.loss import k3_kl
    from lora_grpo.model import attach_adapters
    from lora_grpo.reference import sync_reference

    cfg = GRPOConfig(model_name_or_path=path, lora_r=16, lora_alpha=32, gradient_checkpointing=False)
    models = {}
    for dtype in (torch.bfloat16, torch.float32):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        models[dtype] = attach_adapters(base, cfg).eval()
    bf16, fp32 = models[torch.bfloat16], models[torch.float32]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, module in lora_layers(bf16):
            weight = module.lora_B[POLICY].weight
            weight.copy_(torch.randn(weight.shape, generator=g) * 0.02)
    sync_reference(bf16, 1.0)  # the reference slot: an exact copy of the policy
    batch, length, completion = (4, 64, 32) if args.cpu else (16, 256, 128)
    vocab = QWEN2_SHAPES[args.shape]["vocab_size"]
    ids = torch.randint(3, vocab, (batch, length), generator=g).to(device)
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
    print(
        f"bf16 KL(policy ‖ the same policy): {same:.3e} ({'PASS: exactly 0' if same == 0 else 'FAIL: must be 0'})"
    )
    if same != 0:
        FAILED.append("bf16 KL between identical adapters")
    print(
        f"bf16 KL(policy ‖ reference right after a hard sync): {kl(logp(bf16, POLICY), logp(bf16, REFERENCE)):.3e} "
        "(other factor shapes; trainer skips this forward: reference_is_policy)"
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
    print(
        f"nearby adapters, KL per token: float32 model {exact:.4e}; bf16 model with lora_grpo's float32 head "
        f"{ours:.4e} ({ours / exact - 1:+.1%}); bf16 from the model's own bf16 logits {rounded:.4e} "
        f"({rounded / exact - 1:+.1%})"
    )


# ------------------------------------------------------------------------------ 5. resume
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


def resume_here(path: str, checkpoint: str) -> None:
    """The CPU side of section 5 (run as a subprocess): resume `checkpoint` and train one more step."""
    from lora_grpo import GRPOTrainer

    out = str(Path(checkpoint).parent)
    config = tiny_config(path, out, max_steps=3, resume_from_checkpoint=checkpoint)
    trainer = GRPOTrainer(
        config,
        reward_funcs=[even_token_share],
        train_dataset=token_prompts(QWEN2_SHAPES["tiny"]["vocab_size"], 8, count=16),
    )
    assert trainer.accelerator.device.type == "cpu", trainer.accelerator.device
    trainer.train()
    states = trainer.optimizer.state.values()
    devices = {t.device.type for s in states for t in s.values() if isinstance(t, torch.Tensor)}
    print(
        f"resumed on {trainer.accelerator.device} at step 2, trained to step {trainer.state.global_step}; "
        f"optimizer state on {sorted(devices)}; loss {trainer.state.log_history[-1]['loss']:.4f}"
    )


def check_resume(device: torch.device, args, root: str) -> None:
    from lora_grpo import GRPOTrainer

    path = f"{root}/tiny"
    build_qwen2("tiny", path)
    out = f"{root}/resume"
    trainer = GRPOTrainer(
        tiny_config(path, out, max_steps=2),
        reward_funcs=[even_token_share],
        train_dataset=token_prompts(QWEN2_SHAPES["tiny"]["vocab_size"], 8, count=16),
    )
    trainer.train()
    print(f"a tiny run on {trainer.accelerator.device} wrote {out}/checkpoint-2")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, __file__, "--resume-on-cpu", f"{out}/checkpoint-2", "--model", path],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    lines = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if "resumed on" in line or "sampling generator" in line or "Error" in line
    ]
    print("\n".join(lines[-6:]))
    if result.returncode != 0:
        raise RuntimeError(f"the CPU resume failed (exit {result.returncode}):\n{result.stderr[-3000:]}")


# ------------------------------------------------------------------------------ main
def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU with the tiny shape")
    parser.add_argument("--steps", type=int, default=3, help="training steps of section 2")
    parser.add_argument(
        "--budget", type=float, default=450, help="seconds; later sections are skipped past it"
    )
    parser.add_argument("--out", help="write summary.json and summary.txt to this folder")
    parser.add_argument("--resume-on-cpu", help=argparse.SUPPRESS)  # section 5's subprocess
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("lora_grpo").setLevel(logging.INFO)  # what 'auto' chose, in one line each
    if args.resume_on_cpu:
        resume_here(args.model, args.resume_on_cpu)
        return 0
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --cpu for a dry run")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    args.shape = "tiny" if args.cpu else "qwen2.5-0.5b"
    torch._logging.set_logs(graph_breaks=True, recompiles=True)  # TORCH_LOGS="graph_breaks,recompiles"
    start = time.perf_counter()

    def time_left() -> bool:
        left = args.budget - (time.perf_counter() - start)
        if left <= 0:
            print(f"(skipped: past the --budget of {args.budget:.0f} s)")
        return left > 0

    with tempfile.TemporaryDirectory() as root:
        with section("1. devices"):
            check_devices(device)
        path = f"{root}/model"
        build_qwen2(args.shape, path, torch.float32 if args.cpu else torch.bfloat16)
        trainer = prompts = None
        with section("2. the 0.5B recipe, memory against the plan"):
            trainer, prompts = run_recipe(path, device, args, f"{root}/recipe")
        with section("3. decode: compiled vs eager, graph breaks, recompiles"):
            if trainer is None:
                raise RuntimeError("needs section 2's trained model")
            if time_left():
                check_decode(trainer, prompts, device, args)
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with section("4. bf16 KL"):
            if time_left():
                check_bf16_kl(path, device, args)
        with section("5. resume a GPU checkpoint on a CPU"):
            if time_left():
                check_resume(device, args, root)
    print(
        f"\n{len(FAILED)} section(s) failed{': ' + ', '.join(FAILED) if FAILED else ''}; "
        f"{time.perf_counter() - start:.0f} s in all"
    )
    if args.out:
        write_summary(args.out, time.perf_counter() - start)
    return len(FAILED)


if __name__ == "__main__":
    sys.exit(main())
