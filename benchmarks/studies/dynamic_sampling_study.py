"""Dynamic sampling, measured: an offline recipe with and without it, several seeds, at the recipe's beta.

Every run is a shipped offline recipe (--recipe: toy-addition, the tiny two-digit-sum model pre-trained
on noisy sums, 4-bit base, LoRA r 8, G = 8, 16 prompts a step, beta 0.04, soft syncs every 10 steps;
or toy-countdown) for --steps optimizer steps, evaluated every --eval-steps steps on its held-out
prompts (greedy accuracy: the eval score of the recipe's first reward function). Two arms:

    plain      every sampled group is trained on (groups of equal rewards carry only the KL pull)
    dynamic    dynamic_sampling: true, dynamic_sampling_max_rounds --max-rounds: each step samples
               rounds of prompts until it holds prompts_per_step groups whose rewards differ

The x axes are what each arm spent: completions sampled (prompts drawn × G, every round counted) and
seconds of training (rollouts, rewards, log-probs and updates; the evals are not counted). Output in
--out, named dynamic_sampling_<recipe>: .png (held-out accuracy against completions sampled and
against seconds; every seed thin, the mean over seeds thick) and .md (accuracy before → after, the
completions and seconds until the first eval at --target, the totals, the plain arm's zero-std
fraction, the dynamic arm's rounds and filled groups per step; mean ± std over seeds, and every seed).
Every seed is reported; none is dropped. Run it alone on the machine: the seconds are wall time.

    python benchmarks/studies/dynamic_sampling_study.py         # toy-addition, 2 arms × 5 seeds, ~3 min
    python benchmarks/studies/dynamic_sampling_study.py --recipe toy-countdown --plain-steps 60 --target 0.7
    python benchmarks/studies/dynamic_sampling_study.py --seeds 0 --steps 10      # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

# benchmarks/ on sys.path, for the helpers the scripts share (run as `python benchmarks/studies/X.py`).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import mean_std  # noqa: E402

ARMS = {"plain": {}, "dynamic": {"dynamic_sampling": True}}


def run_one(arm: str, seed: int, args) -> dict:
    from lora_grpo import GRPOConfig, GRPOTrainer

    recipe = resources.files("lora_grpo") / "recipes" / f"{args.recipe}.yaml"
    config = GRPOConfig.from_yaml(
        str(recipe),
        {
            "max_steps": args.plain_steps if arm == "plain" and args.plain_steps else args.steps,
            "eval_steps": args.eval_steps,
            "eval_pass_k": [],
            "eval_kl_to_base": False,
            "seed": seed,
            "dynamic_sampling_max_rounds": args.max_rounds,
            "output_dir": tempfile.mkdtemp(prefix=f"dynamic-{arm}-{seed}-"),
            "disable_tqdm": True,
            "logging_steps": 10**6,
            **ARMS[arm],
        },
    )
    trainer = GRPOTrainer(config)
    accuracy = f"eval/{trainer.reward_names[0]}"  # the recipe's headline: held-out greedy accuracy
    start = time.perf_counter()
    summary = trainer.train()
    wall = time.perf_counter() - start
    G, per_step = config.num_generations, config.prompts_per_step
    curve = [(0, 0.0, summary["eval_before"][accuracy])]  # (completions sampled, seconds, accuracy)
    completions = seconds = 0.0
    for m in trainer.state.log_history:
        if "time/step" not in m:
            continue
        completions += G * m.get("dynamic_sampling/prompts_consumed", per_step)
        seconds += m["time/step"]
        if accuracy in m:
            curve.append((completions, seconds, m[accuracy]))
    curve.append((completions, seconds, summary["eval_after"][accuracy]))
    reached = next(((c, t) for c, t, a in curve if a >= args.target), (math.nan, math.nan))
    steps = [m for m in trainer.state.log_history if "time/step" in m]
    return {
        "arm": arm,
        "seed": seed,
        "curve": curve,
        "accuracy": summary["eval_after"][accuracy],
        "accuracy_before": summary["eval_before"][accuracy],
        "to_target": reached,  # (completions, seconds) at the first eval at or above --target
        "completions": completions,
        "seconds": seconds,
        "wall": wall,
        "zero_std": statistics.mean(m["frac_reward_zero_std"] for m in steps),
        "rounds": statistics.mean(m.get("dynamic_sampling/rounds", 1.0) for m in steps),
        "filled": statistics.mean(m.get("dynamic_sampling/filled_groups", 0.0) for m in steps),
    }


def write_table(results: dict[str, list[dict]], args, path: Path) -> str:
    lines = [
        f"Recipe {args.recipe}, {args.steps} optimizer steps (plain: {args.plain_steps or args.steps}), "
        f"eval every {args.eval_steps} steps on the held-out prompts; dynamic_sampling_max_rounds "
        f"{args.max_rounds}; seeds {args.seeds}; mean ± std over seeds.",
        "",
        "| arm | held-out accuracy (before → after) | per seed (after) | completions to "
        f"{args.target} | seconds to {args.target} | completions sampled | seconds (train) | zero-std groups "
        "(sampled) | rounds / step | filled groups / step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, runs in results.items():
        lines.append(
            f"| {arm} | {statistics.mean(r['accuracy_before'] for r in runs):.3f} → "
            f"{mean_std([r['accuracy'] for r in runs])} | "
            f"{', '.join(format(r['accuracy'], '.3f') for r in runs)} | "
            f"{mean_std([r['to_target'][0] for r in runs], '.0f')} | "
            f"{mean_std([r['to_target'][1] for r in runs], '.1f')} | "
            f"{mean_std([r['completions'] for r in runs], '.0f')} | {mean_std([r['seconds'] for r in runs], '.1f')} | "
            f"{mean_std([r['zero_std'] for r in runs], '.2f')} | {statistics.mean(r['rounds'] for r in runs):.2f} | "
            f"{statistics.mean(r['filled'] for r in runs):.2f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(results: dict[str, list[dict]], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for arm, runs in results.items():
        for ax, column in zip(axes, (0, 1)):
            for r in runs:  # every seed, thin; the mean over seeds at the eval points, thick
                ax.plot(
                    [c[column] for c in r["curve"]],
                    [c[2] for c in r["curve"]],
                    color="C0" if arm == "plain" else "C1",
                    alpha=0.3,
                    linewidth=0.8,
                    label=None,
                )
            points = list(zip(*[r["curve"] for r in runs]))
            ax.plot(
                [statistics.mean(p[column] for p in point) for point in points],
                [statistics.mean(p[2] for p in point) for point in points],
                color="C0" if arm == "plain" else "C1",
                linewidth=2,
                marker="o",
                label=f"{arm} (mean of {len(runs)} seeds)",
            )
    axes[0].set(xlabel="completions sampled", ylabel="held-out greedy accuracy")
    axes[1].set(xlabel="seconds of training (rollouts + updates)", ylabel="held-out greedy accuracy")
    for ax in axes:
        ax.legend(loc="lower right")
    fig.suptitle(
        f"Dynamic sampling, recipe {args.recipe}: {args.steps} steps (plain {args.plain_steps or args.steps}), "
        "thin lines one seed each"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="toy-addition", help="a shipped offline recipe")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--target", type=float, default=0.9, help="the accuracy the to-target columns time")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--plain-steps",
        type=int,
        default=0,
        help="the plain arm's steps, to match the dynamic arm's completions (0: --steps)",
    )
    parser.add_argument("--eval-steps", type=int, default=2)
    parser.add_argument("--max-rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/dynamic_sampling_study")
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:  # the arms alternate, so drift in the machine's speed hits both alike
        for arm in args.arms.split(","):
            r = run_one(arm, seed, args)
            results.setdefault(arm, []).append(r)
            print(
                f"{arm} seed {seed}: accuracy {r['accuracy']:.3f}, {r['completions']:.0f} completions, "
                f"{r['seconds']:.1f} s training ({r['wall']:.1f} s wall), zero-std {r['zero_std']:.2f}, "
                f"{r['rounds']:.2f} rounds/step, {r['filled']:.2f} filled/step",
                flush=True,
            )
    name = f"dynamic_sampling_{args.recipe}"
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(write_table(results, args, out / f"{name}.md"))
    plot(results, args, out / f"{name}.png")
    print(f"wrote {out}/{name}.md, .png, .json")


if __name__ == "__main__":
    main()
