"""`lora-grpo train | eval | plot | merge`. The CLI builds a GRPOConfig and calls the Python API.

    lora-grpo train recipes/toy-addition.yaml --set max_steps=20 --set output_dir=runs/try
    lora-grpo eval runs/try/adapter --recipe recipes/toy-addition.yaml
    lora-grpo plot runs/try
    lora-grpo merge runs/try/adapter --recipe recipes/toy-addition.yaml --out merged/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import ConfigError, GRPOConfig

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "toy-addition.yaml"


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        out[key.strip()] = GRPOConfig.parse_value(key.strip(), raw)
    return out


def load_config(recipe: str | None, sets: list[str]) -> GRPOConfig:
    overrides = _overrides(sets)
    if recipe:
        return GRPOConfig.from_yaml(recipe, overrides)
    return GRPOConfig.from_dict(overrides, source="--set")


def _help_config() -> str:
    import dataclasses

    lines = []
    for f in dataclasses.fields(GRPOConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {f.name:<28} {f.metadata.get('help', '')} [default: {default!r}]")
    return "config fields (recipe keys and --set names):\n" + "\n".join(lines)


def cmd_train(args) -> int:
    from .trainer import GRPOTrainer

    recipe = args.recipe or (str(DEFAULT_RECIPE) if DEFAULT_RECIPE.exists() else None)
    config = load_config(recipe, args.set)
    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun / accelerate launch, print once
    if main_process:
        print(f"lora-grpo: training {config.model_name_or_path} → {config.output_dir}" + (f" (recipe {recipe})" if recipe else ""))
    summary = GRPOTrainer(config).train()
    if main_process:
        print(json.dumps({k: v for k, v in summary.items() if not k.startswith("eval_")}, indent=2))
    return 0


def cmd_eval(args) -> int:
    from .adapters import POLICY
    from .checkpoint import load_adapter_weights
    from .trainer import GRPOTrainer

    config = load_config(args.recipe, args.set)
    if not config.eval_dataset:
        raise ConfigError("eval needs eval_dataset in the recipe or --set eval_dataset=...")
    trainer = GRPOTrainer(config)
    if args.adapter:
        load_adapter_weights(trainer.model, args.adapter, POLICY)
    print(json.dumps(trainer.evaluate(), indent=2))
    return 0


def cmd_plot(args) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot needs matplotlib: pip install 'lora_grpo[plot]'", file=sys.stderr)
        return 2
    run = Path(args.run_dir)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    keys = args.keys or ["reward/mean", "kl", "completion_length/mean", "entropy"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True)
    for ax, key in zip(axes if len(keys) > 1 else [axes], keys):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points))
        syncs = [r["step"] for r in records if r.get("sync/event")]
        for s in syncs:
            ax.axvline(s, color="gray", alpha=0.3, lw=0.8)
        ax.set_ylabel(key)
    (axes[-1] if len(keys) > 1 else axes).set_xlabel("step (gray: reference syncs)")
    out = Path(args.out or run / "metrics.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


def cmd_merge(args) -> int:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .model import load_tokenizer, resolve_dtype, resolve_model_path

    config = load_config(args.recipe, args.set)
    path = resolve_model_path(config)
    # Merge into the unquantized weights: merging into a 4-bit base would re-quantize (and lose) the update.
    dtype = resolve_dtype(config.torch_dtype)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=config.trust_remote_code)
    merged = PeftModel.from_pretrained(base, args.adapter).merge_and_unload()
    merged.save_pretrained(args.out)
    load_tokenizer(config, path).save_pretrained(args.out)
    print(f"merged {args.adapter} into {path} ({dtype}) → {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora-grpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, recipe_positional: bool):
        if recipe_positional:
            p.add_argument("recipe", nargs="?", help="YAML recipe (default: the offline toy recipe)")
        else:
            p.add_argument("--recipe", help="YAML recipe the run was trained with")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")

    p = sub.add_parser("train", help="train with GRPO", epilog=_help_config(), formatter_class=argparse.RawDescriptionHelpFormatter)
    common(p, True)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("eval", help="greedy eval of an adapter on eval_dataset with the recipe's rewards")
    p.add_argument("adapter", nargs="?", help="adapter dir (default: the fresh policy = the base model)")
    common(p, False)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("plot", help="plot metrics.jsonl of a run dir to PNG (needs matplotlib)")
    p.add_argument("run_dir")
    p.add_argument("--keys", nargs="*", help="metric names to plot")
    p.add_argument("--out", help="output PNG path (default: RUN_DIR/metrics.png)")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser("merge", help="merge a trained adapter into the (unquantized) base and save it")
    p.add_argument("adapter")
    p.add_argument("--out", required=True)
    common(p, False)
    p.set_defaults(func=cmd_merge)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"lora-grpo: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from .trainer import TrainingInterrupted

        if isinstance(e, TrainingInterrupted):  # a checkpoint was written; the message said how to resume
            return e.exit_code
        raise
    except (ValueError, OSError, RuntimeError, FloatingPointError) as e:
        # lora_grpo's errors say what, where and how to fix: show that, not a traceback (unless asked).
        if os.environ.get("LORA_GRPO_TRACEBACK"):
            raise
        print(f"lora-grpo: error: {e}\n(set LORA_GRPO_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
