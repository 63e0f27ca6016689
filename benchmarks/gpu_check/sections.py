"""The sections of the GPU check, in the order they run: the one list (a new section is a module of
its own and one entry here). The numbers are the docs'; estimate_s is each one's expected seconds on
the lent H200, for the plan printed at the start and benchmarks/README.md's device-time table."""

from __future__ import annotations

from benchmarks.gpu_check import (
    decode,
    decode_bound,
    devices,
    numerics,
    paged_adamw,
    profile_step,
    pytest_gpu,
    recipe_memory,
    resume,
    reward_model,
    tools,
    vs_trl,
)
from benchmarks.gpu_check.harness import Section

# What is still unmeasured on a GPU first (the profile of the step, then the decode's weight forms,
# which extrapolate from the profile's 24-layer step), then the cheap sections (tiny or small models,
# no compiled decode), then the ones that compile a decode (the recipes' 24- and 28-layer 4-bit + LoRA
# models first).
SECTIONS = [
    Section(1, "devices", devices.check_devices, 5),
    Section(14, "profile: where the decode step and the update go", profile_step.check_profile, 70),
    # Section 13 extrapolates its weight forms to 24 layers with section 14's step, in the same process.
    Section(13, "decode bound: three weight forms", decode_bound.check_decode_bound, 60, needs=(14,)),
    Section(7, "resume: on the same device, and on a CPU", resume.check_resume, 25),
    Section(8, "pytest -m gpu", pytest_gpu.check_pytest_gpu, 20),
    Section(10, "reward model", reward_model.check_reward_model, 10),
    Section(11, "paged_adamw_8bit", paged_adamw.check_paged_adamw, 20),
    Section(6, "bf16 KL", numerics.check_bf16_kl, 20),
    Section(2, "memory: the 0.5B recipe on an emulated 8 GB card", recipe_memory.check_memory_05b, 150),
    # Section 3 runs on section 2's trained model, in the same process.
    Section(3, "decode: compiled vs eager, graph breaks, recompiles", decode.check_decode, 20, needs=(2,)),
    Section(4, "memory: the 1.5B recipe on an emulated 8 GB card", recipe_memory.check_memory_15b, 200),
    Section(
        5,
        "decode after updates: compiled vs eager in float32 and bf16",
        decode.check_decode_after_updates,
        60,
    ),
    Section(9, "tools with the compiled decode", tools.check_tools, 30),
    Section(12, "step time and peak memory against TRL + PEFT", vs_trl.check_vs_trl, 90),
]
