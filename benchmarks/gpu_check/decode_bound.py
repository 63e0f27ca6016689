"""Section 13, what bounds the decode: the compiled sampler's token step of the 0.5B recipe's shape
(Qwen2.5-0.5B's body and 151,936-token vocabulary, random init, 64 rows: 8 prompts × G 8, 256-token
prompts in a cache of the recipe's 256 + 384 slots, temperature 1) with three weight forms, tokens/s
each: the 4-bit base with the LoRA adapter (the recipe's path), a bf16 base with the adapter, and the
bf16 base with the adapter merged (peft's merge_and_unload: plain linears).

Each form is a new torch.compile of the decode (~40-50 s at 24 layers on the H200: three would be
~150 s), so the forms run at FORM_LAYERS of the 24 layers, and section 14's 24-layer step of the
4-bit form (the same loop, the same shape otherwise) splits a step into a part that grows with the
layers and a fixed part (the head, the sampling over the vocabulary, the launches): with it each
form's 24-layer step is extrapolated, assuming the fixed part is the same for all three (the head is
bf16 in each). The differences answer the question: 4-bit + LoRA - bf16 + LoRA is the
dequantisation's cost, bf16 + LoRA - merged LoRA's, and the merged step what the rest costs.

DecodeLoop, the token step measured here and profiled by section 14, is the static sampler's own
(generate.py's _decode_chunk_static): StaticDecoder's step, then sample_next and the one device sync
a token (the EOS check), without the rollout's bookkeeping."""

from __future__ import annotations

import torch

from benchmarks._common import QWEN2_SHAPES, build_qwen2
from benchmarks.gpu_check.harness import Run, fresh_compiler, release

# The layers of the forms' models (the cost of three compiles at 24: the module docstring); the CPU
# dry run's tiny shape keeps its 2.
FORM_LAYERS = 6
# Token steps: compiled and CUDA graphs recorded, then timed.
WARM_STEPS, TIMED_STEPS = 3, 12
RECIPE = "qwen2.5-0.5b-gsm8k-qlora"


class DecodeLoop:
    """The compiled (or, on a CPU, static) sampler's token step on `rows` rows of random `prompt`-token
    prompts with room for `completion` new tokens (the cache's slots: the recipe's), the policy adapter
    active; `step()` runs one token step, `seconds(steps)` times `steps` of them."""

    @torch.no_grad()
    def __init__(self, model, rows: int, prompt: int, completion: int, *, compiled: bool, seed: int = 0):
        from lora_grpo.rollout.fast_decode import StaticDecoder

        self.model, self.completion = model, completion
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.randint(3, vocab, (rows, prompt), generator=self.generator, device=self.device)
        mask = torch.ones_like(ids)
        self.training = model.training
        model.eval()
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1),
            use_cache=True,
            logits_to_keep=1,
        )
        self.logits = out.logits[:, -1]
        # transformers 5 returns the cache as `cache`, earlier versions as `past_key_values`.
        cache = getattr(out, "cache", None)
        cache = out.past_key_values if cache is None else cache
        self.decoder = StaticDecoder(model, cache, mask, completion, compiled=compiled)
        self.positions = mask.sum(1)
        self.eos = torch.tensor([1], device=self.device)
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        from lora_grpo.rollout.sampling import sample_next

        if self.steps >= self.completion - 1:
            raise RuntimeError(
                f"the loop's cache holds {self.completion} new tokens: make `completion` larger"
            )
        tokens, _ = sample_next(
            self.logits,
            None,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
            generator=self.generator,
            overwrite=self.steps == 0,
        )
        # The sampler's one sync a token: whether every row has finished.
        int(torch.isin(tokens, self.eos).sum())
        self.logits = self.decoder.step(tokens, self.positions)
        self.positions = self.positions + 1
        self.steps += 1

    def seconds(self, steps: int) -> float:
        """Seconds per token step over `steps` steps (the device's queue drained before and after)."""
        from lora_grpo.device import now

        start = now(self.device)
        for _ in range(steps):
            self.step()
        return (now(self.device) - start) / steps

    def close(self) -> None:
        self.model.train(self.training)
        del self.decoder


def recipe_shape(run: Run) -> dict:
    """The loop's shape: the recipe's rows, prompt and completion tokens (the dry run's on a CPU)."""
    from benchmarks.gpu_check.recipe_memory import recipe_config

    config = recipe_config(run, RECIPE, "unused", "unused")
    return {
        "rows": config.generation_batch,
        "prompt": config.max_prompt_length,
        "completion": config.max_completion_length,
        "lora_r": config.lora_r,
    }


def measure_form(run: Run, model, shape: dict, what: str) -> float:
    """Seconds per token step of `model` in DecodeLoop (compiled on a GPU), after WARM_STEPS."""
    from lora_grpo.device import now

    fresh_compiler(run)
    start = now(run.device)
    room = max(shape["completion"], WARM_STEPS + TIMED_STEPS + 1)
    loop = DecodeLoop(model, shape["rows"], shape["prompt"], room, compiled=run.cuda)
    for _ in range(WARM_STEPS):
        loop.step()
    warm = now(run.device) - start
    seconds = loop.seconds(TIMED_STEPS)
    loop.close()
    print(
        f"{what}: {seconds * 1e3:.2f} ms a token step = {shape['rows'] / seconds:,.0f} tokens/s "
        f"(prefill, compile and {WARM_STEPS} warm steps {warm:.1f} s)",
        flush=True,
    )
    return seconds


def extrapolate(forms: dict[str, float], layers: int, full: float, full_layers: int, four_bit: str):
    """Each form's step at `full_layers`: the 4-bit form's steps at `layers` and `full_layers` give
    its fixed part f and per-layer part p (t = f + L·p); each form keeps f, its per-layer part is its
    own (t - f) / layers. -> (f, {form: seconds at full_layers})."""
    per_layer = (full - forms[four_bit]) / (full_layers - layers)
    fixed = forms[four_bit] - layers * per_layer
    return fixed, {form: fixed + full_layers * (t - fixed) / layers for form, t in forms.items()}


def check_decode_bound(run: Run) -> None:
    from benchmarks.gpu_check.recipe_memory import recipe_config
    from lora_grpo.model.adapters import POLICY
    from lora_grpo.model.load import load_model

    full = run.results.pop(14, None)
    shape_name = run.shape("qwen2.5-0.5b")
    spec = QWEN2_SHAPES[shape_name]
    layers = FORM_LAYERS if not run.args.cpu else spec["num_hidden_layers"]
    dtype = torch.bfloat16 if run.cuda else torch.float32
    path = run.root / f"forms-{shape_name}-{layers}"
    build_qwen2(shape_name, path, dtype, device=run.device, num_hidden_layers=layers)
    shape = recipe_shape(run)
    print(
        f"{shape_name} with {layers} of its {spec['num_hidden_layers']} layers (random init), {shape['rows']} rows, "
        f"{shape['prompt']} + {shape['completion']} slots, LoRA r {shape['lora_r']}, temperature 1; "
        f"{'compiled' if run.cuda else 'static'} decode"
    )
    if not run.cuda:
        run.not_here("the compiled sampler (CUDA graphs) and bitsandbytes' CUDA kernels: 'static' stands in")
    forms: dict[str, float] = {}
    names = ("4-bit base + LoRA", "bf16 base + LoRA", "bf16 base, LoRA merged")
    for quantization, name in zip(("4bit", "none"), names):
        config = recipe_config(
            run,
            RECIPE,
            str(path),
            f"{run.root}/forms-{quantization}",
            quantization=quantization,
            gradient_checkpointing=False,
            micro_batch_size=1,
        )
        model, _ = load_model(config, device_map={"": run.device})
        model.set_adapter(POLICY)
        forms[name] = measure_form(run, model, shape, name)
        if quantization == "none":
            merged = model.merge_and_unload(adapter_names=[POLICY])
            forms[names[2]] = measure_form(run, merged, shape, names[2])
            del merged
        del model
        release(run)
    run.findings["layers"] = layers
    run.findings["ms_per_step"] = {name: t * 1e3 for name, t in forms.items()}
    run.findings["tokens_per_s"] = {name: shape["rows"] / t for name, t in forms.items()}
    dequant, lora = forms[names[0]] - forms[names[1]], forms[names[1]] - forms[names[2]]
    print(
        f"at {layers} layers: dequantisation {dequant * 1e3:.2f} ms, LoRA {lora * 1e3:.2f} ms, the rest (the merged "
        f"step) {forms[names[2]] * 1e3:.2f} ms of the 4-bit + LoRA step's {forms[names[0]] * 1e3:.2f} ms"
    )
    if full is None:
        print("(section 14's 24-layer step is missing: no extrapolation to 24 layers)")
        return
    if full["layers"] == layers:
        at_full = dict(forms)
        fixed = None
    else:
        fixed, at_full = extrapolate(forms, layers, full["seconds"], full["layers"], names[0])
    run.findings["full_layers"] = full["layers"]
    run.findings["measured_full_ms"] = full["seconds"] * 1e3
    run.findings["extrapolated_full_ms"] = {name: t * 1e3 for name, t in at_full.items()}
    if fixed is not None:
        run.findings["fixed_ms"] = fixed * 1e3
        print(
            f"4-bit + LoRA at {full['layers']} layers (section 14): {full['seconds'] * 1e3:.2f} ms a step: "
            f"{fixed * 1e3:.2f} ms fixed (head, vocabulary, launches) + "
            f"{(full['seconds'] - fixed) / full['layers'] * 1e3:.3f} ms a layer"
        )
    parts = {
        "dequantisation": at_full[names[0]] - at_full[names[1]],
        "LoRA": at_full[names[1]] - at_full[names[2]],
        "the rest": at_full[names[2]],
    }
    run.findings["bound_ms"] = {k: v * 1e3 for k, v in parts.items()}
    how = "extrapolated" if fixed is not None else "measured"
    print(f"| form | ms / step at {full['layers']} layers ({how}) | tokens/s |\n|---|---|---|")
    for name, t in at_full.items():
        print(f"| {name} | {t * 1e3:.2f} | {shape['rows'] / t:,.0f} |")
    holds = max(parts, key=parts.get)
    run.findings["holds_the_step"] = holds
    print(
        f"what holds the 4-bit + LoRA step at {at_full[names[0]] * 1e3:.1f} ms: {holds}; "
        + ", ".join(f"{k} {v * 1e3:.2f} ms ({v / at_full[names[0]]:.0%})" for k, v in parts.items())
    )
    run.expect(all(t > 0 for t in forms.values()), "every form decoded")
