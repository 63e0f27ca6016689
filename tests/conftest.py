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


def write_recipe(tmp_path, base_dir, rows: int = 8, **fields) -> "os.PathLike":
    """A recipe YAML for the tiny model over `rows` local "i+1" questions (answer column), with `fields` on top."""
    import json

    import yaml

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(rows)))
    recipe = dict(model_name_or_path=str(base_dir), dataset=str(data), eval_dataset=str(data),
                  prompt_template="Q: {question} A:", reward_funcs=["accuracy"], num_generations=2, prompts_per_step=2,
                  max_completion_length=4, gradient_checkpointing=False, lora_r=4, output_dir=str(tmp_path / "run"))
    recipe.update(fields)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path
