"""A GSM8K-like GRPO step, lora_grpo against TRL's GRPOTrainer: the shape people really train.

vs_trl.py compares the trainers at toy shapes (16 new tokens); this is the step of a GSM8K run on
Qwen2.5-0.5B: chat-templated prompts of about 150 tokens, completions up to 256 tokens with varied
lengths, G = 8, 4 prompts a step (32 sequences), LoRA r 16 on every linear layer, beta 0.04.

- The model: Qwen2.5-0.5B's shape (hidden 896, 14 heads, 2 KV heads, intermediate 4864, tied
  embeddings) with its real 151,936-token vocabulary, random-init (_common.build_qwen2; nothing is
  downloaded), but --layers of its 24 decoder layers (default 2, so that a step fits a CPU run;
  the header says how many). With 2 layers the LM head (136 M of the 166 M parameters) dominates
  every stage, as it does not with 24: the ratios here weigh the vocabulary-sized work heavily.
- The prompts: a conversational dataset (TRL's format: a system and a user message) rendered by
  a chat template with role tokens; questions of 120-160 words of the word-level vocabulary. The
  dataset holds the 4 prompts of one step, so both trainers' steps sample for the same prompts.
- Varied lengths: a random model would sample EOS once in 151,936 tokens and every completion would
  run to the cap. Every embedding row gets one shared component (column 0 = 0.5), which the
  final norm turns into a fixed direction of the hidden state; the EOS row gets a little more of
  it (the embeddings are tied, so that is a bias on EOS's logit), calibrated on a forward of
  text the model samples, for a mean of --mean-completion tokens (a geometric length, capped at
  256; the run prints the means it got, 70-80 tokens for the default 110: the prompts shift the
  hidden state). Both trainers sample from this same model.
- The reward: the share of even-numbered tokens in the completion's content (variance inside
  every group; the cost of a real answer check is negligible next to the step).
- TRL (the `bench` extra pins 1.16): its defaults (gradient checkpointing on), per-device batch 8
  with 4 accumulation steps (one generation of 32 a step, as its docs do for GSM8K); its stages
  are timed by wrapping `generate` and `_generate_and_score_completions`.
- lora_grpo: its defaults (micro_batch_size auto, gradient_checkpointing auto) with soft exact
  reference syncs every 2 steps; its stages are its own timers.

Each trainer runs in its own fresh process (`train()`, logging every step, a step timed from its
start to its end: syncs, rewards and logging inside). Ours skips --warmup steps first: its first
step skips the reference forward (the slot still equals the policy), which no later step does;
TRL's steps are all alike, so all of them count. The table reports the median of --steps steps,
each stage and its ratio, tokens per second, and each stage's floor from limit.py's model (the
larger of its FLOPs at the measured matmul peak and its weight reads at the measured read
bandwidth, at the mean prompt and completion lengths).

    pip install -e ".[bench]"
    python benchmarks/gsm8k_step.py                 # 2 layers, fp32, ours and TRL (16 minutes on 2 cores)
    python benchmarks/gsm8k_step.py --layers 24     # the whole body (for a GPU, or patience)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import QWEN2_SHAPES, build_qwen2, environment, load_peer_model, print_markdown_table, run_worker
from limit import matmul_peak, read_bandwidth, step_flops, weight_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS, G, LORA_R, BETA, LR = 4, 8, 16, 0.04, 1e-6
ROLES = {"system": "t10", "user": "t11", "assistant": "t12"}  # role tokens of the chat template
CHAT_TEMPLATE = (
    "{% set roles = " + json.dumps(ROLES) + " %}"
    "{% for m in messages %}t3 {{ roles[m['role']] }} {{ m['content'] }} t4 {% endfor %}"
    "{% if add_generation_prompt %}t3 t12 {% endif %}"
)
SYSTEM = " ".join(f"t{20 + i}" for i in range(12))  # "You are a helpful assistant. Reason step by step ..."


def questions(vocab: int, count: int = PROMPTS, seed: int = 0) -> list[dict]:
    """Conversational rows: a fixed system message and a question of 120-160 random words.

    As many rows as a step takes, so that every step of both trainers samples for the same prompts:
    how long a random model's completions run depends on the prompt, and the step's cost on them."""
    rng = random.Random(seed)
    words = lambda n: " ".join(f"t{rng.randrange(100, vocab)}" for _ in range(n))  # noqa: E731
    return [
        {
            "prompt": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": words(rng.randint(120, 160))},
            ]
        }
        for _ in range(count)
    ]


def even_share(completions, **kwargs):
    """The share of even-numbered tokens in each completion's content (text or a message list)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [
        sum(int(t[1:]) % 2 == 0 for t in s.split() if t[1:].isdigit()) / max(1, len(s.split())) for s in texts
    ]


def eos_probability(mean: float, cap: int) -> float:
    """p with E[min(geometric(p), cap)] = (1 - (1 - p)^cap) / p = mean, by bisection."""
    lo, hi = 1e-6, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if (1 - (1 - p) ** cap) / p > mean else (lo, p)
    return (lo + hi) / 2


def build(path: Path, layers: int, mean_completion: float, cap: int) -> float:
    """Save the model and tokenizer (see the docstring); return the EOS probability per token it was tuned to."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    build_qwen2("qwen2.5-0.5b", path, chat_template=CHAT_TEMPLATE, num_hidden_layers=layers)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    embedding = model.get_input_embeddings().weight  # tied: also the LM head
    target = eos_probability(mean_completion, cap)
    with torch.no_grad():
        embedding[:, 0] = 0.5
        # Text as the model samples it (min_new_tokens holds EOS back): its hidden states set EOS's bias.
        tokenizer = AutoTokenizer.from_pretrained(f"{path}/tokenizer")
        row = questions(embedding.shape[0], 1)[0]["prompt"]
        prompt = tokenizer(
            tokenizer.apply_chat_template(row, add_generation_prompt=True, tokenize=False),
            return_tensors="pt",
        )["input_ids"]
        torch.manual_seed(1)
        text = model.generate(
            prompt.repeat(8, 1),
            do_sample=True,
            max_new_tokens=96,
            min_new_tokens=96,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            pad_token_id=0,
            eos_token_id=1,
        )
        hidden = (
            model.model(input_ids=text)
            .last_hidden_state[:, prompt.shape[1] :]
            .reshape(-1, embedding.shape[1])
        )
        logits = hidden @ embedding.T
        eos = logits[:, 1]
        others = torch.cat([logits[:, :1], logits[:, 2:]], dim=1).logsumexp(dim=1)
        lo, hi = (
            -50.0,
            50.0,
        )  # EOS's logit gains delta * hidden[:, 0]: the mean probability is monotone in delta
        for _ in range(60):
            delta = (lo + hi) / 2
            p = torch.sigmoid(eos + delta * hidden[:, 0] - others).mean().item()
            lo, hi = (delta, hi) if p < target else (lo, delta)
        embedding[1, 0] += delta
    model.save_pretrained(path)
    return target


# ------------------------------------------------------------------ one run per process


def run_ours(args) -> dict:
    from lora_grpo import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        model_name_or_path=args.path,
        tokenizer_name_or_path=f"{args.path}/tokenizer",
        torch_dtype="float32",
        quantization="4bit" if args.base == "4bit" else "none",
        lora_r=LORA_R,
        lora_alpha=2 * LORA_R,
        lora_target_modules=TARGETS,
        num_generations=G,
        prompts_per_step=PROMPTS,
        max_prompt_length=None,
        max_completion_length=args.completion_length,
        beta=BETA,
        ref_sync_steps=2,
        ref_sync_alpha=0.6,
        ref_sync_mode="exact",
        learning_rate=LR,
        max_steps=args.warmup + args.steps,
        save_steps=0,
        logging_steps=1,
        output_dir=tempfile.mkdtemp(),
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = GRPOTrainer(config, reward_funcs=[even_share], train_dataset=questions(args.vocab))
    begins, ends = [], []
    trainer.hooks.append(
        lambda event, _t, **_: (
            (begins if event == "step_begin" else ends).append(time.perf_counter())
            if event in ("step_begin", "step_end")
            else None
        )
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    history = [m for m in trainer.state.log_history if "time/train" in m]
    measured = list(zip(history, [b - a for a, b in zip(begins, ends)]))[args.warmup :]
    med = lambda key: statistics.median(m[key] for m, _ in measured)  # noqa: E731
    step = statistics.median(seconds for _, seconds in measured)
    stages = {
        "rollout": med("time/rollout"),
        "reference log-probs": med("time/log_probs"),
        "train": med("time/train"),
    }
    return {
        "step_s": step,
        "stages": stages,
        "completion_length": med("completion_length/mean"),
        "tokens_per_s": statistics.median(m["completion_length/mean"] * PROMPTS * G / s for m, s in measured),
        "setup": f"micro-batch {trainer.micro_batch_size}, checkpointing {trainer.gradient_checkpointing}",
    }


def run_trl(args) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model = load_peer_model(args.path, args.base)
    timed = {"generate": [], "score": []}

    def timer(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            timed[name].append(time.perf_counter() - start)
            return out

        return wrapper

    type(model).generate = timer("generate", type(model).generate)  # PeftModel.generate calls the base's
    begins, ends, lengths = [], [], []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            begins.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=PROMPTS * G // 8,
        num_generations=G,
        max_completion_length=args.completion_length,
        gradient_checkpointing=True,
        beta=BETA,
        learning_rate=LR,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=args.seed,
    )
    peft_config = LoraConfig(
        r=LORA_R, lora_alpha=2 * LORA_R, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[even_share],
        args=config,
        train_dataset=Dataset.from_list(questions(args.vocab)),
        processing_class=AutoTokenizer.from_pretrained(f"{args.path}/tokenizer"),
        peft_config=peft_config,
        callbacks=[StepTimes()],
    )
    trainer._generate_and_score_completions = timer("score", trainer._generate_and_score_completions)
    trainer.train()
    intervals = [b - a for a, b in zip(begins, ends)]  # every step: TRL's first is a step like the others
    rollout = statistics.median(timed["generate"])
    score = statistics.median(timed["score"])  # generate + rewards + the reference forward
    step = statistics.median(intervals)
    return {
        "step_s": step,
        "completion_length": statistics.median(lengths),
        "stages": {"rollout": rollout, "reference log-probs": score - rollout, "train": step - score},
        "tokens_per_s": statistics.median(n * PROMPTS * G / t for n, t in zip(lengths, intervals)),
        "setup": f"per-device batch 8 × {PROMPTS * G // 8} accumulation, checkpointing true",
    }


# ------------------------------------------------------------------ the comparison


def child(trainer: str, path: Path, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        trainer,
        "--path",
        str(path),
        "--base",
        args.base,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--vocab",
        str(args.vocab),
        "--completion-length",
        str(args.completion_length),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
    ]
    return run_worker(command, trainer)


def compare(args) -> None:
    import peft
    import transformers
    import trl
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    spec = {**QWEN2_SHAPES["qwen2.5-0.5b"], "num_hidden_layers": args.layers}
    args.vocab = spec["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        p_eos = build(path, args.layers, args.mean_completion, args.completion_length)
        tokenizer = AutoTokenizer.from_pretrained(f"{path}/tokenizer")
        P = statistics.mean(
            len(
                tokenizer(
                    tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
                )["input_ids"]
            )
            for row in questions(args.vocab)
        )
        results = {}
        for r in range(args.repeats):
            for trainer in ["ours", "trl"] if r % 2 == 0 else ["trl", "ours"]:
                results.setdefault(trainer, []).append(child(trainer, path, args))
                print(f"  round {r + 1} {trainer}: {results[trainer][-1]}", file=sys.stderr)
    pick = lambda runs: sorted(runs, key=lambda x: x["step_s"])[len(runs) // 2]  # noqa: E731  the median run
    ours, peer = pick(results["ours"]), pick(results["trl"])
    B, S = PROMPTS * G, int(P + ours["completion_length"])
    H, I = spec["hidden_size"], spec["intermediate_size"]
    peak, _ = matmul_peak([(2048, 2048, 2048), (B * S // 4, H, I), (B * S // 4, I, H)])
    bandwidth = read_bandwidth()
    print(f"# {environment(transformers, peft, trl)}")
    print(
        f"# Qwen2.5-0.5B's shape with {args.layers} of its 24 layers and its {spec['vocab_size']}-token vocabulary "
        f"({args.base} base); {PROMPTS} prompts × G={G}, chat-templated prompts of {P:.0f} tokens (mean), completions "
        f"up to {args.completion_length} (EOS's bias tuned on sampled text to p = {p_eos:.4f} a token, for a mean of "
        f"{args.mean_completion:.0f}; the means measured are below), "
        f"LoRA r {LORA_R}, beta {BETA}; median of {args.steps} step(s) (ours after {args.warmup}), "
        f"{args.repeats} round(s), each run in a fresh process"
    )
    print(f"# ours: {ours['setup']}, soft exact syncs every 2 steps; TRL: {peer['setup']}")
    print(f"# limits: float32 matmul peak {peak:.1f} GFLOP/s, memory read bandwidth {bandwidth:.1f} GB/s")
    flops = step_flops(
        spec,
        prompts=PROMPTS,
        G=G,
        P=P,
        T=ours["completion_length"],
        lora_r=LORA_R,
        ref_rank=LORA_R,
        recompute=ours["setup"].endswith("True"),
    )
    passes = {
        "rollout": 1 + round(ours["completion_length"]),
        "reference log-probs": 1,
        "train": 2 + ours["setup"].endswith("True"),
    }
    rows, floor_total = [], 0.0
    for stage, f in flops.items():
        floor = max(f / (peak * 1e9), passes[stage] * weight_bytes(spec, args.base) / (bandwidth * 1e9))
        floor_total += floor
        a, b = ours["stages"][stage], peer["stages"][stage]
        rows.append(
            [
                stage,
                f"{a:.2f}",
                f"{b:.2f}",
                f"{a / b:.2f}",
                f"{floor:.2f}",
                f"{100 * floor / a:.0f}%",
                f"{100 * floor / b:.0f}%",
            ]
        )
    rows.append(
        [
            "whole step",
            f"{ours['step_s']:.2f}",
            f"{peer['step_s']:.2f}",
            f"{ours['step_s'] / peer['step_s']:.2f}",
            f"{floor_total:.2f}",
            f"{100 * floor_total / ours['step_s']:.0f}%",
            f"{100 * floor_total / peer['step_s']:.0f}%",
        ]
    )
    print_markdown_table(
        ["stage", "ours s", "TRL s", "ours / TRL", "floor s", "floor / ours", "floor / TRL"],
        rows,
        text_columns=1,
    )
    print(
        f"\ncompletion tokens/s: ours {ours['tokens_per_s']:.0f}, TRL {peer['tokens_per_s']:.0f} "
        f"(mean completion: ours {ours['completion_length']:.0f}, TRL {peer['completion_length']:.0f} tokens); "
        f"step ours/TRL {ours['step_s'] / peer['step_s']:.2f} (target ≤ 0.6)"
    )
    print(
        "# TRL's 'reference log-probs' row is its _generate_and_score_completions less generate: rewards, "
        "tokenisation and the reference forward; ours is time/log_probs (rewards are in neither of our rows)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of Qwen2.5-0.5B's 24 to keep")
    parser.add_argument("--base", choices=["fp32", "4bit"], default="fp32")
    parser.add_argument("--completion-length", type=int, default=256, help="max_completion_length")
    parser.add_argument(
        "--mean-completion", type=float, default=110.0, help="mean completion tokens to tune EOS to"
    )
    parser.add_argument("--steps", type=int, default=1, help="measured steps per run")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="ours: steps before measuring (its first skips the reference forward: the slot is the policy)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (ours, TRL), alternating the order")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps((run_ours if args.worker == "ours" else run_trl)(args)), flush=True)
    else:
        compare(args)


if __name__ == "__main__":
    main()
