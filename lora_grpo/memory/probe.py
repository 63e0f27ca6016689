"""micro_batch_size and gradient_checkpointing 'auto': one memory probe at start, which is also a preflight.

What an optimizer step adds, at its peak, to what is resident once the model is loaded:

    need(m) = optimizer states + max(rollout, kept + training pass of m sequences)

- training pass(m): one real forward + backward of m worst-case sequences (the longest training
  prompt as the rollout cuts it, i.e. at most max_prompt_length, + max_completion_length, every
  completion token in the loss) through the trainer's own loss path,
  and the no-grad log-prob forward (old / reference log-probs) at m; the larger of the two,
  measured. CUDA: the allocator's peak growth in reserved bytes (of allocated or of reserved bytes
  whichever is larger: fragmentation is memory the pass takes from the device), each pass measured
  from an emptied cache (device.release_cached_memory), so that blocks an earlier, larger pass left
  cached do not hide its reserved growth. CPU: the growth of
  the process's resident set, sampled every 0.5 ms by a thread, from a start where glibc has
  returned freed memory to the OS (malloc_trim), so that the start is the live memory. No
  optimizer step; the gradients are set to None and the RNG states restored by the caller.
  Every no-grad forward of the run is measured at m too: the log-prob forward at the longest
  eval prompt (eval/kl_to_base's), and each reward model's scoring forward (side passes). So m is
  the most rows any forward of the run takes: the eval's and the reward models' forwards are split
  into micro-batches of micro_batch_size as the training ones are (MemoryPlan.forward_rows).
- rollout: all generation_batch sequences decode at once, and an eval decodes at most that many
  rows at once too (decode_rows: the training rollout's row count, or one prompt's eval samples when
  they are more), estimated from the model's shapes for the sampler decode_mode resolves
  to (a probe decode would take as long as a rollout; decode_memory): eager, the KV cache at full
  length and one layer's copy while it grows; static / compiled, the static cache of
  cache_length(prompt + completion) slots (up to 1.5× the length) next to the prefill's cache, which
  both exist while the one is copied into the other; plus the sampler's (N, vocab) float32
  temporaries.
- kept: what stays allocated between rollouts, under every training pass: the compiled decode's
  static cache (one: the run reserves the shape of its largest decode, fast_decode.reserve_shape,
  and every rollout and eval decodes in it) and, on CUDA, an estimate of its graph's private pool.
  0 for eager and uncompiled static decoding, which free their caches.
- optimizer states: AdamW's two float32 moments per policy parameter (one byte each for the
  8-bit optimizers); they appear at the first step.
- held (CUDA): what the allocator keeps reserved over the allocated bytes once its cache is emptied
  (the unused parts of live segments: the loaded model's own fragmentation), under everything.

need and budget are in reserved bytes over the allocated bytes of the loaded model: what an 8 GB
card runs out of is what the caching allocator reserves. The allocator runs with expandable
segments unless the user chose otherwise (device.use_expandable_segments): freed pages then serve
any later size, so what one stage (rollout, update, eval) frees, the next reuses, as the plan's
max(rollout, pass) assumes; the estimated rollout counts allocated bytes.

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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# how much memory there is and a pass takes: per device
from ..batch import MicroBatch
from ..device import MiB, allocator_setting, available_bytes, measure_peak, release_cached_memory
from ..model.load import set_gradient_checkpointing
from ..rng import rng_state, set_rng_state
from ..rollout.fast_decode import (
    give_up,
    kv_bytes_per_slot,
    reserve_shape,
    resolve_decode_mode,
    static_cache_bytes,
)

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
    need: float  # predicted peak at the chosen sizes, reserved: held + optimizer states + max(rollout, pass)
    budget: float  # memory_budget × available
    available: float
    source: str  # "free GPU memory" / "available RAM"
    rollout: float  # the largest rollout's peak, kept bytes included
    optimizer: float
    tokens: tuple[int, int]  # (prompt, completion) of the worst-case sequence
    seconds: float
    largest: dict[bool, int | None] = field(default_factory=dict)  # checkpointing → largest size found to fit
    measured: dict[bool, dict[int, float]] = field(default_factory=dict)  # checkpointing → {m: pass bytes}
    kept: float = 0.0  # allocated between rollouts, under every pass (the compiled decode's static cache)
    decode_rows: int = 0  # the most sequences a decode runs at once (training rollout and eval alike)
    # how the sizes were found (memory_probe): the sweep's measurements, one pass, or the shapes alone
    probe: str = "measured"
    held: float = 0.0  # CUDA: reserved over allocated with the cache emptied (live segments' unused parts)
    allocator: str = ""  # CUDA: what the caching allocator runs with (device.allocator_setting)

    @property
    def forward_rows(self) -> int:
        """The most sequences any forward takes but a decode's: training, log-prob, eval and reward-model forwards."""
        return self.micro_batch_size

    def fits(self, micro_batch_size: int, gradient_checkpointing: bool) -> bool:
        """Whether sizes chosen elsewhere (a checkpoint's) are known to fit: recompute never needs more."""
        known = [self.largest.get(False)] + ([self.largest.get(True)] if gradient_checkpointing else [])
        return any(m is not None and micro_batch_size <= m for m in known)

    def describe(self, auto_size: bool, auto_checkpointing: bool) -> str:
        size = f"micro_batch_size {'auto → ' if auto_size else ''}{self.micro_batch_size}"
        ckpt = (
            "gradient_checkpointing "
            f"{'auto → ' if auto_checkpointing else ''}{'on' if self.gradient_checkpointing else 'off'}"
        )
        kept = f", {self.kept / MiB:,.0f} MiB of it the compiled decode's kept caches" if self.kept else ""
        held = f", {self.held / MiB:,.0f} MiB of it held in live segments" if self.held >= MiB else ""
        reserved = " reserved" if self.allocator else ""
        allocator = f"; CUDA allocator: {self.allocator}" if self.allocator else ""
        return (
            f"{size} (peak ~{self.need / MiB:,.0f} MiB{reserved} over the loaded model{kept}{held}, budget "
            f"{self.budget / MiB:,.0f} MiB of {self.available / MiB:,.0f} MiB {self.source}; worst case "
            f"{self.tokens[0]}+{self.tokens[1]} tokens, {self.probe}, {self.seconds:.1f} s); {ckpt}{allocator}"
        )


# ------------------------------------------------------------------------------ estimating
def rollout_bytes(
    model_config,
    sequences: int,
    length: int,
    dtype: torch.dtype,
    vocab_size: int,
    *,
    mode: str = "eager",
    prompt_length: int | None = None,
) -> float:
    """Peak of one rollout of `sequences` decoded together to `length` = prompt + completion tokens
    by the sampler `mode` (resolved: eager / static / compiled), over what was allocated before it.

    eager: the KV cache at full length, plus one layer's copy while the cache grows. static and
    compiled: the static cache (fast_decode.static_cache_bytes: cache_length(length) slots) next to
    the prefill's cache of `prompt_length` (default: length) tokens, which exist together while the
    one is copied into the other. Both: the sampler's (N, vocab) float32 temporaries (logits,
    probabilities, sort). A compiled rollout reuses a kept cache: see decode_memory."""
    slot = kv_bytes_per_slot(model_config, dtype)
    sampler = 4 * sequences * vocab_size * 4
    if mode == "eager":
        kv = sequences * length * slot
        return float(kv + kv / model_config.get_text_config().num_hidden_layers + sampler)
    prefill = sequences * (length if prompt_length is None else prompt_length) * slot
    return float(static_cache_bytes(model_config, sequences, length, dtype) + prefill + sampler)


def decode_memory(
    model_config,
    shapes: list[tuple[int, int, int]],
    dtype: torch.dtype,
    vocab_size: int,
    mode: str,
    device: torch.device,
) -> tuple[float, float]:
    """(peak of the largest rollout, bytes kept between rollouts) for a run whose rollouts decode
    `shapes` = [(sequences, prompt tokens, completion tokens)] with the resolved sampler `mode`.

    Only the compiled sampler keeps memory: one static cache of the run's reserved shape (the most
    rows and the longest prompt + completion of `shapes`: fast_decode.reserve_shape, so every decode
    runs in it), and on CUDA its graph's private pool, estimated as the step's (rows, vocab) logits
    in the model's dtype and in float32. A compiled rollout decodes in the kept cache, so its peak is
    what is kept plus its prefill cache (and one layer of it padded to the cache's rows) and sampler."""
    peaks = [
        rollout_bytes(model_config, n, p + c, dtype, vocab_size, mode=mode, prompt_length=p)
        for n, p, c in shapes
    ]
    if mode != "compiled":
        return max(peaks), 0.0
    rows, needed = max(n for n, _, _ in shapes), max(p + c for _, p, c in shapes)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    pool = rows * vocab_size * (itemsize + 4) if device.type == "cuda" else 0
    kept = static_cache_bytes(model_config, rows, needed, dtype) + pool
    slot = kv_bytes_per_slot(model_config, dtype)
    layers = model_config.get_text_config().num_hidden_layers
    padded = max(rows * p * slot / layers for _, p, _ in shapes)
    own = [peak - static_cache_bytes(model_config, n, p + c, dtype) for peak, (n, p, c) in zip(peaks, shapes)]
    return kept + max(own) + padded, float(kept)


def optimizer_state_bytes(params, optimizer: str) -> float:
    n = sum(p.numel() for p in params)
    return float(n * (2 if "8bit" in optimizer else 8))


def worst_case_micro_batch(
    m: int, prompt_length: int, completion_length: int, vocab_size: int, device: torch.device, old_logp: bool
) -> MicroBatch:
    """A MicroBatch (what Batch.micro_batches yields) of m full-length sequences, every
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
    return MicroBatch(
        input_ids=ids,
        attention_mask=mask,
        completion_length=completion_length,
        completion_mask=ones.long(),
        advantages=torch.linspace(-1, 1, m, device=device) if m > 1 else torch.ones(1, device=device),
        old_logp=torch.full_like(ones, -1.0) if old_logp else None,
        # the loss then takes the policy's own (detached): the same work
        ref_logp=None,
    )


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
    rollout_sequences: int | None = None,
    rollout_what: str = "the rollout",
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
    kept: float = 0.0,
    side_passes: tuple[Callable[[int], None], ...] = (),
    decode_rows: int = 0,
    estimate: Callable[[int, bool], float] | None = None,
    held: float = 0.0,
    agree: Callable[[float], float] = float,
) -> MemoryPlan:
    """Choose micro_batch_size and gradient_checkpointing (either may be fixed by the config).

    run_pass(m, train): one worst-case pass of m sequences, with backward when train (the caller
    leaves no gradients, optimizer state or RNG change behind); set_checkpointing(on) turns
    recompute on or off; side_passes: other no-grad forwards of m sequences (a reward model's
    scoring), measured with the pass at every size. estimate(m, checkpointing): bytes of a pass
    computed instead of measured (memory/estimate.py: a plan from a model's shapes alone). rollout:
    the largest rollout's peak, `kept` included; kept: bytes that stay allocated between rollouts,
    under every training pass (decode_memory); held: bytes reserved over the allocated ones before
    any of it (release_cached_memory), under everything. agree(peak): the value every process takes
    for a peak each one measured (the largest, with several: their choices and their passes then stay
    in step). Raises MemoryBudgetError when one sequence, or the rollout, does not fit.
    """
    t0 = time.perf_counter()
    available_bytes_, source = available
    budget = budget_fraction * available_bytes_
    room = (
        budget - optimizer - held
    )  # for the larger of the rollout and the training pass (over what is kept)
    where = (
        f"budget {budget / MiB:,.0f} MiB = memory_budget {budget_fraction} × "
        f"{available_bytes_ / MiB:,.0f} MiB {source}"
    )
    if rollout > room:
        raise MemoryBudgetError(
            f"memory preflight: {rollout_what} decodes {rollout_sequences or batch} sequences of up to "
            f"{sum(tokens)} tokens at once "
            f"({tokens[0]} prompt + {tokens[1]} completion); their KV cache and sampler need ~{rollout / MiB:,.0f} MiB "
            + (
                f"(of it {kept / MiB:,.0f} MiB the compiled decode's kept caches: decode_mode eager keeps none) "
                if kept
                else ""
            )
            + f"(+{optimizer / MiB:,.0f} MiB optimizer states"
            + (f", +{held / MiB:,.0f} MiB the allocator holds in live segments" if held >= MiB else "")
            + f") over the loaded model, over the {where}. {rollout_hint}"
        )
    modes = [False, True] if gradient_checkpointing == "auto" else [bool(gradient_checkpointing)]
    fixed_size = None if micro_batch_size == "auto" else int(micro_batch_size)
    largest: dict[bool, int | None] = {}
    measured: dict[bool, dict[int, float]] = {}

    def measure(on: bool) -> Callable[[int], float]:
        def at(m: int) -> float:
            if estimate is not None:
                return estimate(m, on)
            set_checkpointing(on)
            passes = [
                lambda: run_pass(m, True),
                lambda: run_pass(m, False),
                *(lambda f=f: f(m) for f in side_passes),
            ]
            return agree(max(_measured(p, device) for p in passes))

        return at

    room_for_pass = room - kept  # the kept caches sit under every pass

    choice = None  # (micro_batch_size, checkpointing)
    if fixed_size is not None:
        for on in modes:  # off first: recompute only when the fixed size needs it
            peak = measure(on)(fixed_size)
            measured[on], largest[on] = {fixed_size: peak}, fixed_size if peak <= room_for_pass else None
            if peak <= room_for_pass:
                choice = (fixed_size, on)
                break
    else:
        if False in modes:
            m, measured[False] = largest_fitting(measure(False), batch, room_for_pass)
            largest[False] = m or None
            if m and (m == batch or m * sum(tokens) >= BUSY_TOKENS or True not in modes):
                choice = (m, False)
        if choice is None and True in modes:
            m, measured[True] = largest_fitting(measure(True), batch, room_for_pass)
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
            + ("more memory than there is (it ran out)" if math.isinf(peak) else f"~{peak / MiB:,.0f} MiB")
            + " for its training pass (forward + backward, gradient checkpointing "
            f"{'on' if on else 'off'}) + {optimizer / MiB:,.0f} MiB optimizer states"
            + (
                f" + {kept / MiB:,.0f} MiB the compiled decode keeps (decode_mode eager keeps none)"
                if kept
                else ""
            )
            + (f" + {held / MiB:,.0f} MiB the allocator holds in live segments" if held >= MiB else "")
            + " over the loaded model, "
            f"over the {where}.{extra} {fix_hint}"
        )
    size, on = choice
    set_checkpointing(on)
    need = held + optimizer + max(rollout, kept + measured[on][size])
    return MemoryPlan(
        size,
        on,
        need,
        budget,
        available_bytes_,
        source,
        rollout,
        optimizer,
        tokens,
        time.perf_counter() - t0,
        largest,
        measured,
        kept=kept,
        decode_rows=decode_rows,
        held=held,
    )


def _measured(fn: Callable[[], None], device: torch.device) -> float:
    """One pass's peak growth (measure_peak), from an emptied CUDA cache: in reserved bytes."""
    release_cached_memory(device)
    return measure_peak(fn, device)


# ------------------------------------------------------------------------------ the run's plan
def probe_pass(
    update,
    m: int,
    train: bool,
    tokens: tuple[int, int],
    device: torch.device,
    eval_tokens: tuple[int, int] | None = None,
) -> None:
    """One worst-case micro-batch of m sequences of tokens = (prompt, completion) through the run's
    own loss path (update.PolicyUpdate): `accumulate` with backward (train), or the no-grad
    log-prob `forward`, at eval_tokens when longer (eval/kl_to_base's forward over the eval's
    longest prompt). The gradients are dropped, no optimizer step; the caller restores the RNG
    states and the training flag."""
    vocab = update.model.get_input_embeddings().weight.shape[0]
    if not train and eval_tokens is not None and sum(eval_tokens) > sum(tokens):
        tokens = eval_tokens
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


def decode_rows(config) -> int:
    """The most sequences a run decodes at once: the training rollout's generation_batch; an eval
    decodes in chunks of as many rows (evaluation.Evaluator), or of one prompt's samples when
    eval_num_samples / max(eval_pass_k) is more."""
    samples = max(max(config.eval_pass_k or [0]), config.eval_num_samples or 0)
    return max(config.generation_batch, samples)


def rollout_shapes(
    config, longest_prompt: int, eval_longest_prompt: int | None = None
) -> list[tuple[int, int, int]]:
    """[(sequences, prompt tokens, completion tokens)] of the run's largest rollouts: the training
    rollout (generation_batch sequences), and with an eval dataset the evaluator's decodes
    (decode_rows sequences at once)."""
    shapes = [(config.generation_batch, longest_prompt, config.max_completion_length)]
    if eval_longest_prompt is not None:
        shapes.append((decode_rows(config), eval_longest_prompt, config.max_completion_length))
    return shapes


def reserve_decode_shape(config, model, longest_prompt: int, eval_longest_prompt: int | None = None) -> None:
    """Reserve the run's largest decode for the compiled sampler (fast_decode.reserve_shape): its
    training rollouts and evals then share one static cache and one graph, as decode_memory plans."""
    shapes = rollout_shapes(config, longest_prompt, eval_longest_prompt)
    reserve_shape(model, max(n for n, _, _ in shapes), max(p + c for _, p, c in shapes))


def plan_run_memory(
    update,
    *,
    device: torch.device,
    num_processes: int,
    longest_prompt: int,
    eval_longest_prompt: int | None = None,
    side_passes: tuple[Callable[[int, tuple[int, int]], None], ...] = (),
    estimate: Callable[[tuple[int, int], tuple[int, int]], Callable[[int, bool], float]] | None = None,
) -> MemoryPlan:
    """micro_batch_size / gradient_checkpointing 'auto' and the preflight for a run: worst-case
    probes (probe_pass) of the longest prompt + max_completion_length through `update`, the run's
    update.PolicyUpdate, next to the rollouts' memory for the sampler the run's decode_mode resolves
    to (decode_memory; eval_longest_prompt: the eval dataset's longest prompt, None without one);
    side_passes(m, tokens): the reward models' scoring of m worst-case sequences (scorer.RolloutScorer).
    estimate(tokens, worst): the pass's bytes from the model's shapes (memory/estimate.py: pass_estimate);
    with memory_probe 'auto' it decides first (plan_from_shapes), so that the probe costs at most one
    pass, and nothing when the run is far under its budget. The RNG states and the training flag are
    restored afterwards. Several processes plan for the tightest one: each measured figure is the largest
    any process measured, so all choose the same sizes (process 0's are broadcast besides)."""
    cfg, model = update.config, update.model
    tokens = (longest_prompt, cfg.max_completion_length)
    eval_tokens = None if eval_longest_prompt is None else (eval_longest_prompt, cfg.max_completion_length)
    longest = max([tokens] + ([eval_tokens] if eval_tokens else []), key=sum)
    embeddings = model.get_input_embeddings().weight
    vocab = embeddings.shape[0]
    shapes = rollout_shapes(cfg, longest_prompt, eval_longest_prompt)
    mode = resolve_decode_mode(cfg.decode_mode, model, device)
    rollout, kept = decode_memory(model.config, shapes, embeddings.dtype, vocab, mode, device)
    # The loaded model's own unused reserved bytes, with the cache emptied: under everything (CUDA).
    held = release_cached_memory(device)
    available = available_bytes(device)
    agree = float
    if num_processes > 1:
        # Plan for the tightest process: the least room, the most held, the largest peak of each pass. Every
        # process then makes the same choices and runs the same passes (whose collectives must pair up).
        def agree(value: float, op=torch.distributed.ReduceOp.MAX) -> float:
            reduced = torch.tensor([value], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(reduced, op=op)
            return float(reduced.item())

        available = (agree(available[0], torch.distributed.ReduceOp.MIN), available[1])
        held = agree(held)
    size_hint = (
        f"To fit: lower max_completion_length (now {cfg.max_completion_length}) or shorten the prompts (the "
        f"longest has {longest_prompt} tokens; max_prompt_length now {cfg.max_prompt_length}); "
    )
    rng, was_training = rng_state(), model.training
    run_pass = lambda m, train: probe_pass(update, m, train, tokens, device, eval_tokens)
    set_checkpointing = lambda on: set_gradient_checkpointing(model, on)
    # the largest decode: the training rollout's, or an eval's samples of one prompt (eval_num_samples, pass@k)
    rows = max(sequences for sequences, _, _ in shapes)
    eval_decode = rows > cfg.generation_batch
    try:
        sizes = dict(
            batch=cfg.step_batch,
            rollout_sequences=rows,
            rollout_what="the eval" if eval_decode else "the rollout",
            micro_batch_size=cfg.micro_batch_size,
            gradient_checkpointing=cfg.gradient_checkpointing,
            budget_fraction=cfg.memory_budget,
            available=available,
            optimizer=optimizer_state_bytes(update.params, cfg.optimizer),
            rollout=rollout,
            kept=kept,
            tokens=tokens,
            device=device,
            decode_rows=decode_rows(cfg),
            held=held,
            agree=agree,
            side_passes=tuple(lambda m, f=f: f(m, longest) for f in side_passes),
            fix_hint=size_hint
            + ("" if cfg.quantization == "4bit" else "quantization=4bit (frees the weights' memory); ")
            + f"a smaller lora_r (now {cfg.lora_r}) or logprob_chunk_size (now {cfg.logprob_chunk_size}: the LM head's "
            f"float32 logits are chunk × vocab {vocab}); a smaller model; or free memory / raise memory_budget.",
            rollout_hint=(
                f"Lower eval_num_samples (now {cfg.eval_num_samples}) or the largest eval_pass_k (now "
                f"{max(cfg.eval_pass_k or [0])}): the eval decodes that many samples of a prompt at once; "
                if eval_decode
                else f"Lower prompts_per_step (now {cfg.prompts_per_step}) or num_generations (now "
                f"{cfg.num_generations}); "
            )
            + size_hint
            + "a smaller model; or free memory / raise memory_budget.",
        )

        def planned() -> MemoryPlan:
            plan = None
            # The reward models' scoring forwards have no estimate from shapes: those runs are measured.
            if cfg.memory_probe == "auto" and estimate is not None and not side_passes:
                plan = plan_from_shapes(estimate(tokens, longest), run_pass, set_checkpointing, sizes)
            return plan_memory(run_pass, set_checkpointing, **sizes) if plan is None else plan

        try:
            plan = planned()
        except MemoryBudgetError:
            if cfg.decode_mode != "auto" or mode != "compiled":
                raise
            # 'auto' chose the compiled decode, whose static caches stay allocated between rollouts: where they
            # do not fit, the eager sampler (which keeps nothing) may. Its refusal, if it does not fit either.
            sizes["rollout"], sizes["kept"] = decode_memory(
                model.config, shapes, embeddings.dtype, vocab, "eager", device
            )
            plan = planned()
            give_up(
                model,
                f"decode_mode auto: the compiled decode's static caches ({kept / MiB:,.0f} MiB, kept between "
                "rollouts) do not fit the memory budget beside training; the eager sampler's rollouts do",
            )
    finally:
        set_rng_state(rng)
        model.train(was_training)
    if device.type == "cuda":
        plan.allocator = allocator_setting()
    if num_processes > 1:  # every process the same sizes (CPU measurements vary a little)
        from accelerate.utils import broadcast_object_list

        chosen = broadcast_object_list([(plan.micro_batch_size, plan.gradient_checkpointing)])[0]
        plan.micro_batch_size, plan.gradient_checkpointing = chosen
        set_gradient_checkpointing(model, chosen[1])
    return plan


FAR_UNDER = 4  # a plan from shapes needing under 1/FAR_UNDER of the budget is taken without measuring


def plan_from_shapes(
    estimate: Callable[[int, bool], float],
    run_pass: Callable[[int, bool], None],
    set_checkpointing: Callable[[bool], None],
    sizes: dict,
) -> MemoryPlan | None:
    """The plan memory_probe 'auto' makes: plan_memory's choice with the pass estimated from the model's
    shapes, taken as it is when it needs under 1/FAR_UNDER of the budget (the estimate's error cannot
    matter there), else confirmed by one measured pass (training and no-grad) at the size it chose.
    None when that pass does not fit, or the estimate does not fit at all: then the measured sweep
    decides, and words any refusal from measurements."""
    t0 = time.perf_counter()
    try:
        plan = plan_memory(None, lambda on: None, estimate=estimate, **sizes)
    except MemoryBudgetError:
        return None
    size, on = plan.micro_batch_size, plan.gradient_checkpointing
    set_checkpointing(on)
    if plan.need * FAR_UNDER <= plan.budget:
        need = f"~{plan.need / MiB:,.0f} MiB"
        plan.probe = f"not measured: the model's shapes give {need}, under 1/{FAR_UNDER} of the budget"
    else:
        device = sizes["device"]
        peak = sizes.get("agree", float)(
            max(_measured(lambda train=train: run_pass(size, train), device) for train in (True, False))
        )
        need = plan.held + plan.optimizer + max(plan.rollout, plan.kept + peak)
        if need > plan.budget:
            return None
        plan.need, plan.measured, plan.largest = need, {on: {size: peak}}, {on: size}
        plan.probe = "one pass measured at the size the model's shapes give"
    plan.seconds = time.perf_counter() - t0
    return plan


def resume_sizes(plan: MemoryPlan | None, config, current: tuple, saved: tuple) -> tuple[tuple, str | None]:
    """The (micro_batch_size, gradient_checkpointing) a resumed run uses, and a line saying so (None:
    nothing to say). An 'auto' size takes the checkpoint's when the probe found it to fit (the same
    accumulation order: an exact resume); otherwise this start's stays."""
    if plan is None or saved == current or None in saved:
        return current, None
    if not plan.fits(*saved):
        return current, (
            f"the checkpoint ran micro_batch_size {saved[0]}, gradient_checkpointing {saved[1]}; that "
            f"does not fit now: using {current[0]}, {current[1]}"
        )
    size = saved[0] if config.micro_batch_size == "auto" else current[0]
    on = saved[1] if config.gradient_checkpointing == "auto" else current[1]
    plan.micro_batch_size, plan.gradient_checkpointing = size, on
    return (
        (size, on),
        f"resumed with the checkpoint's micro_batch_size {size}, gradient_checkpointing {'on' if on else 'off'}",
    )
