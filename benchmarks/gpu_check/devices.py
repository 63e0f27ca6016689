"""Section 1, devices: what device.py decides here (torch_dtype auto, whether decode_mode auto
compiles), the versions and where each package was imported from."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks._common import environment
from benchmarks.gpu_check.harness import Run


def check_devices(run: Run) -> None:
    import bitsandbytes
    import peft
    import transformers

    from lora_grpo.device import _triton_installed, auto_dtype, compile_pays, describe_gpu

    device = run.device
    print(environment(transformers, peft, bitsandbytes))
    print(f"device: {describe_gpu(device) if run.cuda else 'CPU'}; Triton installed: {_triton_installed()}")
    dtype, why = auto_dtype()
    print(f"torch_dtype auto → {str(dtype).removeprefix('torch.')} ({why})")
    import lora_grpo

    # Where each package came from: the bundle installed beside the image (/tmp/site), the image, the checkout.
    places = {
        m.__name__: str(Path(m.__file__).parent.parent)
        for m in (torch, transformers, peft, bitsandbytes, lora_grpo)
    }
    print("imported from: " + ", ".join(f"{name} {place}" for name, place in places.items()))
    run.findings.update(
        {
            "imported_from": places,
            "versions": {m.__name__: m.__version__ for m in (torch, transformers, peft, bitsandbytes)},
            "torch_dtype_auto": str(dtype).removeprefix("torch."),
        }
    )
    for candidate in (torch.bfloat16, torch.float32):
        pays, why = compile_pays(device, candidate)
        name = str(candidate).removeprefix("torch.")
        print(f"decode_mode auto for {name} → {'compiled' if pays else 'eager'} ({why})")
        run.findings[f"decode_mode_auto_{name}"] = "compiled" if pays else "eager"
