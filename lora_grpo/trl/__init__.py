"""The TRL front door: a TRL GRPO script runs here with one changed import line.

    from lora_grpo.trl import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

The script helpers TRL's examples import on the same line come from here too (TRL not needed): ModelConfig,
ScriptArguments, DatasetMixtureConfig, TrlParser, get_peft_config, get_quantization_config, get_dataset
(script.py, script_data.py).

`GRPOConfig` has TRL 1.16's fields, names and defaults (transformers' TrainingArguments underneath);
`GRPOTrainer` TRL's signature, step counting, callbacks (transformers' CallbackHandler), save_model
and resume. Each is a translation onto lora_grpo's own config and trainer (translate.py: the table
of what becomes of every field); TRL itself is not needed. What TRL refuses, `sync_ref_model=True`
with a `peft_config`, is lora_grpo's reference slot: the LoRA reference, synced exactly in weight space.
"""

from .config import GRPOConfig
from .script import (
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_peft_config,
    get_quantization_config,
)
from .script_data import DatasetMixtureConfig, get_dataset
from .trainer import GRPOTrainer
from .translate import FIELDS

__all__ = [
    "FIELDS",
    "DatasetMixtureConfig",
    "GRPOConfig",
    "GRPOTrainer",
    "ModelConfig",
    "ScriptArguments",
    "TrlParser",
    "get_dataset",
    "get_peft_config",
    "get_quantization_config",
]
