"""Sections 2 and 4, the recipes' memory on an emulated 8 GB card: the 0.5B and 1.5B recipes'
settings on random models of their shapes, the allocator's peaks around each stage against the
memory plan (the thresholds: the package's docstring)."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from benchmarks._common import QWEN2_SHAPES, MiB, even_token_share, token_prompts
from benchmarks.gpu_check.common import CudagraphSkips, GiB, Memory
from benchmarks.gpu_check.harness import Run, fresh_compiler, mib, release

# The emulated card of sections 2 and 4 (the recipes' "8 GB GPU").
CARD = 8 * GiB
# What a rollout leaves allocated besides the kept caches: its own tensors.
STAYS_SLACK = 8 * MiB


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
        run.not_here("the allocator cap of an 8 GB card (set_per_process_memory_fraction)")
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
    run.findings.update(
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
    run.findings.update(
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
        run.findings["estimate_mib"] = {
            "weights_and_adapters": (estimate.weights + estimate.adapters) / MiB,
            "pass": estimated_pass / MiB,
            "total": estimate.total / MiB,
        }
    except MemoryBudgetError as e:
        print(f"memory_estimate at these sizes refuses the run: {e}")
        run.findings["estimate_mib"] = f"refused: {str(e)[:300]}"
    if memory.cuda:
        run.findings["reserved_at_end_mib"] = overall[1] / MiB
        check_against_plan(run, plan, rows, evals, loaded, kept, stays, pass_bytes)
        run.expect(
            skips.count == 0,
            f"the training decode ran as CUDA graphs (cudagraph skips: {skips.count}; {skips.reasons[:2]})",
        )
    else:
        run.not_here(
            "allocator peaks against the plan (CUDA only; a CPU's resident set is not the allocator's)"
        )
    run.expect(bool(rows) and len(evals) == 1, f"{len(rows)} rollouts and {len(evals)} eval measured")
    if keep:
        run.results[2] = (trainer, train)


def check_against_plan(run: Run, plan, rows, evals, loaded, kept, stays, pass_bytes) -> None:
    """The thresholds of sections 2 and 4 (the module docstring), each peak over the loaded model."""
    opt = plan.optimizer

    def worst(key, i, items):
        values = [item[key][i] - loaded for item in items if item.get(key) is not None]
        return max(values, default=0.0)

    rollout_a, rollout_r = worst("rollout_peak", 0, rows), worst("rollout_peak", 1, rows)
    update_a, update_r = worst("update_peak", 0, rows), worst("update_peak", 1, rows)
    eval_a, eval_r = worst("peak", 0, evals), worst("peak", 1, evals)
    run.findings["measured_mib"] = {
        "rollout_allocated": rollout_a / MiB,
        "rollout_reserved": rollout_r / MiB,
        "update_allocated": update_a / MiB,
        "update_reserved": update_r / MiB,
        "eval_allocated": eval_a / MiB,
        "eval_reserved": eval_r / MiB,
    }
    run.expect(
        rollout_a <= plan.rollout + opt,
        f"rollout allocated {mib(rollout_a)} ≤ plan rollout {mib(plan.rollout)} + optimizer {mib(opt)} MiB",
    )
    run.expect(
        update_a <= opt + plan.kept + pass_bytes,
        f"update allocated {mib(update_a)} ≤ optimizer {mib(opt)} + kept {mib(plan.kept)} + pass {mib(pass_bytes)} MiB",
    )
    run.expect(eval_a <= plan.need, f"eval allocated {mib(eval_a)} ≤ plan need {mib(plan.need)} MiB")
    run.expect(kept <= plan.kept, f"kept caches {mib(kept)} ≤ plan kept {mib(plan.kept)} MiB")
    run.expect(
        stays <= plan.kept + STAYS_SLACK,
        f"left allocated by the first rollout {mib(stays)} ≤ plan kept {mib(plan.kept)} + {mib(STAYS_SLACK)} MiB",
    )
    for what, value in (("rollout", rollout_r), ("update", update_r), ("eval", eval_r)):
        run.expect(value <= plan.need, f"{what} reserved {mib(value)} ≤ plan need {mib(plan.need)} MiB")


def check_memory_05b(run: Run) -> None:
    """Section 2: the 0.5B recipe; its trainer is kept for section 3 when that runs."""
    check_recipe_memory(run, "qwen2.5-0.5b-gsm8k-qlora", "qwen2.5-0.5b", keep=run.selected(3))


def check_memory_15b(run: Run) -> None:
    """Section 4: the 1.5B calculator recipe, without its calculator (section 9 runs tools)."""
    check_recipe_memory(run, "qwen2.5-1.5b-gsm8k-calculator-qlora", "qwen2.5-1.5b")
