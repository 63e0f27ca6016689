"""Random state: seeding a run, and every generator's state for checkpoints (python, numpy, torch CPU, CUDA).

The states are plain Python values and CPU byte tensors, so that a checkpoint loads with
torch.load(weights_only=True) (run/checkpoint.py): NumPy's key array is stored as a list of ints, not
as an ndarray, whose unpickling would need NumPy's own globals. States from another machine are
restored where they fit and replaced, saying so, where they cannot.
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU and (where present) every CUDA device."""
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, key.tolist(), pos, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every device) alike."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore rng_state()'s states (NumPy's key as a list of ints). CUDA
    states go to the devices both machines have: with fewer GPUs visible than at save time the
    extra states are dropped (one line says so), with more the extra devices keep theirs."""
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    saved = state.get("cuda") or []
    if saved and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        for device, cuda_state in enumerate(saved[:visible]):
            torch.cuda.set_rng_state(cuda_state, device)
        if len(saved) > visible:
            logger.warning(
                "the checkpoint holds RNG states of %d CUDA devices, %d are visible: restored those, "
                "dropped the rest",
                len(saved),
                visible,
            )


def _hashed_seed(*parts) -> int:
    # A hash, not arithmetic on the numbers: distinct parts never share a stream.
    digest = hashlib.sha256(" ".join(["lora_grpo", *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes a non-negative 64-bit int


def _derived_seed(seed: int, process_index: int, step: int) -> int:
    return _hashed_seed("sampling", seed, process_index, step)


def sampling_seed(seed: int, process_index: int) -> int:
    """The seed of a run's sampling generator on one process: a hash of (seed, process), never the
    seed itself. seed_everything(seed) starts torch's global stream at manual_seed(seed), and that
    stream initialises the adapters (LoRA A is kaiming-uniform); a sampler seeded with the same
    number would draw the very uniforms that made A, coupling the first rollouts' tokens to the
    initialisation. On SmolLM2-135M the coupling cost 5–43 points of held-out accuracy after
    10 steps (seeds 1 and 2); TRL's sampler draws from the global stream after the init."""
    return _hashed_seed("sampling stream", seed, process_index)


def restore_sampling(
    generator: torch.Generator, saved: torch.Tensor, *, seed: int, process_index: int, step: int
) -> str | None:
    """Set the sampling generator to its saved state (a CPU byte tensor). A state saved by a
    generator of another device type (a CUDA generator's 16 bytes of seed and offset against a CPU
    one's 5056 bytes of Mersenne twister, or the reverse) cannot be converted: the generator is then
    reseeded from (seed, process_index, step), the same on every resume of that checkpoint, and the
    returned line says so (None when the state was restored)."""
    if saved.numel() == generator.get_state().numel():
        try:
            generator.set_state(saved)
            return None
        except RuntimeError:  # the same size from another generator kind: reseed as below
            pass
    fresh_sampling(generator, seed=seed, process_index=process_index, step=step)
    kind = {16: "a CUDA", 5056: "a CPU"}.get(saved.numel(), "another")
    return (
        f"the checkpoint's sampling generator state comes from {kind} generator ({saved.numel()} bytes); this "
        f"process samples on {generator.device.type}: reseeded the sampling generator from seed {seed}, process "
        f"{process_index} and step {step} instead. The run continues reproducibly (every resume of this "
        "checkpoint on this device type draws alike), but not with the draws of a run that was never interrupted"
    )


def fresh_sampling(generator: torch.Generator, *, seed: int, process_index: int, step: int) -> None:
    """Seed the sampling generator from (seed, process_index, step): a resumed process without a saved state of
    its own to restore (another device type's, or a process the saved run did not have). Every resume of that
    checkpoint draws alike."""
    generator.manual_seed(_derived_seed(seed, process_index, step))


def shuffle_seed(seed: int, global_step: int) -> int:
    """The seed of a step's row order where a step is cut into random shares of its rollout, as TRL
    shuffles before cutting: the trainer's order of a generation's rows (steps_per_generation > 1)
    and the update's clip-fraction groups (clip_ratio_group_size). One formula for both, so that
    the two orders agree."""
    return seed * 1_000_003 + global_step
