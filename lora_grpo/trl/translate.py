"""TRL's GRPOConfig → lora_grpo's GRPOConfig, in one function, and the table of what becomes of every field.

Each of TRL 1.16's 191 GRPOConfig fields (its own and TrainingArguments') is in FIELDS, one of:

    mapped     acts as in TRL, through the native field(s) named (to_native reads it)
    flow       acts as in TRL, through transformers' own DefaultFlowCallback and TrainerState
               (logging / eval / save strategies and steps, eval_delay, logging_first_step)
    no effect  accepted at any value, with the reason it changes nothing here (no DataLoader, no
               DeepSpeed, vLLM-only, what lora_grpo always does)
    trainer    acts as in TRL, in the front door's GRPOTrainer itself (the hub push, run/hub.py)
    refused    lora_grpo has no equivalent: set away from TRL's default, it is a ConfigError naming the
               field, why, and what to do

tests/test_trl.py walks dataclasses.fields(trl.GRPOConfig) and checks every field is here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..algo.loss_types import LOSS_TYPES
from ..config import ConfigError
from ..config import GRPOConfig as NativeConfig
from .config import EXTENSIONS, GRPOConfig


@dataclass(frozen=True)
class Field:
    how: str  # mapped | flow | no effect | trainer | refused
    why: str  # the native field(s) it becomes, or the reason
    # the switch TRL reads this field under (use_vllm, ...): while it is off, the field changes nothing in TRL,
    # and a refused one is not refused
    only_with: str = ""


def _m(why):
    return Field("mapped", why)


def _flow(why="transformers' DefaultFlowCallback decides, from TrainingArguments, as in TRL"):
    return Field("flow", why)


def _no(why):
    return Field("no effect", why)


def _r(why, only_with=""):
    return Field("refused", why, only_with)


def _t(why):
    return Field("trainer", why)


NO_LOADER = "lora_grpo has no DataLoader (prompts are drawn by data.PromptBatches)"
NO_DDP = "lora_grpo averages the LoRA gradients itself (one flat all-reduce), without torch DDP"
VLLM = "used only with use_vllm, as in TRL"
OWN_SAMPLER = (
    "lora_grpo samples with its own prefix-shared sampler on the training model (its decode step compiled on a GPU: "
    "decode_mode auto)"
)
NO_HUB = (
    "lora_grpo pushes the model to the hub (push_to_hub), not a dataset of its completions: completions.jsonl in "
    "output_dir holds every completion"
)

FIELDS: dict[str, Field] = {
    # --- the run and its batches ---------------------------------------------------------------
    "output_dir": _m("output_dir (None: 'trainer_output', as transformers)"),
    "per_device_train_batch_size": _m(
        "completions per micro-step: × gradient_accumulation_steps = a step's completions; "
        "clip_ratio_group_size (the groups of clip_ratio/low_min and high_max)"
    ),
    "gradient_accumulation_steps": _m(
        "micro-steps per optimizer step (lora_grpo sizes its own micro-batches: micro_batch_size auto)"
    ),
    "steps_per_generation": _m(
        "steps_per_generation = this / gradient_accumulation_steps optimizer steps per rollout; "
        "a value that is not a multiple of gradient_accumulation_steps (TRL lets an optimizer "
        "step straddle two generations) is refused"
    ),
    "generation_batch_size": _m("generation_batch_size (per process: / the number of processes)"),
    "num_generations": _m("num_generations"),
    "num_iterations": _m("num_iterations (each pass over a rollout is steps_per_generation optimizer steps)"),
    "max_steps": _m("max_steps (-1: from num_train_epochs)"),
    "num_train_epochs": _m("num_epochs (may be fractional; the steps are rounded up, as transformers)"),
    "seed": _m("seed"),
    "use_cpu": _m("use_cpu"),
    "shuffle_dataset": _m("shuffle_dataset"),
    # --- optimisation --------------------------------------------------------------------------
    "learning_rate": _m("learning_rate"),
    "lr_scheduler_type": _m("lr_scheduler (transformers' schedules by name)"),
    "lr_scheduler_kwargs": _m("lr_scheduler_kwargs"),
    "warmup_steps": _m("warmup_steps (below 1: a share of the run, as transformers 5)"),
    "optim": _m(
        "optimizer: adamw_torch(_fused) / adamw_hf → adamw; adamw_8bit / adamw_bnb_8bit → adamw_8bit; paged_adamw_8bit"
    ),
    "weight_decay": _m("weight_decay"),
    "adam_beta1": _m("adam_beta1"),
    "adam_beta2": _m("adam_beta2"),
    "adam_epsilon": _m("adam_epsilon"),
    "max_grad_norm": _m("max_grad_norm"),
    "gradient_checkpointing": _m(
        "gradient_checkpointing: True (TRL's default) → auto (the memory plan turns it on when needed); False → off"
    ),
    "activation_checkpointing": _m("as gradient_checkpointing (transformers 5's name)"),
    "gradient_checkpointing_kwargs": _no(
        "lora_grpo always checkpoints non-reentrantly; the values change no result"
    ),
    "activation_checkpointing_kwargs": _no("as gradient_checkpointing_kwargs"),
    "bf16": _m(
        "torch_dtype bfloat16 (None: where the GPU has bf16, else float32); lora_grpo computes in "
        "the dtype, no autocast"
    ),
    "fp16": _m(
        "torch_dtype float16 on a GPU, the loss scaled dynamically as TRL's GradScaler does (optim.LossScale); "
        "on a CPU float32, as in TRL (accelerate runs no fp16 there)"
    ),
    "tf32": _no("transformers' TrainingArguments applies it to torch itself, as in TRL"),
    "average_tokens_across_devices": _m(
        "always on: the step's token count (the loss types normalised by it) spans every process "
        "(False is refused)"
    ),
    # --- the model -----------------------------------------------------------------------------
    "model_init_kwargs": _m(
        "dtype / torch_dtype → torch_dtype, attn_implementation, revision, quantization_config, "
        "device_map (auto or one device)"
    ),
    "trust_remote_code": _m("trust_remote_code"),
    "disable_dropout": _no(
        "lora_grpo always turns the base model's dropout off (rollout and loss must see one distribution)"
    ),
    "cast_lm_head_to_fp32": _no("lora_grpo's log-probs always accumulate the LM head in float32"),
    "router_aux_loss_coef": _r("MoE auxiliary losses are not added to the GRPO loss"),
    # --- generation ----------------------------------------------------------------------------
    "max_completion_length": _m(
        "max_completion_length (prompts are never cut: max_prompt_length None, as TRL 1.x)"
    ),
    "temperature": _m("temperature"),
    "top_p": _m("top_p"),
    "top_k": _m(
        "top_k (None: the model's generation_config's, else 50, as transformers' generate fills an unset one; "
        "open-r1 writes top_k: null)"
    ),
    "min_p": _m("min_p (None: the model's generation_config's, else off)"),
    "repetition_penalty": _m("repetition_penalty"),
    "chat_template_kwargs": _m("chat_template_kwargs"),
    "cache_implementation": _m("decode_mode: None or 'dynamic' → auto, 'static' → static"),
    "generation_kwargs": _m(
        "its temperature, top_p, top_k, min_p, repetition_penalty; any other key is refused"
    ),
    "max_tool_calling_iterations": _m("max_tool_calling_iterations"),
    "pad_to_multiple_of": _no("lora_grpo trims padding per micro-batch; a multiple changes no result"),
    "ds3_gather_for_generation": _no("DeepSpeed only; lora_grpo does not use DeepSpeed"),
    "num_generations_eval": _m(
        "eval_num_samples n and eval_pass_k [1, n]: n completions sampled per eval prompt, reported as pass@1 and "
        "pass@n beside the greedy completion's rewards (None: the greedy eval alone)"
    ),
    "use_transformers_continuous_batching": _no(
        OWN_SAMPLER
        + ", not transformers' continuous batching: True is said when the trainer is built (stand_ins)"
    ),
    "transformers_continuous_batching_config": _no(
        "used only with use_transformers_continuous_batching, as in TRL; with it, not used either: "
        + OWN_SAMPLER
    ),
    "use_transformers_paged": _no(
        "TRL's deprecated use_transformers_continuous_batching (True sets it, with TRL's FutureWarning)"
    ),
    # --- the objective -------------------------------------------------------------------------
    "beta": _m("beta"),
    "epsilon": _m("epsilon_low"),
    "epsilon_high": _m("epsilon_high (None: epsilon)"),
    "delta": _m("delta"),
    "sapo_temperature_neg": _m("sapo_temperature_neg"),
    "sapo_temperature_pos": _m("sapo_temperature_pos"),
    "vespo_k_pos": _m("vespo_k_pos"),
    "vespo_lambda_pos": _m("vespo_lambda_pos"),
    "vespo_k_neg": _m("vespo_k_neg"),
    "vespo_lambda_neg": _m("vespo_lambda_neg"),
    "importance_sampling_level": _m("importance_sampling"),
    "reward_weights": _m("reward_weights"),
    "multi_objective_aggregation": _m("multi_objective_aggregation"),
    "scale_rewards": _m("scale_rewards"),
    "loss_type": _m("loss_type"),
    "mask_truncated_completions": _m("mask_truncated_completions"),
    "top_entropy_quantile": _m("top_entropy_quantile"),
    "entropy_coef": _m("entropy_coef"),
    "use_adaptive_entropy": _m("use_adaptive_entropy"),
    "entropy_coef_min": _m("entropy_coef_min"),
    "entropy_coef_max": _m("entropy_coef_max"),
    "entropy_coef_delta": _m("entropy_coef_delta"),
    "entropy_target": _m("entropy_target"),
    "off_policy_mask_threshold": _m("off_policy_mask_threshold"),
    "use_bias_correction_kl": _m(
        "kl_ratio_correction (lora_grpo multiplies by the per-token ratio at both levels)"
    ),
    # --- the reference: TRL refuses sync_ref_model with PEFT; here it is the reference slot ------
    "sync_ref_model": _m(
        "ref_sync_steps = ref_model_sync_steps (the LoRA reference slot; with peft_config too)"
    ),
    "ref_model_sync_steps": _m("ref_sync_steps, when sync_ref_model"),
    "ref_model_mixup_alpha": _m(
        "ref_sync_alpha, ref_sync_mode exact: the mix is made in weight space, exactly"
    ),
    # --- logging, evaluation, saving -----------------------------------------------------------
    "logging_strategy": _flow(),
    "logging_steps": _flow("DefaultFlowCallback (below 1: a share of the run); also the progress lines"),
    "logging_first_step": _flow(),
    "eval_strategy": _flow(
        "DefaultFlowCallback; 'no' also skips lora_grpo's evals before and after training"
    ),
    "eval_steps": _flow("DefaultFlowCallback (None: logging_steps, as transformers)"),
    "eval_delay": _flow(),
    "eval_on_start": _m("eval_on_start"),
    "save_strategy": _flow(
        "DefaultFlowCallback for 'steps', 'epoch', 'no'; 'best': each eval that beats metric_for_best_model's best"
    ),
    "save_steps": _flow(),
    "save_total_limit": _m("save_total_limit (None: every checkpoint is kept)"),
    "report_to": _flow(
        "transformers' reporting callbacks (get_reporting_integration_callbacks), as in TRL: every tracker "
        "transformers knows, sent TRL's records at its logging steps (train/<metric>, eval/<metric>)"
    ),
    "run_name": _flow("transformers' reporting callbacks read it (the W&B / Trackio run's name), as in TRL"),
    "project": _flow("transformers' reporting callbacks read it (the Trackio / W&B project), as in TRL"),
    "disable_tqdm": _m("disable_tqdm"),
    "log_completions": _m(
        "log_completions (completions.jsonl, tracker tables) and printing num_completions_to_print"
    ),
    "num_completions_to_print": _m("num_completions_to_print (None: all of the step's)"),
    "log_multimodal": _no("text only: there is no multimodal content to log"),
    "log_unique_prompts": _no("completions.jsonl keeps every completion; filter it with jq"),
    "include_num_input_tokens_seen": _no(
        "the token counts are in metrics.jsonl (tokens_per_second) either way"
    ),
    "log_level": _no("lora_grpo prints through its progress bar"),
    "log_level_replica": _no("only the main process prints"),
    "log_on_each_node": _no("only the main process prints"),
    "logging_nan_inf_filter": _no("lora_grpo skips NaN/inf updates and logs them (skipped_nonfinite)"),
    "skip_memory_metrics": _no("the memory plan's figures are in summary.json"),
    "per_device_eval_batch_size": _no("evaluate() decodes its prompts in chunks of its own"),
    "prediction_loss_only": _no("evaluate() computes rewards, no loss"),
    "eval_do_concat_batches": _no("evaluate() gathers per-prompt results itself"),
    "eval_use_gather_object": _no("evaluate() gathers per-prompt results itself"),
    "eval_accumulation_steps": _no("evaluate() gathers per-prompt results itself"),
    "include_for_metrics": _no("evaluate() computes rewards, no compute_metrics"),
    "batch_eval_metrics": _no("evaluate() computes rewards, no compute_metrics"),
    "save_only_model": _no("checkpoints hold the adapters, optimizer and RNG states: a few MB"),
    "save_on_each_node": _no("the main process writes the checkpoints"),
    "ignore_data_skip": _no("a resume restores the data position itself, at no cost"),
    "resume_from_checkpoint": _no(
        "as in transformers: only what a script passes to train(resume_from_checkpoint=...)"
    ),
    "do_train": _no("for scripts, as in transformers"),
    "do_eval": _no("for scripts, as in transformers"),
    "do_predict": _no("for scripts, as in transformers"),
    "local_rank": _no("set by the launcher; lora_grpo reads accelerate's state"),
    "remove_unused_columns": _no("every column reaches the reward functions (TRL's default False)"),
    "label_names": _no("GRPO has no labels"),
    "length_column_name": _no("GRPO has no length grouping"),
    "train_sampling_strategy": _no("prompts are drawn by data.PromptBatches (shuffle_dataset)"),
    "use_cache": _no("the rollout always uses a KV cache, the loss never"),
    "dataloader_drop_last": _no(NO_LOADER),
    "dataloader_num_workers": _no(NO_LOADER),
    "dataloader_pin_memory": _no(NO_LOADER),
    "dataloader_persistent_workers": _no(NO_LOADER),
    "dataloader_prefetch_factor": _no(NO_LOADER),
    "dataloader_multiprocessing_context": _no(NO_LOADER),
    "dataloader_in_order": _no(NO_LOADER),
    "ddp_find_unused_parameters": _no(NO_DDP),
    "ddp_bucket_cap_mb": _no(NO_DDP),
    "ddp_broadcast_buffers": _no(NO_DDP),
    "ddp_static_graph": _no(NO_DDP),
    "ddp_timeout": _no(NO_DDP),
    "vllm_importance_sampling_correction": _no(VLLM),
    "vllm_importance_sampling_mode": _no(VLLM),
    "vllm_importance_sampling_clip_max": _no(VLLM),
    "vllm_importance_sampling_clip_min": _no(VLLM),
    "vllm_importance_sampling_cap": _no(VLLM),
    # the generation engines: lora_grpo samples with its own sampler, whichever is asked for (a script that asks for
    # one runs, and is told so: stand_ins)
    "use_vllm": _no(OWN_SAMPLER + ", not vLLM: True is said when the trainer is built (stand_ins)"),
    **{
        name: _no(VLLM + "; with it, not used either: " + OWN_SAMPLER)
        for name in (
            "vllm_mode",
            "vllm_model_impl",
            "vllm_enable_sleep_mode",
            "vllm_server_base_url",
            "vllm_server_host",
            "vllm_server_port",
            "vllm_server_timeout",
            "vllm_group_port",
            "vllm_gpu_memory_utilization",
            "vllm_max_model_length",
            "vllm_tensor_parallel_size",
        )
    },
    "vllm_structured_outputs_regex": _r(
        "lora_grpo's sampler does not constrain completions to a regular expression (vLLM's structured outputs)",
        only_with="use_vllm",
    ),
    # the hub push: the front door's GRPOTrainer, as transformers' Trainer (run/hub.py)
    "push_to_hub": _t(
        "creates the repository when the trainer is built; save_model() and push_to_hub() push"
    ),
    "hub_model_id": _t("the repository (None: output_dir's name under the token's user)"),
    "hub_strategy": _t(
        "what a save step pushes in the background: end, every_save, checkpoint, all_checkpoints"
    ),
    "hub_token": _t("the token of every push"),
    "hub_private_repo": _t("a repository created private"),
    "hub_always_push": _t("a save step pushes even while the last push is still uploading"),
    "hub_revision": _t("the branch pushed to"),
    "log_completions_hub_repo": _r(NO_HUB),
    **{
        name: _flow(
            "transformers' TrackioCallback reads it when report_to names trackio (the Space or bucket the "
            "dashboard syncs to), as in TRL; without trackio in report_to it changes nothing, as in TRL"
        )
        for name in ("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")
    },
    **{
        name: _r(
            "one process per GPU with its own base and adapters: accelerate launch / torchrun, no DeepSpeed or FSDP"
        )
        for name in (
            "deepspeed",
            "fsdp",
            "fsdp_config",
            "parallelism_config",
            "accelerator_config",
            "ddp_backend",
        )
    },
    "optim_args": _r("the optimizer is built from adam_beta1/2, adam_epsilon and weight_decay"),
    "optim_target_modules": _r("only the LoRA policy adapter is optimised"),
    "label_smoothing_factor": _no(
        "GRPO has no labels to smooth: TRL's GRPOTrainer computes its own loss, which transformers' label "
        "smoother never enters"
    ),
    "bf16_full_eval": _r("evaluate() runs in the training dtype"),
    "fp16_full_eval": _r("evaluate() runs in the training dtype"),
    "torch_compile": _r("the training forward is not compiled (the rollout's decode step is: decode_mode)"),
    "torch_compile_backend": _r(
        "the training forward is not compiled (the rollout's decode step is: decode_mode)"
    ),
    "torch_compile_mode": _r(
        "the training forward is not compiled (the rollout's decode step is: decode_mode)"
    ),
    "use_liger_kernel": _no(
        "lora_grpo applies no Liger kernels: the model runs transformers' own layers (TRL 1.16 applies Liger's layer "
        "kernels only, and deprecates it); True is said when the trainer is built (stand_ins)"
    ),
    "liger_kernel_config": _no(
        "used only with use_liger_kernel, as in TRL; with it, not used either ({'fused_linear_cross_entropy': True} "
        "is refused in TRL's words)"
    ),
    "neftune_noise_alpha": _r("NEFTune noise is not added to embeddings in GRPO"),
    "torch_empty_cache_steps": _flow(
        "the accelerator's cache is emptied before each step whose global_step it divides (transformers empties it "
        "before each micro-batch of such a step)"
    ),
    "auto_find_batch_size": _r(
        "micro_batch_size auto: a start-up memory probe sizes the micro-batch (refused by TRL too)"
    ),
    "load_best_model_at_end": _m("load_best_model_at_end"),
    "metric_for_best_model": _m(
        "metric_for_best_model: eval_reward, eval_<reward function> (TRL's eval_rewards/<name>/mean), "
        "eval_completion_length (TRL's eval_completions/mean_length), eval_pass@k; not eval_loss"
    ),
    "greater_is_better": _m(
        "greater_is_better (transformers' default: True unless the metric ends in 'loss')"
    ),
    "restore_callback_states_from_checkpoint": _r("callback states are not stored in lora_grpo checkpoints"),
    "enable_jit_checkpoint": _r("checkpoints are written at save steps and on SIGINT/SIGTERM"),
    "full_determinism": _r(
        "lora_grpo seeds every generator (seed) and resumes them exactly; it does not force deterministic kernels"
    ),
    "data_seed": _no("the prompt order follows seed, as in TRL's GRPOTrainer (its RepeatSampler takes seed)"),
    "debug": _r("transformers' debug modes are for its Trainer loop"),
}

# lr_scheduler_type names lora_grpo's native lr_scheduler takes (transformers' get_scheduler names).
SCHEDULERS = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
    "cosine_with_restarts": "cosine_with_restarts",
    "polynomial": "polynomial",
    "inverse_sqrt": "inverse_sqrt",
    "cosine_with_min_lr": "cosine_with_min_lr",
    "warmup_stable_decay": "warmup_stable_decay",
}
OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "adamw_8bit": "adamw_8bit",
    "adamw_bnb_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
}
GENERATION_KWARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _defaults() -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(GRPOConfig):
        out[f.name] = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
    return out


def _value(v):
    # transformers' enums (IntervalStrategy, SchedulerType, OptimizerNames) → str
    return getattr(v, "value", v)


def unset_sampling(values: dict[str, Any], source: Any, revision: str | None) -> dict[str, Any]:
    """The sampling settings (GENERATION_KWARGS) as TRL's sampling reads them: None is unset, and transformers'
    generate fills it from the model's generation_config (`source`: the model's, or the path it is read from),
    then its own default (temperature, top_p and repetition_penalty 1, top_k 50, min_p off), as it fills every
    unset field (a Qwen model's generation_config has top_k 20; open-r1's recipes write top_k: null)."""
    from transformers import GenerationConfig

    values = dict(values)
    if any(v is None for v in values.values()):
        model_defaults = source if isinstance(source, GenerationConfig) else None
        if model_defaults is None:
            try:
                model_defaults = GenerationConfig.from_pretrained(str(source), revision=revision)
            except (OSError, ValueError):  # no generation_config.json: transformers' own defaults
                model_defaults = GenerationConfig()
        # what generate fills when both leave it unset
        own = GenerationConfig._get_default_generation_params()
        for name in [n for n, v in values.items() if v is None]:
            value = getattr(model_defaults, name, None)
            values[name] = value if value is not None else own.get(name)
    return {**values, "top_k": int(values["top_k"] or 0), "min_p": float(values["min_p"] or 0.0)}


def precision_dtype(args) -> str:
    """The torch_dtype TRL's precision flags stand for. bf16: bfloat16. fp16: float16 on a GPU (TRL
    autocasts to float16 and scales the loss; lora_grpo computes in float16 and scales the loss); on a
    CPU accelerate neither autocasts to float16 nor scales, so TRL's run is float32 there, and so is
    ours ("auto"). Neither: "auto"."""
    import torch

    if args.bf16:
        return "bfloat16"
    if args.fp16 and not args.use_cpu and torch.cuda.is_available():
        return "float16"
    return "auto"


def _as_dict(value, name: str) -> dict:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"{name}={value!r} is not a JSON object") from None
    return dict(value)


def check_refused(args) -> None:
    """ConfigError naming every refused field set away from TRL's default, with why and what to do."""
    defaults = _defaults()
    bad = [
        (name, getattr(args, name))
        for name, f in FIELDS.items()
        if f.how == "refused"
        and hasattr(args, name)
        and (not f.only_with or getattr(args, f.only_with, False))
        and not _is_default(name, getattr(args, name), defaults.get(name))
    ]
    if not getattr(args, "average_tokens_across_devices", True):
        bad.append(("average_tokens_across_devices", False))
    if bad:
        lines = "; ".join(
            f"{name}={value!r}: "
            f"{FIELDS[name].why if name in FIELDS and FIELDS[name].how == 'refused' else _EXTRA[name]}"
            for name, value in bad
        )
        raise ConfigError(
            f"lora_grpo.trl cannot act on these GRPOConfig settings: {lines}. Leave them at TRL's defaults."
        )


_EXTRA = {
    "average_tokens_across_devices": "the step's token count always spans every process",
}


def stand_ins(args) -> list[str]:
    """The warnings for a script that asks for what lora_grpo does its own way (vLLM or transformers' continuous
    batching for generation: lora_grpo's sampler; Liger's or the Hub's kernels: transformers' layers), one per thing
    asked."""
    said = []
    if getattr(args, "use_vllm", False):
        said.append(
            "use_vllm=True: lora_grpo samples with its own prefix-shared sampler on the training model (its decode "
            "step compiled on a GPU), not vLLM: no vLLM engine is started and no server is contacted, no GPU memory "
            "is set aside for one (vllm_gpu_memory_utilization: the memory plan sizes the step), and the other "
            "vllm_* settings are not used. The completions are sampled from the policy itself, so "
            "vllm_importance_sampling_correction has nothing to correct, and TRL's sampling/* metrics are not "
            "logged. Set use_vllm=False to silence this."
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        said.append(
            "use_transformers_continuous_batching=True: lora_grpo samples with its own prefix-shared sampler on the "
            "training model (its decode step compiled on a GPU), not transformers' continuous batching; "
            "transformers_continuous_batching_config is not used. Set use_transformers_continuous_batching=False "
            "to silence this."
        )
    if _as_dict(getattr(args, "model_init_kwargs", None), "model_init_kwargs").get("use_kernels"):
        said.append(
            "model_init_kwargs use_kernels=True: lora_grpo loads no kernels from the Hub (transformers' `kernels` "
            "integration); the model runs transformers' own layers. Leave use_kernels out to silence this."
        )
    if getattr(args, "use_liger_kernel", False):
        said.append(
            "use_liger_kernel=True: lora_grpo applies no Liger kernels; the model runs transformers' own layers (the "
            "memory plan sizes micro-batches and gradient checkpointing to what they need), and log-probs go "
            "through the LM head in chunks, never the full logits. Set use_liger_kernel=False to silence this."
        )
    return said


_EMPTY = ("", None, [], {}, ())


def _is_default(name: str, value, default) -> bool:
    """TRL's default, as transformers leaves it after __post_init__ ('' → [], None → an AcceleratorConfig)."""
    value, default = _value(value), _value(default)
    if name == "accelerator_config":
        return _is_default_accelerator_config(value)
    return value == default or (value in _EMPTY and default in _EMPTY)


def _is_default_accelerator_config(value) -> bool:
    # transformers turns accelerator_config None into an AcceleratorConfig of defaults in __post_init__.
    if value is None:
        return True
    try:
        from transformers.trainer_pt_utils import AcceleratorConfig

        return dataclasses.asdict(value) == dataclasses.asdict(AcceleratorConfig())
    except Exception:  # noqa: BLE001 - an unknown object is not the default
        return False


def to_native(
    args,
    *,
    model_name_or_path: str,
    world_size: int = 1,
    eval_set_names: Sequence[str] | None = (),
    generation_defaults: Any = None,
    **native: Any,
) -> NativeConfig:
    """The native GRPOConfig a TRL GRPOConfig (ours, or TRL's own: read by field name) stands for.

    `eval_set_names`: the names of a dict of eval sets (metric_for_best_model may name one's metric), () for one
    unnamed set, None for no eval prompts (then no eval runs, and metric_for_best_model is left unset: transformers
    tracks no best without evals). `native`: fields the front door fills from the trainer's arguments (lora_*,
    quantization, init_adapter...).
    Raises ConfigError for a refused field, or batch sizes lora_grpo cannot split into whole groups.
    """
    check_refused(args)
    G, accumulation = args.num_generations, args.gradient_accumulation_steps
    steps_per_generation, generation = args.steps_per_generation, args.generation_batch_size
    if steps_per_generation % accumulation:
        raise ConfigError(
            f"steps_per_generation={steps_per_generation} is not a multiple of "
            f"gradient_accumulation_steps={accumulation}: "
            "lora_grpo feeds whole optimizer steps from each generation (TRL lets one optimizer step straddle two "
            "generations); make it a multiple (or leave it unset)"
        )
    per_process = generation // world_size
    if per_process % G:
        raise ConfigError(
            f"each process generates {per_process} completions (generation_batch_size {generation} / "
            f"{world_size} processes), "
            f"not a multiple of num_generations={G}: lora_grpo keeps a prompt's whole group on one process. Raise "
            "per_device_train_batch_size or gradient_accumulation_steps so that per_device_train_batch_size × "
            "steps_per_generation is a multiple of num_generations"
        )
    schedule = _value(args.lr_scheduler_type)
    if schedule not in SCHEDULERS:
        raise ConfigError(f"lr_scheduler_type={schedule!r}: lora_grpo takes {sorted(SCHEDULERS)}")
    optim = _value(args.optim)
    if optim not in OPTIMIZERS:
        raise ConfigError(
            f"optim={optim!r}: lora_grpo takes {sorted(OPTIMIZERS)} (AdamW, or bitsandbytes' 8-bit AdamW)"
        )
    sampling = _as_dict(args.generation_kwargs, "generation_kwargs")
    unknown = sorted(set(sampling) - set(GENERATION_KWARGS), key=str)
    if unknown:
        raise ConfigError(
            f"generation_kwargs {unknown}: lora_grpo's sampler takes {list(GENERATION_KWARGS)} only"
        )
    sampled = unset_sampling(
        {name: sampling.get(name, getattr(args, name)) for name in GENERATION_KWARGS},
        model_name_or_path if generation_defaults is None else generation_defaults,
        native.get("revision"),
    )
    if (
        "temperature" in sampling
        and args.temperature is not None
        and sampled["temperature"] != args.temperature
    ):
        raise ConfigError(
            f"generation_kwargs temperature {sampled['temperature']:g} with temperature={args.temperature:g}: in TRL "
            "the override samples at its temperature while the loss divides the logits by `temperature`; "
            "lora_grpo's temperature does both (its log-probs are those of the distribution it samples). Set "
            f"temperature={sampled['temperature']:g} and drop it from generation_kwargs, or drop the override"
        )
    cache = args.cache_implementation
    if cache not in (None, "dynamic", "static"):
        raise ConfigError(
            f"cache_implementation={cache!r}: lora_grpo's sampler has a dynamic cache (None or 'dynamic', "
            "transformers' default) or a static one ('static')"
        )
    checkpointing = getattr(args, "activation_checkpointing", None)
    checkpointing = args.gradient_checkpointing if checkpointing is None else checkpointing
    warmup = 0 if schedule == "constant" else args.warmup_steps  # transformers' 'constant' ignores the warmup
    return NativeConfig(
        **{
            "model_name_or_path": model_name_or_path,
            "output_dir": args.output_dir or "trainer_output",
            "num_generations": G,
            "generation_batch_size": per_process,
            "steps_per_generation": steps_per_generation // accumulation,
            "num_iterations": args.num_iterations,
            "max_steps": 0 if args.max_steps is None or args.max_steps < 0 else args.max_steps,
            "num_epochs": args.num_train_epochs,
            "seed": args.seed,
            "use_cpu": args.use_cpu,
            "shuffle_dataset": bool(args.shuffle_dataset),
            "learning_rate": args.learning_rate,
            "lr_scheduler": SCHEDULERS[schedule],
            "lr_scheduler_kwargs": _as_dict(args.lr_scheduler_kwargs, "lr_scheduler_kwargs"),
            "warmup_steps": warmup,
            "optimizer": OPTIMIZERS[optim],
            "weight_decay": args.weight_decay,
            "adam_beta1": args.adam_beta1,
            "adam_beta2": args.adam_beta2,
            "adam_epsilon": args.adam_epsilon,
            "max_grad_norm": args.max_grad_norm,
            "gradient_checkpointing": "auto" if checkpointing else False,
            "micro_batch_size": args.per_device_train_batch_size if _loss_reads_micro_batch(args) else "auto",
            "clip_ratio_group_size": args.per_device_train_batch_size,
            "torch_dtype": precision_dtype(args),
            "trust_remote_code": args.trust_remote_code,
            "max_completion_length": args.max_completion_length,
            "max_prompt_length": None,
            **sampled,
            "chat_template_kwargs": _as_dict(args.chat_template_kwargs, "chat_template_kwargs"),
            "decode_mode": "static" if cache == "static" else "auto",
            "max_tool_calling_iterations": args.max_tool_calling_iterations,
            "beta": args.beta,
            "epsilon_low": args.epsilon,
            "epsilon_high": args.epsilon if args.epsilon_high is None else args.epsilon_high,
            "delta": args.delta,
            "sapo_temperature_pos": args.sapo_temperature_pos,
            "sapo_temperature_neg": args.sapo_temperature_neg,
            "vespo_k_pos": args.vespo_k_pos,
            "vespo_lambda_pos": args.vespo_lambda_pos,
            "vespo_k_neg": args.vespo_k_neg,
            "vespo_lambda_neg": args.vespo_lambda_neg,
            "importance_sampling": args.importance_sampling_level,
            "reward_weights": args.reward_weights,
            "multi_objective_aggregation": args.multi_objective_aggregation,
            "scale_rewards": {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards),
            "loss_type": args.loss_type,
            "mask_truncated_completions": args.mask_truncated_completions,
            "top_entropy_quantile": args.top_entropy_quantile,
            "entropy_coef": args.entropy_coef,
            "use_adaptive_entropy": args.use_adaptive_entropy,
            "entropy_coef_min": args.entropy_coef_min,
            "entropy_coef_max": args.entropy_coef_max,
            "entropy_coef_delta": args.entropy_coef_delta,
            "entropy_target": args.entropy_target,
            "off_policy_mask_threshold": args.off_policy_mask_threshold,
            "kl_ratio_correction": args.use_bias_correction_kl,
            "ref_sync_steps": args.ref_model_sync_steps if args.sync_ref_model else 0,
            "ref_sync_alpha": args.ref_model_mixup_alpha if args.sync_ref_model else 1.0,
            "ref_sync_mode": "exact",
            **{name: getattr(args, name) for name in EXTENSIONS if hasattr(args, name)},
            # The flow (when to log, evaluate, save) is transformers' DefaultFlowCallback's (trl.trainer).
            "logging_steps": 1,
            "eval_steps": 0,
            "save_steps": 0,
            "eval_on_start": bool(args.eval_on_start),  # whatever the strategy, as transformers
            "eval_on_end": False,
            **_sampled_eval(args.num_generations_eval),
            "save_total_limit": args.save_total_limit or 0,
            # the best checkpoint: each new best is saved, as save_strategy='best' saves (run/best.py)
            "metric_for_best_model": None
            if eval_set_names is None
            else best_metric(args.metric_for_best_model, eval_set_names),
            "greater_is_better": True if args.greater_is_better is None else bool(args.greater_is_better),
            "load_best_model_at_end": bool(args.load_best_model_at_end),
            # trackers are transformers' callbacks on TRL's records (trl.trainer), not lora_grpo's own
            "report_to": "none",
            "disable_tqdm": bool(args.disable_tqdm),
            "log_completions": args.log_completions,
            "num_completions_to_print": (
                args.num_completions_to_print or per_process // (steps_per_generation // accumulation)
            )
            if args.log_completions
            else 0,
            "messages_column": None,  # TRL reads the prompt column only
            # TRL calls a tool in its own thread, one call after another, with no time limit
            "tool_timeout": None,
            # TRL writes over a previous run in output_dir; here its files move to output_dir/previous-run-K/ first.
            "overwrite_output_dir": True,
            **native,
        }
    )


def _loss_reads_micro_batch(args) -> bool:
    """Whether TRL's loss depends on which completions share a micro-step: a loss type normalised by the
    micro-batch's tokens, the high-entropy token mask (its quantile taken per micro-step) or the entropy
    bonus (a token mean per micro-step). Those runs take per_device_train_batch_size rows a micro-batch, as
    TRL does, so that the objective is TRL's; the others' gradient does not depend on it (micro-batches
    sized by the memory plan)."""
    entry = LOSS_TYPES.get(args.loss_type)  # an unknown name is refused by the native config, naming them all
    return (
        (entry is not None and entry.per_micro_batch)
        or args.top_entropy_quantile < 1.0
        or bool(args.entropy_coef)
        or bool(args.use_adaptive_entropy)
    )


def best_metric(name: str | None, set_names: Sequence[str] = ()) -> str | None:
    """transformers' metric_for_best_model ('reward', 'eval_reward', 'eval_<set>_reward') as the native eval metric
    ('eval/reward', 'eval/<set>/reward'): TRL's names of the sampled completions' figures (rewards/<name>/mean,
    completions/mean_length) as the greedy eval's (eval/<name>, eval/completion_length). ConfigError for eval_loss,
    which lora_grpo's evaluate() does not compute."""
    if name is None:
        return None
    metric = name.removeprefix("eval_")
    if metric == "loss":
        raise ConfigError(
            f"metric_for_best_model={name!r} (transformers' default with load_best_model_at_end, when none is named): "
            "lora_grpo's "
            "evaluate() reports no eval_loss (it scores a greedy completion per eval prompt with the reward "
            "functions): set metric_for_best_model='reward' (their weighted sum), a reward function's name, or "
            "'pass@1' with num_generations_eval"
        )
    set_name = next((s for s in set_names if metric.startswith(f"{s}_")), None)
    if set_name is not None:
        metric = metric.removeprefix(f"{set_name}_")
    if metric == "completions/mean_length":
        metric = "completion_length"
    elif metric.startswith("rewards/") and metric.endswith("/mean"):
        metric = metric.removeprefix("rewards/").removesuffix("/mean")
    return f"eval/{metric}" if set_name is None else f"eval/{set_name}/{metric}"


def unknown_metric(name: str, known: Sequence[str], set_names: Sequence[str] = ()) -> str:
    """transformers' error for a metric_for_best_model that no eval reports, then the eval metrics of lora_grpo's
    evaluate() under the front door's names (`known`: the native ones, eval/<metric> or eval/<set>/<metric>)."""
    shown = []
    for key in known:
        rest = key.removeprefix("eval/")
        set_name = next((s for s in set_names if rest.startswith(f"{s}/")), None)
        shown.append(
            f"eval_{rest}" if set_name is None else f"eval_{set_name}_{rest.removeprefix(set_name + '/')}"
        )
    metric = name if name.startswith("eval_") else f"eval_{name}"
    return (
        f"The `metric_for_best_model` training argument is set to '{metric}', which is not found in the evaluation "
        f"metrics. lora_grpo's evaluate() reports {shown} (TRL's eval_rewards/<name>/mean is eval_<name> here, of "
        "a greedy completion per prompt): name one of them"
    )


def _sampled_eval(n: int | None) -> dict[str, Any]:
    """TRL's num_generations_eval (n completions sampled per eval prompt) as lora_grpo's pass@k eval: pass@1 (the
    share of sampled completions the first reward function counts correct) and pass@n; {} for None."""
    return {} if not n else {"eval_num_samples": n, "eval_pass_k": sorted({1, n})}


def resolved_steps(value: float | None, max_steps: int, fallback: float) -> int:
    """transformers' TrainerState steps: None → fallback, below 1 a share of max_steps (rounded up)."""
    value = fallback if value is None else value
    return math.ceil(max_steps * value) if 0 < value < 1 else int(value)
