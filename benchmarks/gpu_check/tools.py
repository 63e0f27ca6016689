"""Section 9, tools: the calculator task with the compiled decode on the bundled pre-trained base,
2 training steps that call the tool, then sampled tool rollouts compiled against eager."""

from __future__ import annotations

import math

import torch

from benchmarks.gpu_bundle import CALCULATOR_BASE
from benchmarks.gpu_check.common import CudagraphSkips
from benchmarks.gpu_check.harness import REPO, Run, fresh_compiler

# What benchmarks/gpu_bundle.py builds (and the lent machine is sent).
BUNDLE = REPO / "gpu_bundle"


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
        run.not_here("the pre-trained calculator base (no bundle here; a random one rarely calls)")
    else:
        raise RuntimeError(
            f"no calculator base in {bundled}: build the bundle where the checkout is (python "
            "benchmarks/gpu_bundle.py, which pre-trains it there) and carry gpu_bundle/; pre-training it "
            "here would spend the GPU's time on this machine's CPU"
        )
    run.findings["base"] = base
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
    run.expect(all(math.isfinite(m["loss"]) for m in history), "finite losses")
    run.expect(why is None, f"the {fast} sampler ran {fast} with tools ({why or 'not refused'})")
    if run.cuda:
        run.expect(sum(calls) > 0, "the training rollouts called the tool")
        run.expect(skips.count == 0, f"the training decode ran as CUDA graphs ({skips.reasons[:2]})")
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
    run.findings.update(
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
    run.expect(same >= 0.9, f"{same:.0%} of sampled float32 tool rollouts the same in both samplers (≥ 90%)")
