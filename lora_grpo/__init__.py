"""lora_grpo: GRPO through LoRA/QLoRA adapters, with iterative GRPO via a reference slot.

The math modules (advantages, loss, logprobs, reference) import only torch, so they can be used
and tested without loading any model. ``GRPOConfig``, ``GRPOTrainer`` and ``export_gguf`` (a trained run
as one GGUF file) are imported lazily.
"""

__version__ = "0.1.0"

__all__ = ["GRPOConfig", "GRPOTrainer", "export_gguf", "__version__"]


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
