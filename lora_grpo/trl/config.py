"""TRL 1.16's GRPOConfig: its names, defaults and meanings, on transformers' own TrainingArguments.

The 114 fields TRL inherits come from transformers' TrainingArguments itself (this class subclasses
it, as TRL's does), with TRL's five overrides (learning_rate 1e-6, logging_steps 10,
gradient_checkpointing True, bf16 None = "not fp16", remove_unused_columns False). The 77 fields of
TRL's own are written out below with TRL 1.16's defaults, read from the pinned package. What each
one does in lora_grpo is lora_grpo.trl.translate's table: acted on as in TRL, or refused by name when
set away from its default. Last come lora_grpo's own extensions (EXTENSIONS): at their defaults a run is as
in TRL. `trl` is not needed to use this class.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..algo.loss_types import Objective, loss_type_help, loss_types_using
from ..device import native_bf16

# Fields of lora_grpo's own, beyond TRL's: what TRL cannot do. Each leaves a TRL script's run as in TRL at
# its default (reward_bisect_on_error acts only once a reward has raised), and maps to the native field of the
# same name.
EXTENSIONS = (
    "dynamic_sampling",
    "dynamic_sampling_max_rounds",
    "dynamic_sampling_min_std",
    "reward_bisect_on_error",
)


# The loss types whose objective an option tunes, named in its help (from the registry).
_SOFT_GATE, _GAMMA = loss_types_using(Objective.SOFT_GATE), loss_types_using(Objective.GAMMA_WEIGHT)


def _f(default, help: str):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class GRPOConfig(TrainingArguments):
    """TRL's GRPOConfig (1.16), for `from lora_grpo.trl import GRPOConfig, GRPOTrainer` scripts."""

    # --- TRL's overrides of TrainingArguments' defaults ------------------------------------------
    learning_rate: float = _f(1e-6, "initial learning rate (TRL's default)")
    logging_steps: float = _f(10, "log every N steps; below 1: a share of the run's steps")
    gradient_checkpointing: bool = _f(
        True, "recompute activations in backward (lora_grpo: its memory plan decides unless set False)"
    )
    bf16: bool | None = _f(
        None, "bfloat16; None = True unless fp16 (TRL), and here only on a GPU with native bf16"
    )
    remove_unused_columns: bool | None = _f(False, "keep every dataset column: reward functions read them")
    # --- model ---------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = _f(
        None,
        "from_pretrained kwargs when `model` is a name: dtype, attn_implementation, revision, "
        "device_map, quantization_config",
    )
    trust_remote_code: bool = _f(False, "allow models and tokenizers with custom code from the hub")
    router_aux_loss_coef: float | None = _f(None, "MoE load-balancing loss weight")
    disable_dropout: bool = _f(False, "disable the model's dropout (lora_grpo always does)")
    cast_lm_head_to_fp32: bool = _f(
        False, "LM head in float32 (lora_grpo's log-probs always accumulate it in float32)"
    )
    # --- generation ----------------------------------------------------------------------------
    num_generations: int | None = _f(8, "completions per prompt (the group size)")
    num_generations_eval: int | None = _f(None, "completions per prompt in evaluation")
    max_completion_length: int | None = _f(512, "maximum new tokens per completion")
    ds3_gather_for_generation: bool = _f(True, "DeepSpeed ZeRO-3: gather the weights for generation")
    shuffle_dataset: bool | None = _f(True, "shuffle the training prompts")
    pad_to_multiple_of: int | str | None = _f("auto", "pad prompt and completion ids to a multiple of this")
    generation_batch_size: int | None = _f(
        None,
        "completions per generation (all processes); default per_device_train_batch_size × "
        "processes × steps_per_generation",
    )
    steps_per_generation: int | None = _f(
        None, "micro-steps each generation feeds; default gradient_accumulation_steps"
    )
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling threshold")
    top_k: int = _f(0, "top-k sampling (0 = off)")
    min_p: float | None = _f(None, "min-p sampling")
    generation_kwargs: dict | str | None = _f(None, "extra GenerationConfig kwargs")
    chat_template_kwargs: dict | str | None = _f(None, "extra apply_chat_template kwargs")
    repetition_penalty: float = _f(1.0, "repetition penalty")
    cache_implementation: str | None = _f(None, "KV cache implementation (e.g. 'static')")
    # --- vLLM ----------------------------------------------------------------------------------
    use_vllm: bool = _f(False, "generate with vLLM")
    vllm_mode: str = _f("colocate", "vLLM mode: server | colocate")
    vllm_model_impl: str = _f("vllm", "vLLM model implementation")
    vllm_enable_sleep_mode: bool = _f(False, "vLLM sleep mode")
    vllm_structured_outputs_regex: str | None = _f(None, "vLLM structured outputs regex")
    vllm_server_base_url: str | None = _f(None, "vLLM server URL")
    vllm_server_host: str = _f("0.0.0.0", "vLLM server host")
    vllm_server_port: int = _f(8000, "vLLM server port")
    vllm_server_timeout: float = _f(240.0, "vLLM server timeout")
    vllm_group_port: int = _f(51216, "vLLM weight-update group port")
    vllm_gpu_memory_utilization: float = _f(0.3, "vLLM GPU memory share")
    vllm_max_model_length: int | None = _f(None, "vLLM context window")
    vllm_tensor_parallel_size: int = _f(1, "vLLM tensor parallel size")
    # --- the objective -------------------------------------------------------------------------
    beta: float = _f(0.0, "KL coefficient (0: no reference model)")
    num_iterations: int = _f(1, "optimisation passes per generation (μ); each update is a step")
    epsilon: float = _f(0.2, "clip epsilon (the lower one)")
    delta: float | None = _f(None, "two-sided clipping bound (INTELLECT-2)")
    epsilon_high: float | None = _f(
        None,
        f"upper clip epsilon; None = epsilon; {loss_types_using(Objective.CAPPED_RATIO)}: the cap on the ratio "
        "(about 5)",
    )
    sapo_temperature_neg: float = _f(1.05, f"{_SOFT_GATE}: temperature for non-positive advantages")
    sapo_temperature_pos: float = _f(1.0, f"{_SOFT_GATE}: temperature for positive advantages")
    vespo_k_pos: float = _f(2.0, f"{_GAMMA}: k for positive advantages")
    vespo_lambda_pos: float = _f(3.0, f"{_GAMMA}: lambda for positive advantages")
    vespo_k_neg: float = _f(3.0, f"{_GAMMA}: k for negative advantages")
    vespo_lambda_neg: float = _f(2.0, f"{_GAMMA}: lambda for negative advantages")
    importance_sampling_level: str = _f("token", "importance ratio: token | sequence")
    reward_weights: list[float] | None = _f(None, "one weight per reward function")
    multi_objective_aggregation: str = _f(
        "sum_then_normalize", "sum_then_normalize | normalize_then_sum (GDPO)"
    )
    scale_rewards: str = _f("group", "group | batch | none (True = group, False = none)")
    # TRL 1.16's default; the names and their help are the registry's (algo/loss_types.py)
    loss_type: str = _f("dapo", loss_type_help())
    mask_truncated_completions: bool = _f(False, "exclude truncated completions from the loss")
    sync_ref_model: bool = _f(
        False,
        "sync the reference to the policy every ref_model_sync_steps (lora_grpo: also with peft_config)",
    )
    ref_model_mixup_alpha: float = _f(
        0.6, "sync mix: ref ← alpha·policy + (1−alpha)·ref (lora_grpo: exactly, in weight space)"
    )
    ref_model_sync_steps: int = _f(512, "steps between reference syncs")
    top_entropy_quantile: float = _f(1.0, "share of highest-entropy tokens that carry the policy gradient")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    use_adaptive_entropy: bool = _f(False, "adaptive entropy coefficient (Skywork-OR1)")
    entropy_coef_min: float = _f(0.0, "adaptive entropy: lower bound")
    entropy_coef_max: float = _f(1.0, "adaptive entropy: upper bound")
    entropy_coef_delta: float = _f(0.005, "adaptive entropy: step")
    entropy_target: float = _f(0.2, "adaptive entropy: target entropy")
    max_tool_calling_iterations: int | None = _f(None, "tool-calling turns per completion at most")
    vllm_importance_sampling_correction: bool = _f(True, "vLLM: importance-sampling correction")
    vllm_importance_sampling_mode: str = _f("sequence_mask", "vLLM: importance-sampling mode")
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "vLLM: importance ratio upper bound")
    vllm_importance_sampling_clip_min: float | None = _f(None, "vLLM: importance ratio lower bound")
    off_policy_mask_threshold: float | None = _f(None, "off-policy sequence mask threshold (DeepSeek-V3.2)")
    use_bias_correction_kl: bool = _f(
        True, "multiply the KL term by the importance ratio (unbiased KL gradient)"
    )
    # --- logging -------------------------------------------------------------------------------
    log_completions: bool = _f(False, "log completions at each logging step")
    log_multimodal: bool = _f(True, "log images with completions")
    num_completions_to_print: int | None = _f(None, "completions to print at each logging step")
    log_unique_prompts: bool = _f(False, "log each prompt once")
    log_completions_hub_repo: str | None = _f(None, "hub repo for the completions")
    use_transformers_continuous_batching: bool = _f(False, "transformers' continuous batching for generation")
    transformers_continuous_batching_config: dict | str | None = _f(None, "continuous batching config")
    use_transformers_paged: bool = _f(False, "deprecated: use_transformers_continuous_batching")
    vllm_importance_sampling_cap: float | None = _f(None, "deprecated: vllm_importance_sampling_clip_max")
    # --- lora_grpo's extensions (not TRL's: EXTENSIONS; at their defaults a TRL script runs as in TRL) --
    dynamic_sampling: bool = _f(
        False,
        "lora_grpo: train only on groups whose rewards are not all equal (DAPO's dynamic sampling; "
        "lora_grpo.GRPOConfig.dynamic_sampling)",
    )
    dynamic_sampling_max_rounds: int = _f(4, "lora_grpo: dynamic_sampling's rollouts per step at most")
    dynamic_sampling_min_std: float = _f(
        0.0, "lora_grpo: dynamic_sampling also drops groups whose reward std is below this"
    )
    reward_bisect_on_error: bool = _f(
        True,
        "lora_grpo: when a reward function raises, call it again per sample to name the failing one (False "
        "for paid or remote rewards)",
    )

    def __post_init__(self):
        """TRL 1.16's GRPOConfig.__post_init__: the same derived values, warnings and errors, in TRL's words
        (lora_grpo.trl.checks lists each one's fate)."""
        # TRL: "not fp16"; here also "where the device has bf16", so a CPU run does not fail
        if self.bf16 is None:
            self.bf16 = not self.fp16 and native_bf16()
        super().__post_init__()
        # the CLI passes a string
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            text = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if text in ("none", "null") else int(text)
        if self.pad_to_multiple_of == "auto":  # TRL: 128 only on Neuron devices
            self.pad_to_multiple_of = None
        if self.use_transformers_paged:
            warnings.warn(
                "`use_transformers_paged` is deprecated and will be removed in v2.0.0. Use "
                "`use_transformers_continuous_batching` instead.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.log_completions_hub_repo is not None and not self.log_completions:
            raise ValueError(
                "log_completions_hub_repo is set, but log_completions is False. Enable log_completions to "
                "upload completions to the Hub, or unset log_completions_hub_repo."
            )
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size is not supported by GRPO, because the generation batch must contain "
                "full prompt groups of num_generations completions, and reducing the batch size on "
                "out-of-memory breaks this invariant. Set auto_find_batch_size=False and lower "
                "per_device_train_batch_size instead. (lora_grpo sizes its micro-batches from a memory "
                "probe at start: micro_batch_size auto.)"
            )
        # TRL's batch arithmetic: a generation of generation_batch_size completions (over every process)
        # feeds steps_per_generation micro-steps of per_device_train_batch_size each.
        global_batch = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = global_batch * self.steps_per_generation
        elif self.generation_batch_size is not None and self.steps_per_generation is None:
            if self.generation_batch_size % global_batch != 0:
                raise ValueError(
                    f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global "
                    f"batch size ({global_batch})."
                )
            self.steps_per_generation = self.generation_batch_size // global_batch
        elif self.generation_batch_size is None:
            self.generation_batch_size = global_batch * self.steps_per_generation
        else:
            raise ValueError(
                "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time"
            )
        if self.do_eval and self.eval_strategy != "no":
            eval_generations = self.num_generations_eval or self.num_generations
            if (self.per_device_eval_batch_size * self.world_size) % eval_generations != 0:
                raise ValueError(
                    f"The global eval batch size ({self.per_device_eval_batch_size} * {self.world_size}) must "
                    f"be divisible by the number of generations used for evaluation ({eval_generations})."
                )
        if self.num_generations is None or self.generation_batch_size % self.num_generations != 0:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by num_generations "
                f"({self.num_generations})."
            )
        if self.num_generations < 2:
            raise ValueError(
                "GRPO requires at least 2 generations per prompt to calculate the advantages. You provided "
                f"{self.num_generations}, which is less than the minimum required."
            )
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "The `vllm_importance_sampling_cap` argument is deprecated and will be removed in v2.0.0. "
                "Use `vllm_importance_sampling_clip_max` instead.",
                FutureWarning,
                stacklevel=2,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({low}) must be less than "
                f"vllm_importance_sampling_clip_max ({high})."
            )
        if (
            self.vllm_importance_sampling_correction
            and low is None
            and high is None
            and self.vllm_importance_sampling_mode in ("token_truncate", "sequence_truncate")
        ):
            raise ValueError(
                "At least one of `vllm_importance_sampling_clip_min` or `vllm_importance_sampling_clip_max` "
                "must be set when `vllm_importance_sampling_mode` is a `*_truncate` mode."
            )
