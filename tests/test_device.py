"""lora_grpo/device.py: the decisions that depend on the GPU (native bf16, whether compiling the
decode step pays), the synchronised clock and model placement, tested on a CPU with a mocked
torch.cuda (a T4, an A100, an H200)."""

import logging
import os

import pytest
import torch
from helpers import load_4bit
from torch import nn

from lora_grpo import device as device_module
from lora_grpo.device import auto_dtype, compile_pays, native_bf16, now, place_model
from lora_grpo.model.load import resolve_dtype

GPUS = {
    "Tesla V100": (7, 0),
    "Tesla T4": (7, 5),
    "NVIDIA A100": (8, 0),
    "NVIDIA H200": (9, 0),
    "Tesla P100": (6, 0),
}
CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """gpu(name): torch.cuda answers as if that GPU were device 0. torch.cuda.is_bf16_supported
    answers True on every one of them, as torch's does with bf16 emulation (the trap of defect 3)."""

    def use(name: str, triton: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: GPUS[name])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
        monkeypatch.setattr(device_module, "_triton_installed", lambda: triton)

    return use


# ------------------------------------------------------------------------------ dtype
# Failed before the fix (defect 3): torch_dtype auto took torch.cuda.is_bf16_supported(), which counts
# emulation, and gave bf16 to a T4.
@pytest.mark.parametrize(
    "name, expected",
    [
        ("Tesla T4", torch.float32),
        ("Tesla V100", torch.float32),
        ("NVIDIA A100", torch.bfloat16),
        ("NVIDIA H200", torch.bfloat16),
    ],
)
def test_auto_dtype_is_bfloat16_only_where_the_gpu_computes_it_natively(gpu, caplog, name, expected):
    gpu(name)
    assert native_bf16() == (expected == torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="lora_grpo.model.load"):
        assert resolve_dtype("auto") == expected
    [line] = [r for r in caplog.records if r.name == "lora_grpo.model.load"]
    assert (
        f"torch_dtype auto → {str(expected).removeprefix('torch.')}" in line.getMessage()
        and name in line.getMessage()
    )
    # float32 on a GPU is worth a warning: the user asked for "auto" and gets the slow dtype; it names the fast one
    assert line.levelno == (logging.WARNING if expected == torch.float32 else logging.INFO)
    assert ("torch_dtype float16 computes on its tensor cores" in line.getMessage()) == (
        expected == torch.float32
    )


# TRL's bf16=None is "not fp16"; here also "where the GPU computes bf16 natively" (device.native_bf16, not torch's
# is_bf16_supported, which a T4 answers True through emulation), and ROCm's GPUs all have it.
@pytest.mark.parametrize(
    "name, hip, bf16",
    [("Tesla T4", None, False), ("NVIDIA A100", None, True), ("AMD Instinct MI100", "6.2", True)],
)
def test_the_trl_front_doors_bf16_default_is_true_only_on_a_gpu_with_native_bf16(
    gpu, monkeypatch, tmp_path, name, hip, bf16
):
    from lora_grpo.trl import GRPOConfig

    gpu(name)
    monkeypatch.setattr(torch.version, "hip", hip)
    if hip:  # a ROCm GPU's capability reads as an old CUDA one
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert native_bf16() is bf16
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True).bf16 is bf16
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp16=True).bf16 is False


def test_auto_dtype_without_cuda_is_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_dtype() == (torch.float32, "no CUDA device") and not native_bf16()


def test_an_explicit_bfloat16_on_a_gpu_without_native_bf16_is_warned_about(gpu, caplog):
    gpu("Tesla T4")
    with caplog.at_level(logging.WARNING, logger="lora_grpo.model.load"):
        assert resolve_dtype("bfloat16") == torch.bfloat16  # what was asked for, with a warning
    assert any("emulated" in r.getMessage() and "Tesla T4" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ compiling
@pytest.mark.parametrize(
    "name, dtype, pays",
    [
        ("NVIDIA H200", torch.bfloat16, True),
        ("NVIDIA A100", torch.bfloat16, True),
        ("Tesla T4", torch.float32, True),  # Triton serves sm_75 in float32
        ("Tesla T4", torch.float16, True),  # and in float16
        ("Tesla T4", torch.bfloat16, False),  # but not emulated bf16: inductor would skip the frame
        ("Tesla P100", torch.float32, False),  # older than Triton
    ],
)
def test_compiling_the_decode_step_pays_only_where_triton_serves_the_gpu_and_dtype(gpu, name, dtype, pays):
    gpu(name)
    chosen, why = compile_pays(CUDA, dtype)
    assert chosen is pays and name in why


def test_compiling_does_not_pay_on_a_cpu_or_without_triton(gpu):
    assert compile_pays(torch.device("cpu"), torch.float32)[0] is False
    gpu("NVIDIA H200", triton=False)
    chosen, why = compile_pays(CUDA, torch.bfloat16)
    assert chosen is False and "Triton is not installed" in why


# ------------------------------------------------------------------------------ the clock
# Failed before the fix (defect 7): stage times read time.perf_counter() right after asynchronous launches.
def test_the_clock_waits_for_the_gpu_before_reading_the_time(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    monkeypatch.setattr(device_module.time, "perf_counter", lambda: events.append(("time", None)) or 42.0)
    assert now(CUDA) == 42.0
    assert events == [("sync", CUDA), ("time", None)]
    events.clear()
    assert now(torch.device("cpu")) == 42.0 and events == [("time", None)]  # nothing to wait for on a CPU


def test_sync_seconds_come_from_the_synchronised_clock(monkeypatch):
    """reference.sync_reference times the sync with device.now on the adapters' device (defect 7:
    it read time.perf_counter, which on a GPU times the launches of the sync's kernels)."""
    from lora_grpo.config import GRPOConfig
    from lora_grpo.model import reference
    from lora_grpo.model.load import attach_adapters
    from lora_grpo.tasks.toy import make_tiny_model, make_tokenizer

    tok = make_tokenizer()
    model = attach_adapters(
        make_tiny_model(tok, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, seed=0),
        GRPOConfig(model_name_or_path="tiny", lora_r=2, lora_alpha=4, gradient_checkpointing=False),
    )
    reads = []
    monkeypatch.setattr(reference, "now", lambda device: reads.append(device) or 10.0 * len(reads))
    metrics = reference.sync_reference(model, 0.5, "exact")
    assert reads == [torch.device("cpu")] * 2 and metrics["sync/seconds"] == 10.0


# ------------------------------------------------------------------------------ placement
def test_place_model_moves_a_plain_model_and_leaves_one_in_place():
    model = nn.Linear(4, 4)
    assert place_model(model, torch.device("cpu")) is model and model.weight.device.type == "cpu"
    place_model(model, torch.device("meta"))  # a device this CPU has besides its own: the move is real
    assert model.weight.device.type == "meta"


# Failed before the fix (defect 8): the trainer skipped a 4-bit model on the wrong device, and the
# probe batch and the sampling generator then met it on CUDA: a device-mismatch error.
def test_place_model_refuses_a_4bit_model_on_another_device_saying_how_to_load_it(tiny_base_dir):
    model = load_4bit(tiny_base_dir)
    with pytest.raises(ValueError) as e:
        place_model(model, CUDA)
    text = str(e.value)
    assert (
        "4-bit (bitsandbytes) on cpu" in text
        and "trains on cuda:0" in text
        and "device_map={'': 'cuda:0'}" in text
    )
    assert "model_name_or_path" in text
    assert all(p.device.type == "cpu" for p in model.parameters())  # untouched


def test_place_model_refuses_a_model_spread_over_devices():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    with pytest.raises(ValueError, match=r"spread over cpu, meta.*trains on one device"):
        place_model(model, torch.device("cpu"))


# ------------------------------------------------------------------------------ use_cpu, mixed_precision
# Failed before the fix: use_cpu on a GPU machine loaded a 4-bit base onto cuda:0 (then refused it), and
# torch_dtype auto picked the GPU's bfloat16 for the CPU run.
def test_use_cpu_on_a_gpu_machine_gets_float32_and_the_cpu_device_map(gpu, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    from lora_grpo import GRPOConfig
    from lora_grpo.model.load import load_base_model

    gpu("NVIDIA H200")
    assert auto_dtype(torch.device("cpu"))[0] == torch.float32 and auto_dtype(CUDA)[0] == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger="lora_grpo.model.load"):
        assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert not caplog.records  # float32 on the CPU is no GPU's slow path: nothing to warn about
    passed = {}

    def from_pretrained(path, **kwargs):
        passed.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    config = GRPOConfig(model_name_or_path="some/model", quantization="4bit", use_cpu=True)
    with pytest.raises(RuntimeError, match="stop here"):
        load_base_model(config, device_map={"": torch.device("cpu")})  # what the trainer passes under use_cpu
    assert passed["device_map"] == {"": torch.device("cpu")} and passed["dtype"] == torch.float32
    assert passed["quantization_config"].bnb_4bit_compute_dtype == torch.float32


def test_accelerates_mixed_precision_is_honoured_as_the_dtype_or_refused_by_name():
    from lora_grpo.device import mixed_precision_dtype

    assert mixed_precision_dtype("no", "auto", "cuda") == "auto"
    assert mixed_precision_dtype(None, "float32", "cuda") == "float32"
    assert (
        mixed_precision_dtype("bf16", "auto", "cuda")
        == mixed_precision_dtype("bf16", "bfloat16", "cpu")
        == "bfloat16"
    )
    assert (
        mixed_precision_dtype("fp16", "auto", "cuda")
        == mixed_precision_dtype("fp16", "float16", "cuda")
        == "float16"
    )
    # accelerate neither autocasts to float16 nor scales on a CPU: fp16 changes nothing there
    assert mixed_precision_dtype("fp16", "auto", "cpu") == "auto"
    assert mixed_precision_dtype("fp16", "float16", "cpu") == "float16"
    assert mixed_precision_dtype("fp16", "float32", "cpu") == "float32"
    with pytest.raises(ValueError, match="mixed_precision=bf16 and torch_dtype=float32 disagree"):
        mixed_precision_dtype("bf16", "float32", "cuda")
    with pytest.raises(ValueError, match="mixed_precision=fp16 and torch_dtype=bfloat16 disagree.*float16"):
        mixed_precision_dtype("fp16", "bfloat16", "cuda")
    with pytest.raises(ValueError, match="mixed_precision=fp8 is not supported.*--mixed_precision no"):
        mixed_precision_dtype("fp8", "auto", "cuda")


def test_the_trainer_reads_accelerates_mixed_precision(tiny_base_dir, tmp_path, monkeypatch):
    """Read from accelerate (its refusals: the test above); fp16 on this CPU is float32 with no loss scale, as in
    accelerate, which neither autocasts nor scales on a CPU."""
    from accelerate.state import AcceleratorState
    from helpers import make_trainer

    monkeypatch.setenv(
        "ACCELERATE_MIXED_PRECISION", "fp16"
    )  # what `accelerate launch --mixed_precision fp16` sets
    AcceleratorState._reset_state(
        reset_partial_state=True
    )  # accelerate reads it once per process: as a fresh one
    try:
        trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none")
        assert trainer.accelerator.mixed_precision == "fp16"
        assert trainer.model.get_input_embeddings().weight.dtype == torch.float32
        assert not trainer.state.loss_scale.enabled
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# ------------------------------------------------------------------------------ the allocator
# cuda_build: conftest.py
def test_expandable_segments_are_set_when_the_user_set_no_allocator_variable(cuda_build):
    assert device_module.use_expandable_segments() is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    assert device_module.allocator_setting() == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by lora_grpo)"
    )


@pytest.mark.parametrize(
    "name,value",
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
        ("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync"),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),
    ],
)
def test_a_users_allocator_variable_is_left_as_it_is(cuda_build, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert device_module.use_expandable_segments() is False
    assert os.environ[name] == value
    assert [n for n in device_module.ALLOC_CONF_VARIABLES if n in os.environ] == [name]
    assert device_module.allocator_setting() == f"{name}={value} (yours, left as it is)"


def test_nothing_is_set_once_cuda_started_or_on_a_cpu_build(cuda_build, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert device_module.use_expandable_segments() is False
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert "too late" in device_module.allocator_setting()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert device_module.use_expandable_segments() is False and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    # A ROCm build (torch.version.hip; its cuda attribute may name a version too): left alone as well
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert device_module.use_expandable_segments() is False and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_the_variable_is_not_read_at_import_torch_so_setting_it_afterwards_works():
    """What use_expandable_segments relies on: torch reads the allocator's settings when they are
    first used, not at `import torch` (checked on this build's device-independent settings)."""
    import subprocess
    import sys

    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("this torch has no device-independent allocator settings to read")
    code = (
        "import os, torch\n"
        "x = torch.ones(256, 256) @ torch.ones(256, 256)\n"
        "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n"
        "print(torch._C._accelerator_getAllocatorSettings())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in device_module.ALLOC_CONF_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "expandable_segments:True"
