import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory):
    """A tiny random Llama-style model and char tokenizer saved to disk, built once per session."""
    from lora_grpo.toy import save_tiny_base

    return save_tiny_base(tmp_path_factory.mktemp("tiny_base"))
