"""Sections 3 and 5, the decode: the compiled sampler against the eager one on section 2's trained
model (tokens/s, the same rows, each greedy token the eager model's argmax up to rounding, what
dynamo recorded), and again after optimizer steps and reference syncs in float32 and bf16."""

from __future__ import annotations

import torch

from benchmarks._common import QWEN2_SHAPES, even_token_share, token_prompts
from benchmarks.gpu_check.common import CudagraphSkips, tiny_config
from benchmarks.gpu_check.harness import Run, Skip, fresh_compiler, mib, release

# Section 3's eager decode: this share of the recipe's completion length on CUDA.
EAGER_SHARE = 4


@torch.no_grad()
def greedy_margin(model, rollout, rows: int = 4) -> tuple[float, float]:
    """(the largest margin by which the model's own logits, in one teacher-forced forward over a greedy
    rollout's tokens with the policy adapter, prefer another token to the one the decode chose; the
    largest |logit|). 0 for a decode that followed those logits exactly: a decode whose kernels round
    otherwise shows near-ties here, a wrong decode margins of the logits' own scale."""
    from lora_grpo.model.adapters import POLICY, use_adapter

    ids, mask, chosen = rollout.input_ids, rollout.attention_mask, rollout.completion_ids
    width, margin, largest = chosen.shape[1], 0.0, 0.0
    with use_adapter(model, POLICY):
        for s in range(0, ids.shape[0], rows):
            m = mask[s : s + rows]
            positions = (m.long().cumsum(-1) - 1).clamp(min=0)
            logits = (
                model(
                    input_ids=ids[s : s + rows],
                    attention_mask=m,
                    position_ids=positions,
                    logits_to_keep=width + 1,
                )
                .logits[:, :-1]
                .float()
            )
            real = rollout.completion_mask[s : s + rows].bool()
            gap = logits.max(-1).values - logits.gather(-1, chosen[s : s + rows, :, None]).squeeze(-1)
            if real.any():
                margin = max(margin, gap[real].max().item())
                largest = max(largest, logits[real].abs().max().item())
            del logits
    return margin, largest


def greedy_verdict(model, eager, fast) -> tuple[float, float, float, float]:
    """Two greedy rollouts of the same prompts, by the eager sampler and another: (the share of rows
    with the same tokens, the eager and the other decode's greedy_margin, the other's tolerance: the
    logits' rounding, 8 ulps of the largest, or 4 times the eager decode's own margin)."""
    # The eager decode may be the shorter (section 3): greedy tokens are compared over its length.
    width = min(eager.completion_ids.shape[1], fast.completion_ids.shape[1])
    same = (eager.completion_ids[:, :width] == fast.completion_ids[:, :width]).all(1).float().mean().item()
    (m_eager, z_eager), (m_fast, z_fast) = greedy_margin(model, eager), greedy_margin(model, fast)
    dtype = model.get_input_embeddings().weight.dtype
    tolerance = 1e-3 + 8 * torch.finfo(dtype).eps * max(z_eager, z_fast)
    return same, m_eager, m_fast, max(tolerance, 4 * m_eager)


def compare_greedy(
    model, tokenizer, texts, device, mode: str, num_generations: int, prompt: int, completion: int
):
    """Greedy rollouts of `texts` by the eager sampler and by `mode`, and their greedy_verdict."""
    from lora_grpo.rollout import generate_rollout

    def sample(decode_mode):
        return generate_rollout(
            model,
            tokenizer,
            texts,
            num_generations=num_generations,
            max_prompt_length=prompt,
            max_completion_length=completion,
            temperature=0.0,
            generator=torch.Generator(device=device),
            decode_mode=decode_mode,
        )

    return greedy_verdict(model, sample("eager"), sample(mode))


def check_decode(run: Run) -> None:
    from lora_grpo.device import now
    from lora_grpo.rollout import fast_decode, generate_rollout

    got = run.results.pop(2, None)
    if got is None:
        raise Skip("needs section 2's trained model")
    trainer, prompts = got
    cfg, device = trainer.config, run.device
    fast = "compiled" if run.cuda else "static"
    texts = [p["prompt"] for p in prompts[: cfg.prompts_per_step]]
    # The eager decode runs ~10x slower a token (the first GPU run: 347 tokens/s, 71 s for the recipe's
    # 384 tokens): on CUDA it decodes a quarter of them, the same rate, the first quarter of each row's
    # greedy tokens compared. The compiled decode keeps the recipe's length (the shape training compiled).
    lengths = {
        "eager": cfg.max_completion_length // (EAGER_SHARE if run.cuda else 1),
        fast: cfg.max_completion_length,
    }
    rollouts = {}
    for mode, attempts in (("eager", ("first",)), (fast, ("first", "second"))):
        for attempt in attempts:
            start = now(device)
            rollout = generate_rollout(
                trainer.model,
                trainer.tokenizer,
                texts,
                num_generations=cfg.num_generations,
                max_prompt_length=cfg.max_prompt_length,
                max_completion_length=lengths[mode],
                temperature=0.0,
                generator=torch.Generator(device=device),
                decode_mode=mode,
            )
            seconds = now(device) - start
            rollouts[mode] = rollout
            tokens = int(rollout.completion_mask.sum())
            run.findings[f"{mode}_{attempt}_tokens_per_s"] = tokens / seconds
            print(
                f"{mode:8s} {attempt:6s} call (up to {lengths[mode]} tokens a row): {tokens} tokens in "
                f"{seconds:.2f} s = {tokens / seconds:,.0f} tokens/s"
                + (" (the shape training compiled)" if mode == "compiled" and attempt == "first" else "")
            )
    if not run.cuda:
        run.not_here("the compiled sampler (CUDA graphs): 'static' stands in")
    why = fast_decode.unavailable(trainer.model)
    run.expect(why is None, f"the {fast} sampler ran {fast} ({why or 'not refused'})")
    print(f"kept caches {mib(fast_decode.kept_cache_bytes(trainer.model))} MiB")
    same, m_eager, m_fast, tolerance = greedy_verdict(trainer.model, rollouts["eager"], rollouts[fast])
    run.findings.update({"same_rows": same, "margin_eager": m_eager, "margin_fast": m_fast})
    print(
        f"greedy rows with the same tokens, {fast} vs eager: {same:.0%} (bf16 kernels and attention over padded "
        "slots may flip near-ties on a GPU)"
    )
    run.expect(
        m_fast <= tolerance,
        f"each {fast} greedy token is the eager model's argmax up to rounding: margin {m_fast:.3g} ≤ {tolerance:.3g} "
        f"(eager's own {m_eager:.3g})",
    )
    counters = torch._dynamo.utils.counters
    breaks = sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])
    run.findings["graph_breaks"] = sum(v for _, v in breaks)
    run.findings["graph_break_reasons"] = [reason[:200] for reason, _ in breaks[:5]]
    print(
        f"dynamo: {counters['stats'].get('unique_graphs', 0)} graphs, {sum(v for _, v in breaks)} graph breaks; "
        f"frames {dict(counters['frames'])} (more compiled frames than graphs: recompiles, see the stderr lines)"
    )
    for reason, count in breaks[:8]:
        print(f"  graph break ×{count}: {reason[:200]}")
    del trainer


def check_decode_after_updates(run: Run) -> None:
    from lora_grpo import GRPOTrainer
    from lora_grpo.model.adapters import POLICY, lora_layers
    from lora_grpo.rollout import fast_decode

    shape = run.shape("small")
    path = run.model(shape, torch.float32)
    fast = "compiled" if run.cuda else "static"
    if not run.cuda:
        run.not_here("the compiled sampler and its cudagraph skips: 'static' stands in")
    prompts = token_prompts(QWEN2_SHAPES[shape]["vocab_size"], 16, count=32)
    completion = 8 if run.args.cpu else 32
    for dtype, alpha in (("float32", 1.0), ("bfloat16", 0.6)):
        fresh_compiler(run)
        config = tiny_config(
            path,
            f"{run.root}/after-updates-{dtype}",
            torch_dtype=dtype,
            decode_mode=fast,
            lora_r=16,
            lora_alpha=32,
            prompts_per_step=4,
            micro_batch_size=16,
            max_completion_length=completion,
            ref_sync_steps=1,
            ref_sync_alpha=alpha,
            max_steps=2,
            save_steps=0,
        )
        with CudagraphSkips() as skips:
            trainer = GRPOTrainer(config, reward_funcs=[even_token_share], train_dataset=prompts)
            trainer.train()
        history = trainer.state.log_history
        lora_b = max(m.lora_B[POLICY].weight.abs().max().item() for _, m in lora_layers(trainer.model))
        why = fast_decode.unavailable(trainer.model)
        print(
            f"{dtype}: 2 steps, sync alpha {alpha} after each; max |lora_B| {lora_b:.3g}; cudagraph skips "
            f"{skips.count}; decode {fast}: {why or 'ran'}"
        )
        run.expect(lora_b > 0, f"{dtype}: lora_B is off zero after the optimizer steps")
        run.expect(history[0].get("sync/event") == 1.0, f"{dtype}: a sync between the two rollouts")
        run.expect(why is None, f"{dtype}: the {fast} sampler ran {fast} ({why or 'not refused'})")
        if run.cuda:
            run.expect(
                skips.count == 0, f"{dtype}: the training decode ran as CUDA graphs ({skips.reasons[:2]})"
            )
        texts = [p["prompt"] for p in prompts[:4]]
        same, m_eager, m_fast, tolerance = compare_greedy(
            trainer.model, trainer.tokenizer, texts, run.device, fast, 4, None, completion
        )
        print(f"{dtype}: greedy rows with the same tokens, {fast} vs eager: {same:.0%}")
        run.findings[dtype] = {
            "same_rows": same,
            "margin_eager": m_eager,
            "margin_fast": m_fast,
            "cudagraph_skips": skips.count,
            "cudagraph_skip_reasons": skips.reasons[:5],
            "lora_b_max": lora_b,
        }
        if dtype == "float32":
            run.expect(same >= 0.9, f"float32: {same:.0%} of greedy rows the same (≥ 90%)")
        run.expect(
            m_fast <= tolerance,
            f"{dtype}: each {fast} greedy token is the eager model's argmax up to rounding: margin "
            f"{m_fast:.3g} ≤ {tolerance:.3g}",
        )
        del trainer
        release(run)
