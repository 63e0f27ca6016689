"""A checkpoint written by an earlier lora_grpo resumes with today's code and continues its run.

tests/fixtures/checkpoint_e7b67b7/ holds one written before issue 46's folders move (commit e7b67b7, by the
write_it.py beside it: run there with that commit's code, as its docstring says). What a checkpoint holds
names no module of ours (trainer_state.pt unpickles only tensors and plain values, weights_only; the
adapters are peft's files; trainer_state.json and config.yaml are plain data), so a module's move cannot
break it; what can is a field of the state, the process state or the config read under another name or
shape, which is what this test meets. The checkpoint lies inside a generation (the next step trains on
the saved rollout's rows) and the step after samples again from the restored generators.
"""

import importlib.util
import json
import math
import shutil
from pathlib import Path

from safetensors.torch import load_file

from lora_grpo.model.adapters import POLICY

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_e7b67b7"


def _writer():
    """The fixture's write_it.py as a module: its settings, reward, base and record helpers."""
    spec = importlib.util.spec_from_file_location("checkpoint_e7b67b7_writer", FIXTURE / "write_it.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _close(a, b) -> bool:
    """Equal; floats within 1e-4 relative (another CPU's kernels may round the last bits otherwise)."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    return a == b


def completions_per_generation(settings) -> int:
    """The completions of one generation, over which its reward metrics are taken."""
    return settings["prompts_per_step"] * settings["num_generations"] * settings["steps_per_generation"]


def test_a_checkpoint_from_before_the_folders_move_resumes_and_continues_its_run(tmp_path, monkeypatch):
    writer = _writer()
    expected = json.loads((FIXTURE / "expected.json").read_text())
    # The base and the run under the relative names the checkpoint was written with.
    monkeypatch.chdir(tmp_path)
    writer.make_base()
    assert writer.base_digest() == expected["base"], (
        "save_tiny_base builds another base than the one the fixture was trained on: the continuation "
        "cannot be compared"
    )
    shutil.copytree(FIXTURE / "checkpoint-1", tmp_path / "run" / "checkpoint-1")

    trainer = writer.make_trainer(resume_from_checkpoint="latest")
    trainer.train()

    history = writer.comparable(trainer.state.log_history)
    assert trainer.state.global_step == 3 and len(history) == 3
    # Step 1 is the checkpoint's own record, read back exactly.
    assert history[0] == expected["history"][0]
    # Steps 2 (on the saved rollout) and 3 (sampled again) are those of the run that wrote the checkpoint. Its
    # reward std was the population std; today's is the sample std (n - 1, as TRL's) of the generation's n.
    n = completions_per_generation(writer.SETTINGS)
    for step, (got, want) in enumerate(zip(history[1:], expected["history"][1:]), start=2):
        want = {k: v * math.sqrt(n / (n - 1)) if k.endswith("/std") else v for k, v in want.items()}
        assert got.keys() == want.keys(), f"step {step}: {sorted(got.keys() ^ want.keys())}"
        differ = {k: (got[k], want[k]) for k in want if not _close(got[k], want[k])}
        assert not differ, f"step {step} differs from the run that wrote the checkpoint: {differ}"
    # Both adapters end where that run's ended.
    saved = load_file(str(FIXTURE / "expected_adapters.safetensors"))
    # (the fixture names the policy's parameters by its in-memory adapter name of then, "policy"; peft's "default"
    # since: its files on disk, which the resume read, are named alike)
    now = {k.replace(f".{POLICY}.", ".policy."): v for k, v in writer.adapters(trainer.model).items()}
    assert now.keys() == saved.keys()
    # Each tensor within 1e-4 of its norm: kernels of other library versions round the last bits otherwise
    # (peft 0.21.2 / transformers 5.25 against the fixture's: 2.2e-5 at most), while a step lost or replayed
    # moves an adapter by a whole Adam step, orders of magnitude more.
    for name in saved:
        drift = float((now[name] - saved[name]).norm() / saved[name].norm())
        assert drift <= 1e-4, f"{name}: {drift:.2e} of its norm from where the run that wrote it ended"
