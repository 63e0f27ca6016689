"""Load the base model (none / 8-bit / 4-bit), attach the policy ("default") and "reference" adapters.

    policy    = base + ΔW_policy      trainable
    reference = base + ΔW_ref         frozen; changed only by reference.sync_reference

Both adapters sit on the one frozen base. `reference_forward(model)` switches to the reference
for a no-grad forward and back without changing any requires_grad flag (peft's set_adapter marks
the adapter it activates trainable and every other one frozen; we undo that).
"""

from __future__ import annotations

import copy
import gc
import logging
import re
from pathlib import Path

import torch
from torch import nn

from ..config import GRPOConfig, default_ref_rank
from ..device import GiB, auto_dtype, available_bytes, describe_gpu, is_out_of_memory, native_bf16
from .adapters import BASE, POLICY, POLICY_DIR, REFERENCE, TAGS, lora_layers
from .bases import resolve_base
from .loading import LoadError, loading
from .reference import check_syncable, sync_reference

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device | str | None = None) -> torch.dtype:
    """The config's torch_dtype as a torch dtype; 'auto' says in one line what it chose and why
    (device.auto_dtype: bfloat16 only where the GPU computes it natively, else float32; float32 for
    a run on the CPU `device`, use_cpu on a GPU machine included)."""
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if name == "auto":
        dtype, why = auto_dtype(device)
        # A GPU without native bf16 gets float32, which the user should know about: a warning there.
        level = logging.INFO if dtype == torch.bfloat16 or not on_gpu else logging.WARNING
        logger.log(level, "torch_dtype auto → %s (%s)", str(dtype).removeprefix("torch."), why)
        return dtype
    if name == "float16":
        logger.info(
            "torch_dtype float16: the loss is scaled dynamically (optim.LossScale); activations beyond "
            "float16's ±65504 become inf, which the start-up check names (bfloat16 or float32 then)"
        )
    if name == "bfloat16" and on_gpu and not native_bf16():
        logger.warning(
            "torch_dtype=bfloat16 on %s: emulated, slower than float32; set torch_dtype to float32 or auto",
            describe_gpu(),
        )
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# Config attributes that hold dropout probabilities in transformers' model configs.
DROPOUT_ATTRS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "activation_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)


def disable_dropout(model: nn.Module) -> None:
    """Turn the base model's dropout off for good (LoRA dropout is separate and configured).

    Rollout, old and reference log-probs run in eval mode; the loss forward runs in train mode.
    Base dropout would make those disagree: KL > 0 against an identical reference, ratios ≠ 1.
    """
    for attr in DROPOUT_ATTRS:
        if isinstance(getattr(model.config, attr, None), float):
            setattr(model.config, attr, 0.0)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # layers that keep a probability as a float of their own, copied from the config when built, and use it
        # in the forward (OPT's dropout, StarCoder2's residual_dropout, GPT-BigCode's attn_dropout, layerdrop)
        for name, value in vars(module).items():
            if isinstance(value, float) and ("dropout" in name or name == "layerdrop"):
                setattr(module, name, 0.0)


def resolve_model_path(config: GRPOConfig) -> str:
    """The model's path: an offline task's base or a packaged model by name, a GGUF file converted
    once, or the config's path or hub id as given (bases.resolve_base)."""
    return resolve_base(config.model_name_or_path, config.gguf_file, revision=config.revision)


def quantization_config(config: GRPOConfig, dtype: torch.dtype):
    if config.quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    if config.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=config.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=config.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=dtype,
    )


def load_tokenizer(config: GRPOConfig, model_path: str | None = None, saved_with: Path | None = None):
    """The run's tokenizer: config.tokenizer_name_or_path, else the model's. `saved_with`: a trained adapter (or
    a checkpoint's policy/) whose run saved its tokenizer beside it, which is then the one read: the tokenizer
    a run trained with may be a script's own (a chat template set, tokens added), which no config field names."""
    from transformers import AutoTokenizer

    path = config.tokenizer_name_or_path or model_path or resolve_model_path(config)
    revision = config.revision
    if saved_with is not None:
        saved = Path(saved_with)
        beside = [saved, *([saved.parent] if saved.name == POLICY_DIR else [])]
        found = next((where for where in beside if (where / "tokenizer_config.json").is_file()), None)
        path, revision = (str(found), None) if found is not None else (path, revision)
    with loading("policy", "tokenizer", path):
        # padded and truncated on the left, as a decoder-only model generates (and TRL loads it): given at load, so
        # that every tokenizer saved beside an adapter reloads so (an attribute set later is not saved)
        tokenizer = AutoTokenizer.from_pretrained(
            path,
            trust_remote_code=config.trust_remote_code,
            padding_side="left",
            truncation_side="left",
            revision=revision,
        )
    if tokenizer.pad_token is None:
        # Completions are masked by length, so reusing EOS as padding is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(config: GRPOConfig, model_path: str | None = None, device_map=None) -> nn.Module:
    """The frozen base causal LM, quantized as configured, on device_map ({"": device}; None: a
    quantized base goes to the current GPU when there is one, else everything stays on the CPU)."""
    from transformers import AutoModelForCausalLM

    device = device_map.get("") if isinstance(device_map, dict) else None
    dtype = resolve_dtype(config.torch_dtype, device)
    kwargs = {}
    if config.attn_implementation:
        kwargs["attn_implementation"] = config.attn_implementation
    qconfig = quantization_config(config, dtype)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
        if device_map is None and torch.cuda.is_available():
            device_map = {"": torch.cuda.current_device()}
    path = model_path or resolve_model_path(config)
    ran_out = None
    try:
        with loading("policy", "base model", path):
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                device_map=device_map,
                trust_remote_code=config.trust_remote_code,
                revision=config.revision,  # None: the default branch
                **kwargs,
            )
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(error):
            raise
        ran_out = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    if ran_out is not None:
        # Raised here, after the except block: until then its traceback's frames hold the weights loaded so far,
        # and the memory left could not be read without them.
        device = device_map.get("") if isinstance(device_map, dict) else None
        raise BaseTooLarge(too_large(config, path, dtype, torch.device(device or "cpu"), ran_out))
    return prepare_base(model)


class BaseTooLarge(LoadError, torch.OutOfMemoryError):
    """The base model did not fit in the memory of its device while it loaded (a LoadError, and a
    torch.OutOfMemoryError for a script that catches those): the message says what its weights take."""


# Bytes one weight of the body's linear layers takes as bitsandbytes loads it: NF4/FP4 half a byte, plus an absmax
# per 64-weight block, itself quantised to a byte with a float32 per 256 blocks (double quantisation); LLM.int8 a
# byte (its float32 scale per row left out).
QUANTIZED_WEIGHT_BYTES = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}


def weights_as_loaded(config: GRPOConfig, path: str, dtype: torch.dtype) -> dict[str, float]:
    """The base's weights in bytes for each `quantization` ('none', '8bit', '4bit'), counted on an
    empty copy of it built from its config on the meta device (no weight is read): bitsandbytes
    quantizes the linear layers but the output head; embeddings, the head and norms stay in dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_config = AutoConfig.from_pretrained(
        path, trust_remote_code=config.trust_remote_code, revision=config.revision
    )
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(model_config, trust_remote_code=config.trust_remote_code)
    head = empty.get_output_embeddings()
    linear = sum(m.weight.numel() for m in empty.modules() if isinstance(m, nn.Linear) and m is not head)
    rest = sum(p.numel() for p in empty.parameters()) - linear
    size = dtype.itemsize
    return {
        "none": float((linear + rest) * size),
        **{name: linear * per_weight + rest * size for name, per_weight in QUANTIZED_WEIGHT_BYTES.items()},
    }


def too_large(config: GRPOConfig, path: str, dtype: torch.dtype, device: torch.device, ran_out: str) -> str:
    """What a load that ran out of memory says: the weights against the memory left, and what to change."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    room, what = available_bytes(device)
    message = (
        f"could not load the policy's base model from {path!r}: it ran out of memory on {device} ({ran_out})"
    )
    try:
        weights = weights_as_loaded(config, path, dtype)
    except Exception as error:  # noqa: BLE001 - the figures only explain; the refusal stands without them
        logger.debug("the base's size could not be counted from its config: %s", error)
        return (
            message
            + f"; {room / GiB:.1f} GiB of {what} is left: set quantization: 4bit, or choose a smaller model"
        )
    need = weights[config.quantization]
    held = {"4bit": "quantized to 4 bits", "8bit": "quantized to 8 bits"}.get(
        config.quantization, f"in {str(dtype).removeprefix('torch.')}"
    )
    message += (
        f". Its weights take about {need / GiB:.1f} GiB {held} (counted from its config), and "
        f"{room / GiB:.1f} GiB of {what} is left with nothing loaded: "
    )
    if need <= room:
        return message + (
            "they fit, so the memory went elsewhere while it loaded (another process on the device? nvidia-smi lists "
            "them): free it and run again"
        )
    fixes = [
        f"quantization: {q} (about {weights[q] / GiB:.1f} GiB)" for q in ("4bit", "8bit") if weights[q] < need
    ]
    return message + "use " + " or ".join([*fixes, "a smaller model"])


def prepare_base(model: nn.Module) -> nn.Module:
    """A loaded causal LM made a frozen base: no gradients, no dropout, 4-bit layers on their portable
    path, no cache in the training forward (the rollout asks for one)."""
    model.requires_grad_(False)
    disable_dropout(model)
    keep_4bit_weights_fixed(model)
    model.config.use_cache = False
    return model


def keep_4bit_weights_fixed(model: nn.Module) -> int:
    """Keep every bitsandbytes 4-bit layer on its portable CPU path; returns how many were pinned.

    On a CPU with AVX512-BF16, `Linear4bit.forward` repacks its weights for a CPU kernel on the
    first no-grad eval forward (rollout): the absmax goes to bf16, and `_save_to_state_dict` later
    unpacks and re-quantises it, lossy, so the frozen base drifts (up to 4e-4 in the dequantised
    weights). Worse for training: the packed kernel (`gemv_4bit`) has no autograd, so after the
    first rollout no gradient flows through the base matmuls to earlier layers (measured:
    input.grad is None). Turning the flag off gives every CPU the same dequantise-and-matmul path,
    exact in backward; GPUs never take the packed path.
    """
    pinned, packed = 0, []
    for name, module in model.named_modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            pinned += 1
        if getattr(
            getattr(getattr(module, "weight", None), "quant_state", None), "packing_format_for_cpu", False
        ):
            packed.append(name)
    if packed:
        # Undoing the repack re-quantises (lossy), and training through it would drop gradients.
        raise ValueError(
            f"{len(packed)} 4-bit layers (e.g. {packed[0]}) were already repacked by bitsandbytes for its CPU kernel "
            "(a no-grad eval forward ran before the trainer got the model); backward does not pass through that "
            "kernel. Load the model again and hand it to GRPOTrainer before running it, or let lora_grpo load it "
            "(model_name_or_path)."
        )
    return pinned


def lora_config(config: GRPOConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        use_rslora=config.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def other_towers(base: nn.Module) -> str | None:
    """A multimodal model's modules beside its language model (Gemma 3's vision tower and projector), as a
    peft ``exclude_modules`` pattern; None for a text model. GRPO on text trains the language model: an
    adapter on a tower the prompts never reach would take memory and never move."""
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    names = {id(module): name for name, module in base.named_modules()}
    if decoder is None or id(decoder) not in names:
        return None
    inside = {id(module) for module in decoder.modules()}
    head = base.get_output_embeddings()
    path = names[id(decoder)].split(".")
    towers = set()
    for name, module in base.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in inside and module is not head:
            parts = name.split(".")
            shared = next(i for i, (a, b) in enumerate(zip([*path, None], parts)) if a != b)
            towers.add(".".join(parts[: shared + 1]))
    if not towers:
        return None
    return rf"({'|'.join(re.escape(tower) for tower in sorted(towers))})\..*"


def reference_lora_config(policy_config, ref_rank: int):
    """The reference slot: same target modules as the policy, its own rank, scaling 1, no dropout."""
    from peft import LoraConfig

    return LoraConfig(
        r=ref_rank,
        lora_alpha=ref_rank,  # scaling = 1: the slot's factors hold ΔW_ref directly
        lora_dropout=0.0,
        target_modules=sorted(policy_config.target_modules)
        if isinstance(policy_config.target_modules, (set, list))
        else policy_config.target_modules,
        exclude_modules=policy_config.exclude_modules,
        layers_to_transform=policy_config.layers_to_transform,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=True,  # B = 0; overwritten by the initial copy of the policy
    )


def attach_adapters(base: nn.Module, config: GRPOConfig, lora=None) -> nn.Module:
    """Wrap the base in a peft model with the trainable policy ("default") and frozen "reference" adapters.

    The initial reference is an exact copy of the initial policy: the base itself for a fresh
    LoRA (ΔW = 0), the warm-start adapter when `init_adapter` is given. `lora`: a peft LoraConfig for
    the policy (exclude_modules, layers_to_transform, rank/alpha patterns...) instead of the config's
    lora_* fields (the TRL front door's peft_config).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    from .adapter_files import check_init_adapter, check_target_modules

    if config.init_adapter:
        # an adapter of another model: refused here, naming the layer (peft would drop it silently)
        check_init_adapter(base, config.init_adapter, config.model_name_or_path)
        with loading("policy", "init_adapter", config.init_adapter):
            saved = LoraConfig.from_pretrained(config.init_adapter)
        if saved.lora_dropout != config.lora_dropout:  # SFT adapters often carry 0.05–0.1
            logger.warning(
                "init_adapter's lora_dropout %s replaced by the config's %s",
                saved.lora_dropout,
                config.lora_dropout,
            )
            saved.lora_dropout = config.lora_dropout
        with loading("policy", "init_adapter", config.init_adapter):
            model = PeftModel.from_pretrained(
                base, config.init_adapter, adapter_name=POLICY, is_trainable=True, config=saved
            )
        if saved.r != config.lora_r:
            logger.warning("init_adapter has rank %d; config lora_r=%d is ignored", saved.r, config.lora_r)
    else:
        policy = lora_config(config) if lora is None else copy.deepcopy(lora)
        if lora is None:  # a peft_config given (the TRL front door) is the user's, as it stands
            policy.exclude_modules = other_towers(base)
        if policy.target_modules is not None:  # None: peft's default for the model type
            # an entry matching nothing, with the closest names
            check_target_modules(base, policy.target_modules)
        model = get_peft_model(base, policy, adapter_name=POLICY, autocast_adapter_dtype=True)
    # The largest rank of any layer (an adapter may carry a per-module rank_pattern).
    ranks = sorted({m.lora_A[POLICY].weight.shape[0] for _, m in lora_layers(model, (POLICY,))})
    policy_rank = ranks[-1]
    default = default_ref_rank(config.lora_r, config.ref_sync_mode)
    if config.init_adapter and policy_rank != config.lora_r and config.ref_rank == default:
        # lora_r is ignored for a warm start, so ref_rank's default follows the adapter's own rank
        config.ref_rank = default_ref_rank(policy_rank, config.ref_sync_mode)
        logger.info("ref_rank %d: the default for init_adapter's rank %d", config.ref_rank, policy_rank)
    if config.ref_rank < policy_rank and (config.init_adapter or config.ref_sync_alpha == 1):
        raise ValueError(
            f"ref_rank={config.ref_rank} is below the policy adapter's rank {policy_rank}: the reference slot could "
            "not hold an exact copy of the policy. Set ref_rank ≥ the policy rank (default 2 × lora_r)."
        )
    if config.ref_sync_mode == "factors" and len(ranks) > 1:
        raise ValueError(
            f"ref_sync_mode='factors' blends A and B layer by layer, so every layer of the policy must have "
            f"the slot's rank; this adapter's layers have ranks {ranks} (a rank_pattern). Use ref_sync_mode: exact"
        )
    if config.ref_sync_mode == "factors" and config.ref_rank != policy_rank:
        raise ValueError(
            f"ref_sync_mode='factors' needs ref_rank == the policy rank ({policy_rank}), got {config.ref_rank}"
        )
    model.add_adapter(REFERENCE, reference_lora_config(model.peft_config[POLICY], config.ref_rank))
    model.set_adapter(POLICY)
    # the base's model_tags: peft's card of a script's trainer.model.save_pretrained lists them
    model.add_model_tags(list(TAGS))
    # Adapter weights in float32 (peft does this for the policy; do it for the slot too), so that
    # syncs and the optimizer work at full precision whatever the base dtype.
    model.requires_grad_(False)
    for _, m in lora_layers(model):
        for adapter in (POLICY, REFERENCE):
            for param in (m.lora_A[adapter].weight, m.lora_B[adapter].weight):
                param.data = param.data.float()
                param.requires_grad_(adapter == POLICY)
    check_syncable(model)
    if config.init_adapter:
        sync_reference(model, alpha=1.0)  # the initial reference = the warm-start policy, exactly
        attach_base_slot(model)  # what eval/kl_to_base measures from
    elif config.ref_sync_mode == "factors":
        # The factor blend mixes A and B name by name: from a copy of the policy's factors (B = 0, so still ΔW_ref
        # = 0), as a parameter EMA starts, a blend is near the weight-space mix; from A_ref = 0 the first ones
        # fell short by α (α² ΔW_policy after one).
        sync_reference(model, 1.0, "factors")
    else:
        # A fresh policy has B = 0, so ΔW_policy = 0: an all-zero slot is its exact copy, at any ref_rank.
        with torch.no_grad():
            for _, m in lora_layers(model):
                m.lora_A[REFERENCE].weight.zero_()
                m.lora_B[REFERENCE].weight.zero_()
    return model


def attach_base_slot(model: nn.Module) -> None:
    """A third, frozen adapter "base": a copy of the policy as it is now (the warm-start adapter),
    with the policy's own config and scaling, so its forward is bit-identical to the initial
    policy's. eval/kl_to_base measures from it (adapters.base_forward). The reference slot cannot
    serve (syncs move it), and the policy tensors cannot be swapped out and back around a forward
    without risking the trained ones; one adapter's worth of memory (a few MB) buys neither risk.
    Not saved in checkpoints: a resumed run rebuilds it from init_adapter."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    slot = copy.deepcopy(model.peft_config[POLICY])
    slot.lora_dropout = 0.0  # eval forwards only (dropout is off in eval mode anyway)
    model.add_adapter(BASE, slot)
    model.set_adapter(POLICY)
    for p, flag in flags:
        p.requires_grad_(flag)
    with torch.no_grad():
        for _, m in lora_layers(model, (POLICY, BASE)):
            for factors in (m.lora_A, m.lora_B):
                factors[BASE].weight.data = factors[POLICY].weight.detach().clone()
                factors[BASE].weight.requires_grad_(False)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    # Non-reentrant checkpointing needs no input-requires-grad hook and works on 4-bit bases.
    kwargs = {"use_reentrant": False}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_enable"):  # transformers ≥ 5.x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers registers that hook anyway (enable_input_require_grads: `output.requires_grad_()`
    # on the embeddings' output); it runs in every forward, the compiled decode step's too, where
    # dynamo before torch 2.13 breaks the graph at it (7 breaks on the first GPU run, issue 48).
    if hasattr(base, "disable_input_require_grads"):
        base.disable_input_require_grads()


def disable_gradient_checkpointing(model: nn.Module) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_disable"):  # transformers ≥ 5.x name
        base.activation_checkpointing_disable()
    else:
        base.gradient_checkpointing_disable()


def set_gradient_checkpointing(model: nn.Module, on: bool) -> None:
    (enable_gradient_checkpointing if on else disable_gradient_checkpointing)(model)


def load_model(config: GRPOConfig, device_map=None):
    """Base + both adapters, and the tokenizer: what the trainer trains. Returns (model, tokenizer)."""
    path = resolve_model_path(config)
    tokenizer = load_tokenizer(config, path)
    base = load_base_model(config, path, device_map=device_map)
    model = attach_adapters(base, config)
    # 'auto' is decided by the trainer's memory probe (memory/probe.py)
    if config.gradient_checkpointing is True:
        enable_gradient_checkpointing(model)
    return model, tokenizer
