"""lora_grpo: GRPO through LoRA/QLoRA adapters, with iterative GRPO via a reference slot.

The math modules (advantages, loss, logprobs, reference) import only torch, so they can be used
and tested without loading any model. ``GRPOConfig``, ``GRPOTrainer`` and ``export_gguf`` (a trained run
as one GGUF file) are imported lazily.
"""

import logging as _logging

__version__ = "0.1.0"

__all__ = ["GRPOConfig", "GRPOTrainer", "export_gguf", "__version__"]


def _unused_kernel_notice(record: _logging.LogRecord) -> bool:
    """False for bitsandbytes' notice that it could not fetch its fused CPU kernel for packed 4-bit weights.

    Imported on a CPU with AVX512-BF16 (Zen 4 and 5, Sapphire Rapids), bitsandbytes asks the hub's
    kernels-community for that kernel and, where it gets none (offline, or the kernels package's trust check),
    warns "Failed to load CPU gemm_4bit_forward from kernels-community ... pip install kernels" on every run. The
    kernel serves only the packed path that model/load.py's keep_4bit_weights_fixed turns off, so the advice
    would send a user after something lora_grpo never uses. Every other record passes."""
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


# Here, before anything imports bitsandbytes (it warns at import; peft and TRL's config import it too).
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_unused_kernel_notice)


def __getattr__(name):
    if name == "GRPOConfig":
        from .config import GRPOConfig

        return GRPOConfig
    if name == "GRPOTrainer":
        from .trainer import GRPOTrainer

        return GRPOTrainer
    if name == "export_gguf":
        from .export import export_gguf

        return export_gguf
    raise AttributeError(f"module 'lora_grpo' has no attribute {name!r}")
