"""GRPOConfig: one typed dataclass, the single source of truth for a run.

Every field has a one-line help (the `help` metadata). The CLI's `--set key=value` and the YAML
recipes use the same names; `GRPOConfig.from_yaml` rejects unknown keys. Validation runs at
construction and names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The names of the options; what each one does lives in its module's table, which this module
# cannot import (it loads before torch): loss.LOSS_TYPES, loss.IMPORTANCE_SAMPLING,
# advantages.SCALES, reference.SYNC_MODES. tests/test_config.py checks that the names agree.
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
IMPORTANCE_SAMPLING = ("token", "sequence")
SCALES = ("group", "batch", "none")
SYNC_MODES = ("exact", "factors")
QUANTIZATIONS = ("none", "8bit", "4bit")
QUANT_TYPES_4BIT = ("nf4", "fp4")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
SCHEDULERS = ("constant", "linear", "cosine")
DTYPES = ("auto", "float32", "bfloat16", "float16")
TRACKERS = ("tensorboard", "wandb", "trackio")  # report_to names (reporting.py maps each to its package)
DECODE_MODES = ("auto", "eager", "static", "compiled")  # the samplers of rollout.generate_rollout (fast_decode.DECODE_MODES)

CHOICES = {  # field → its options: validate() checks the value, and each field's help names every option
    "quantization": QUANTIZATIONS, "loss_type": LOSS_TYPES, "ref_sync_mode": SYNC_MODES, "scale_rewards": SCALES,
    "optimizer": OPTIMIZERS, "lr_scheduler": SCHEDULERS, "torch_dtype": DTYPES,
    "bnb_4bit_quant_type": QUANT_TYPES_4BIT, "importance_sampling": IMPORTANCE_SAMPLING, "decode_mode": DECODE_MODES,
}


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclass
class GRPOConfig:
    # --- model -------------------------------------------------------------------------------
    model_name_or_path: str | None = _f(None, "hub id or local path of the base causal LM; 'toy' builds the offline toy base")
    tokenizer_name_or_path: str | None = _f(None, "tokenizer to load (default: model_name_or_path)")
    quantization: str = _f("none", "base model quantization: none | 8bit | 4bit (bitsandbytes; 4bit = QLoRA)")
    bnb_4bit_quant_type: str = _f("nf4", "4-bit data type: nf4 | fp4")
    bnb_4bit_use_double_quant: bool = _f(True, "quantize the 4-bit quantization constants too (saves ~0.4 bit/param)")
    torch_dtype: str = _f("auto", "dtype of the unquantized weights and 4-bit compute: auto | float32 | bfloat16 | float16")
    trust_remote_code: bool = _f(False, "allow custom model code from the hub")
    attn_implementation: str | None = _f(None, "attention kernel (e.g. sdpa, flash_attention_2); None = transformers' default")
    # --- policy adapter ----------------------------------------------------------------------
    lora_r: int = _f(16, "rank of the policy LoRA adapter")
    lora_alpha: float = _f(32, "LoRA alpha of the policy adapter (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA)")
    lora_dropout: float = _f(0.0, "dropout on the LoRA input (0 keeps rollout and training log-probs consistent)")
    lora_target_modules: Any = _f("all-linear", "modules that get LoRA: 'all-linear' or a list of module names")
    use_rslora: bool = _f(False, "rank-stabilised LoRA scaling alpha / sqrt(r)")
    init_adapter: str | None = _f(None, "a saved peft LoRA adapter to warm-start the policy (and the initial reference)")
    # --- reference slot and iterative GRPO ---------------------------------------------------
    ref_rank: int | None = _f(None, "rank of the reference slot (default 2 × lora_r for 'exact', lora_r for 'factors')")
    ref_sync_steps: int = _f(0, "sync the reference to the policy every N optimizer steps (0 = off)")
    ref_sync_every_epoch: bool = _f(False, "sync the reference at every epoch boundary (DeepSeekMath iterative RL)")
    ref_sync_kl: float | None = _f(None, "adaptive: sync when the step's mean KL to the reference exceeds this")
    ref_sync_alpha: float = _f(1.0, "sync mix: ref ← alpha·policy + (1−alpha)·ref; 1 = hard copy")
    ref_sync_mode: str = _f("exact", "exact (weight-space mix, recompressed to ref_rank) | factors (blend A and B separately; approximate)")
    ref_sync_on_plateau: bool = _f(False, "also sync when the greedy eval score of the first reward function has not beaten its best by more than ref_sync_plateau_min_delta for ref_sync_plateau_patience evals (ProRL, Liu et al. 2025); needs eval_dataset and eval_steps")
    ref_sync_plateau_patience: int = _f(2, "with ref_sync_on_plateau: evals in a row without improvement that trigger a sync (the count restarts after it)")
    ref_sync_plateau_min_delta: float = _f(0.01, "with ref_sync_on_plateau: the smallest rise over the best eval score so far that counts as an improvement")
    ref_sync_reset_optimizer: bool = _f(False, "at each sync also reset the optimizer's moments and step counts (ProRL's reference reset, Liu et al. 2025 §2.3.1)")
    ref_sync_restart_warmup: bool = _f(False, "at each sync restart the linear LR warmup of warmup_steps (the LR multiplier becomes warmup(step − last sync) × schedule(step))")
    # --- data --------------------------------------------------------------------------------
    dataset: str | None = _f(None, "training prompts: a hub dataset name or a local json/jsonl/csv/parquet file or saved dataset dir; 'toy' / 'countdown' = offline tasks generated locally")
    dataset_config: str | None = _f(None, "configuration name of a hub dataset that has several (gsm8k: 'main')")
    dataset_split: str = _f("train", "split of `dataset` to use")
    eval_dataset: str | None = _f(None, "held-out prompts for evaluation (same formats as `dataset`)")
    eval_split: str = _f("test", "split of `eval_dataset` to use")
    eval_limit: int = _f(0, "evaluate on the first N eval prompts only (0 = all)")
    eval_pass_k: list[int] = _f([], "also report eval/pass@k for each k, e.g. [1, 8]: eval_num_samples sampled completions per eval prompt (Chen et al. 2021's unbiased estimator), n× the greedy eval's completions; [] = greedy only")
    eval_num_samples: int | None = _f(None, "completions sampled per eval prompt for pass@k, n ≥ every k (a larger n lowers the estimate's variance); None = max(eval_pass_k)")
    eval_temperature: float | None = _f(None, "sampling temperature for pass@k (None = temperature; top_p, top_k, min_p, repetition_penalty as in training)")
    eval_kl_to_base: bool = _f(True, "report eval/kl_to_base, the k3 KL per token of the policy to the model the run started from (base, or init_adapter), on sampled completions: pass@k's when drawn at the training temperature, else one more per eval prompt")
    eval_correct_threshold: float = _f(1.0, "pass@k counts a sampled completion correct when the first reward function gives ≥ this (toy_reward and accuracy give 1.0 for a right answer, None counts as wrong)")
    prompt_column: str = _f("prompt", "column holding the prompt text (or a list of chat messages)")
    messages_column: str = _f("messages", "column holding chat messages, rendered with the tokenizer's chat template")
    prompt_template: str | None = _f(None, "a Python format string over the row's columns, e.g. 'Q: {question}\\nA:'")
    system_prompt: str | None = _f(None, "system message prepended to chat prompts")
    use_chat_template: bool = _f(False, "render text prompts as a user message through the tokenizer's chat template (instruct models)")
    # --- rewards -----------------------------------------------------------------------------
    reward_funcs: list = _f([], "reward functions: built-in names (format, accuracy, countdown, soft_overlong, length) or dotted paths 'pkg.module:fn'")
    reward_weights: list | None = _f(None, "one weight per reward function (default all 1)")
    # --- generation --------------------------------------------------------------------------
    num_generations: int = _f(8, "completions sampled per prompt (the group size G)")
    prompts_per_step: int = _f(8, "prompts per optimizer step, each sampled num_generations times")
    generation_batch_size: int | None = _f(None, "alternatively, sequences per step; must be divisible by num_generations")
    max_prompt_length: int | None = _f(512, "prompts longer than this keep their last tokens (with a warning); None = no limit")
    max_completion_length: int = _f(256, "maximum new tokens per completion")
    temperature: float = _f(1.0, "sampling temperature (also divides the logits in the loss)")
    top_p: float = _f(1.0, "nucleus sampling threshold (1 = off); like every filter, not in the loss: ratio and KL use unfiltered log-probs")
    top_k: int = _f(0, "top-k sampling (0 = off); not in the loss (ratio and KL use the unfiltered distribution)")
    min_p: float = _f(0.0, "min-p sampling (0 = off); not in the loss (ratio and KL use the unfiltered distribution)")
    repetition_penalty: float = _f(1.0, "CTRL repetition penalty (1 = off); not in the loss (ratio and KL use the unfiltered distribution)")
    decode_mode: str = _f("auto", "sampler: auto (compiled on CUDA, eager on CPU) | eager | static (fixed-shape KV cache) | compiled (static + torch.compile, CUDA graphs on GPU; eager if compiling fails); all draw the same tokens")
    # --- loss --------------------------------------------------------------------------------
    beta: float = _f(0.04, "weight of the k3 KL penalty to the reference (0 = no reference forward)")
    loss_type: str = _f("dapo", "token aggregation: grpo | bnpo | dapo | dr_grpo")
    epsilon_low: float = _f(0.2, "lower clip: ratio ≥ 1 − epsilon_low")
    epsilon_high: float = _f(0.28, "upper clip: ratio ≤ 1 + epsilon_high (DAPO clip-higher, Yu et al. 2025)")
    scale_rewards: str = _f("group", "advantage scaling: group | batch (std of this process's batch) | none (Dr. GRPO)")
    importance_sampling: str = _f("token", "importance ratio: token (one per token) | sequence (one length-normalised ratio per sequence, GSPO)")
    kl_ratio_correction: bool = _f(True, "multiply k3 by pi/pi_old (unbiased KL gradient, DeepSeek-V3.2)")
    mask_truncated_completions: bool = _f(False, "exclude completions without EOS from the loss")
    num_iterations: int = _f(1, "optimizer passes over each generation batch (>1 uses old log-probs and clipping)")
    logprob_chunk_size: int = _f(1024, "tokens per chunk through the LM head when computing log-probs")
    # --- optimisation ------------------------------------------------------------------------
    learning_rate: float = _f(2e-5, "peak learning rate of the policy adapter")
    optimizer: str = _f("adamw", "adamw | adamw_8bit | paged_adamw_8bit (bitsandbytes)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.99, "AdamW beta2")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 = off)")
    max_nonfinite_updates: int = _f(5, "a NaN/inf loss or gradient skips the update; stop with an error after this many in a row")
    lr_scheduler: str = _f("constant", "constant | linear | cosine (after warmup)")
    warmup_steps: int = _f(0, "linear warmup steps")
    micro_batch_size: int | str = _f("auto", "sequences per forward/backward (gradient accumulation over the step); 'auto' = the largest that fits memory_budget, measured once at start (memory.py)")
    gradient_checkpointing: bool | str = _f("auto", "recompute activations in backward to save memory: true | false | auto (on only when the start-up memory probe needs it)")
    memory_budget: float = _f(0.9, "share of free GPU memory (on CPU: of available RAM) that the 'auto' sizes and the start-up preflight may plan for, in (0, 1]")
    max_steps: int = _f(100, "optimizer steps to run (0 = run num_epochs)")
    num_epochs: int = _f(1, "epochs over the prompts when max_steps = 0")
    # --- run ---------------------------------------------------------------------------------
    output_dir: str = _f("runs/grpo", "run directory: config, metrics.jsonl, checkpoints, final adapter")
    save_steps: int = _f(50, "checkpoint every N steps (0 = only at the end)")
    save_total_limit: int = _f(2, "keep at most this many checkpoints")
    resume_from_checkpoint: str | None = _f(None, "a checkpoint dir, or 'latest' in output_dir")
    logging_steps: int = _f(1, "print metrics every N steps")
    eval_steps: int = _f(0, "evaluate on eval_dataset every N steps (0 = only at the start and end)")
    seed: int = _f(42, "random seed (sampling, data order, adapter init)")
    # --- reporting (TRL / transformers names where they have them) -----------------------------
    report_to: Any = _f("none", "experiment trackers: none | tensorboard | wandb | trackio, or a list of them (pip extras of the same names)")
    project: str = _f("lora-grpo", "tracker project: the wandb / trackio project, TensorBoard's subdirectory of logging_dir")
    run_name: str | None = _f(None, "run name shown by wandb / trackio (default: the name of output_dir)")
    logging_dir: str | None = _f(None, "directory for TensorBoard events and wandb files (default: output_dir/runs)")
    disable_tqdm: bool = _f(False, "turn off the progress bar (the logging_steps lines stay)")
    log_completions: bool = _f(False, "append every completion with its rewards and advantage to output_dir/completions.jsonl (and tracker tables)")
    log_completions_steps: int = _f(1, "with log_completions: log the completions of every N-th step")

    # -----------------------------------------------------------------------------------------
    def __post_init__(self):
        if self.generation_batch_size is not None:
            if self.generation_batch_size % self.num_generations != 0:
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} is not divisible by "
                    f"num_generations={self.num_generations}: each prompt's whole group must be in the batch. "
                    "Set generation_batch_size to a multiple of num_generations, or set prompts_per_step instead."
                )
            self.prompts_per_step = self.generation_batch_size // self.num_generations
        if self.ref_rank is None:
            self.ref_rank = self.lora_r if self.ref_sync_mode == "factors" else 2 * self.lora_r
        if isinstance(self.lora_target_modules, tuple):
            self.lora_target_modules = list(self.lora_target_modules)
        self.validate()
        self._warn_about_sampling_filters()

    def _warn_about_sampling_filters(self) -> None:
        filters = [f"{k}={getattr(self, k)}" for k, off in
                   (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0)) if getattr(self, k) != off]
        if filters and (self.num_iterations > 1 or self.beta > 0):
            warnings.warn(
                f"sampling filters {', '.join(filters)} change the distribution completions are drawn from, but the "
                "ratio and KL terms use the model's unfiltered log-probs (as TRL does): the importance ratio and the "
                "KL are those of the unfiltered policy. Turn the filters off for an exact on-policy loss.",
                stacklevel=4,
            )

    def validate(self) -> None:
        def choice(name, options):
            value = getattr(self, name)
            if value not in options:
                close = difflib.get_close_matches(str(value), options, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{name}={value!r} is not one of {list(options)}{hint}")

        def positive(name, allow_zero=False):
            value = getattr(self, name)
            if value < 0 or (value == 0 and not allow_zero):
                raise ConfigError(f"{name}={value} must be {'≥ 0' if allow_zero else '> 0'}")

        if not self.model_name_or_path:
            raise ConfigError("model_name_or_path is required: a hub id, a local model dir, or 'toy'")
        for name, options in CHOICES.items():
            choice(name, options)
        for name in ["lora_r", "lora_alpha", "ref_rank", "prompts_per_step", "max_completion_length", "logging_steps",
                     "repetition_penalty",
                     "num_iterations", "max_nonfinite_updates", "logprob_chunk_size", "learning_rate", "num_epochs"]:
            positive(name)
        for name in ["eval_limit", "ref_sync_steps", "max_steps", "save_steps", "eval_steps", "warmup_steps", "weight_decay",
                     "max_grad_norm", "beta", "top_k", "min_p", "epsilon_low", "epsilon_high"]:
            positive(name, allow_zero=True)
        # Reporting.
        trackers = [self.report_to] if isinstance(self.report_to, str) else self.report_to or []  # None = none
        for tracker in trackers if isinstance(trackers, list) else [trackers]:
            if tracker not in TRACKERS + ("none",):
                close = difflib.get_close_matches(str(tracker), TRACKERS, n=1)
                raise ConfigError(
                    f"report_to={self.report_to!r}: expected 'none', one of {list(TRACKERS)} or a list of them"
                    + (f" (did you mean {close[0]!r}?)" if close else "")
                )
        positive("log_completions_steps")
        # Memory: 'auto' sizes (memory.py).
        mbs = self.micro_batch_size
        if mbs != "auto" and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
            raise ConfigError(
                f"micro_batch_size={mbs!r} must be an integer ≥ 1 or 'auto' (the largest that fits memory_budget)"
            )
        if not (isinstance(self.gradient_checkpointing, bool) or self.gradient_checkpointing == "auto"):
            raise ConfigError(f"gradient_checkpointing={self.gradient_checkpointing!r} must be true, false or 'auto'")
        if not 0 < self.memory_budget <= 1:
            raise ConfigError(
                f"memory_budget={self.memory_budget} must be in (0, 1]: the share of free GPU memory (available RAM "
                "on CPU) that the 'auto' micro_batch_size may plan for"
            )
        # Evaluation: pass@k.
        ks = self.eval_pass_k
        if not isinstance(ks, list) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
            raise ConfigError(
                f"eval_pass_k={ks!r} must be a list of integers ≥ 1, e.g. [1, 8] (--set eval_pass_k=[1,8]); [] turns pass@k off"
            )
        if self.eval_num_samples is not None and self.eval_num_samples < max(ks, default=1):
            raise ConfigError(
                f"eval_num_samples={self.eval_num_samples}: pass@k needs n ≥ k samples per prompt, here "
                f"n ≥ {max(ks, default=1)} (max of eval_pass_k={ks}); raise it, or leave it unset (= max(eval_pass_k))"
            )
        if self.eval_temperature is not None and self.eval_temperature <= 0:
            raise ConfigError(
                f"eval_temperature={self.eval_temperature} must be > 0, or None (= temperature): pass@k needs sampled "
                "completions; the greedy eval is reported anyway"
            )
        if self.num_generations < 2:
            raise ConfigError(
                f"num_generations={self.num_generations}: GRPO compares completions within a group, so it needs "
                "at least 2 per prompt (4–16 is typical)"
            )
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length={self.max_prompt_length} must be ≥ 1 or None (no limit)")
        if self.temperature <= 0:
            raise ConfigError(
                f"temperature={self.temperature} must be > 0: GRPO needs varied samples within a group "
                "(greedy groups are identical and carry no signal)"
            )
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p={self.min_p} must be in [0, 1]")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.epsilon_low >= 1:
            raise ConfigError(f"epsilon_low={self.epsilon_low} must be < 1 (the ratio's lower clip is 1 − epsilon_low)")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout={self.lora_dropout} must be in [0, 1)")
        # Reference slot.
        if not 0 < self.ref_sync_alpha <= 1:
            raise ConfigError(
                f"ref_sync_alpha={self.ref_sync_alpha} must be in (0, 1]: 1 copies the policy, smaller values mix "
                "ref ← alpha·policy + (1−alpha)·ref"
            )
        if self.ref_sync_kl is not None and self.ref_sync_kl <= 0:
            raise ConfigError(f"ref_sync_kl={self.ref_sync_kl} must be > 0 (a KL threshold) or None")
        if self.sync_enabled and self.beta == 0:
            raise ConfigError(
                "reference sync is configured (ref_sync_steps / ref_sync_every_epoch / ref_sync_kl / ref_sync_on_plateau) "
                "but beta = 0, so no reference is used: set beta > 0 or turn the sync off"
            )
        for name in ("ref_sync_reset_optimizer", "ref_sync_restart_warmup"):
            if getattr(self, name) and not self.sync_enabled:
                raise ConfigError(
                    f"{name}=true acts at each reference sync, but no sync is configured: set ref_sync_steps, "
                    "ref_sync_every_epoch, ref_sync_kl or ref_sync_on_plateau, or turn it off"
                )
        if self.ref_sync_restart_warmup and self.warmup_steps == 0:
            raise ConfigError("ref_sync_restart_warmup=true restarts a warmup of warmup_steps steps, but warmup_steps=0: "
                              "set warmup_steps > 0 (e.g. 5), or turn it off")
        if self.ref_sync_on_plateau:
            if self.eval_steps == 0:
                raise ConfigError(
                    "ref_sync_on_plateau=true watches the eval score during training, but eval_steps=0 evaluates only "
                    "before and after it: set eval_steps > 0 (and an eval_dataset)"
                )
            if isinstance(self.ref_sync_plateau_patience, bool) or self.ref_sync_plateau_patience < 1:
                raise ConfigError(f"ref_sync_plateau_patience={self.ref_sync_plateau_patience} must be an integer ≥ 1 (evals)")
            if not self.ref_sync_plateau_min_delta >= 0:
                raise ConfigError(f"ref_sync_plateau_min_delta={self.ref_sync_plateau_min_delta} must be ≥ 0")
        if self.ref_rank < self.lora_r:
            if self.ref_sync_alpha == 1:
                raise ConfigError(
                    f"ref_rank={self.ref_rank} < lora_r={self.lora_r} with ref_sync_alpha=1: a hard copy of the "
                    "policy needs ref_rank ≥ lora_r"
                )
        if self.ref_sync_mode == "factors" and self.ref_rank != self.lora_r:
            raise ConfigError(
                f"ref_sync_mode='factors' blends A and B name by name, so ref_rank ({self.ref_rank}) must equal "
                f"lora_r ({self.lora_r}); use ref_sync_mode='exact' for a reference slot of another rank"
            )

    # -----------------------------------------------------------------------------------------
    @property
    def sync_enabled(self) -> bool:
        return self.ref_sync_steps > 0 or self.ref_sync_every_epoch or self.ref_sync_kl is not None or self.ref_sync_on_plateau

    @property
    def generation_batch(self) -> int:
        """Sequences sampled per optimizer step (prompts_per_step × num_generations)."""
        return self.prompts_per_step * self.num_generations

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """name → its one-line help with the default, e.g. 'rank of the policy LoRA adapter [default: 16]'."""
        def default(f):
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()

        return {f.name: f"{f.metadata.get('help', '')} [default: {default(f)!r}]" for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "GRPOConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in values if k not in known]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, known, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"unknown key(s) in {source}: {', '.join(hints)}. `lora-grpo train --help-config` lists the fields.")
        # YAML 1.1 reads "1e-4" as a string: strings go through the same typed parser as --set.
        values = {k: cls.parse_value(k, v) if isinstance(v, str) else v for k, v in values.items()}
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "GRPOConfig":
        text = Path(path).read_text()
        values = yaml.safe_load(text) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: a recipe is a mapping of config fields to values, got {type(values).__name__}")
        values.update(overrides or {})
        return cls.from_dict(values, source=str(path))

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def parse_value(cls, key: str, raw: str) -> Any:
        """Parse a `--set key=value` string with YAML rules, checked against the field's type."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(f"unknown config field {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        expected = typing.get_type_hints(cls)[key]
        optional = typing.get_origin(expected) in (typing.Union, types.UnionType) and type(None) in typing.get_args(expected)
        if optional:
            if raw.strip().lower() in ("null", "none", "~", ""):
                return None
            expected = next(a for a in typing.get_args(expected) if a is not type(None))
        if expected is str:
            return raw
        try:
            if expected is bool:
                value = yaml.safe_load(raw)
                if not isinstance(value, bool):
                    raise ValueError
                return value
            if expected is int:
                return int(raw)
            if expected is float:
                return float(raw)  # YAML 1.1 reads "1e-4" as a string; float() does not
        except ValueError:
            raise ConfigError(f"--set {key}={raw}: expected {expected.__name__}") from None
        return yaml.safe_load(raw)
