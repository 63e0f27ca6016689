"""The session's fixtures: the tiny bases every test file may ask for (built once per session), and the
environment every test runs in (offline, a thread budget). The shared helpers are in helpers.py
(`from helpers import make_trainer`)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# torch.compile's artifacts stay out of ~/.cache/lora_grpo (tests/test_compile_cache.py turns it on)
os.environ.setdefault("LORA_GRPO_COMPILE_CACHE", "0")
# Two threads, or one per worker when pytest-xdist runs several (two workers share CI's two cores).
torch.set_num_threads(
    1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else min(2, torch.get_num_threads())
)


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory):
    """A tiny random Llama-style model and char tokenizer saved to disk, built once per session."""
    from lora_grpo.tasks.toy import save_tiny_base

    # max_positions: room for the GPU recipes' lengths
    return save_tiny_base(tmp_path_factory.mktemp("tiny_base"), max_positions=1024)


@pytest.fixture(scope="session")
def qwen_tool_base_dir(tmp_path_factory):
    """A tiny random Llama-style model with qwen_style_tokenizer, saved once per session."""
    from helpers import qwen_style_tokenizer

    from lora_grpo.tasks.toy import make_tiny_model

    path = tmp_path_factory.mktemp("qwen_tool_base")
    tok = qwen_style_tokenizer()
    make_tiny_model(tok, max_positions=2048).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def toy_base():
    """The default recipe's toy base (pre-trained on noisy sums, ~40 s on CPU): the entry in the machine's
    cache that `lora-grpo train` uses too, built once for every test worker and later run."""
    from lora_grpo.tasks.toy import ensure_toy_base

    return ensure_toy_base()


@pytest.fixture
def cuda_build(monkeypatch):
    """A CUDA build of torch whose CUDA has not started; both allocator variables unset (what
    lora_grpo.device.use_expandable_segments decides on: tests/test_device.py, test_gpu_check.py)."""
    from lora_grpo import device

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(device, "_ALLOCATOR", {"set": False, "why": "not decided"})
    for name in device.ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_hub(monkeypatch):
    """The hub, recorded instead of reached (helpers.FakeHub): tests that push."""
    from helpers import FakeHub

    return FakeHub().install(monkeypatch)
