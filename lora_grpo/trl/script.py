"""`lora-grpo trl --config recipe.yaml [--flag value ...]`: what `trl grpo --config` accepts, run here.

A TRL recipe holds four groups of keys, as TRL's GRPO script parses them (transformers'
HfArgumentParser over four dataclasses; the YAML gives the defaults, flags override them):

    GRPOScriptArguments  dataset_name, dataset_config, dataset_train_split, dataset_test_split (TRL's
                     ScriptArguments), reward_model_name_or_path, reward_funcs (TRL's registry names or dotted paths)
    ModelConfig      model_name_or_path, model_revision, dtype, attn_implementation, use_peft, lora_*,
                     load_in_4bit / load_in_8bit, bnb_4bit_quant_type, use_bnb_nested_quant
    GRPOConfig       every field of TRL's GRPOConfig (lora_grpo.trl.GRPOConfig)
    DatasetMixtureConfig  datasets (several to mix), streaming, test_split_size (script_data.py, which
                     loads the data as TRL's script does)

TRL's reward registry: accuracy_reward, reasoning_accuracy_reward, think_format_reward,
get_soft_overlong_punishment (max_completion_len 1280, soft_punish_cache 256), as lora_grpo's
built-ins of the same meaning (rewards/builtins.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser

from ..config import ConfigError
from ..config_checks import did_you_mean
from ..recipe_yaml import read_recipe
from ..rewards.specs import import_hint
from .script_data import DatasetMixtureConfig, dataset_split, script_dataset
from .translate import precision_dtype


@dataclass
class ScriptArguments:
    """TRL's ScriptArguments (TRL 1.16 names and defaults)."""

    dataset_name: str | None = field(default=None, metadata={"help": "hub dataset name or local path"})
    dataset_config: str | None = field(default=None, metadata={"help": "dataset configuration name"})
    dataset_train_split: str = field(default="train", metadata={"help": "training split"})
    dataset_test_split: str = field(default="test", metadata={"help": "evaluation split"})
    dataset_streaming: bool = field(
        default=False,
        metadata={"help": "stream the dataset (refused: lora_grpo shuffles a map-style dataset)"},
    )
    ignore_bias_buffers: bool = field(
        default=False, metadata={"help": "DDP bias buffers (no effect: no DDP wrapper)"}
    )


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """TRL's GRPO script's GRPOScriptArguments: ScriptArguments and the reward sources (TRL 1.16 names and
    defaults)."""

    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "a sequence-classification reward model"}
    )
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "TRL registry names or dotted import paths"}
    )


@dataclass
class ModelConfig:
    """TRL's ModelConfig (TRL 1.16 names and defaults)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "model id or path"})
    model_revision: str = field(default="main", metadata={"help": "model revision"})
    dtype: str | None = field(default="float32", metadata={"help": "model dtype"})
    attn_implementation: str | None = field(default=None, metadata={"help": "attention implementation"})
    use_peft: bool = field(default=False, metadata={"help": "train a LoRA adapter (lora_grpo always does)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout"})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "LoRA target modules"})
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "LoRA target parameters (refused)"}
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "fully trained modules (refused)"}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "peft task type"})
    use_rslora: bool = field(default=False, metadata={"help": "rank-stabilised LoRA"})
    use_dora: bool = field(
        default=False, metadata={"help": "DoRA (refused: the reference slot holds B·A only)"}
    )
    load_in_8bit: bool = field(default=False, metadata={"help": "8-bit base"})
    load_in_4bit: bool = field(default=False, metadata={"help": "4-bit base (QLoRA)"})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit type"})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "double quantization"})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "4-bit storage dtype"})


def groups() -> tuple:
    """The four dataclasses of TRL's GRPO script, in its order (TRL's GRPOConfig imported on first use)."""
    from .config import GRPOConfig

    return (GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig)


def reward_registry() -> dict:
    """TRL's grpo-script registry names → lora_grpo's reward functions of the same meaning."""
    from ..rewards import soft_overlong_penalty
    from ..rewards.builtins import accuracy_reward, reasoning_accuracy_reward, think_format_reward

    return {  # under TRL's function names, so that the metrics are TRL's (rewards/accuracy_reward/mean, ...)
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": _named(
            soft_overlong_penalty(max_completion_length=1280, buffer_length=256),
            "soft_overlong_punishment_reward",
        ),
    }


def _named(fn, name: str):
    """fn under another __name__ (the metric name a reward logs under), its attributes kept."""

    @functools.wraps(fn)
    def named(*args, **kwargs):
        return fn(*args, **kwargs)

    named.__name__ = named.__qualname__ = name
    return named


def reward_funcs(script) -> list:
    """The script's reward model and reward functions, as TRL's GRPO script resolves them: a registry name,
    or a dotted path 'module.function' imported with the current directory first on the path."""
    funcs: list = [script.reward_model_name_or_path] if script.reward_model_name_or_path else []
    registry = reward_registry()
    for name in script.reward_funcs or []:
        if name in registry:
            funcs.append(registry[name])
        elif "." in name:
            sys.path.insert(0, os.getcwd())
            funcs.append(_import_reward(name, registry))
        else:
            raise ConfigError(
                f"{_could_not_load(name, registry)} reward_funcs: {name!r} is neither one of TRL's reward names"
                + did_you_mean(name, registry)
                + " nor a dotted path 'module.function' (a function in module.py in the directory you run from, "
                "or in an installed package)"
            )
    return funcs


def _could_not_load(name: str, registry: dict) -> str:
    # the sentence of TRL's GRPO script
    return (
        f"Could not load reward function '{name}'. Expected one of {list(registry)} or a valid import path."
    )


def _import_reward(name: str, registry: dict):
    """reward_funcs' dotted path 'module.function' as TRL's script imports it, or a ConfigError naming the
    path, what failed (the module is not there, it failed to import, it lacks the function) and the fix."""
    module, attr = name.rsplit(".", 1)
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        hint = import_hint(name, e) or (
            f". Importing {module!r} raised it: fix that module or install what it imports"
            if isinstance(e, ImportError)
            else ""
        )
        raise ConfigError(
            f"{_could_not_load(name, registry)} reward_funcs: {name!r} did not import ({type(e).__name__}: "
            f"{e}){hint}"
        ) from e
    if not callable(found):
        raise ConfigError(
            f"{_could_not_load(name, registry)} reward_funcs: {name!r} is a {type(found).__name__}, not a "
            "function; name a function def fn(completions, **kwargs) -> list[float]"
        )
    return found


def get_peft_config(model_args: ModelConfig):
    """TRL's get_peft_config: the LoraConfig of a ModelConfig with use_peft, else None (the front door then trains
    its default adapter, said in one line)."""
    from peft import LoraConfig

    if model_args.lora_target_parameters:
        raise ConfigError(
            "lora_target_parameters: LoRA on raw parameters has no B·A layer for the reference slot to mirror"
        )
    if not model_args.use_peft:
        return None
    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        modules_to_save=model_args.lora_modules_to_save,
        task_type=model_args.lora_task_type,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        bias="none",
    )


def get_quantization_config(model_args: ModelConfig):
    """TRL's get_quantization_config: a BitsAndBytesConfig for load_in_4bit (the model's dtype as compute dtype, its
    quant type, nested quantization and storage dtype) or load_in_8bit, else None."""
    from transformers import BitsAndBytesConfig

    if model_args.load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            # as TRL: the compute dtype is the model's dtype (when it names one: "auto" is left to the run)
            bnb_4bit_compute_dtype=model_args.dtype if model_args.dtype not in (None, "auto") else None,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
        )
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


class TrlParser(HfArgumentParser):
    """TRL's TrlParser: transformers' HfArgumentParser over dataclasses, where `--config file.yaml` gives the
    defaults (flags override them) and the file's `env` mapping is set in the environment.

        parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
        script_args, training_args, model_args = parser.parse_args_and_config()
    """

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif dataclasses.is_dataclass(dataclass_types) or not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        for kind in dataclass_types:
            if "config" in kind.__dataclass_fields__:
                raise ValueError(
                    f"Dataclass {kind.__name__} has a field named 'config'. This field is reserved for the config "
                    "file path and should not be used in the dataclass. Rename the field."
                )
        super().__init__(dataclass_types=dataclass_types, **kwargs)

    def parse_args_and_config(
        self,
        args=None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple:
        """The dataclasses from `args` (default: sys.argv[1:]) over the `--config` file's values. With
        return_remaining_strings, the unknown flags and the file's unknown keys (as "--key", "value") come last (two
        lists with separate_remaining_strings: the file's, then the flags'); without it, a file's unknown key is a
        ValueError unless fail_with_unknown_args is False."""
        args, path = take_config(sys.argv[1:] if args is None else args)
        from_file = self.set_defaults_with_config(**config_values(path)) if path is not None else []
        parsed = self.parse_args_into_dataclasses(
            args=args, return_remaining_strings=return_remaining_strings
        )
        if return_remaining_strings:
            *values, from_flags = parsed
            tail = (from_file, from_flags) if separate_remaining_strings else (from_file + from_flags,)
            return (*values, *tail)
        if fail_with_unknown_args and from_file:
            raise ValueError(
                f"Unknown arguments from config file: {from_file}. Please remove them, add them to the dataclass, "
                "or set `fail_with_unknown_args=False`."
            )
        return parsed

    def set_defaults_with_config(self, **values) -> list[str]:
        """Each value the default of its argument (no longer required on the command line, in subparsers too); the
        values no argument takes, as strings ("--key", "value")."""

        def apply(parser) -> set:
            used = set()
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for sub in action.choices.values():
                        used |= apply(sub)
                elif action.dest in values:
                    action.default, action.required = values[action.dest], False
                    used.add(action.dest)
            return used

        used = apply(self)
        return [text for key, value in values.items() if key not in used for text in (f"--{key}", str(value))]


def parse(argv: list[str]):
    """(ScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig) from `--config file.yaml` (defaults) and
    flags (override); a key of the file that none of them has is a ConfigError naming it (config_values)."""
    parser = TrlParser(groups(), prog="lora-grpo trl")
    argv, path = take_config(argv)
    if path is not None:
        known = {f.name for cls in groups() for f in dataclasses.fields(cls)}
        parser.set_defaults_with_config(**config_values(path, known))
    return parser.parse_args_into_dataclasses(args=argv)


def take_config(args) -> tuple[list[str], str | None]:
    """(the arguments without `--config PATH`, PATH or None); `--config` without a path is a ConfigError."""
    args = list(args)
    if "--config" not in args:
        return args, None
    at = args.index("--config")
    if at + 1 == len(args):
        raise ConfigError("--config needs the path of a TRL GRPO recipe (YAML)")
    return args[:at] + args[at + 2 :], args[at + 1]


def config_values(path: str, known: set[str] | None = None) -> dict:
    """A `--config` file's values, read as a recipe is (recipe_yaml.read_recipe: errors at their line and
    column, no tag builds an object); its `env` mapping set in the environment, as TRL's parser does. With `known`
    (the fields it may set), a key outside it is a ConfigError naming it and the closest field, before anything is
    set in the environment."""
    if not Path(path).is_file():
        raise ConfigError(f"--config {path}: no such file: give the path of a TRL GRPO recipe (YAML)")
    values, _ = read_recipe(path, not_a_mapping=f"Config file {path} must contain a YAML mapping.")
    env = values.pop("env", {})
    if not isinstance(env, dict):
        raise ConfigError(
            f"`env` field should be a dict in the YAML file. {path}: write one `NAME: value` a line under `env:`, "
            "e.g. `env: {WANDB_PROJECT: my-project}`"
        )
    unknown = sorted(set(values) - known, key=str) if known is not None else []
    if unknown:
        hints = [f"{k!r}{did_you_mean(k, known)}" for k in unknown]
        raise ConfigError(
            f"{path}: unknown keys {', '.join(hints)} (not in TRL's ScriptArguments, GRPOConfig, ModelConfig or "
            "DatasetMixtureConfig): correct or remove them"
        )
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    return values


def resume_command(argv: list[str]) -> str:
    """The `lora-grpo trl` command that resumes this one: its flags (a --resume_from_checkpoint given dropped), then
    --resume_from_checkpoint latest, the newest checkpoint in output_dir."""
    import shlex

    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in ("--resume_from_checkpoint", "--resume-from-checkpoint"):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return shlex.join(["lora-grpo", "trl", *kept, "--resume_from_checkpoint", "latest"])


def main(argv: list[str]) -> int:
    """TRL's GRPO script, on lora_grpo: load the data, build the trainer, train, save, push (push_to_hub), end."""
    from .trainer import GRPOTrainer

    script, training_args, model_args, mixture = parse(argv)
    if not model_args.model_name_or_path:
        raise ConfigError("a TRL recipe needs model_name_or_path: the model's hub name or local directory")
    init = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
        trust_remote_code=training_args.trust_remote_code,
    )
    if model_args.dtype == "float32" and precision_dtype(training_args) != "auto":
        # ModelConfig's default: TRL loads float32 weights and autocasts to bf16 / fp16's dtype, so its model computes
        # in that; here the model computes in it too (precision_dtype), instead of float32 throughout.
        del init["dtype"]
    init.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = init
    dataset = script_dataset(script, mixture, training_args.seed)
    mixed = bool(mixture.datasets)
    peft, quantization = get_peft_config(model_args), get_quantization_config(model_args)
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs(script),
        args=training_args,
        train_dataset=dataset_split(dataset, script, "dataset_train_split", mixed),
        eval_dataset=dataset_split(dataset, script, "dataset_test_split", mixed)
        if training_args.eval_strategy != "no"
        else None,
        quantization_config=quantization,
        peft_config=peft,
    )
    # a failed step's message says how to go on in this command's words: the same flags, the newest checkpoint
    trainer.native.resume_hint = resume_command(argv)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script.dataset_name)
        trainer.accelerator.print(
            f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}."
        )
    trainer.end()
    return 0
