"""Section 14, where the step goes: torch.profiler over a few compiled decode token steps of the 0.5B
recipe (its settings on a random Qwen2.5-0.5B-shaped model, 64 rows, 256 + 384 slots; DecodeLoop of
decode_bound.py, the static sampler's own step) and over one update of one micro-batch of a rollout
of that trainer (log-probs, loss, backward, optimizer step: trainer.optimize on UPDATE_MICRO_BATCH rows
with gradient checkpointing, not what 'auto' would choose on the H200; the whole batch's ~220k profiled
ops took 13 s to tabulate on a CPU).

For each: the top kernels by CUDA time, each kind's ms per step (kernel_shares.KINDS: dequantisation,
GEMMs, attention, the vocabulary's softmax / top-p / sampling, norms, copies) and the launches and
gaps (the step's wall time the kernels leave empty) against its floor on this GPU (limit.py's FLOPs
and bytes), as a Markdown table in the log and in summary.json's findings ("decode_table",
"update_table"); the traces, gzipped Chrome traces, to --out (decode-trace.json.gz,
update-trace.json.gz; one over 16 MiB is dropped and named). The 24-layer decode step's seconds go to
section 13 (its weight forms' extrapolation).

On a CPU (the dry run) the profiler's CPU op times stand in for the kernels' and the same table is
made of them."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

from benchmarks._common import QWEN2_SHAPES, MiB, even_token_share, token_prompts
from benchmarks.gpu_check import kernel_shares as ks
from benchmarks.gpu_check.decode_bound import RECIPE, TIMED_STEPS, WARM_STEPS, DecodeLoop
from benchmarks.gpu_check.harness import Run, fresh_compiler

PROFILED_STEPS = 4
UPDATE_MICRO_BATCH = 16
# The most a file under --out may weigh to come back from the lent machine.
TRACE_LIMIT = 16 * MiB


def profiler(run: Run):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    return profile(activities=activities)


def save_trace(run: Run, prof, name: str) -> None:
    """The profile as a gzipped Chrome trace in --out (Perfetto and chrome://tracing read it)."""
    if not run.args.out:
        return
    raw = run.root / f"{name}.json"
    prof.export_chrome_trace(str(raw))
    target = Path(run.args.out) / f"{name}.json.gz"
    with open(raw, "rb") as source, gzip.open(target, "wb", compresslevel=1) as sink:
        shutil.copyfileobj(source, sink)
    raw.unlink()
    size = target.stat().st_size
    if size > TRACE_LIMIT:
        target.unlink()
        print(
            f"({name}: {size / MiB:.1f} MiB gzipped, over the {TRACE_LIMIT / MiB:.0f} MiB a file may weigh: dropped)"
        )
        run.findings.setdefault("traces_dropped", []).append(name)
    else:
        print(f"trace: {target.name} ({size / MiB:.1f} MiB)")
        run.findings.setdefault("traces", []).append(target.name)


def gpu_peak(run: Run) -> ks.Peak:
    """The peak the floors divide by: this GPU's (kernel_shares.DATASHEETS), recorded in the findings;
    the H200's in the CPU dry run."""
    import torch

    at = ks.peak(torch.cuda.get_device_name(run.device)) if run.cuda else ks.H200
    run.findings["floors_for"] = at.device
    return at


def report(run: Run, what: str, prof, wall: float, steps: int, floors: dict[str, float] | None) -> dict:
    """Print and record one profile's top kernels and its table of kinds; -> its seconds per kind."""
    events = ks.events_of(prof, run.cuda)
    per_step = ks.shares(events, wall, steps)
    unit = "CUDA" if run.cuda else "CPU (standing in for CUDA)"
    print(
        f"\n{what}: {steps} step(s), {wall / steps * 1e3:.2f} ms a step of wall time; top kernels by {unit} time:"
    )
    for e in ks.top(events):
        print(
            f"  {e.us / 1e3 / steps:8.3f} ms/step  ×{e.count / steps:g}  [{ks.kind_of(e.name)}] {e.name[:110]}"
        )
    lines = ks.table(per_step, floors)
    print("\n".join(lines))
    key = what.split()[0]
    run.findings[f"{key}_table"] = lines
    run.findings[f"{key}_ms"] = {kind: s * 1e3 for kind, s in per_step.items()}
    run.findings[f"{key}_top"] = [[e.name[:120], round(e.us / 1e3 / steps, 4)] for e in ks.top(events)]
    save_trace(run, prof, f"{key}-trace")
    return per_step


def check_profile(run: Run) -> None:
    from benchmarks.gpu_check.recipe_memory import recipe_config
    from lora_grpo import GRPOTrainer
    from lora_grpo.device import now
    from lora_grpo.rollout.fast_decode import kv_bytes_per_slot

    fresh_compiler(run)
    at = gpu_peak(run)
    shape = run.shape("qwen2.5-0.5b")
    spec = QWEN2_SHAPES[shape]
    path = run.model(shape)
    fast = "compiled" if run.cuda else "static"
    config = recipe_config(
        run,
        RECIPE,
        path,
        f"{run.root}/profile",
        decode_mode=fast,
        micro_batch_size=UPDATE_MICRO_BATCH if run.cuda else 4,
        gradient_checkpointing=True,
        max_steps=1,
        eval_on_end=False,
    )
    rows, prompt, completion = config.generation_batch, config.max_prompt_length, config.max_completion_length
    prompts = token_prompts(spec["vocab_size"], prompt, count=config.prompts_per_step)
    trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
    if not run.cuda:
        run.not_here("CUDA kernel times and the compiled sampler: CPU op times and 'static' stand in")
    print(
        f"{RECIPE} settings on a random {shape}: {rows} rows, {prompt} + {completion} slots, {fast} decode, "
        f"update micro-batches of {config.micro_batch_size} with gradient checkpointing"
    )
    # The decode: compiled, warmed, timed, then profiled.
    model = trainer.model
    start = now(run.device)
    # The recipe's slots (the dry run's 16 new tokens are fewer than the steps run here).
    room = max(completion, WARM_STEPS + TIMED_STEPS + PROFILED_STEPS + 1)
    loop = DecodeLoop(model, rows, prompt, room, compiled=run.cuda)
    for _ in range(WARM_STEPS):
        loop.step()
    print(f"prefill, compile and {WARM_STEPS} warm steps: {now(run.device) - start:.1f} s")
    seconds = loop.seconds(TIMED_STEPS)
    print(f"decode: {seconds * 1e3:.2f} ms a token step = {rows / seconds:,.0f} tokens/s")
    run.findings["decode_step_ms"] = seconds * 1e3
    run.findings["decode_tokens_per_s"] = rows / seconds
    with profiler(run) as prof:
        loop.seconds(PROFILED_STEPS)
    context = prompt + WARM_STEPS + TIMED_STEPS + PROFILED_STEPS // 2
    slots = loop.decoder.attn.shape[1]
    loop.close()
    dtype = model.get_input_embeddings().weight.dtype
    floors = ks.decode_step_floors(
        spec, rows, context, slots, config.lora_r, "4bit", kv_bytes_per_slot(model.config, dtype), at
    )
    run.findings["decode_floor_ms"] = {k: v * 1e3 for k, v in floors.items()}
    if run.cuda:
        launches = ks.graph_launches(prof)
        run.findings["graphs_per_step"] = launches / PROFILED_STEPS
        print(f"CUDA graphs launched a step: {launches / PROFILED_STEPS:g}")
    # The gaps: the unprofiled step's wall time less the profiled kernels' (the profiler slows the host).
    per_step = report(run, "decode token steps", prof, seconds * PROFILED_STEPS, PROFILED_STEPS, floors)
    print(
        f"the step's floor on the {at.device}: {floors['step'] * 1e3:.3g} ms; measured {seconds * 1e3:.2f} ms "
        f"({seconds / floors['step']:,.0f}× the floor)"
    )
    if run.cuda and per_step[ks.GAPS] > 0.9 * seconds:
        print(
            "(the profile holds almost no kernel time: the profiler may not see kernels inside CUDA graphs)"
        )
    run.results[14] = {"seconds": seconds, "layers": spec["num_hidden_layers"]}
    del prof
    # One update: a rollout of the recipe's prompts (the same compiled graph), a warm update, then the
    # profiled one.
    steps, _ = trainer.generation_round({"prompt": [p["prompt"] for p in prompts]})
    # One micro-batch of it: the whole batch's ~220k profiled ops took 13 s to tabulate on a CPU, outside the estimate.
    batch = steps[0].rows(slice(0, config.micro_batch_size))
    start = now(run.device)
    trainer.optimize(batch)
    warm = now(run.device) - start
    start = now(run.device)
    with profiler(run) as prof:
        trainer.optimize(batch)
        profiled = now(run.device) - start
    # The wall time: the faster of the two (the first allocates the optimizer's states, the second is profiled).
    wall = min(warm, profiled)
    T = int(batch.completion_mask.shape[1])
    floors = ks.update_floors(spec, batch.input_ids.shape[0], prompt, T, config.lora_r, recompute=True, at=at)
    run.findings.update(
        update_s=wall, update_floor_s=floors["step"], update_rows=int(batch.input_ids.shape[0])
    )
    report(
        run,
        f"update of {batch.input_ids.shape[0]} rows (log-probs, loss, backward, optimizer step)",
        prof,
        wall,
        1,
        floors,
    )
    print(
        f"update: {warm:.3f} s, profiled {profiled:.3f} s; its floor on the {at.device} {floors['step']:.3g} s "
        f"({wall / floors['step']:,.0f}×)"
    )
    run.expect(seconds > 0 and wall > 0, "the decode and the update were profiled")
    del trainer, prof
