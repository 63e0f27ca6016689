"""What depends on the accelerator, decided in one place: the dtype 'auto' picks, whether compiling
the decode step pays, a clock that waits for the GPU, putting a model on the device a process
trains on, how CUDA's caching allocator is set up, and how much memory there is and a pass takes
(memory/probe.py plans with these).

Every decision reads torch.cuda through its public functions when it is made (no cached globals),
so a test can monkeypatch torch.cuda.is_available / get_device_capability / get_device_name and
check what a T4, an A100 or an H200 would get, on a CPU machine. The one exception is the
allocator's setting, decided once when this module is imported (use_expandable_segments): it must
come before CUDA starts.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

MiB = 2**20
GiB = 2**30  # a card's "8 GB" is 8 GiB

# bf16 arithmetic in hardware from Ampere (sm_80) on. Below it (Volta 7.0, Turing 7.5: V100, T4,
# RTX 20xx) torch.cuda.is_bf16_supported() still answers True, because bf16 can be emulated
# through float32: slower than float32 itself, and Triton does not compile bf16 there at all.
NATIVE_BF16_CAPABILITY = (8, 0)
# Triton, inductor's GPU code generator, targets sm_70 and newer.
TRITON_CAPABILITY = (7, 0)


def _capability(device: torch.device | None = None) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def describe_gpu(device: torch.device | None = None) -> str:
    """'NVIDIA H200 (compute capability 9.0)': for the lines that say what was chosen and why."""
    major, minor = _capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def native_bf16(device: torch.device | None = None) -> bool:
    """Whether the GPU computes bfloat16 in hardware (False without CUDA)."""
    if not torch.cuda.is_available():
        return False
    if torch.version.hip:  # every ROCm GPU torch supports has bf16
        return True
    return _capability(device) >= NATIVE_BF16_CAPABILITY


def auto_dtype(device: torch.device | None = None) -> tuple[torch.dtype, str]:
    """torch_dtype 'auto' → (dtype, the reason in words): bfloat16 where the GPU computes it
    natively, float32 everywhere else, a CPU `device` included (use_cpu on a GPU machine). Never
    float16, whose range (±65504) some models' activations exceed: a choice the user makes
    (torch_dtype float16, the loss then scaled: optim.LossScale), which the reason suggests on GPUs
    without bf16."""
    if not torch.cuda.is_available():
        return torch.float32, "no CUDA device"
    if device is not None and torch.device(device).type != "cuda":
        return torch.float32, f"the run is on {torch.device(device).type} (use_cpu)"
    gpu = "ROCm GPU" if torch.version.hip else describe_gpu(device)
    if native_bf16(device):
        return torch.bfloat16, f"native on {gpu}"
    return torch.float32, (
        f"{gpu} has no native bfloat16 (it would be emulated, slower than float32); torch_dtype "
        "float16 computes on its tensor cores (the loss is scaled) where the model's activations fit float16"
    )


def mixed_precision_dtype(mixed_precision: str | None, torch_dtype: str, device_type: str) -> str:
    """The torch_dtype a run uses under accelerate's `mixed_precision` (`accelerate launch
    --mixed_precision`, its config file, or ACCELERATE_MIXED_PRECISION). lora_grpo does not autocast:
    the model computes in torch_dtype. So "bf16" is honoured as torch_dtype bfloat16 and "fp16" as
    float16 with a scaled loss (when torch_dtype is auto or that dtype; fp16 on a `device_type` other
    than cuda changes nothing, as in accelerate, which neither autocasts nor scales there), and
    everything else that is not "no" is refused by name (ValueError)."""
    if mixed_precision in (None, "no"):
        return torch_dtype
    if mixed_precision == "fp16" and device_type != "cuda":
        return torch_dtype
    wanted = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision)
    if wanted is None:
        raise ValueError(
            f"accelerate's mixed_precision={mixed_precision} is not supported: lora_grpo does not autocast "
            "(the model computes in torch_dtype). Launch with --mixed_precision no, bf16 or fp16, and set "
            "torch_dtype"
        )
    if torch_dtype not in ("auto", wanted):
        raise ValueError(
            f"accelerate's mixed_precision={mixed_precision} and torch_dtype={torch_dtype} disagree: lora_grpo does "
            f"not autocast, the model computes in torch_dtype. Set torch_dtype to {wanted} (or auto), or "
            "launch with --mixed_precision no"
        )
    return wanted


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def compile_pays(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether decode_mode 'auto' should compile the decode step on `device` for a model of `dtype`
    (its embedding dtype), and why, in words.

    Compiling pays only through CUDA graphs: one launch per token instead of hundreds of small
    kernels. On a CPU inductor takes tens of seconds per shape and its step was no faster than the
    eager one (benchmarks/rollout_speed.py). On a GPU Triton cannot serve, inductor skips the
    frame with a warning, and the static sampler then runs uncompiled over padded slots: slower than
    the eager sampler, which also drops finished rows.
    """
    if device.type != "cuda":
        return False, f"on {device.type} compiling costs tens of seconds per shape and buys no speed"
    if not _triton_installed():
        return False, "Triton is not installed, so inductor cannot compile for this GPU"
    gpu = describe_gpu(device)
    if _capability(device) < TRITON_CAPABILITY:
        return False, f"{gpu} is older than Triton supports (compute capability 7.0)"
    if dtype == torch.bfloat16 and not native_bf16(device):
        return False, f"{gpu} has no native bfloat16, which Triton does not compile"
    return True, f"{gpu}: CUDA graphs of the compiled decode step"


# ------------------------------------------------------------------------------ the allocator
# The variables torch's caching allocator reads its settings from (PYTORCH_ALLOC_CONF is the newer
# name, PYTORCH_CUDA_ALLOC_CONF the one every torch 2.x reads). Either set means the user chose.
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"
# What use_expandable_segments decided when this module was imported (allocator_setting says it).
_ALLOCATOR = {"set": False, "why": "not decided"}


def use_expandable_segments(environ=os.environ) -> bool:
    """Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True when the user set neither allocator
    variable and CUDA has not started; True when it was set here. Called once, when lora_grpo's
    device module is imported: before the trainer loads a model, and before any CUDA work of a
    script that imports lora_grpo first.

    Why: the caching allocator keeps each freed block in its segment, so what the rollout, the update
    and the eval free stays reserved in pieces the next stage cannot always use; on an emulated 8 GB
    card the reserved peaks ran 1.7 % and 8 % over the memory plan while the allocated ones stayed
    within it (issue 48). Expandable segments map one growing segment per stream, and freed pages
    serve any later size. CUDA graphs (the compiled decode's "reduce-overhead") work with them: their
    private pools take expandable segments too (PyTorch #128068, since torch 2.4).

    When it takes effect: torch reads the variable when its allocator's settings are first used (the
    first CUDA allocation or initialisation), not at `import torch`, so setting it after the import
    works until then. A variable the user set, with or without expandable_segments (another backend,
    max_split_size_mb, ...), is left as it is: their choice, and the plan then counts whatever it
    reserves (memory/probe.py measures reserved bytes). ROCm builds are left alone too (expandable
    segments need ROCm 7)."""
    given = [name for name in ALLOC_CONF_VARIABLES if name in environ]
    if given:
        why = ", ".join(f"{name}={environ[name]}" for name in given) + " (yours, left as it is)"
    elif torch.version.cuda is None or torch.version.hip:
        why = "not a CUDA build of torch"
    elif torch.cuda.is_initialized():
        why = (
            "the default caching allocator: CUDA started before lora_grpo was imported, too late to set "
            f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS} (set it before your script starts CUDA)"
        )
    else:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
        _ALLOCATOR.update(set=True, why=f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS} (set by lora_grpo)")
        logger.info("CUDA allocator: %s", _ALLOCATOR["why"])
        return True
    _ALLOCATOR.update(set=False, why=why)
    logger.info("CUDA allocator: %s", why)
    return False


def allocator_setting() -> str:
    """What the CUDA caching allocator runs with, in words, for the run's start-up line."""
    return _ALLOCATOR["why"]


use_expandable_segments()


# ------------------------------------------------------------------------------ time
def synchronize(device: torch.device | str) -> None:
    """Wait until the device has run every kernel queued so far. CUDA launches asynchronously: a
    clock read right after a stage measures its launches, and the next stage pays for its work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str) -> float:
    """time.perf_counter() after the device's queued work is done: stage timings that mean what they say."""
    synchronize(device)
    return time.perf_counter()


# ------------------------------------------------------------------------------ placement
def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.index is not None and b.index is not None:
        return a.index == b.index
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()  # "cuda" without an index is the current device
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def quantization_of(model: nn.Module) -> str | None:
    """'4-bit' / '8-bit' for a bitsandbytes-quantized model (or a peft model around one), else None."""
    for p in model.parameters():
        kind = {"Params4bit": "4-bit", "Int8Params": "8-bit"}.get(type(p).__name__)
        if kind:
            return kind
    if getattr(model, "is_loaded_in_4bit", False):
        return "4-bit"
    return "8-bit" if getattr(model, "is_loaded_in_8bit", False) else None


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Put a model the caller built on `device` (the one this process trains on), in place, or
    refuse with what to do. A bitsandbytes-quantized model is not moved: its weights and
    quantisation states are placed when it loads (and on a CPU their layout may already be the CPU
    kernel's). A model spread over several devices (device_map='auto') is not collapsed onto one."""
    device = torch.device(device)
    found = {t.device for t in [*model.parameters(), *model.buffers()]}
    if all(_same_device(d, device) for d in found):
        return model
    where = ", ".join(sorted(str(d) for d in found))
    if len(found) > 1:
        raise ValueError(
            f"the model passed to GRPOTrainer is spread over {where}; each lora_grpo process trains on one device "
            f"({device}). Load it whole on that device (device_map={{'': '{device}'}}), or pass model_name_or_path "
            "and let lora_grpo load it"
        )
    quantized = quantization_of(model)
    if quantized:
        raise ValueError(
            f"the model passed to GRPOTrainer is {quantized} (bitsandbytes) on {where}, but this process trains on "
            f"{device}, and quantized weights are not moved after loading. Load it on that device: "
            f"from_pretrained(..., quantization_config=..., device_map={{'': '{device}'}}), or pass "
            "model_name_or_path and let lora_grpo load it"
        )
    return model.to(device)


def optimizer_state_on_devices(saved: dict[str, Any], optimizer) -> dict[str, Any]:
    """A loaded optimizer state_dict with every per-parameter tensor on its parameter's device.

    torch's optimizers move states themselves when they load; bitsandbytes' 8-bit ones only cast
    them, so their buffers would stay on the CPU they were read onto. 'step' stays where it was
    saved: torch keeps it on the CPU unless the optimizer is fused or capturable, and moves it then."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved.get("param_groups", []) for i in group["params"]]
    device_of = {i: p.device for i, p in zip(ids, params)}

    def to(value, device):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        return {k: to(v, device) for k, v in value.items()} if isinstance(value, dict) else value

    state = {
        i: {k: v if k == "step" or i not in device_of else to(v, device_of[i]) for k, v in entry.items()}
        for i, entry in saved.get("state", {}).items()
    }
    return {**saved, "state": state}


# What a failed allocation says when it is not a torch.OutOfMemoryError: cuBLAS / cuSOLVER / cuDNN
# handles and workspaces are allocated outside torch's allocator and fail as RuntimeErrors.
ALLOCATION_FAILURES = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "CUDA error: out of memory",
)


# ------------------------------------------------------------------------------ memory
def available_bytes(device: torch.device) -> tuple[float, str]:
    """(bytes this process may still allocate, what they are). CUDA: free device memory plus what
    torch's caching allocator holds unused: the room for reserving more over what is allocated now,
    so a plan over the allocated bytes is checked against it in reserved bytes; less where the process
    is capped (torch.cuda.set_per_process_memory_fraction: the allocator refuses to reserve past
    total × fraction, whatever the device has free); CPU: the available RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        room = free + torch.cuda.memory_reserved(device) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
        if fraction < 1.0 and total * fraction - allocated < room:
            return float(total * fraction - allocated), (
                f"GPU memory this process may use (set_per_process_memory_fraction({fraction:g}))"
            )
        return float(room), "free GPU memory"
    import psutil

    return float(psutil.virtual_memory().available), "available RAM"


def release_cached_memory(device: torch.device) -> float:
    """Give the blocks torch's CUDA allocator caches unused back to the device, so that a pass
    measured next (measure_peak) starts from reserved ≈ allocated and its reserved growth is its own,
    not hidden by blocks an earlier, larger pass left cached. Returns what stays reserved over the
    allocated bytes (live segments' unused parts, which no empty_cache returns); 0 elsewhere."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return float(max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)))


def _release_freed_memory() -> None:
    # No gc.collect(): tensors are freed by reference counting, and a collection over a loaded
    # trainer's objects takes ~0.4 s.
    try:  # glibc keeps freed blocks; give them back so that the resident set is the live memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _PeakRss(threading.Thread):
    """Samples the process's resident set until stopped; torch's kernels release the GIL."""

    def __init__(self, interval: float = 0.0005):
        import psutil

        super().__init__(daemon=True)
        self.process, self.interval, self.done = psutil.Process(), interval, threading.Event()
        self.peak = self.rss()

    def rss(self) -> int:
        return self.process.memory_info().rss

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.rss())
            self.done.wait(self.interval)


def is_out_of_memory(error: BaseException) -> bool:
    """A failed allocation: torch's own OutOfMemoryError, or a CUDA library's (a RuntimeError)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(text in str(error) for text in ALLOCATION_FAILURES)
    )


def measure_peak(fn: Callable[[], None], device: torch.device) -> float:
    """Peak memory growth while fn runs, in bytes; inf when it runs out of memory. CUDA: the larger
    of the allocated and the reserved peak's growth (torch.cuda.max_memory_allocated /
    max_memory_reserved), i.e. in reserved bytes wherever the allocator takes more from the device
    than the pass holds (release_cached_memory first, so that cached blocks do not hide it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        failed = False
        try:
            fn()
            torch.cuda.synchronize(device)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(e):
                raise
            failed = True
        if failed:
            # Only here, after the except block: until then the traceback's frames hold the failed
            # pass's tensors, and empty_cache could not return their blocks to the device.
            gc.collect()
            torch.cuda.empty_cache()
            return math.inf
        # Reserved growth counts the blocks the pass took from the device, fragmentation included.
        return float(
            max(
                torch.cuda.max_memory_allocated(device) - allocated,
                torch.cuda.max_memory_reserved(device) - reserved,
            )
        )
    _release_freed_memory()
    sampler = _PeakRss()
    start = sampler.rss()
    sampler.start()
    try:
        fn()
    finally:
        sampler.done.set()
        sampler.join()
    return float(max(sampler.peak, sampler.rss()) - start)
