"""The sections of the GPU check, in the order they run: the one list (a new section is a module of
its own and one entry here). The numbers are the docs'; estimate_s is each one's expected seconds on
the lent H200, for the plan printed at the start and benchmarks/README.md's device-time table."""

from __future__ import annotations

from benchmarks.gpu_check import (
    compile_cache,
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

# What the first GPU run (H200, 2026-12) left unmeasured runs first, and what times something runs
# alone: against TRL (it was starved twice), the profile of the decode and the update (14), the
# decode's three weight forms (13, extrapolated to 24 layers with 14's step). Then, side by side in
# LANES, what checks memory and correctness: the recipes' memory after the reserved-memory fix (section
# 3 right after section 2, on its trained model, and the compile cache in a fresh process on section
# 2's compile), then what passed there. estimate_s: the seconds that run measured, alone, section 3
# slimmed (its eager decode of a quarter of the tokens: 71 of its 89 s were the eager decode) and
# section 8 (pytest in one process); section 12 is its two workers' caps; 13, 14 and 15 estimated.
SECTIONS = [
    Section(12, "step time and peak memory against TRL + PEFT", vs_trl.check_vs_trl, 190),
    Section(14, "profile: where the decode step and the update go", profile_step.check_profile, 70),
    # Section 13 extrapolates its weight forms to 24 layers with section 14's step, in the same process.
    Section(13, "decode bound: three weight forms", decode_bound.check_decode_bound, 60, needs=(14,)),
    Section(2, "memory: the 0.5B recipe on an emulated 8 GB card", recipe_memory.check_memory_05b, 91),
    # Section 3 runs on section 2's trained model, in the same process.
    Section(3, "decode: compiled vs eager, graph breaks, recompiles", decode.check_decode, 35, needs=(2,)),
    # A fresh process finds section 2's compile in lora_grpo's compile cache (estimated: its one worker).
    Section(
        15, "compile cache: a fresh process skips step 1's compile", compile_cache.check_compile_cache, 50
    ),
    Section(4, "memory: the 1.5B recipe on an emulated 8 GB card", recipe_memory.check_memory_15b, 144),
    Section(6, "bf16 KL", numerics.check_bf16_kl, 10),
    Section(10, "reward model", reward_model.check_reward_model, 5),
    Section(1, "devices", devices.check_devices, 12),
    Section(7, "resume: on the same device, and on a CPU", resume.check_resume, 21),
    Section(11, "paged_adamw_8bit", paged_adamw.check_paged_adamw, 20),
    Section(
        5,
        "decode after updates: compiled vs eager in float32 and bf16",
        decode.check_decode_after_updates,
        28,
    ),
    Section(9, "tools with the compiled decode", tools.check_tools, 11),
    Section(8, "pytest -m gpu", pytest_gpu.check_pytest_gpu, 80),
]

# The sections that run side by side after the others, a worker process a lane (lanes.py), each
# lane's in this order: the 0.5B recipe's memory with what runs on it (its trained model, its
# compile), the 1.5B recipe's memory, and what passed on the first GPU run. By the estimates the
# longest lane (176 s) and the alone sections (320 s) fit one command of --budget 540 with their
# start-ups (harness.planned_s: ~516 s).
LANES = [(2, 3, 15), (4, 6, 10), (1, 7, 11, 5, 9, 8)]
