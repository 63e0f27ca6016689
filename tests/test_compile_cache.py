"""The compile cache (lora_grpo/rollout/compile_cache.py): torch's cache artifacts written under lora_grpo's
cache directory, keyed by torch / Triton / device, read back before a process's first compile;
failures warn and never stop; the compiled decode loads before it compiles and saves after each new
shape's first step."""

import logging

import pytest
import torch

from lora_grpo.rollout import compile_cache

CPU = torch.device("cpu")


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_GRPO_CACHE", str(tmp_path))
    monkeypatch.delenv(compile_cache.SWITCH, raising=False)
    monkeypatch.setattr(compile_cache, "_LOADED", set())
    monkeypatch.setattr(compile_cache, "_WRITTEN", {})
    return tmp_path


def test_the_key_names_torch_triton_and_the_device(monkeypatch):
    assert compile_cache.cache_key(CPU).startswith(f"torch-{torch.__version__}_triton-")
    assert compile_cache.cache_key(CPU).endswith("_cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert compile_cache.cache_key(torch.device("cuda", 0)).endswith("_NVIDIA-H200-sm90")


def test_what_inductor_compiled_is_written_and_read_back(cache_home, caplog):
    """A tiny function through inductor on the CPU (the path the compiled decode takes, in seconds
    once inductor's own /tmp cache is warm: its hits are saved too)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)
    torch.testing.assert_close(compiled(torch.ones(8)), torch.sin(torch.ones(8)) * 2 + 1)
    path = compile_cache.save(CPU)
    assert path is not None and path.parent == cache_home / "compile" / compile_cache.cache_key(CPU)
    assert path.stat().st_size > 0
    assert compile_cache.save(CPU) == path  # the same bytes: the same file, not written again
    assert len(list(path.parent.glob("*.bin"))) == 1
    with caplog.at_level(logging.INFO, logger="lora_grpo.rollout.compile_cache"):
        assert compile_cache.load(CPU) >= 1  # at least inductor's compiled graph
    assert "artifacts loaded from" in caplog.text
    assert compile_cache.load(CPU) == 0  # once per process


def test_an_unreadable_file_or_an_unwritable_folder_warns_and_the_run_goes_on(
    cache_home, monkeypatch, caplog
):
    folder = compile_cache.cache_dir(CPU)
    folder.mkdir(parents=True)
    (folder / "broken.bin").write_bytes(b"not torch's artifacts")
    with caplog.at_level(logging.WARNING, logger="lora_grpo.rollout.compile_cache"):
        assert compile_cache.load(CPU) == 0
    assert "broken.bin" in caplog.text and "compiling as usual" in caplog.text
    caplog.clear()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    (cache_home / "compile").rename(cache_home / "moved")
    (cache_home / "compile").write_text("a file where the folder goes")
    with caplog.at_level(logging.WARNING, logger="lora_grpo.rollout.compile_cache"):
        assert compile_cache.save(CPU) is None
    assert "could not save" in caplog.text


def saving(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (data, None))


def test_the_switch_turns_it_off(cache_home, monkeypatch):
    saving(monkeypatch, b"artifacts")
    monkeypatch.setenv(compile_cache.SWITCH, "0")
    assert compile_cache.save(CPU) is None and compile_cache.load(CPU) == 0
    assert not (cache_home / "compile").exists()
    monkeypatch.setenv(compile_cache.SWITCH, "1")
    assert compile_cache.save(CPU) is not None


def test_a_process_leaves_one_file_and_the_newest_files_stay(cache_home, monkeypatch):
    # torch's artifacts accumulate over a process: its later file holds the earlier one
    saving(monkeypatch, b"step 1's graph")
    first = compile_cache.save(CPU)
    saving(monkeypatch, b"step 1's graph and the eval's")
    second = compile_cache.save(CPU)
    assert not first.exists() and list(second.parent.glob("*.bin")) == [second]
    # other processes' files (this one's record forgotten each time) stay, up to MAX_FILES
    for i in range(compile_cache.MAX_FILES + 2):
        monkeypatch.setattr(compile_cache, "_WRITTEN", {})
        saving(monkeypatch, b"process %d" % i)
        compile_cache.save(CPU)
    assert len(list(compile_cache.cache_dir(CPU).glob("*.bin"))) == compile_cache.MAX_FILES
