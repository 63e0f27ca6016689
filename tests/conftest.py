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

    return save_tiny_base(tmp_path_factory.mktemp("tiny_base"), max_positions=1024)  # room for the GPU recipes' lengths


def run_torchrun(script, *args, nproc: int = 2, timeout: int = 300):
    """Run `script` under torchrun on CPU (gloo; what `accelerate launch` sets up on GPUs); skip the
    test where gloo is unavailable, fail with the processes' stderr when the run fails."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), str(script), *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0 and "gloo" in result.stderr.lower() and "unavailable" in result.stderr.lower():
        pytest.skip("torch.distributed gloo backend unavailable")
    assert result.returncode == 0, result.stderr[-3000:]
    return result
