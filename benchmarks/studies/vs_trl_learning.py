"""Does lora_grpo learn as well as TRL? The toy task, the same budget, several seeds each.

Both trainers start from the toy base (the default recipe's model: pre-trained on noisy two-digit
sums, 4-bit NF4 base with double quantization, float32 compute) and train a LoRA r 8 (alpha 16,
every linear layer) with G = 8, 16 prompts a step (one micro-batch of 128), lr 1e-3 constant,
beta 0.04, temperature 1, 4 new tokens, --steps steps, on the same 2000 training sums (drawn with
the run's seed). Then both are scored by the same function (lora_grpo.tasks.toy.greedy_accuracy, one
greedy completion per prompt) on the same 200 held-out sums (seed 0).

- TRL 1.16 GRPOTrainer + peft_config (the `bench` extra): its defaults for epsilon_high (none:
  symmetric clip 0.2), Adam beta2 (0.999) and the KL correction (on); lr_scheduler_type constant so
  that the schedule is not the difference; its reference is the adapter disabled.
- lora_grpo: the toy recipe with reference syncs off (a fixed reference, as TRL), its defaults
  (epsilon_high 0.28, Adam beta2 0.99, KL ratio correction on).

Each run is a fresh process; every seed is printed; the table gives mean ± standard deviation and
the difference of the means with its standard error.

    pip install -e ".[bench]"
    python benchmarks/studies/vs_trl_learning.py [--seeds 0,1,2,3,4] [--steps 15]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile

import torch

LORA_R, G, PROMPTS, LR, BETA, NEW_TOKENS = 8, 8, 16, 1e-3, 0.04, 4


def held_out():
    from lora_grpo.tasks.toy import toy_problems

    return toy_problems(200, seed=0, split="eval")


def run_ours(seed: int, steps: int) -> float:
    from importlib import resources

    from lora_grpo import GRPOConfig, GRPOTrainer
    from lora_grpo.tasks.toy import greedy_accuracy

    recipe = resources.files("lora_grpo") / "recipes" / "toy-addition.yaml"
    config = GRPOConfig.from_yaml(
        str(recipe),
        {
            "ref_sync_steps": 0,
            "max_steps": steps,
            "seed": seed,
            "eval_dataset": None,
            "disable_tqdm": True,
            "logging_steps": 10**6,
            "output_dir": tempfile.mkdtemp(),
            "beta": BETA,
            "learning_rate": LR,
        },
    )
    trainer = GRPOTrainer(config)
    trainer.train()
    return greedy_accuracy(trainer.model, trainer.tokenizer, held_out())


def run_trl(seed: int, steps: int) -> float:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import GRPOConfig, GRPOTrainer

    from lora_grpo.model.load import keep_4bit_weights_fixed
    from lora_grpo.tasks.toy import ensure_toy_base, greedy_accuracy, toy_problems, toy_reward

    path = ensure_toy_base()
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=quantization)
    keep_4bit_weights_fixed(model)  # exact 4-bit gradients on every CPU (lora_grpo's issue 7), as ours
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=G * PROMPTS,
        num_generations=G,
        max_completion_length=NEW_TOKENS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=BETA,
        max_steps=steps,
        temperature=1.0,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        use_cpu=True,
        seed=seed,
    )
    lora = LoraConfig(
        r=LORA_R, lora_alpha=2 * LORA_R, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[toy_reward],
        args=config,
        processing_class=tokenizer,
        train_dataset=toy_problems(2000, seed=seed, split="train"),
        peft_config=lora,
    )
    trainer.train()
    return greedy_accuracy(trainer.model, tokenizer, held_out())


def run_base() -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from lora_grpo.model.load import keep_4bit_weights_fixed
    from lora_grpo.tasks.toy import ensure_toy_base, greedy_accuracy

    path = ensure_toy_base()
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        ),
    )
    keep_4bit_weights_fixed(model)
    return greedy_accuracy(model, AutoTokenizer.from_pretrained(path), held_out())


def child(trainer: str, seed: int, steps: int) -> float:
    command = [sys.executable, __file__, "--worker", trainer, "--seeds", str(seed), "--steps", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{trainer} seed {seed} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=["ours", "trl", "base"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.worker:
        run = {
            "ours": lambda: run_ours(seeds[0], args.steps),
            "trl": lambda: run_trl(seeds[0], args.steps),
            "base": run_base,
        }[args.worker]
        print("RESULT " + json.dumps(run()), flush=True)
        return
    base = child("base", 0, 0)
    results: dict[str, list[float]] = {"ours": [], "trl": []}
    for i, seed in enumerate(seeds):  # alternate which trainer goes first
        for trainer in ("ours", "trl") if i % 2 == 0 else ("trl", "ours"):
            results[trainer].append(child(trainer, seed, args.steps))
            print(f"{trainer} seed {seed}: held-out accuracy {results[trainer][-1]:.3f}", flush=True)
    print(
        f"\nToy task, {args.steps} steps, G={G}, {PROMPTS} prompts, lr {LR}, beta {BETA}, LoRA r {LORA_R}; "
        f"base (4-bit, no adapter) {base:.3f} on the same 200 held-out sums\n"
    )
    print("| trainer | held-out accuracy (mean ± std) | per seed |")
    print("|---|---|---|")
    for trainer, accs in results.items():
        print(
            f"| {'lora_grpo' if trainer == 'ours' else 'TRL 1.16'} | {statistics.mean(accs):.3f} ± "
            f"{statistics.stdev(accs) if len(accs) > 1 else 0.0:.3f} | {', '.join(f'{a:.3f}' for a in accs)} |"
        )
    ours, trl = results["ours"], results["trl"]
    if len(seeds) > 1:
        se = math.sqrt(statistics.variance(ours) / len(ours) + statistics.variance(trl) / len(trl))
        diff = statistics.mean(ours) - statistics.mean(trl)
        print(
            f"\nlora_grpo − TRL: {diff:+.3f} (standard error {se:.3f}, {diff / se if se else float('inf'):+.1f} SE)"
        )


if __name__ == "__main__":
    main()
