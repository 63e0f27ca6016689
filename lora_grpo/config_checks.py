"""GRPOConfig's validation: every check names the field, the value and the fix.

Also the option names of the choice fields (CHOICES): what each option does lives in its module's
table, which this module cannot import (it loads before torch); tests/test_config.py checks that
the names agree.
"""

from __future__ import annotations

import difflib
import math
import os
import string
import types
import typing
import warnings

from .algo.loss_types import LOSS_TYPES as LOSS_TYPE_REGISTRY


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix.

    `field`: the one field at fault, when there is one, so that a recipe can name the line it is on."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# The names of the options; what each one does lives in its module's table, which this module
# cannot import (it loads before torch): loss.IMPORTANCE_SAMPLING, advantages.SCALES,
# advantages.MULTI_OBJECTIVE_AGGREGATIONS, reference.SYNC_MODES. tests/test_config.py checks that the
# names agree. The loss types come from their torch-free registry (algo/loss_types.py).
LOSS_TYPES = tuple(LOSS_TYPE_REGISTRY)
IMPORTANCE_SAMPLING = ("token", "sequence")
SCALES = ("group", "batch", "none")
MULTI_OBJECTIVE = ("sum_then_normalize", "normalize_then_sum")  # advantages.MULTI_OBJECTIVE_AGGREGATIONS
SYNC_MODES = ("exact", "factors")
QUANTIZATIONS = ("none", "8bit", "4bit")
QUANT_TYPES_4BIT = ("nf4", "fp4")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
SCHEDULERS = (
    "constant",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)  # optim.build_scheduler: transformers.get_scheduler names
DTYPES = ("auto", "float32", "bfloat16", "float16")
MEMORY_PROBES = ("auto", "sweep")  # memory.plan_run_memory
HUB_STRATEGIES = (
    "every_save",
    "checkpoint",
    "all_checkpoints",
    "end",
)  # run/hub.py (transformers' HubStrategy)
TRACKERS = ("tensorboard", "wandb", "trackio")  # report_to names (run/reporting.py maps each to its package)
# the samplers of rollout.generate_rollout (fast_decode.DECODE_MODES)
DECODE_MODES = (
    "auto",
    "eager",
    "static",
    "compiled",
)

CHOICES = {  # field → its options: validate() checks the value, and each field's help names every option
    "quantization": QUANTIZATIONS,
    "loss_type": LOSS_TYPES,
    "ref_sync_mode": SYNC_MODES,
    "scale_rewards": SCALES,
    "optimizer": OPTIMIZERS,
    "lr_scheduler": SCHEDULERS,
    "torch_dtype": DTYPES,
    "bnb_4bit_quant_type": QUANT_TYPES_4BIT,
    "importance_sampling": IMPORTANCE_SAMPLING,
    "decode_mode": DECODE_MODES,
    "memory_probe": MEMORY_PROBES,
    "multi_objective_aggregation": MULTI_OBJECTIVE,
    "hub_strategy": HUB_STRATEGIES,
}


def did_you_mean(word: str, options) -> str:
    """' (did you mean 'x'?)' with the option closest to word (difflib's default cutoff), or ''. A key YAML read as
    no text (8:, ~:, and on:, yes:, no: as booleans) is said so."""
    if not isinstance(word, str):
        return f" (YAML reads that key as the {type(word).__name__} {word!r}, not a name: quote it)"
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def warn_about_sampling_filters(cfg) -> None:
    filters = [
        f"{k}={getattr(cfg, k)}"
        for k, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0))
        if getattr(cfg, k) != off
    ]
    if filters and (cfg.num_iterations > 1 or cfg.beta > 0):
        warnings.warn(
            f"sampling filters {', '.join(filters)} change the distribution completions are drawn from, but the "
            "ratio and KL terms use the model's unfiltered log-probs (as TRL does): the importance ratio and the "
            "KL are those of the unfiltered policy. Turn the filters off for an exact on-policy loss.",
            stacklevel=5,
        )


# What a field's annotation asks for, in words; a list's elements in the plural.
_KINDS = {
    bool: "true or false",
    int: "an integer",
    float: "a finite number",
    str: "text",
    dict: "a mapping of names (text keys)",
    list: "a list",
}
_PLURAL = {int: "integers", float: "finite numbers", str: "strings"}
_EXAMPLES = {bool: "true", int: "8", float: "0.5", str: "'text'", dict: "{}", list: "[]"}
_LIST_EXAMPLES = {int: "[1, 8]", float: "[1.0, 0.5]", str: "['a', 'b']"}


def _fits(value, hint) -> bool:
    """`value` is of the annotated type: no bool for a number, no float for an integer, no NaN or inf."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in args)
    if hint is type(None):
        return value is None
    if hint is list or origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    # keyword arguments (chat_template_kwargs, lr_scheduler_kwargs): YAML may read a key as 8 or true
    if hint is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return isinstance(value, hint)


def _arms(hint) -> list:
    """The kinds a field takes besides None: [int] for `int | None`, [list[int]] for `list[int]`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [arm for arm in typing.get_args(hint) if arm is not type(None)]
    return [hint]


def _kind(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_kind(arm) for arm in args)
    if hint is type(None):
        return "null"
    if origin is list:
        return f"a list of {_PLURAL[args[0]]}"
    return _KINDS[hint]


def _example(name: str, value, hint, default) -> str:
    """The fix of a value of the wrong type: the field written with a value that fits."""
    arms = _arms(hint)
    if str in arms and isinstance(value, (int, float, bool)):
        return f": quote it if it is text, {name}: '{value}'"
    if default is not None and _fits(default, hint) and default not in ("", [], {}):
        return f", e.g. {default!r} (its default)"
    if typing.get_origin(arms[0]) is list:
        return f", e.g. {_LIST_EXAMPLES[typing.get_args(arms[0])[0]]}"
    return f", e.g. {_EXAMPLES[arms[0]]}"


def value_problem(name: str, value, hint, default=None) -> str | None:
    """Why `value` cannot be the field `name` annotated `hint` ("must be an integer, e.g. ..."), or None when
    it fits. The one type check of recipe values, ``--set`` values and ``GRPOConfig(...)`` from Python.

    Fields typed as a union of two kinds (micro_batch_size: int | str) have checks of their own that name their
    forms ('auto'); they are left to those."""
    arms = _arms(hint)
    if len(arms) > 1 or _fits(value, hint):
        return None
    where = ""
    if isinstance(value, list) and typing.get_args(arms[0]):
        element = typing.get_args(arms[0])[0]
        i = next(i for i, v in enumerate(value) if not _fits(v, element))
        where = f" ({name}[{i}] is {value[i]!r})"
    return f"must be {_kind(hint)}{where}{_example(name, value, hint, default)}"


def check_types(cfg, hints: dict, defaults: dict) -> None:
    """Every field's value against its annotation (`value_problem`), before any check compares values."""
    for name, hint in hints.items():
        value = getattr(cfg, name)
        problem = value_problem(name, value, hint, defaults.get(name))
        if problem:
            raise ConfigError(f"{name}={value!r} {problem}", field=name)


def _validate_fields(cfg) -> None:
    def choice(name, options):
        value = getattr(cfg, name)
        if value not in options:
            raise ConfigError(
                f"{name}={value!r} is not one of {list(options)}{did_you_mean(str(value), options)}",
                field=name,
            )

    def positive(name, allow_zero=False):
        value = getattr(cfg, name)
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{name}={value} must be {'≥ 0' if allow_zero else '> 0'}", field=name)

    if not cfg.model_name_or_path:
        raise ConfigError("model_name_or_path is required: a hub id, a local model dir, or 'toy'")
    # fields of several forms (value_problem leaves them to checks of their own)
    resume = cfg.resume_from_checkpoint
    if resume is not None and not isinstance(resume, (str, bool, os.PathLike)):
        raise ConfigError(
            f"resume_from_checkpoint={resume!r} must be a checkpoint directory, 'latest' or true (the newest in "
            "output_dir), or null; quote a directory named by a number: resume_from_checkpoint: '2024'",
            field="resume_from_checkpoint",
        )
    targets = cfg.lora_target_modules
    if not (
        targets is None  # peft's default for the model type (a peft_config without target_modules)
        or (isinstance(targets, str) and targets)
        or (
            isinstance(targets, (list, tuple, set))
            and targets
            and all(isinstance(t, str) and t for t in targets)
        )
    ):
        raise ConfigError(
            f"lora_target_modules={targets!r} must be 'all-linear', a list of module names (e.g. [q_proj, v_proj]) "
            "or one regular expression over the modules' names",
            field="lora_target_modules",
        )
    for name, options in CHOICES.items():
        choice(name, options)
    for name in [
        "lora_r",
        "lora_alpha",
        "ref_rank",
        "prompts_per_step",
        "max_completion_length",
        "logging_steps",
        "repetition_penalty",
        "steps_per_generation",
        "adam_epsilon",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "vespo_lambda_pos",
        "vespo_lambda_neg",
        "num_iterations",
        "max_nonfinite_updates",
        "logprob_chunk_size",
        "num_epochs",
        "dynamic_sampling_max_rounds",
    ]:
        positive(name)
    if cfg.tool_timeout is not None:  # None: no limit, each call inline
        positive("tool_timeout")
    for name in [
        "eval_limit",
        "ref_sync_steps",
        "max_steps",
        "save_steps",
        "eval_steps",
        "warmup_steps",
        "weight_decay",
        "max_grad_norm",
        "beta",
        "top_k",
        "min_p",
        "save_total_limit",
        "vespo_k_pos",
        "vespo_k_neg",
        "entropy_coef_delta",
        "entropy_coef_min",
        "dynamic_sampling_min_std",
        "seed",
        "learning_rate",  # 0: a baseline that samples, scores and evaluates without moving (TRL trains it too)
    ]:
        positive(name, allow_zero=True)
    for name in ("adam_beta1", "adam_beta2"):  # Adam's moment decays (torch's own error names no field)
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be in [0, 1), e.g. 0.9 or 0.999", field=name)
    # Reporting.
    trackers = [cfg.report_to] if isinstance(cfg.report_to, str) else cfg.report_to or []  # None = none
    for tracker in trackers if isinstance(trackers, list) else [trackers]:
        if tracker not in TRACKERS + ("none",):
            raise ConfigError(
                f"report_to={cfg.report_to!r}: expected 'none', one of {list(TRACKERS)} or a list of them"
                + did_you_mean(str(tracker), TRACKERS)
            )
    positive("log_completions_steps")
    group = cfg.clip_ratio_group_size
    if group is not None and group < 1:
        raise ConfigError(
            f"clip_ratio_group_size={group!r} must be an integer ≥ 1 or None (a step's completions are one group)"
        )
    # Memory: 'auto' sizes (memory/probe.py).
    mbs = cfg.micro_batch_size
    if mbs != "auto" and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
        raise ConfigError(
            f"micro_batch_size={mbs!r} must be an integer ≥ 1 or 'auto' (the largest that fits memory_budget)"
        )
    if not (isinstance(cfg.gradient_checkpointing, bool) or cfg.gradient_checkpointing == "auto"):
        raise ConfigError(
            f"gradient_checkpointing={cfg.gradient_checkpointing!r} must be true, false or 'auto'"
        )
    if not 0 < cfg.memory_budget <= 1:
        raise ConfigError(
            f"memory_budget={cfg.memory_budget} must be in (0, 1]: the share of free GPU memory (available RAM "
            "on CPU) that the 'auto' micro_batch_size may plan for"
        )
    # Evaluation: pass@k.
    ks = cfg.eval_pass_k
    if not all(k >= 1 for k in ks):
        raise ConfigError(
            f"eval_pass_k={ks!r} must be a list of integers ≥ 1, e.g. [1, 8] (--set "
            "eval_pass_k=[1,8]); [] turns pass@k off"
        )
    if cfg.eval_num_samples is not None and cfg.eval_num_samples < max(ks, default=1):
        raise ConfigError(
            f"eval_num_samples={cfg.eval_num_samples}: pass@k needs n ≥ k samples per prompt, here "
            f"n ≥ {max(ks, default=1)} (max of eval_pass_k={ks}); raise it, or leave it unset (= max(eval_pass_k))"
        )
    if cfg.eval_temperature is not None and cfg.eval_temperature <= 0:
        raise ConfigError(
            f"eval_temperature={cfg.eval_temperature} must be > 0, or None (= temperature): pass@k needs sampled "
            "completions; the greedy eval is reported anyway"
        )
    if cfg.num_generations < 2:
        raise ConfigError(
            f"num_generations={cfg.num_generations}: GRPO compares completions within a group, so it needs "
            "at least 2 per prompt (4–16 is typical)"
        )
    if cfg.max_prompt_length is not None and cfg.max_prompt_length < 1:
        raise ConfigError(f"max_prompt_length={cfg.max_prompt_length} must be ≥ 1 or None (no limit)")
    if cfg.temperature <= 0:
        raise ConfigError(
            f"temperature={cfg.temperature} must be > 0: GRPO needs varied samples within a group "
            "(greedy groups are identical and carry no signal)"
        )
    if not 0 <= cfg.min_p <= 1:
        raise ConfigError(f"min_p={cfg.min_p} must be in [0, 1]")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"top_p={cfg.top_p} must be in (0, 1]")
    # epsilon_low and epsilon_high take any value, as in TRL, with TRL's meaning: the ratio is clamped
    # to [1 − epsilon_low, 1 + epsilon_high] (epsilon_low ≥ 1, as DeepSeekMath's 10, never clips low).
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"lora_dropout={cfg.lora_dropout} must be in [0, 1)")
    # Reference slot.
    if not 0 < cfg.ref_sync_alpha <= 1:
        raise ConfigError(
            f"ref_sync_alpha={cfg.ref_sync_alpha} must be in (0, 1]: 1 copies the policy, smaller values mix "
            "ref ← alpha·policy + (1−alpha)·ref"
        )
    if cfg.ref_sync_kl is not None and cfg.ref_sync_kl <= 0:
        raise ConfigError(f"ref_sync_kl={cfg.ref_sync_kl} must be > 0 (a KL threshold) or None")
    if cfg.sync_enabled and cfg.beta == 0:
        raise ConfigError(
            "reference sync is configured (ref_sync_steps / ref_sync_every_epoch / ref_sync_kl / ref_sync_on_plateau) "
            "but beta = 0, so no reference is used: set beta > 0 or turn the sync off"
        )
    for name in ("ref_sync_reset_optimizer", "ref_sync_restart_warmup"):
        if getattr(cfg, name) and not cfg.sync_enabled:
            raise ConfigError(
                f"{name}=true acts at each reference sync, but no sync is configured: set ref_sync_steps, "
                "ref_sync_every_epoch, ref_sync_kl or ref_sync_on_plateau, or turn it off"
            )
    if cfg.ref_sync_restart_warmup and cfg.warmup_steps == 0:
        raise ConfigError(
            "ref_sync_restart_warmup=true restarts a warmup of warmup_steps steps, but warmup_steps=0: "
            "set warmup_steps > 0 (e.g. 5), or turn it off"
        )
    if cfg.ref_sync_on_plateau:
        if cfg.eval_steps == 0:
            raise ConfigError(
                "ref_sync_on_plateau=true watches the eval score during training, but eval_steps=0 evaluates only "
                "before and after it: set eval_steps > 0 (and an eval_dataset)"
            )
        if cfg.ref_sync_plateau_patience < 1:
            raise ConfigError(
                f"ref_sync_plateau_patience={cfg.ref_sync_plateau_patience} must be an integer ≥ 1 (evals)"
            )
        if not cfg.ref_sync_plateau_min_delta >= 0:
            raise ConfigError(f"ref_sync_plateau_min_delta={cfg.ref_sync_plateau_min_delta} must be ≥ 0")
    if cfg.ref_rank < cfg.lora_r:
        if cfg.ref_sync_alpha == 1:
            raise ConfigError(
                f"ref_rank={cfg.ref_rank} < lora_r={cfg.lora_r} with ref_sync_alpha=1: a hard copy of the "
                "policy needs ref_rank ≥ lora_r"
            )
    if cfg.ref_sync_mode == "factors" and cfg.ref_rank != cfg.lora_r:
        raise ConfigError(
            f"ref_sync_mode='factors' blends A and B name by name, so ref_rank ({cfg.ref_rank}) must equal "
            f"lora_r ({cfg.lora_r}); use ref_sync_mode='exact' for a reference slot of another rank"
        )


def check_generation_batch_size(cfg) -> None:
    """generation_batch_size holds whole groups and cuts into steps_per_generation equal steps."""
    gbs, G, S = cfg.generation_batch_size, cfg.num_generations, cfg.steps_per_generation
    if gbs < 1:  # (before prompts_per_step is derived from it: the error named that)
        raise ConfigError(f"generation_batch_size={gbs} must be >= 1", field="generation_batch_size")
    if gbs % G != 0:
        raise ConfigError(
            f"generation_batch_size={gbs} is not divisible by num_generations={G}: each prompt's whole group must be "
            "in the rollout. Set generation_batch_size to a multiple of num_generations, or set "
            "prompts_per_step instead."
        )
    if S < 1 or gbs % S != 0:
        raise ConfigError(
            f"generation_batch_size={gbs} cannot be cut into steps_per_generation={S} equal optimizer steps: make it a "
            "multiple of steps_per_generation"
        )
    # TRL refuses the pair that fixes the same size twice (generation_batch_size with steps_per_generation); here
    # that pair is generation_batch_size with prompts_per_step, refused when they disagree.
    P = cfg.prompts_per_step
    if P is not None and P * G * S != gbs:
        raise ConfigError(
            f"'generation_batch_size' and 'prompts_per_step' can not be both configured at the same time unless they "
            f"agree: generation_batch_size={gbs} makes {gbs / (G * S):g} prompts a step ({gbs} / num_generations={G} "
            f"/ steps_per_generation={S}), but prompts_per_step={P}: set only one of them"
        )


def require_eval_set(cfg, eval_dataset) -> None:
    """Evals during training (eval_steps, ref_sync_on_plateau, metric_for_best_model) need eval prompts: the config's
    eval_dataset or the trainer's `eval_dataset`. Refused as transformers' Trainer refuses eval_strategy='steps'
    without one."""
    if eval_dataset is not None or cfg.eval_dataset is not None:
        return
    if cfg.metric_for_best_model is not None:
        raise ConfigError(
            f"metric_for_best_model={cfg.metric_for_best_model!r} picks the best checkpoint by its evals, but there "
            "are no eval prompts: set eval_dataset (or pass eval_dataset=...), or leave metric_for_best_model unset",
            field="metric_for_best_model",
        )
    if cfg.eval_steps == 0:
        return
    if cfg.ref_sync_on_plateau:
        raise ConfigError(
            "ref_sync_on_plateau=true watches the eval score, but there are no eval prompts: set eval_dataset "
            "(or pass eval_dataset=...), or turn it off",
            field="ref_sync_on_plateau",
        )
    raise ConfigError(
        f"eval_steps={cfg.eval_steps} asks for evals during training, but there are no eval prompts (transformers' "
        "Trainer likewise refuses eval_strategy='steps' without an eval_dataset): set eval_dataset (or pass "
        "eval_dataset=... to GRPOTrainer), or eval_steps=0",
        field="eval_steps",
    )


def _check_objective(cfg) -> None:
    """The loss options of TRL 1.16 (algo/loss.py): ranges, and the combinations TRL warns about."""
    if cfg.delta is not None and cfg.delta <= 1:
        raise ConfigError(
            f"delta={cfg.delta} must be > 1 (it caps the unclipped ratio; INTELLECT-2 uses 1 + epsilon_high or more)"
        )
    if not 0 < cfg.top_entropy_quantile <= 1:
        raise ConfigError(
            f"top_entropy_quantile={cfg.top_entropy_quantile} must be in (0, 1]: the share of tokens, by "
            "entropy, that carry the gradient"
        )
    if cfg.off_policy_mask_threshold is not None and cfg.off_policy_mask_threshold < 0:
        raise ConfigError(
            f"off_policy_mask_threshold={cfg.off_policy_mask_threshold} must be ≥ 0 (a KL) or None"
        )
    if cfg.entropy_coef_min > cfg.entropy_coef_max:
        raise ConfigError(
            f"entropy_coef_min={cfg.entropy_coef_min} is above entropy_coef_max={cfg.entropy_coef_max}"
        )
    if cfg.use_adaptive_entropy and not cfg.entropy_target > 0:
        raise ConfigError(f"entropy_target={cfg.entropy_target} must be > 0 with use_adaptive_entropy")
    facts = LOSS_TYPE_REGISTRY[cfg.loss_type]
    if facts.ratio_cap and cfg.epsilon_high < 1:
        warnings.warn(
            f"loss_type={cfg.loss_type!r} caps the ratio itself at epsilon_high={cfg.epsilon_high} (MiniMax-M1's "
            "ε_max), so even on-policy tokens weigh at most that much; ScaleRL recommends epsilon_high=5.0",
            stacklevel=5,
        )
    if facts.meant_for is not None and cfg.importance_sampling != facts.meant_for:
        warnings.warn(facts.warning, stacklevel=5)


def _check_schedule(cfg) -> None:
    """Steps given as a count, or below 1 as a share of the run (TRL / transformers 5); the best checkpoint's
    metric; tool rounds."""
    for name in ("warmup_steps", "logging_steps", "eval_steps"):
        value = getattr(cfg, name)
        if value >= 1 and value != int(value):
            raise ConfigError(
                f"{name}={value}: a number of steps (an integer) or, below 1, a share of max_steps"
            )
    if cfg.load_best_model_at_end and cfg.metric_for_best_model is None:
        raise ConfigError(
            "load_best_model_at_end=true needs metric_for_best_model, the eval metric that names the best "
            "checkpoint (e.g. eval/reward): set it, or turn load_best_model_at_end off",
            field="load_best_model_at_end",
        )
    if cfg.max_tool_calling_iterations is not None and cfg.max_tool_calling_iterations < 1:
        raise ConfigError(
            f"max_tool_calling_iterations={cfg.max_tool_calling_iterations} must be ≥ 1 or None (no limit)"
        )
    if not all(isinstance(t, str) or callable(t) for t in cfg.tools):
        raise ConfigError(
            f"tools={cfg.tools!r} must be a list of dotted paths 'pkg.module:fn' (or functions, from Python)"
        )


def template_columns(template: str) -> list[str]:
    """The columns a prompt_template reads ("Q: {question}" -> ["question"], "{row[a]}" -> ["row"]); ConfigError,
    naming prompt_template, for a template that is not a str.format template over column names. Which
    columns exist is known only when the data loads (data/prompts.py)."""
    fix = "write each column as {name} and a literal brace as {{ or }}, e.g. 'Q: {question}\\nA:'"
    try:
        fields = [(name, conversion) for _, name, _, conversion in string.Formatter().parse(template)]
    except ValueError as e:
        raise ConfigError(
            f"prompt_template={template!r} is not a format string ({e}): {fix}", field="prompt_template"
        ) from None
    columns = []
    for name, conversion in fields:
        if name is None:
            continue
        column = name.split(".")[0].split("[")[0]
        shown = "{" + name + (f"!{conversion}" if conversion else "") + "}"
        if not column or column.isdigit():
            raise ConfigError(
                f"prompt_template={template!r}: the field {shown} does not name a column: {fix}",
                field="prompt_template",
            )
        if conversion not in (None, "r", "s", "a"):
            raise ConfigError(
                f"prompt_template={template!r}: the field {shown} has the conversion !{conversion}, which "
                "str.format does not know: use !r, !s or !a, or none",
                field="prompt_template",
            )
        columns.append(column)
    return columns


def validate(cfg) -> None:
    """All checks of a GRPOConfig (at construction); ConfigError on the first that fails."""
    _validate_fields(cfg)
    if cfg.prompt_template is not None:
        template_columns(cfg.prompt_template)
    _check_objective(cfg)
    _check_schedule(cfg)
    warn_about_sampling_filters(cfg)
