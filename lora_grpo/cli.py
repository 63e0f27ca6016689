"""`lora-grpo train | eval | plot | merge | export | push | recipes | trl`. The CLI builds a GRPOConfig and calls the
Python API.

    lora-grpo train toy-addition --set max_steps=20 --set output_dir=runs/try
    lora-grpo eval runs/try            # its final adapter, with the run's own config.yaml (or --recipe)
    lora-grpo plot runs/try
    lora-grpo merge runs/try --out merged/
    lora-grpo export runs/smollm2-135m-chat-sum --gguf chat.gguf  # one GGUF file for llama.cpp / ollama / LM
                                       # Studio, of a real model's run (the toy's character tokenizer has no GGUF form)
    lora-grpo push runs/try you/try-grpo  # the adapter to the Hugging Face Hub (`hf auth login` first)
    lora-grpo recipes                  # the shipped recipes; `lora-grpo recipes NAME > my.yaml` to copy one
    lora-grpo trl --config grpo.yaml   # a TRL GRPO recipe (what `trl grpo --config` takes), via lora_grpo.trl

A recipe is a YAML file's path or the name of a recipe shipped in the package (lora_grpo/recipes/).
Every subcommand imports the dotted paths of a recipe (reward functions, tools, environments) with the
current directory first on the path, as `python -m` does, so a `my_rewards.py` in the directory you run
from works.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.resources
import json
import os
import sys
from pathlib import Path

from .config import ConfigError, GRPOConfig
from .model.adapter_files import check_adapter_fits

DEFAULT_RECIPE = "toy-addition"  # shipped in the package, so it works outside a clone too


def shipped_recipes() -> dict:
    """name -> package resource (a ``Traversable``) of every recipe in lora_grpo/recipes/, by name."""
    folder = importlib.resources.files(__package__ or "lora_grpo") / "recipes"
    found = {p.name[: -len(".yaml")]: p for p in folder.iterdir() if p.name.endswith(".yaml")}
    return dict(sorted(found.items()))


@contextlib.contextmanager
def recipe_file(recipe: str):
    """The recipe as a file path: ``recipe`` itself when that file exists, else the shipped recipe
    of that name (".yaml" optional). ConfigError naming the shipped recipes when it is neither."""
    if Path(recipe).is_file():
        yield Path(recipe)
        return
    shipped = shipped_recipes()
    name = recipe[: -len(".yaml")] if recipe.endswith(".yaml") and "/" not in recipe else recipe
    if name in shipped:
        with importlib.resources.as_file(shipped[name]) as path:  # a real file even from a zipped package
            yield path
        return
    stem = Path(recipe).name.removesuffix(".yaml")
    close = [stem] if stem in shipped else difflib.get_close_matches(stem, shipped, n=1)
    hint = f" (did you mean the shipped recipe {close[0]!r}: `lora-grpo train {close[0]}`?)" if close else ""
    raise ConfigError(
        f"recipe {recipe!r} is neither a file nor a shipped recipe{hint}; shipped recipes: "
        f"{', '.join(shipped)} (`lora-grpo recipes` lists them)"
    )


def recipe_summary(text: str) -> str:
    """A recipe's first comment line, without the '#'."""
    return next((line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")), "")


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
        with recipe_file(recipe) as path:
            return GRPOConfig.from_yaml(path, overrides)
    return GRPOConfig.from_dict(overrides, source="--set")


def trained_config(command: str, adapter: str | None, recipe: str | None, sets: list[str]) -> GRPOConfig:
    """The config eval and merge use: --recipe's; else, for an adapter of a run (its dir, its adapter/, a
    checkpoint), the config.yaml the run wrote (export.run_config_file); --set on top. Neither, and no base model among
    the --set: one error that says what to pass."""
    from .export import run_config_file
    from .run.checkpoint import resolve_adapter

    if adapter and not Path(adapter).exists():
        resolve_adapter(adapter)  # its error: no such directory
    if recipe:
        return load_config(recipe, sets)
    overrides = _overrides(sets)
    found = run_config_file(adapter) if adapter else None
    if found is not None:
        return GRPOConfig.from_yaml(found, overrides)
    if "model_name_or_path" not in overrides:
        where = (
            f"{adapter} is no run's adapter (no config.yaml in it or beside it)" if adapter else "no adapter"
        )
        raise ConfigError(
            f"{command} needs the config the adapter was trained with: {where}, and no --recipe. Pass --recipe (the "
            "recipe's file or shipped name), or --set model_name_or_path=... with the other fields it needs"
        )
    return GRPOConfig.from_dict(overrides, source="--set")


def _help_config() -> str:
    lines = [f"  {name:<28} {text}" for name, text in GRPOConfig.field_help().items()]
    return "config fields (recipe keys and --set names):\n" + "\n".join(lines)


def cmd_train(args) -> int:
    from .trainer import GRPOTrainer

    recipe = args.recipe or DEFAULT_RECIPE
    config = load_config(recipe, args.set)
    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun / accelerate launch, print once
    if main_process:
        print(f"lora-grpo: training {config.model_name_or_path} → {config.output_dir} (recipe {recipe})")
    trainer = GRPOTrainer(config)
    trainer.resume_hint = resume_command(recipe, args.set)
    trainer.train_further_hint = lambda max_steps: resume_command(recipe, args.set, max_steps=max_steps)
    summary = trainer.train()
    if main_process:
        print(json.dumps({k: v for k, v in summary.items() if not k.startswith("eval_")}, indent=2))
    _end_processes()
    return 0


def resume_command(recipe: str, sets: list[str], max_steps: int | None = None) -> str:
    """The command that resumes this `lora-grpo train`: its recipe and --set overrides, resuming the
    latest checkpoint; with `max_steps`, training on to that step."""
    import shlex

    replaced = {"resume_from_checkpoint"} | ({"max_steps"} if max_steps is not None else set())
    kept = [s for s in sets if s.split("=", 1)[0].strip() not in replaced]
    return " ".join(
        [
            "lora-grpo train",
            shlex.quote(recipe),
            *(f"--set {shlex.quote(s)}" for s in kept),
            *([f"--set max_steps={max_steps}"] if max_steps is not None else []),
            "--set resume_from_checkpoint=latest",
        ]
    )


def _end_processes() -> None:
    """Under torchrun / accelerate launch: leave the process group before exiting (a gloo group
    still up at interpreter exit can abort a process that has finished its work)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def cmd_trl(args) -> int:
    """A TRL GRPO recipe (`trl grpo --config`'s keys and flags), through the TRL front door."""
    from .trl.script import main as trl_main

    return trl_main(args.trl_args)


def cmd_recipes(args) -> int:
    if args.name:  # the recipe's text, to copy and edit: lora-grpo recipes NAME > my.yaml
        with recipe_file(args.name) as path:
            sys.stdout.write(path.read_text())
        return 0
    shipped = shipped_recipes()
    width = max(map(len, shipped))
    for name, resource in shipped.items():
        print(f"{name:<{width}}  {recipe_summary(resource.read_text())}")
    return 0


def cmd_eval(args) -> int:
    from .export import other_base_fix
    from .model.adapters import POLICY
    from .model.load import load_tokenizer, resolve_model_path
    from .run.checkpoint import load_adapter_weights, resolve_adapter
    from .trainer import GRPOTrainer

    sets = list(args.set)
    if args.k:  # --k 1 --k 8 or --k 1,8: the same as --set eval_pass_k=[1,8], and it wins over it
        try:
            ks = sorted({int(x) for arg in args.k for x in arg.split(",") if x.strip()})
        except ValueError:
            raise ConfigError(f"--k expects integers such as 8 or 1,8, got {' '.join(args.k)!r}") from None
        sets.append(f"eval_pass_k={ks}")
    config = trained_config("eval", args.adapter, args.recipe, sets)
    if not config.eval_dataset:
        raise ConfigError("eval needs eval_dataset in the recipe or --set eval_dataset=...")
    adapter, what = (
        resolve_adapter(args.adapter) if args.adapter else (None, "no adapter: the base model itself")
    )
    if adapter is not None:
        config = _with_adapters_shape(config, adapter, what)
    # the tokenizer the run trained with, saved beside its adapter (a script's own chat template, added tokens)
    tokenizer = load_tokenizer(config, saved_with=adapter) if adapter is not None else None
    trainer = GRPOTrainer(config, tokenizer=tokenizer)
    if adapter is not None:
        check_adapter_fits(
            trainer.model,
            adapter,
            label=what[0].upper() + what[1:],
            base_given=(config.model_name_or_path, resolve_model_path(config)),
            fix=other_base_fix(adapter, "Evaluate it on"),
        )
        load_adapter_weights(trainer.model, adapter, POLICY)
    metrics = trainer.evaluate()  # under torchrun / accelerate launch the processes split the prompts
    if os.environ.get("RANK", "0") == "0":
        print(f"lora-grpo: evaluated {what}", file=sys.stderr)
        print(json.dumps(metrics, indent=2))
    return 0


def _with_adapters_shape(config: GRPOConfig, adapter, what: str) -> GRPOConfig:
    """The config with the adapter's own rank and scaling (its adapter_config.json: r, lora_alpha, use_rslora),
    so that its tensors compute what they computed in training, as `merge` and peft load it; the config's may be
    another run's (--recipe). A per-module rank_pattern or alpha_pattern cannot be rebuilt here: refused."""
    import dataclasses

    from peft import LoraConfig

    saved = LoraConfig.from_pretrained(str(adapter))
    patterns = [name for name in ("rank_pattern", "alpha_pattern") if getattr(saved, name)]
    if patterns:
        raise ConfigError(
            f"{what} has a per-module {' and '.join(patterns)} in its adapter_config.json, which eval does not "
            "rebuild: merge it (lora-grpo merge ADAPTER --out DIR) and evaluate the merged model (--set "
            "model_name_or_path=DIR)"
        )
    own = {"lora_r": saved.r, "lora_alpha": saved.lora_alpha, "use_rslora": bool(saved.use_rslora)}
    if all(getattr(config, name) == value for name, value in own.items()):
        return config
    said = ", ".join(
        f"{name} {value} (the config's {getattr(config, name)})"
        for name, value in own.items()
        if getattr(config, name) != value
    )
    print(f"lora-grpo: evaluating {what} with its own {said}", file=sys.stderr)
    return dataclasses.replace(config, **own, ref_rank=max(config.ref_rank, 2 * saved.r))


def cmd_plot(args) -> int:
    from .run.plots import plot_run  # the same plot a run writes by itself

    if args.out is not None:
        out = Path(args.out)
        if out.suffix.lower() not in PLOT_FORMATS:
            raise ConfigError(
                f"--out {out}: name the image file with its format's suffix, one of {', '.join(PLOT_FORMATS)} "
                f"(e.g. --out {out.with_suffix('.png') if not out.is_dir() else out / 'metrics.png'})"
            )
        if out.exists() and not args.overwrite:
            raise ConfigError(
                f"--out {out} exists: plot never writes over a file of yours; name a new file, or pass --overwrite "
                "to replace it"
            )
    info = plot_run(args.run_dir, args.out, args.keys)
    print(f"wrote {info.path}")
    return 0


# The image formats --out may name (matplotlib's savefig, by the suffix).
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def cmd_merge(args) -> int:
    """Merge an adapter into its base (export.merge_policy: --base trained or full) and save the merged model
    with its tokenizer, saying how far its logits are from the trained policy's.

    --out is written whole (run/owned_dir.py): never the base, its cache or the adapter; a directory holding
    files lora_grpo did not write there only with --overwrite; into a temporary directory renamed into place."""
    from .export import MERGE_CHECK_PROMPTS, merge_policy, merge_source
    from .run.owned_dir import check_whole_target, write_whole

    config = trained_config("merge", args.adapter, args.recipe, args.set)
    source = merge_source(config, args.adapter)
    # Before any weight is loaded: a refused --out costs nothing.
    target = dict(protected=source.protected, overwrite=args.overwrite, label="--out")
    replaced = check_whole_target(args.out, **target, flag="--overwrite")
    merged = merge_policy(config, source, args.base)
    with write_whole(args.out, **target, flag="--overwrite", writer="lora_grpo merge") as tmp:
        merged.model.save_pretrained(tmp)
        merged.tokenizer.save_pretrained(tmp)
    print(
        f"merged {source.what} into {merged.into} of {source.path} ({str(source.dtype).removeprefix('torch.')}) → "
        f"{args.out}; the merged model's logits differ from the trained policy's by at most {merged.gap:.3g} on "
        f"{len(MERGE_CHECK_PROMPTS)} prompts" + (f" ({replaced})" if replaced else "")
    )
    return 0


def cmd_export(args) -> int:
    """The policy of a run merged (as `merge` does) and written as one GGUF file for llama.cpp / ollama; the
    config is --recipe's, else the run's own config.yaml, with --set on top."""
    from .export import export_gguf

    config = trained_config("export", args.run, args.recipe, args.set)  # eval's and merge's, and their errors
    exported = export_gguf(
        args.run, args.gguf, config=config, gguf_type=args.gguf_type, base=args.base, overwrite=args.overwrite
    )
    print(exported.summary)
    return 0


def cmd_push(args) -> int:
    """A trained adapter to a hub repository in one commit (run.hub.push_run): a run's final adapter with its
    config and metrics, a checkpoint's adapter, or an adapter directory."""
    from .run.hub import push_run

    pushed = push_run(
        args.run,
        args.repo_id,
        token=args.token,
        private=args.private,
        revision=args.revision,
        message=args.message,
    )
    print(f"pushed {pushed.what} to {args.repo_id}: {pushed.commit_url}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lora-grpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, recipe_positional: bool):
        if recipe_positional:
            p.add_argument(
                "recipe",
                nargs="?",
                help=f"a YAML file or a shipped recipe's name (`lora-grpo recipes`; default: {DEFAULT_RECIPE})",
            )
        else:
            p.add_argument(
                "--recipe",
                help="the recipe the run was trained with: a YAML file or a shipped recipe's name (default: the "
                "run's own config.yaml, beside its adapter/ or in the checkpoint)",
            )
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
        )

    p = sub.add_parser(
        "train",
        help="train with GRPO",
        epilog=_help_config(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(p, True)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser(
        "recipes", help="list the shipped recipes (train one with `lora-grpo train NAME`), or print one"
    )
    p.add_argument(
        "name", nargs="?", help="print this recipe (to copy and edit: lora-grpo recipes NAME > my.yaml)"
    )
    p.set_defaults(func=cmd_recipes)
    p = sub.add_parser(
        "eval", help="greedy eval (and pass@k) of an adapter on eval_dataset with the recipe's rewards"
    )
    p.add_argument(
        "adapter",
        nargs="?",
        help="an adapter dir, a checkpoint dir (its policy adapter) or a run dir (its "
        "final adapter/); default: the fresh policy = the base model",
    )
    p.add_argument(
        "--k",
        action="append",
        default=[],
        metavar="K[,K...]",
        help="also report pass@k for these k (--k 1 --k 8, or --k 1,8): max(k) sampled completions per "
        "prompt, or eval_num_samples; sets eval_pass_k",
    )
    common(p, False)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("plot", help="plot metrics.jsonl of a run dir to PNG (needs matplotlib)")
    p.add_argument("run_dir")
    p.add_argument("--keys", nargs="*", help="metric names to plot")
    p.add_argument(
        "--out",
        help="a new image file, .png, .pdf, .svg or .jpg (default: RUN_DIR/metrics.png, the run's own)",
    )
    p.add_argument("--overwrite", action="store_true", help="let --out replace an existing file")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser(
        "trl",
        help="run a TRL GRPO recipe: --config recipe.yaml and TRL's flags (ScriptArguments, GRPOConfig, ModelConfig)",
        add_help=False,
    )
    p.add_argument(
        "trl_args", nargs=argparse.REMAINDER, help="--config recipe.yaml and TRL's flags (--help lists them)"
    )
    p.set_defaults(func=cmd_trl)
    p = sub.add_parser("merge", help="merge a trained adapter into its base and save the merged model")
    p.add_argument(
        "adapter",
        help="an adapter dir, a checkpoint dir (its policy adapter) or a run dir (its final adapter/)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="a new directory for the merged model (an earlier merge's output there is replaced); never the "
        "base's directory",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --out be a directory holding files lora_grpo did not write there: they are deleted",
    )
    p.add_argument(
        "--base",
        choices=("trained", "full"),
        default="trained",
        help="trained (default): the weights the adapter was trained against (a 4-bit base dequantised); "
        "full: the original full-precision weights",
    )
    common(p, False)
    p.set_defaults(func=cmd_merge)
    p = sub.add_parser(
        "export",
        help="merge a trained adapter into its base and write it as one GGUF file (llama.cpp, ollama)",
    )
    p.add_argument(
        "run", help="a run dir (its final adapter/), a checkpoint dir (its policy adapter) or an adapter dir"
    )
    p.add_argument(
        "--gguf", required=True, metavar="FILE", help="the GGUF file to write (*.gguf); never inside the base"
    )
    p.add_argument(
        "--gguf-type",
        choices=("f16", "q8_0"),
        default="f16",
        help="f16 (default): matrices in float16; q8_0: 8-bit blocks, about half the size",
    )
    p.add_argument(
        "--base",
        choices=("trained", "full"),
        default="trained",
        help="as merge's --base: trained (default) the weights the adapter was trained against; full the "
        "original full-precision weights",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the file at --gguf if there is one")
    common(p, False)
    p.set_defaults(func=cmd_export)
    p = sub.add_parser(
        "push",
        help="push a trained adapter to the Hugging Face Hub, with a model card that loads it from there",
    )
    p.add_argument(
        "run",
        help="a run dir (its final adapter/, with config.yaml, metrics.jsonl, summary.json, metrics.png), a "
        "checkpoint dir (its adapter, tokenizer and card) or an adapter dir",
    )
    p.add_argument("repo_id", help="the repository, user/name (created if it is not there)")
    p.add_argument(
        "--private",
        action="store_const",
        const=True,
        default=None,
        help="create the repository private (no effect on one that exists)",
    )
    p.add_argument("--revision", help="the branch to push to (default: main)")
    p.add_argument("--token", help="a token that may write to the repository (default: `hf auth login`'s)")
    p.add_argument(
        "--message", default="Upload the adapter trained with lora_grpo", help="the commit message"
    )
    p.set_defaults(func=cmd_push)
    return parser


def current_directory_first() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does: the ``lora-grpo``
    script's own path starts with its bin directory, so without this a recipe's ``my_rewards:fn``
    beside it would import under ``python -m lora_grpo.cli`` but not under ``lora-grpo``."""
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in ("", cwd):
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    current_directory_first()  # train, eval, merge and trl import local modules alike
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "trl":  # TRL's own flags (--config, --output_dir, ...) are its parser's
        args.trl_args = extra + args.trl_args
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"lora-grpo: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from .run.stopping import TrainingInterrupted

        if isinstance(e, TrainingInterrupted):  # a checkpoint was written; the message said how to resume
            return e.exit_code
        if os.environ.get("LORA_GRPO_TRACEBACK"):
            raise
        # loading, planning, a command that writes atomically, or a second Ctrl-C: one line, not a traceback
        print(f"lora-grpo: interrupted (Ctrl-C){f': {e}' if str(e) else ''}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - said in one line where lora_grpo has the words, else raised
        # lora_grpo's errors say what, where and how to fix: show that, not a traceback (unless asked). A step that
        # raised in the TRL front door (`trl`) raises its own error, as TRL, with lora_grpo's words as a note.
        said = [note for note in getattr(e, "__notes__", ()) if note.startswith("lora_grpo: ")]
        if os.environ.get("LORA_GRPO_TRACEBACK") or not (
            said or isinstance(e, (ValueError, OSError, RuntimeError, FloatingPointError))
        ):
            raise
        what = said[-1].removeprefix("lora_grpo: ") if said else e
        print(f"lora-grpo: error: {what}\n(set LORA_GRPO_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
