"""micro_batch_size and gradient_checkpointing 'auto': one memory probe at start, which is also a preflight.

What an optimizer step adds, at its peak, to what is resident once the model is loaded:

    need(m) = optimizer states + max(rollout, training pass of m sequences)

- training pass(m): one real forward + backward of m worst-case sequences (the longest training
  prompt as the rollout cuts it, i.e. at most max_prompt_length, + max_completion_length, every
  completion token in the loss) through the trainer's own loss path,
  and the no-grad log-prob forward (old / reference log-probs) at m; the larger of the two,
  measured. CUDA: torch.cuda.max_memory_allocated over memory_allocated before. CPU: the growth of
  the process's resident set, sampled every 0.5 ms by a thread, from a start where glibc has
  returned freed memory to the OS (malloc_trim), so that the start is the live memory. No
  optimizer step; the gradients are set to None and the RNG states restored by the caller.
- rollout: all prompts_per_step × G sequences decode at once; their KV cache at full length (and
  one layer's copy while the cache grows) plus the sampler's (N, vocab) float32 temporaries,
  estimated from the model's shapes (a probe decode would take as long as a rollout).
- optimizer states: AdamW's two float32 moments per policy parameter (one byte each for the
  8-bit optimizers); they appear at the first step.

The budget is memory_budget × (free GPU memory + what torch's cache holds unused), or × the
available RAM on CPU. The largest m ≤ the generation batch with need(m) ≤ budget is found by a
secant search over measured sizes (m = 1, 2, then the linear prediction, at most ×8 per try);
every accepted size was run once, so the logged peak is a measurement, not an extrapolation.

gradient_checkpointing 'auto' (recompute costs about a third more compute per pass; an extra
micro-batch costs one more pass, which is cheap once a pass keeps the device busy):
  off  when the whole generation batch fits without recompute, or when a pass without it still
       holds ≥ BUSY_TOKENS tokens;
  on   otherwise, when recompute allows a larger micro-batch (or is the only way one sequence fits).
When even one sequence does not fit, MemoryBudgetError names the numbers and what to change,
before any rollout.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .rng import rng_state, set_rng_state
from .model import set_gradient_checkpointing

MiB = 2**20
BUSY_TOKENS = 4096  # tokens per pass above which an extra pass costs little next to recompute's ~1/3
MAX_PROBES = 6  # measured sizes per checkpointing mode
MAX_GROWTH = 8  # a candidate is at most this many times the largest size known to fit


class MemoryBudgetError(RuntimeError):
    """Not even one sequence (or the rollout) fits the memory budget; the message names the fix."""


@dataclass
class MemoryPlan:
    """What the probe chose, and the numbers behind it (bytes over the loaded model)."""

    micro_batch_size: int
    gradient_checkpointing: bool
    need: float  # predicted peak at the chosen sizes: optimizer states + max(rollout, pass)
    budget: float  # memory_budget × available
    available: float
    source: str  # "free GPU memory" / "available RAM"
    rollout: float
    optimizer: float
    tokens: tuple[int, int]  # (prompt, completion) of the worst-case sequence
    seconds: float
    largest: dict[bool, int | None] = field(default_factory=dict)  # checkpointing → largest size found to fit
    measured: dict[bool, dict[int, float]] = field(default_factory=dict)  # checkpointing → {m: pass bytes}

    def fits(self, micro_batch_size: int, gradient_checkpointing: bool) -> bool:
        """Whether sizes chosen elsewhere (a checkpoint's) are known to fit: recompute never needs more."""
        known = [self.largest.get(False)] + ([self.largest.get(True)] if gradient_checkpointing else [])
        return any(m is not None and micro_batch_size <= m for m in known)

    def describe(self, auto_size: bool, auto_checkpointing: bool) -> str:
        size = f"micro_batch_size {'auto → ' if auto_size else ''}{self.micro_batch_size}"
        ckpt = f"gradient_checkpointing {'auto → ' if auto_checkpointing else ''}{'on' if self.gradient_checkpointing else 'off'}"
        return (f"{size} (peak ~{self.need / MiB:,.0f} MiB over the loaded model, budget {self.budget / MiB:,.0f} MiB "
                f"of {self.available / MiB:,.0f} MiB {self.source}; worst case {self.tokens[0]}+{self.tokens[1]} tokens, "
                f"probe {self.seconds:.1f} s); {ckpt}")


# ------------------------------------------------------------------------------ measuring
def available_bytes(device: torch.device) -> tuple[float, str]:
    """(bytes this process may still allocate, what they are). CUDA: free device memory plus what
    torch's caching allocator holds unused; CPU: the available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + cached), "free GPU memory"
    import psutil

    return float(psutil.virtual_memory().available), "available RAM"


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


def measure_peak(fn: Callable[[], None], device: torch.device) -> float:
    """Peak memory growth while fn runs, in bytes; inf when it runs out of memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            fn()
            torch.cuda.synchronize(device)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return math.inf
        return float(torch.cuda.max_memory_allocated(device) - start)
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


# ------------------------------------------------------------------------------ estimating
def rollout_bytes(model_config, sequences: int, length: int, dtype: torch.dtype, vocab_size: int) -> float:
    """KV cache of `sequences` decoded together to `length` tokens, plus one layer's copy while the
    cache grows, plus the sampler's (N, vocab) float32 temporaries (logits, probabilities, sort)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    itemsize = torch.empty(0, dtype=dtype).element_size()
    kv = sequences * length * layers * 2 * kv_heads * head_dim * itemsize
    return float(kv + kv / layers + 4 * sequences * vocab_size * 4)


def optimizer_state_bytes(params, optimizer: str) -> float:
    n = sum(p.numel() for p in params)
    return float(n * (2 if "8bit" in optimizer else 8))


def worst_case_micro_batch(m: int, prompt_length: int, completion_length: int, vocab_size: int,
                           device: torch.device, old_logp: bool) -> dict:
    """A micro-batch (trainer.Batch.micro_batches' format) of m full-length sequences, every
    completion token in the loss. The first token of the first row is padding, as in any real
    batch of unequal prompts: a padded mask takes other attention kernels than a full one (on CPU,
    SDPA's math kernel keeps (m, heads, L, L) scores for backward; measured: +20% at m = 16).
    Token ids are arbitrary: memory does not depend on them."""
    length = prompt_length + completion_length
    ids = (torch.arange(m * length, device=device) % vocab_size).view(m, length)
    mask = torch.ones_like(ids)
    if prompt_length > 1:
        mask[0, 0] = 0
    ones = torch.ones(m, completion_length, device=device)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "completion_mask": ones.long(),
        "advantages": torch.linspace(-1, 1, m, device=device) if m > 1 else torch.ones(1, device=device),
        "old_logp": torch.full_like(ones, -1.0) if old_logp else None,
        "ref_logp": None,  # the loss then takes the policy's own (detached): the same work
        "completion_length": completion_length,
    }


def largest_fitting(measure: Callable[[int], float], limit: int, room: float) -> tuple[int, dict[int, float]]:
    """Largest m in [1, limit] with measure(m) ≤ room, by a secant search on measured sizes:
    (m, {size: measured bytes}); m = 0 when one does not fit. A size is accepted only measured."""
    points: dict[int, float] = {}

    def at(m: int) -> float:
        if m not in points:
            points[m] = measure(m)
        return points[m]

    if at(1) > room:
        return 0, points
    lo, hi = 1, limit + 1  # lo fits (measured); hi does not, or is past the limit
    while lo + 1 < hi and len(points) < MAX_PROBES:
        candidate = _next_size(points, lo, hi, room)
        if candidate is None:
            break  # the line through the measurements says nothing larger fits
        candidate = max(lo + 1, min(candidate, hi - 1, MAX_GROWTH * lo))
        if at(candidate) <= room:
            lo = candidate
        else:
            hi = candidate
    return lo, points


def _next_size(points: dict[int, float], lo: int, hi: int, room: float) -> int | None:
    """The next size to measure: the linear prediction of the largest fit, before clamping."""
    if hi in points and not math.isfinite(points[hi]):
        return (lo + hi) // 2  # out of memory there: bisect
    if hi in points:
        a, b = lo, hi  # between a fit and a miss
    else:
        below = [m for m in points if m < lo]
        if not below:
            return lo + 1
        a, b = max(below), lo
    slope = (points[b] - points[a]) / (b - a)  # bytes per sequence
    if slope <= 0:  # noise (CPU, tiny sequences): as far up as allowed
        return hi - 1
    candidate = lo + math.floor((room - points[lo]) / slope)
    return candidate if candidate > lo else None


# ------------------------------------------------------------------------------ planning
def plan_memory(
    run_pass: Callable[[int, bool], None],
    set_checkpointing: Callable[[bool], None],
    *,
    batch: int,
    micro_batch_size: int | str,
    gradient_checkpointing: bool | str,
    budget_fraction: float,
    available: tuple[float, str],
    optimizer: float,
    rollout: float,
    tokens: tuple[int, int],
    fix_hint: str,
    rollout_hint: str,
    device: torch.device,
) -> MemoryPlan:
    """Choose micro_batch_size and gradient_checkpointing (either may be fixed by the config).

    run_pass(m, train): one worst-case pass of m sequences, with backward when train (the caller
    leaves no gradients, optimizer state or RNG change behind); set_checkpointing(on) turns
    recompute on or off. Raises MemoryBudgetError when one sequence, or the rollout, does not fit.
    """
    t0 = time.perf_counter()
    available_bytes_, source = available
    budget = budget_fraction * available_bytes_
    room = budget - optimizer  # for the larger of the rollout and the training pass
    where = f"budget {budget / MiB:,.0f} MiB = memory_budget {budget_fraction} × {available_bytes_ / MiB:,.0f} MiB {source}"
    if rollout > room:
        raise MemoryBudgetError(
            f"memory preflight: the rollout decodes {batch} sequences of up to {sum(tokens)} tokens at once "
            f"({tokens[0]} prompt + {tokens[1]} completion); their KV cache and sampler need ~{rollout / MiB:,.0f} MiB "
            f"(+{optimizer / MiB:,.0f} MiB optimizer states) over the loaded model, over the {where}. {rollout_hint}"
        )
    modes = [False, True] if gradient_checkpointing == "auto" else [bool(gradient_checkpointing)]
    fixed_size = None if micro_batch_size == "auto" else int(micro_batch_size)
    largest: dict[bool, int | None] = {}
    measured: dict[bool, dict[int, float]] = {}

    def measure(on: bool) -> Callable[[int], float]:
        def at(m: int) -> float:
            set_checkpointing(on)
            return max(measure_peak(lambda: run_pass(m, True), device), measure_peak(lambda: run_pass(m, False), device))
        return at

    choice = None  # (micro_batch_size, checkpointing)
    if fixed_size is not None:
        for on in modes:  # off first: recompute only when the fixed size needs it
            peak = measure(on)(fixed_size)
            measured[on], largest[on] = {fixed_size: peak}, fixed_size if peak <= room else None
            if peak <= room:
                choice = (fixed_size, on)
                break
    else:
        if False in modes:
            m, measured[False] = largest_fitting(measure(False), batch, room)
            largest[False] = m or None
            if m and (m == batch or m * sum(tokens) >= BUSY_TOKENS or True not in modes):
                choice = (m, False)
        if choice is None and True in modes:
            m, measured[True] = largest_fitting(measure(True), batch, room)
            largest[True] = m or None
            off = largest.get(False) or 0
            choice = (m, True) if m > off else (off, False) if off else None
    if choice is None:
        on = modes[-1]
        size = fixed_size or 1
        peak = measured[on].get(size, math.inf)
        what = "one sequence" if fixed_size is None else f"micro_batch_size={fixed_size} sequences"
        extra = "" if True in modes else " Turn gradient_checkpointing on (true or auto)."
        if fixed_size is not None:
            extra += " Lower micro_batch_size, or set it to auto."
        raise MemoryBudgetError(
            f"memory preflight: {what} of {sum(tokens)} tokens ({tokens[0]} prompt + {tokens[1]} completion) needs "
            f"~{peak / MiB:,.0f} MiB for its training pass (forward + backward, gradient checkpointing "
            f"{'on' if on else 'off'}) + {optimizer / MiB:,.0f} MiB optimizer states over the loaded model, "
            f"over the {where}.{extra} {fix_hint}"
        )
    size, on = choice
    set_checkpointing(on)
    need = optimizer + max(rollout, measured[on][size])
    return MemoryPlan(size, on, need, budget, available_bytes_, source, rollout, optimizer, tokens,
                      time.perf_counter() - t0, largest, measured)


# ------------------------------------------------------------------------------ the run's plan
def probe_pass(update, m: int, train: bool, tokens: tuple[int, int], device: torch.device) -> None:
    """One worst-case micro-batch of m sequences of tokens = (prompt, completion) through the run's
    own loss path (update.PolicyUpdate): `accumulate` with backward (train), or the no-grad
    log-prob `forward`. The gradients are dropped, no optimizer step; the caller restores the RNG
    states and the training flag."""
    vocab = update.model.get_input_embeddings().weight.shape[0]
    mb = worst_case_micro_batch(m, *tokens, vocab, device, old_logp=update.config.num_iterations > 1)
    update.model.train(train)
    if not train:
        with torch.no_grad():
            update.forward(mb)
        return
    try:
        update.accumulate(mb, float(m * tokens[1]), m, 1)
    finally:
        for p in update.params:
            p.grad = None


def plan_run_memory(update, *, device: torch.device, num_processes: int, longest_prompt: int) -> MemoryPlan:
    """micro_batch_size / gradient_checkpointing 'auto' and the preflight for a run: worst-case
    probes (probe_pass) of the longest prompt + max_completion_length through `update`, the run's
    update.PolicyUpdate. The RNG states and the training flag are restored afterwards. Several
    processes plan for the tightest one and all take process 0's sizes."""
    cfg, model = update.config, update.model
    tokens = (longest_prompt, cfg.max_completion_length)
    embeddings = model.get_input_embeddings().weight
    vocab = embeddings.shape[0]
    available = available_bytes(device)
    if num_processes > 1:  # plan for the tightest process
        least = torch.tensor([available[0]], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        available = (float(least.item()), available[1])
    size_hint = (f"To fit: lower max_completion_length (now {cfg.max_completion_length}) or max_prompt_length (now "
                 f"{cfg.max_prompt_length}); ")
    rng, was_training = rng_state(), model.training
    try:
        plan = plan_memory(
            lambda m, train: probe_pass(update, m, train, tokens, device), lambda on: set_gradient_checkpointing(model, on),
            batch=cfg.generation_batch, micro_batch_size=cfg.micro_batch_size,
            gradient_checkpointing=cfg.gradient_checkpointing, budget_fraction=cfg.memory_budget,
            available=available, optimizer=optimizer_state_bytes(update.params, cfg.optimizer),
            rollout=rollout_bytes(model.config, cfg.generation_batch, sum(tokens), embeddings.dtype, vocab),
            tokens=tokens, device=device,
            fix_hint=size_hint + ("" if cfg.quantization == "4bit" else "quantization=4bit (frees the weights' memory); ")
            + f"a smaller lora_r (now {cfg.lora_r}) or logprob_chunk_size (now {cfg.logprob_chunk_size}: the LM head's "
            f"float32 logits are chunk × vocab {vocab}); a smaller model; or free memory / raise memory_budget.",
            rollout_hint=f"Lower prompts_per_step (now {cfg.prompts_per_step}) or num_generations (now "
            f"{cfg.num_generations}); " + size_hint + "a smaller model; or free memory / raise memory_budget.",
        )
    finally:
        set_rng_state(rng)
        model.train(was_training)
    if num_processes > 1:  # every process the same sizes (CPU measurements vary a little)
        from accelerate.utils import broadcast_object_list

        chosen = broadcast_object_list([(plan.micro_batch_size, plan.gradient_checkpointing)])[0]
        plan.micro_batch_size, plan.gradient_checkpointing = chosen
        set_gradient_checkpointing(model, chosen[1])
    return plan


def resume_sizes(plan: MemoryPlan | None, config, current: tuple, saved: tuple) -> tuple[tuple, str | None]:
    """The (micro_batch_size, gradient_checkpointing) a resumed run uses, and a line saying so (None:
    nothing to say). An 'auto' size takes the checkpoint's when the probe found it to fit (the same
    accumulation order: an exact resume); otherwise this start's stays."""
    if plan is None or saved == current or None in saved:
        return current, None
    if not plan.fits(*saved):
        return current, (f"the checkpoint ran micro_batch_size {saved[0]}, gradient_checkpointing {saved[1]}; that "
                         f"does not fit now: using {current[0]}, {current[1]}")
    size = saved[0] if config.micro_batch_size == "auto" else current[0]
    on = saved[1] if config.gradient_checkpointing == "auto" else current[1]
    plan.micro_batch_size, plan.gradient_checkpointing = size, on
    return (size, on), f"resumed with the checkpoint's micro_batch_size {size}, gradient_checkpointing {'on' if on else 'off'}"
