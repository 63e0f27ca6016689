"""What TRL 1.16's GRPOTrainer refuses and warns about at construction, refused and warned here in TRL's
words: each message starts with TRL's sentence (the one users search for), then says what to do here.

`TRL_CHECKS` is the list of every error and warning that TRL 1.16 raises in `GRPOTrainer.__init__` and
`GRPOConfig.__post_init__` (and transformers' `Trainer.__init__` check a GRPO script meets), each with its
fate in lora_grpo: "same" (raised or warned here with TRL's sentence: lora_grpo.trl.config for the
config's, this module for the trainer's), or why it does not apply. tests/test_trl_parity.py walks TRL's
installed source and finds each of its messages in this list.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping

from ..algo.loss_types import LOSS_TYPES, trl_sequence_level_warning

logger = logging.getLogger(__name__)

SAME = "same"  # raised or warned here too, starting with TRL's sentence

# (where, the start of TRL's message, its fate here)
TRL_CHECKS: list[tuple[str, str, str]] = [
    # --- GRPOConfig.__post_init__ (lora_grpo.trl.config) ------------------------------------------
    (
        "config",
        "`use_transformers_paged` is deprecated",
        SAME + " (then stand_ins: lora_grpo's own sampler stands in for continuous batching)",
    ),
    (
        "config",
        "GRPOTrainer does not support sequence-dim parallelism",
        "parallelism_config is refused by name",
    ),
    ("config", "log_completions_hub_repo is set, but log_completions is False", SAME),
    ("config", "auto_find_batch_size is not supported by GRPO", SAME),
    (
        "config",
        "generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch size",
        SAME,
    ),
    ("config", "'generation_batch_size' and 'steps_per_generation' can not be both configured", SAME),
    ("config", "The global eval batch size", SAME),
    (
        "config",
        "generation_batch_size ({self.generation_batch_size}) must be divisible by num_generations",
        SAME,
    ),
    ("config", "GRPO requires at least 2 generations per prompt", SAME),
    ("config", "The `vllm_importance_sampling_cap` argument is deprecated", SAME),
    ("config", "vllm_importance_sampling_clip_min", SAME),
    ("config", "At least one of `vllm_importance_sampling_clip_min`", SAME),
    # --- GRPOTrainer.__init__ (this module, unless it says otherwise) -----------------------------
    (
        "trainer",
        "You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`",
        SAME,
    ),
    (
        "trainer",
        "You passed `model_init_kwargs` to the `GRPOConfig`, but your model is already instantiated",
        SAME,
    ),
    (
        "trainer",
        "You passed `quantization_config` to the trainer, but your model is already instantiated",
        SAME,
    ),
    (
        "trainer",
        "`use_transformers_continuous_batching` does not support multimodal models",
        "does not apply: a ProcessorMixin (multimodal) is refused whatever the engine: lora_grpo trains text models",
    ),
    (
        "trainer",
        "The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`",
        SAME + "; a ProcessorMixin (multimodal) is refused too: lora_grpo trains text models",
    ),
    (
        "trainer",
        "You passed `peft_config` but the `peft` library is not installed",
        "does not apply: peft is a dependency of lora_grpo",
    ),
    ("trainer", "`peft_config` must be a `peft.PeftConfig` instance", SAME),
    ("trainer", "You passed a `PeftModel` instance together with a `peft_config` to the trainer", SAME),
    (
        "trainer",
        "Prefix tuning requires `peft>=0.18.0`",
        "does not apply: only LoRA configs are taken (check_lora)",
    ),
    (
        "trainer",
        "PEFT<0.20.0 can't add a frozen reference adapter",
        "does not apply: target_parameters is refused",
    ),
    ("trainer", "You are using PEFT with DeepSpeed ZeRO-3", "does not apply: DeepSpeed is refused by name"),
    (
        "trainer",
        "Number of reward weights ({len(args.reward_weights)}) must match number of reward functions",
        SAME + " (the native config's check)",
    ),
    ("trainer", "The number of reward processing classes", SAME),
    (
        "trainer",
        "You are using 'rollout_func', which is an experimental feature",
        "rollout_func is refused by name",
    ),
    (
        "trainer",
        "You are using 'environment_factory', which is an experimental feature",
        "not warned: environment_factory is a supported part of lora_grpo, not an experiment",
    ),
    (
        "trainer",
        "Using tools with GRPOTrainer requires transformers version 5.0.0",
        "does not apply: tool schemas come from transformers' get_json_schema, in every supported version",
    ),
    (
        "trainer",
        "Using `environment_factory` with GRPOTrainer requires transformers version 5.2.0",
        "does not apply: environments run in lora_grpo's own rollout loop",
    ),
    (
        "trainer",
        "Using tools with GRPOTrainer on transformers below 5.13.0 requires the jmespath library",
        "does not apply: tool calls are parsed by the tokenizer's response_template or lora_grpo's own formats",
    ),
    (
        "trainer",
        "The provided chat template does not support tool calling",
        "refused too, by rollout.tools.check_tool_template, in TRL's sentence, then naming the template, what it "
        "does not render and the fix",
    ),
    (
        "trainer",
        "Each environment instance returned by `environment_factory` must define a callable `reset`",
        SAME,
    ),
    ("trainer", "No reward source provided", SAME),
    (
        "trainer",
        "The tokenizer has a legacy `response_schema` set but no `response_template`",
        "not warned: a legacy response_schema is not read; calls are parsed by lora_grpo's own formats",
    ),
    (
        "trainer",
        "Using `use_transformers_continuous_batching` requires transformers>=5.8.0",
        "does not apply: lora_grpo's own sampler stands in for continuous batching (stand_ins)",
    ),
    ("trainer", "`router_aux_loss_coef` is set to", "router_aux_loss_coef is refused by name"),
    ("trainer", "Applying a PEFT adapter to `lm_head` is not supported", SAME + " (check_lora)"),
    ("trainer", "`train_dataset` is required unless an `environment_factory` is provided", SAME),
    ("trainer", "A `dict` `environment_factory` (multiple environments) requires a `train_dataset`", SAME),
    ("trainer", "When training without a `train_dataset`", SAME),
    (
        "trainer",
        "`train_dataset` must be a `Dataset` or `IterableDataset`",
        "accepted more widely: a list of rows or a local file, as lora_grpo's native API takes them",
    ),
    (
        "trainer",
        "Iterable datasets require `dispatch_batches=False`",
        "does not apply: there is no DataLoader; a stream is read at start",
    ),
    (
        "trainer",
        "Iterable datasets require `dataloader_num_workers=0`",
        "does not apply: there is no DataLoader; a stream is read at start",
    ),
    # each loss type's warning about its importance_sampling level: the registry's sentence
    *(("trainer", entry.trl_warning, SAME) for entry in LOSS_TYPES.values() if entry.trl_warning),
    ("trainer", "When using `importance_sampling_level='sequence'`, the", SAME),
    (
        "trainer",
        "VESPO loss requires `vllm_importance_sampling_mode`",
        SAME + " (with use_vllm, which lora_grpo's own sampler stands in for: stand_ins)",
    ),
    (
        "trainer",
        "does not support `nn.DataParallel`",
        "does not apply: each process uses one device (several GPUs: accelerate launch)",
    ),
    (
        "trainer",
        "`cast_lm_head_to_fp32=True` is not supported when the lm_head carries a PEFT adapter",
        "does not apply: an adapter on lm_head is refused (check_lora)",
    ),
    (
        "trainer",
        "`use_liger_kernel=True` is deprecated",
        SAME + " (then stand_ins: no Liger kernels are applied)",
    ),
    ("trainer", '`liger_kernel_config={"fused_linear_cross_entropy": True}` is not supported', SAME),
    ("trainer", "The vLLM server runs with `--logprobs-mode", "does not apply: no vLLM server is contacted"),
    (
        "vllm",
        "vllm_mode must be either 'server' or 'colocate'",
        SAME + " (with use_vllm, before any model is loaded)",
    ),
    ("trainer", "You passed `sync_ref_model=True` while `beta=0.0`", SAME),
    (
        "trainer",
        "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported",
        "differs on purpose: the LoRA reference slot is synced (README: where we differ)",
    ),
    # --- transformers' Trainer.__init__, as a GRPO script meets it --------------------------------
    ("transformers", "You have set `args.eval_strategy` to", SAME),
    ("transformers", "`args.metric_for_best_model` must be provided when using 'best' save_strategy", SAME),
]


def _environment_classes(environment_factory) -> list[tuple[object, type]]:
    """(factory, the class of what it makes) for each environment factory: a class is its own; any
    other callable is called once to see its instance's class (TRL probes an instance too)."""
    if environment_factory is None:
        return []
    factories = (
        list(environment_factory.values())
        if isinstance(environment_factory, Mapping)
        else [environment_factory]
    )
    return [(f, f if isinstance(f, type) else type(f())) for f in factories]


def refuse_as_trl(
    args,
    *,
    model,
    reward_funcs,
    train_dataset,
    eval_dataset,
    processing_class,
    reward_processing_classes,
    environment_factory,
    quantization_config,
    peft_config,
) -> None:
    """Raise what TRL 1.16's GRPOTrainer.__init__ (and transformers' Trainer.__init__) raises for these
    arguments, with TRL's sentence first, before any model is loaded."""
    from transformers import PreTrainedTokenizerBase

    if (
        isinstance(model, str)
        and quantization_config is not None
        and "quantization_config" in (args.model_init_kwargs or {})
    ):
        raise ValueError(
            "You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`. "
            "Please set it in only one place, preferably as a trainer argument."
        )
    if processing_class is not None and not isinstance(processing_class, PreTrainedTokenizerBase):
        raise TypeError(
            "The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`. "
            f"Got {type(processing_class).__name__}; lora_grpo trains text models: pass the tokenizer "
            "(a multimodal processor's .tokenizer for its text part)."
        )
    if peft_config is not None:
        from peft import PeftConfig, PeftModel

        if not isinstance(peft_config, PeftConfig):
            raise TypeError(
                "`peft_config` must be a `peft.PeftConfig` instance (e.g. `peft.LoraConfig`), got "
                f"{type(peft_config).__name__}."
            )
        if isinstance(model, PeftModel):
            raise ValueError(
                "You passed a `PeftModel` instance together with a `peft_config` to the trainer. Please "
                "first merge and unload the existing adapter, save the resulting base model, and then pass "
                "that base model along with the new `peft_config` to the trainer. (Or pass the PeftModel "
                "alone: its adapter becomes the warm-start policy and the initial reference.)"
            )
    funcs = reward_funcs if isinstance(reward_funcs, list) else [] if reward_funcs is None else [reward_funcs]
    if reward_processing_classes is not None:
        classes = (
            reward_processing_classes
            if isinstance(reward_processing_classes, list)
            else [reward_processing_classes]
        )
        if len(classes) != len(funcs):
            raise ValueError(
                f"The number of reward processing classes ({len(classes)}) must match the number of reward "
                f"functions ({len(funcs)}). Pass one per reward function, in the same order (None for a "
                "plain function)."
            )
    environments = _environment_classes(environment_factory)  # TRL reads both methods off the class too
    for factory, cls in environments:
        if not callable(getattr(cls, "reset", None)):
            raise ValueError(
                "Each environment instance returned by `environment_factory` must define a callable "
                f"`reset`. {factory!r} has none: add reset(self, **row) returning the prompt's text or None."
            )
    if not funcs and not any(callable(getattr(cls, "get_reward", None)) for _, cls in environments):
        raise ValueError(
            "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment "
            "defines a `get_reward` method."
        )
    if train_dataset is None:
        if environment_factory is None:
            raise ValueError("`train_dataset` is required unless an `environment_factory` is provided.")
        if isinstance(environment_factory, Mapping):
            raise ValueError(
                "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                "`environment` column to route each example to its environment. Provide a dataset, or "
                "pass a single environment factory."
            )
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError(
                "When training without a `train_dataset` (the environment owns the data and returns the "
                "prompt from `reset()`), `max_steps` must be set to a positive value to define the training "
                "length. Set it via `GRPOConfig(max_steps=...)`."
            )
    strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
    if strategy not in (None, "no") and eval_dataset is None:
        raise ValueError(
            f"You have set `args.eval_strategy` to {args.eval_strategy} but you didn't pass an "
            "`eval_dataset` to `Trainer`. Either set `args.eval_strategy` to `no` or pass an "
            "`eval_dataset`. "
        )
    if (
        getattr(args.save_strategy, "value", args.save_strategy) == "best"
        and args.metric_for_best_model is None
    ):
        raise ValueError(
            "`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
            "`args.load_best_model_at_end` is set to `True`. Name the eval metric that picks the best checkpoint, "
            "e.g. metric_for_best_model='reward'."
        )
    if args.use_vllm and args.vllm_mode not in ("server", "colocate"):
        raise ValueError(
            f"vllm_mode must be either 'server' or 'colocate', got '{args.vllm_mode}'. (lora_grpo samples with its "
            "own sampler either way; a misspelt mode is refused as TRL refuses it.)"
        )
    entry = LOSS_TYPES.get(args.loss_type)
    if (
        entry is not None
        and entry.trl_vllm_error
        and args.use_vllm
        and args.vllm_importance_sampling_correction
        and args.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
    ):
        raise ValueError(
            f"{entry.trl_vllm_error} Got: {args.vllm_importance_sampling_mode}. (lora_grpo samples with its own "
            "sampler, so the correction does not act here: set the mode TRL asks for, or use_vllm=False.)"
        )
    if args.sync_ref_model and args.beta == 0.0:
        raise ValueError(
            "You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model is not used "
            "during training. Consequently, GRPOTrainer does not create a `ref_model` instance, and there "
            "is nothing to synchronize. Please set `sync_ref_model=False`, or set `beta` to a non-zero value."
        )


def warn_as_trl(args, *, model, quantization_config) -> None:
    """Warn what TRL 1.16's GRPOTrainer.__init__ warns about for these arguments (logger warnings, as TRL; Liger's
    deprecation is a FutureWarning, followed by the error TRL raises right after it)."""
    if not isinstance(model, str):
        if args.model_init_kwargs is not None:
            logger.warning(
                "You passed `model_init_kwargs` to the `GRPOConfig`, but your model is already instantiated. "
                "The `model_init_kwargs` will be ignored."
            )
        if quantization_config is not None:
            logger.warning(
                "You passed `quantization_config` to the trainer, but your model is already instantiated. The "
                "`quantization_config` will be ignored."
            )
    if args.use_liger_kernel:  # then the error TRL raises right after this warning
        warnings.warn(
            "`use_liger_kernel=True` is deprecated and will be removed in v2.0.0. Use the Hub kernels instead, "
            'with `model_init_kwargs={"use_kernels": True}`.',
            FutureWarning,
            stacklevel=3,
        )
        liger = args.liger_kernel_config
        if isinstance(liger, Mapping) and liger.get("fused_linear_cross_entropy"):
            raise ValueError(
                '`liger_kernel_config={"fused_linear_cross_entropy": True}` is not supported: it replaces the '
                "model's forward, which this trainer patches with a fused LM head. (lora_grpo applies no Liger "
                "kernels: leave liger_kernel_config unset.)"
            )
    level = args.importance_sampling_level
    entry = LOSS_TYPES.get(args.loss_type)
    if entry is None:
        # an unknown loss_type is refused by the translated config, naming the choices
        return
    if entry.meant_for is not None and level != entry.meant_for:
        logger.warning(entry.trl_warning)
    if level == "sequence" and entry.sums_tokens:
        logger.warning(trl_sequence_level_warning(args.loss_type))
