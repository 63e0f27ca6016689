"""Iterative GRPO, measured: the same base trained under each reference schedule, several seeds each.

Every run is one recipe (--recipe; by default the offline toy recipe lora_grpo/recipes/toy-addition.yaml:
the tiny two-digit-sum model pre-trained on noisy sums, 4-bit base, LoRA r 8, G = 8, 16 prompts a step,
lr 1e-3) with
the same budget (--steps), a KL coefficient large enough that a fixed reference holds the policy
back (--beta), and one reference schedule:

    no reference       beta = 0: no KL term at all
    fixed reference    beta > 0, never synced (the reference stays the base)
    hard every N       copy the policy into the reference slot every N steps (alpha 1)
    soft exact every N ref ← 0.6·policy + 0.4·ref in weight space, every N steps
    factors every N    the same mix of the A and B factors name by name (not a weight-space mix)
    KL trigger         a hard sync whenever the step's KL to the reference passes --kl-threshold
    plateau trigger    a hard sync when the held-out accuracy has not risen by 0.01 for 2 evals
    reset every N      hard every N, and the AdamW moments reset at each sync (ProRL, §2.3.1)

Evaluated every --eval-steps steps on the recipe's held-out prompts: greedy accuracy and
eval/kl_to_base (the per-token KL of the policy to the model the run started from). Output in --out:
iterative_study.png (held-out accuracy and KL to the base against steps, mean over seeds with
the min–max band) and iterative_study.md (final accuracy, KL to the base, the KL penalty's share
of the loss over the last 10 steps, seconds, syncs; mean ± standard deviation over seeds, and
every seed's accuracy); another recipe's study is iterative_study_<recipe>.png and .md. Every seed
is reported; none is dropped.

    python benchmarks/studies/iterative_study.py                       # 8 schedules × 5 seeds, ~6 min on 2 CPU cores
    python benchmarks/studies/iterative_study.py --schedules fixed,hard --seeds 0 --steps 20   # a quick look
    # the real model (SmolLM2-135M-Instruct, the smollm2-135m-chat-sum recipe), at the recipe's beta:
    python benchmarks/studies/iterative_study.py --recipe smollm2-135m-chat-sum --beta 0.04 --steps 20 \
        --sync-every 5 --eval-steps 10 --schedules fixed,hard,soft --seeds 0,1,2
    # schedules run side by side (one thread each, their own --out), then one table and plot of all:
    python benchmarks/studies/iterative_study.py --recipe R ... --threads 1 --schedules fixed --out runs/a &
    python benchmarks/studies/iterative_study.py --recipe R ... --merge runs/a/iterative_study_R.json ... --out docs
"""

from __future__ import annotations

import argparse
import json
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

SCHEDULES = {  # name → (label, config overrides); "N" is replaced by --sync-every
    "none": ("no reference (beta 0)", {"beta": 0.0}),
    "fixed": ("fixed reference", {}),
    "hard": ("hard every N", {"ref_sync_steps": "N", "ref_sync_alpha": 1.0}),
    "soft": (
        "soft exact every N (alpha 0.6)",
        {"ref_sync_steps": "N", "ref_sync_alpha": 0.6, "ref_sync_mode": "exact"},
    ),
    "factors": (
        "factors every N (alpha 0.6)",
        {"ref_sync_steps": "N", "ref_sync_alpha": 0.6, "ref_sync_mode": "factors", "ref_rank": 8},
    ),
    "kl": ("KL trigger (hard)", {"ref_sync_kl": "KL", "ref_sync_alpha": 1.0}),
    "plateau": ("plateau trigger (hard)", {"ref_sync_on_plateau": True, "ref_sync_alpha": 1.0}),
    "reset": (
        "hard every N + optimizer reset",
        {"ref_sync_steps": "N", "ref_sync_alpha": 1.0, "ref_sync_reset_optimizer": True},
    ),
}
DRIFT = "eval/kl_to_base"
# The eval at step 0 is the base's, whatever the schedule or seed (the LoRA B factors start at zero,
# the held-out completions are greedy): measured by a process's first run, reused by its others.
START_EVAL: dict[str, float] = {}


def run_one(schedule: str, seed: int, args) -> dict:
    from lora_grpo import GRPOConfig, GRPOTrainer

    overrides = {
        k: {"N": args.sync_every, "KL": args.kl_threshold}.get(v, v) if isinstance(v, str) else v
        for k, v in SCHEDULES[schedule][1].items()
    }
    recipe = resources.files("lora_grpo") / "recipes" / f"{args.recipe}.yaml"
    config = GRPOConfig.from_yaml(
        str(recipe),
        {
            "beta": args.beta,
            "ref_sync_steps": 0,
            "max_steps": args.steps,
            "eval_steps": args.eval_steps,
            "eval_pass_k": [],
            "eval_kl_to_base": True,
            "eval_on_start": not START_EVAL,
            "seed": seed,
            "output_dir": tempfile.mkdtemp(prefix=f"study-{schedule}-{seed}-"),
            "disable_tqdm": True,
            "logging_steps": 10**6,
            **overrides,
        },
    )
    start = time.perf_counter()
    trainer = GRPOTrainer(config)
    summary = trainer.train()
    seconds = time.perf_counter() - start
    # the held-out score is the first reward function's greedy mean
    ACCURACY = f"eval/{trainer.reward_names[0]}"
    START_EVAL.update(summary["eval_before"])
    curve = [(0, START_EVAL[ACCURACY], START_EVAL.get(DRIFT, 0.0))]
    curve += [
        (i + 1, m[ACCURACY], m[DRIFT]) for i, m in enumerate(trainer.state.log_history) if ACCURACY in m
    ]
    curve.append((trainer.state.global_step, summary["eval_after"][ACCURACY], summary["eval_after"][DRIFT]))
    history = trainer.state.log_history
    last = history[-10:]
    penalty = [config.beta * m.get("kl", 0.0) for m in last]
    syncs = [m for m in history if m.get("sync/event")]
    return {
        "schedule": schedule,
        "beta": config.beta,
        "seed": seed,
        # the step's mean per-token KL to the reference (what ref_sync_kl compares): the trigger's scale
        "step_kl": [m.get("kl", 0.0) for m in history],
        "sync_ms": [1000 * m["sync/seconds"] for m in syncs],
        "truncation_error": [m["sync/truncation_error"] for m in syncs],
        "curve": curve,
        "accuracy": summary["accuracy_after"],
        "kl_to_base": summary["eval_after"][DRIFT],
        "seconds": seconds,
        "syncs": summary["syncs"],
        # |β·KL| against |loss − β·KL| (the policy-gradient term), over the last 10 steps
        "kl_share": statistics.mean(
            p / (p + abs(m["loss"] - p)) if p + abs(m["loss"] - p) > 0 else 0.0 for p, m in zip(penalty, last)
        ),
    }


def run_beta(schedule: str, run: dict, args) -> float:
    """The run's beta (studies before it was recorded: --beta, and 0 without a reference)."""
    return 0.0 if schedule == "none" else run.get("beta", args.beta)


def betas(results: dict[str, list[dict]], args) -> str:
    """The betas of the runs, for a title: "0, 1"."""
    values = sorted({run_beta(schedule, r, args) for schedule, runs in results.items() for r in runs})
    return ", ".join(format(b, "g") for b in values)


def groups(results: dict[str, list[dict]], args) -> list[tuple[str, list[dict]]]:
    """(label, runs) per schedule and beta, in the order met: merged studies at several betas (the
    sweep that finds where a fixed reference binds) get a row each; the beta is in the label when
    the rows' betas differ."""
    cells: dict[tuple[str, float], list[dict]] = {}
    for schedule, runs in results.items():
        for r in runs:
            cells.setdefault((schedule, run_beta(schedule, r, args)), []).append(r)
    several = len({beta for _, beta in cells}) > 1
    labels = []
    for (schedule, beta), runs in cells.items():
        label = SCHEDULES[schedule][0].replace("N", str(args.sync_every))
        if schedule == "kl":
            label = label.replace("(hard)", f"(hard, KL > {args.kl_threshold})")
        labels.append((f"{label}, beta {beta:g}" if several and schedule != "none" else label, runs))
    return labels


def write_table(results: dict[str, list[dict]], args, path: Path) -> str:
    lines = [
        f"Recipe {args.recipe}, beta {betas(results, args)}, {args.steps} steps, "
        f"N = {args.sync_every}, eval every {args.eval_steps} steps on the recipe's held-out prompts; "
        f"seeds {args.seeds}; mean ± std over seeds.",
        "",
        "| schedule | held-out accuracy | per seed | KL to base (nats/token) | KL share of loss | seconds "
        "| syncs | ms a sync | truncation error (max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in groups(results, args):
        sync_ms = [ms for r in runs for ms in r.get("sync_ms", [])]
        errors = [e for r in runs for e in r.get("truncation_error", [])]
        lines.append(
            f"| {label} | {mean_std([r['accuracy'] for r in runs])} | "
            f"{', '.join(format(r['accuracy'], '.3f') for r in runs)} | {mean_std([r['kl_to_base'] for r in runs])} | "
            f"{statistics.mean(r['kl_share'] for r in runs):.2f} | {statistics.mean(r['seconds'] for r in runs):.0f} | "
            f"{statistics.mean(r['syncs'] for r in runs):.1f} | "
            f"{format(statistics.median(sync_ms), '.1f') if sync_ms else '–'} | "
            f"{format(max(errors), '.1e') if errors else '–'} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(results: dict[str, list[dict]], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, kl_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, runs in groups(results, args):
        steps = [s for s, _, _ in runs[0]["curve"]]
        for ax, column in ((acc_ax, 1), (kl_ax, 2)):
            values = [[c[column] for c in r["curve"]] for r in runs]
            mean = [statistics.mean(v) for v in zip(*values)]
            (line,) = ax.plot(steps, mean, label=label)
            ax.fill_between(
                steps,
                [min(v) for v in zip(*values)],
                [max(v) for v in zip(*values)],
                color=line.get_color(),
                alpha=0.12,
            )
    acc_ax.set(
        xlabel="step",
        ylabel="held-out greedy accuracy",
        title=f"accuracy (mean, min–max over {len(args.seeds)} seeds)",
    )
    kl_ax.set(xlabel="step", ylabel="nats per token", title="eval/kl_to_base: KL of the policy to the start")
    acc_ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Iterative GRPO, recipe {args.recipe}: beta {betas(results, args)}, {args.steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="toy-addition", help="a shipped recipe (lora-grpo recipes)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--beta", type=float, default=4.0)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--kl-threshold", type=float, default=0.004)
    parser.add_argument("--eval-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/iterative_study")
    parser.add_argument(
        "--name", help="the output files' stem (default iterative_study, or iterative_study_<recipe>)"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="no training: one table and plot of the runs in these iterative_study.json files "
        "(studies of the same settings run side by side); the other options say what they were run with",
    )
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for path in args.merge or []:
        for schedule, runs in json.loads(Path(path).read_text()).items():
            results.setdefault(schedule, []).extend(runs)
    if args.merge:
        args.seeds = sorted({r["seed"] for runs in results.values() for r in runs})
    for schedule in [] if args.merge else args.schedules.split(","):
        for seed in args.seeds:
            r = run_one(schedule, seed, args)
            results.setdefault(schedule, []).append(r)
            print(
                f"{schedule} seed {seed}: accuracy {r['accuracy']:.3f}, kl_to_base {r['kl_to_base']:.4f}, "
                f"kl share {r['kl_share']:.2f}, {r['syncs']} syncs, {r['seconds']:.1f} s",
                flush=True,
            )
    # the default recipe's study is docs/iterative_study.*; another recipe's is named after it
    stem = args.name or (
        "iterative_study" if args.recipe == "toy-addition" else f"iterative_study_{args.recipe}"
    )
    if not args.merge:
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    print(write_table(results, args, out / f"{stem}.md"))
    plot(results, args, out / f"{stem}.png")
    print(f"wrote {out}/{stem}.md, .png" + ("" if args.merge else ", .json"))


if __name__ == "__main__":
    main()
