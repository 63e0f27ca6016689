"""TRL's model arguments → lora_grpo's model: a name or path, a loaded PreTrainedModel (4-bit too), or a
PeftModel (its adapter becomes the warm-start policy and the initial reference); peft_config's LoRA;
quantization_config / model_init_kwargs; reward models among the reward functions.

What a LoRA config may not do here, because the reference slot must hold ΔW = B·A exactly and start
equal to the policy: DoRA (a magnitude vector outside B·A), trained biases, modules_to_save (fully
trained modules), and initialisations that move the base or start with ΔW ≠ 0 (PiSSA, OLoRA, LoftQ,
EVA, CorDA, init_lora_weights=False).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from ..config import ConfigError
from .translate import _as_dict, precision_dtype

logger = logging.getLogger(__name__)

DEFAULT_LORA = dict(lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules="all-linear")
_INIT_KEEPS_BASE = (True, "gaussian")  # B = 0 at start: ΔW = 0, the base untouched
_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
}
_HARMLESS_INIT_KWARGS = {"low_cpu_mem_usage", "use_cache"}


def _dtype_name(value) -> str:
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if value is None:
        return "auto"
    if value not in _DTYPES:
        raise ConfigError(f"model_init_kwargs dtype={value!r}: use one of {sorted(set(_DTYPES.values()))}")
    return _DTYPES[value]


def check_lora(peft_config) -> None:
    """Refuse, naming the field and why, a LoRA config the reference slot cannot mirror exactly."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(
            f"peft_config={type(peft_config).__name__}: lora_grpo trains LoRA adapters (peft.LoraConfig)"
        )
    problems = []
    if getattr(peft_config, "use_dora", False):
        problems.append(
            "use_dora=True: DoRA's magnitude vector is not part of ΔW = B·A, so the reference slot could not hold it"
        )
    variants = [
        field.name
        for field in dataclasses.fields(peft_config)
        if field.metadata.get("is_lora_variant")
        and field.name not in ("use_dora", "velora_config")  # DoRA named above; VeLoRA's ΔW is B·A
        and getattr(peft_config, field.name)
    ]
    if variants:
        problems.append(
            f"{', '.join(f'{name}={getattr(peft_config, name)!r:.60}' for name in variants)}: a LoRA variant whose "
            "layers compute other than x·ΔWᵀ with ΔW = B·A, which the reference slot's plain LoRA cannot mirror "
            "(leave it unset)"
        )
    if getattr(peft_config, "bias", "none") != "none":
        problems.append(
            f"bias={peft_config.bias!r}: trained biases are outside the LoRA factors (use 'none')"
        )
    if getattr(peft_config, "modules_to_save", None):
        problems.append(
            f"modules_to_save={peft_config.modules_to_save}: fully trained modules cannot be synced as LoRA factors"
        )
    init = getattr(peft_config, "init_lora_weights", True)
    if init not in _INIT_KEEPS_BASE:
        problems.append(
            f"init_lora_weights={init!r}: it moves the base or starts with ΔW ≠ 0, so the initial reference "
            "would not be the model you loaded (use True or 'gaussian')"
        )
    targets = peft_config.target_modules
    if "lm_head" in ([targets] if isinstance(targets, str) else list(targets or [])):
        raise ConfigError(
            "Applying a PEFT adapter to `lm_head` is not supported: the log-probabilities are computed "
            "from `lm_head.weight` directly, so the adapter would never be trained. Remove `'lm_head'` from "
            "your `target_modules`."
        )
    if getattr(peft_config, "target_parameters", None):
        problems.append("target_parameters: LoRA on raw parameters (MoE experts) has no B·A layer to sync")
    if problems:
        raise ConfigError("peft_config cannot be used for lora_grpo's policy adapter: " + "; ".join(problems))


def _quantization_fields(qconfig) -> dict[str, Any]:
    if qconfig is None:
        return {}
    if getattr(qconfig, "load_in_4bit", False):
        out = {
            "quantization": "4bit",
            "bnb_4bit_quant_type": qconfig.bnb_4bit_quant_type,
            "bnb_4bit_use_double_quant": bool(qconfig.bnb_4bit_use_double_quant),
        }
        compute = getattr(qconfig, "bnb_4bit_compute_dtype", None)
        if compute is not None and compute != torch.float32:
            out["torch_dtype"] = _dtype_name(compute)
        return out
    if getattr(qconfig, "load_in_8bit", False):
        return {"quantization": "8bit"}
    raise ConfigError(
        f"quantization_config={type(qconfig).__name__}: lora_grpo takes bitsandbytes 4-bit or 8-bit "
        "(BitsAndBytesConfig(load_in_4bit=True) or load_in_8bit=True)"
    )


def build_model(
    model, args, quantization_config, peft_config, processing_class
) -> tuple[dict[str, Any], Callable]:
    """(native config fields, build(native_config) → (peft model with the policy "default" and "reference",
    tokenizer))."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    if not isinstance(model, (str, PreTrainedModel, PeftModel)):
        raise TypeError(
            f"model={model!r} ({type(model).__name__}): give a hub id or a local path (str), a loaded "
            "PreTrainedModel or a PeftModel"
        )
    init_kwargs = _as_dict(args.model_init_kwargs, "model_init_kwargs")
    unknown = sorted(
        set(init_kwargs)
        - {
            "dtype",
            "torch_dtype",
            "attn_implementation",
            "revision",
            "device_map",
            "quantization_config",
            "trust_remote_code",
            # consumed by the GGUF conversion before the model is built (bases.resolve_base)
            "gguf_file",
            # the Hub kernels TRL's Liger deprecation points to: not loaded, said (translate.stand_ins)
            "use_kernels",
        }
        - _HARMLESS_INIT_KWARGS
    )
    if unknown:
        raise ConfigError(
            f"model_init_kwargs {unknown}: lora_grpo loads the model with dtype, attn_implementation, "
            "revision, device_map, quantization_config and trust_remote_code only"
        )
    device_map = init_kwargs.get("device_map")
    if device_map not in (None, "auto") and not (
        isinstance(device_map, dict) and len(set(device_map.values())) <= 1
    ):
        raise ConfigError(
            f"model_init_kwargs device_map={device_map!r}: each process holds the whole model on its "
            "device (use None or 'auto'; several GPUs: accelerate launch)"
        )
    fields: dict[str, Any] = {
        "torch_dtype": _dtype_name(init_kwargs.get("dtype", init_kwargs.get("torch_dtype")))
        if ("dtype" in init_kwargs or "torch_dtype" in init_kwargs)
        else precision_dtype(args)
    }
    for key in ("attn_implementation", "revision"):
        if init_kwargs.get(key) is not None:
            fields[key] = init_kwargs[key]
    if init_kwargs.get("trust_remote_code"):
        fields["trust_remote_code"] = True
    qconfig = (
        quantization_config if quantization_config is not None else init_kwargs.get("quantization_config")
    )
    fields.update(_quantization_fields(qconfig))
    # (with a peft_config too it was refused in TRL's words: checks.refuse_as_trl)
    if isinstance(model, PeftModel):
        peft_config = model.peft_config[model.active_adapter]
    if peft_config is not None:
        check_lora(peft_config)
        targets = peft_config.target_modules
        # the reference slot holds twice the largest rank, a rank_pattern's too, as lora_grpo's default (2 × lora_r)
        ranks = [peft_config.r, *(getattr(peft_config, "rank_pattern", None) or {}).values()]
        fields.update(
            ref_rank=2 * max(ranks),
            lora_r=peft_config.r,
            lora_alpha=peft_config.lora_alpha,
            lora_dropout=peft_config.lora_dropout,
            use_rslora=bool(peft_config.use_rslora),
            lora_target_modules=sorted(targets) if isinstance(targets, (set, list)) else targets,
        )
    else:
        fields.update(DEFAULT_LORA)
        logger.warning(
            "peft_config=None: lora_grpo trains LoRA adapters only (r=16, alpha=32, every linear layer; TRL "
            "would fine-tune every weight); pass peft_config=LoraConfig(...) to choose"
        )
    if not isinstance(model, str) and not isinstance(model, PeftModel):
        fields["quantization"] = (
            "4bit"
            if getattr(model, "is_loaded_in_4bit", False)
            else "8bit"
            if getattr(model, "is_loaded_in_8bit", False)
            else fields.get("quantization", "none")
        )

    def build(config):
        from ..model.load import attach_adapters, load_base_model, load_tokenizer, prepare_base

        # a toy base's name is resolved already
        path = model if isinstance(model, str) else config.model_name_or_path
        # the script's own tokenizer as it is, as TRL (lora_grpo's sampler pads by itself); one loaded here is padded
        # and truncated on the left, as TRL loads it
        tokenizer = processing_class if processing_class is not None else load_tokenizer(config, path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if isinstance(model, str):
            base = load_base_model(config, model)
        elif isinstance(model, PeftModel):
            # the adapter becomes init_adapter: the policy and the initial reference
            warm = tempfile.mkdtemp(prefix="lora_grpo_warm_start_")
            model.save_pretrained(warm, selected_adapters=[model.active_adapter])
            adapter_dir = warm if model.active_adapter == "default" else f"{warm}/{model.active_adapter}"
            config.init_adapter = adapter_dir
            base = prepare_base(model.unload())
        else:
            base = prepare_base(model)
        return attach_adapters(
            base, config, lora=peft_config if not isinstance(model, PeftModel) else None
        ), tokenizer

    return fields, build


def reward_models(
    reward_funcs,
    reward_processing_classes,
    chat_template_kwargs: dict | None = None,
    init_kwargs: dict | None = None,
) -> list:
    """TRL's reward_funcs: a callable stays; a string or a PreTrainedModel is a reward model (TRL's rule), with
    its tokenizer from reward_processing_classes (same position) or its own, and the run's chat_template_kwargs
    for its chat template (as TRL renders a conversational row for it). A string is loaded as TRL loads it, with
    `init_kwargs` (the policy's model_init_kwargs: revision, trust_remote_code, dtype, quantization, ...; its
    tokenizer at that revision); each process places it on its own device (scorer.place_reward_models)."""
    from transformers import PreTrainedModel

    from ..rewards import RewardModel
    from ..rewards.specs import in_position

    funcs = (
        reward_funcs if isinstance(reward_funcs, list) else [reward_funcs] if reward_funcs is not None else []
    )
    tokenizers = reward_processing_classes
    if tokenizers is not None and not isinstance(tokenizers, list):
        tokenizers = [tokenizers]
    out = []
    for i, fn in enumerate(funcs):
        tokenizer = tokenizers[i] if tokenizers is not None and i < len(tokenizers) else None
        if isinstance(fn, (str, PreTrainedModel)):
            # to the device in scorer.py
            fn = in_position(
                i,
                fn,
                lambda fn=fn, tokenizer=tokenizer: RewardModel(
                    fn,
                    tokenizer,
                    chat_template_kwargs=chat_template_kwargs,
                    model_kwargs=(
                        {k: v for k, v in (init_kwargs or {}).items() if k != "device_map"}
                        if isinstance(fn, str)
                        else None
                    ),
                ),
            )
        out.append(fn)
    return out  # none at all: refused in TRL's words unless an environment scores (checks.refuse_as_trl)
