"""Fast decode: the static-cache sampler, compiled or not, draws the eager sampler's tokens and
log-probs from the same generator; compilation failures fall back to eager with one message."""

import logging

import pytest
import torch
from helpers import load_4bit, sliding_window_model

from lora_grpo import config as config_module
from lora_grpo.config import ConfigError, GRPOConfig
from lora_grpo.model.adapters import POLICY, REFERENCE, lora_layers, use_adapter
from lora_grpo.model.load import attach_adapters
from lora_grpo.rollout import fast_decode, generate_rollout
from lora_grpo.rollout import generate as rollout_module
from lora_grpo.tasks.toy import make_tiny_model, make_tokenizer

# Ragged (left-padded) prompts; with the model below, sampling ends some rows at EOS within the
# limit and not others, at temperature 1 and greedily alike.
PROMPTS = ["1+2=", "what is 12*3? ", "hi", "7"]
SAMPLING = {  # name → generate_rollout sampling arguments
    "temperature 1": {"temperature": 1.0},
    "greedy": {"temperature": 0.0},
    "filters + repetition penalty": {
        "temperature": 0.8,
        "top_k": 20,
        "top_p": 0.9,
        "repetition_penalty": 1.3,
    },
}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def lora_model(tok, *, seed: int = 0):
    """A tiny Llama with the trainer's "policy" and "reference" adapters, both with random non-zero
    B (so each adapter changes the output), EOS boosted so that some completions end early."""
    base = make_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=seed)
    with torch.no_grad():
        base.lm_head.weight[tok.eos_token_id] *= 12
    model = attach_adapters(
        base, GRPOConfig(model_name_or_path="tiny", lora_r=4, lora_alpha=8, gradient_checkpointing=False)
    )
    randomize_lora(model, seed)
    return model


def randomize_lora(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_layers(model):
            for adapter in (POLICY, REFERENCE):
                m.lora_B[adapter].weight.normal_(0, 0.1, generator=g)


def rollout(model, tok, mode: str, *, G: int = 3, max_new: int = 10, micro_batch_prompts=None, **sampling):
    return generate_rollout(
        model,
        tok,
        PROMPTS,
        num_generations=G,
        max_prompt_length=None,
        max_completion_length=max_new,
        generator=torch.Generator().manual_seed(0),
        micro_batch_prompts=micro_batch_prompts,
        decode_mode=mode,
        **sampling,
    )


def assert_same_rollout(got, expected) -> None:
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.completion_mask, expected.completion_mask)
    assert torch.equal(got.truncated, expected.truncated)
    # float32 rounding: the static cache attends over more (masked) slots, another summation order
    torch.testing.assert_close(got.sampling_logprobs, expected.sampling_logprobs, atol=1e-5, rtol=1e-5)
    assert got.completions == expected.completions


def compile_count() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("sampling", list(SAMPLING), ids=list(SAMPLING))
def test_static_cache_sampler_matches_eager(tok, sampling):
    model = lora_model(tok)
    eager = rollout(model, tok, "eager", **SAMPLING[sampling])
    # What makes the comparison mean something: rows that stop early next to rows that run on.
    assert eager.truncated.any() and (~eager.truncated).any()
    assert_same_rollout(rollout(model, tok, "static", **SAMPLING[sampling]), eager)
    # Chunks of different sizes (3 prompts, then 1): two static caches, the same draws.
    assert_same_rollout(
        rollout(model, tok, "static", micro_batch_prompts=3, **SAMPLING[sampling]),
        rollout(model, tok, "eager", micro_batch_prompts=3, **SAMPLING[sampling]),
    )


def test_compiled_sampler_matches_eager_and_compiles_once(tok):
    """One compile (about 10-20 s on 2 CPU cores) serves every rollout of the same shape, also after
    the policy's weights changed and the adapters were switched back and forth, as in training."""
    torch._dynamo.reset()
    model = lora_model(tok)
    eager = {name: rollout(model, tok, "eager", **SAMPLING[name]) for name in ("temperature 1", "greedy")}
    for name, expected in eager.items():
        assert_same_rollout(rollout(model, tok, "compiled", **SAMPLING[name]), expected)
    compiled = compile_count()
    assert compiled >= 1 and fast_decode.unavailable(model) is None
    randomize_lora(model, seed=1)  # an optimizer step, in place
    with use_adapter(model, REFERENCE):  # a reference forward between rollouts
        pass
    after_step = rollout(model, tok, "eager", **SAMPLING["temperature 1"])
    assert not torch.equal(after_step.sampling_logprobs, eager["temperature 1"].sampling_logprobs)
    assert_same_rollout(rollout(model, tok, "compiled", **SAMPLING["temperature 1"]), after_step)
    assert compile_count() == compiled, "a later rollout recompiled"


# --------------------------------------------------------------------------- fallback


def test_compile_refused_falls_back_to_eager_with_one_message(tok, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("torch.compile is not supported on this Python")

    monkeypatch.setattr(torch, "compile", refuse)
    model = lora_model(tok)
    eager = rollout(model, tok, "eager")
    with caplog.at_level(logging.WARNING, logger="lora_grpo.rollout.fast_decode"):
        first = rollout(model, tok, "compiled")
        second = rollout(model, tok, "compiled")
    assert_same_rollout(first, eager)
    assert_same_rollout(second, eager)
    messages = [r.getMessage() for r in caplog.records if r.name == "lora_grpo.rollout.fast_decode"]
    assert len(messages) == 1, messages
    assert "torch.compile is not supported on this Python" in messages[0] and "eager sampler" in messages[0]
    assert "torch.compile is not supported" in fast_decode.unavailable(model)


def test_failure_while_compiling_finishes_the_rollout_then_goes_eager(tok, monkeypatch, caplog):
    """torch.compile is lazy: a missing C++ compiler or an untraceable op shows at the first call,
    mid-rollout. That rollout finishes uncompiled, with the same tokens; later ones are eager."""
    calls = []

    def lazy_failure(fn, **kwargs):
        def compiled(*args):
            calls.append(1)
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return compiled

    static_chunks = []

    class CountingDecoder(fast_decode.StaticDecoder):
        def __init__(self, *args, **kwargs):
            static_chunks.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", lazy_failure)
    monkeypatch.setattr(rollout_module, "StaticDecoder", CountingDecoder)
    model = lora_model(tok)
    eager = rollout(model, tok, "eager")
    with caplog.at_level(logging.WARNING, logger="lora_grpo.rollout.fast_decode"):
        assert_same_rollout(rollout(model, tok, "compiled"), eager)
        assert_same_rollout(rollout(model, tok, "compiled"), eager)
    assert len(calls) == 1 and len(static_chunks) == 1  # tried once; the second rollout was eager
    messages = [r.getMessage() for r in caplog.records if r.name == "lora_grpo.rollout.fast_decode"]
    assert len(messages) == 1 and "No working C++ compiler" in messages[0], messages


@pytest.mark.parametrize(
    "kind, attention",
    [("gemma3", "sdpa"), ("gemma2", "eager"), ("mistral", "sdpa"), ("gemma3", "flex_attention")],
)
def test_a_sliding_window_model_decodes_statically_with_the_eager_samplers_tokens(tok, kind, attention):
    """A window of 6 tokens, narrower than the prompts (up to 14 tokens) and the decodes (24): the static
    cache keeps every slot in every layer and the model masks each sliding layer's window over them, so
    the tokens are the eager sampler's (whose cache keeps only the window). With a window wider than every
    decode the sliding layers attend to everything: a different rollout, so the window was in force. Flex
    attention reads the query's offset when its kernel runs, after the cache advanced: the static layers
    give it a copy."""
    model = sliding_window_model(tok, kind, window=6, attention=attention)
    eager = rollout(model, tok, "eager")
    assert eager.truncated.any() and (~eager.truncated).any()
    assert_same_rollout(rollout(model, tok, "static"), eager)
    assert fast_decode.unavailable(model) is None
    if attention == "flex_attention":
        return  # flex runs uncompiled on a CPU, slowly: the one comparison
    assert_same_rollout(
        rollout(model, tok, "static", micro_batch_prompts=3),
        rollout(model, tok, "eager", micro_batch_prompts=3),
    )
    wide = sliding_window_model(tok, kind, window=64, attention=attention)
    assert not torch.equal(rollout(wide, tok, "eager").sampling_logprobs, eager.sampling_logprobs)


def test_a_sliding_window_model_compiles_its_decode_once(tok):
    """Gemma 3 (a sliding layer of a 6-token window beside a full one), compiled: the eager sampler's
    tokens, one compile for every rollout of the shape (transformers' own sliding static layer counts its
    fill in a Python int: a recompile a token)."""
    torch._dynamo.reset()
    model = sliding_window_model(tok, "gemma3", window=6)
    eager = rollout(model, tok, "eager")
    assert_same_rollout(rollout(model, tok, "compiled"), eager)
    compiled = compile_count()
    assert_same_rollout(rollout(model, tok, "compiled"), eager)
    assert compiled >= 1 and compile_count() == compiled and fast_decode.unavailable(model) is None


def test_a_model_that_attends_in_chunks_is_refused():
    """Llama 4's chunked attention: transformers builds its static layers as sliding ones, but flash attention
    refuses them past a chunk; eager, and why."""
    from types import SimpleNamespace

    from transformers import Llama4TextConfig

    reason = fast_decode._unsupported(SimpleNamespace(config=Llama4TextConfig(attention_chunk_size=8)))
    assert reason.startswith("the model attends in chunks (attention_chunk_size 8)"), reason


def test_a_model_of_other_attention_layers_is_refused_with_one_message(tok, caplog, monkeypatch):
    """A static cache of layers other than full or sliding attention (chunked, linear): eager, said once."""
    from transformers import cache_utils

    class ChunkedLayer(cache_utils.StaticLayer):
        pass

    model = lora_model(tok)
    real = cache_utils.StaticCache.__init__

    def chunked(self, config, max_cache_len, **kwargs):
        real(self, config, max_cache_len, **kwargs)
        self.layers = [ChunkedLayer(max_cache_len=max_cache_len) for _ in self.layers]

    monkeypatch.setattr(cache_utils.StaticCache, "__init__", chunked)
    with caplog.at_level(logging.WARNING, logger="lora_grpo.rollout.fast_decode"):
        got = rollout(model, tok, "static")
        rollout(model, tok, "static")
    monkeypatch.undo()
    assert_same_rollout(got, rollout(model, tok, "eager"))
    messages = [r.getMessage() for r in caplog.records if r.name == "lora_grpo.rollout.fast_decode"]
    assert len(messages) == 1 and "['ChunkedLayer'] layers" in messages[0], messages
    assert "full and sliding-window attention only" in messages[0]


def test_static_sampler_on_a_4bit_base(tiny_base_dir):
    from transformers import AutoTokenizer

    base = load_4bit(tiny_base_dir, portable=True)  # as the trainer does: one 4-bit kernel, both samplers
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_dir)
    model = attach_adapters(
        base, GRPOConfig(model_name_or_path="tiny", lora_r=4, lora_alpha=8, gradient_checkpointing=False)
    )
    randomize_lora(model, seed=0)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    assert_same_rollout(
        rollout(model, tokenizer, "static", G=2, max_new=6),
        rollout(model, tokenizer, "eager", G=2, max_new=6),
    )


def identity_compile(fail: dict):
    """A torch.compile stand-in that returns the function itself (no inductor: seconds, not tens of
    seconds), so "compiled" runs the static path as compiled decoding does; fail["now"] makes the
    compiled call raise, as a compile that fails mid-run does."""

    def compile(fn, **kwargs):
        def compiled(*args):
            if fail["now"]:
                raise RuntimeError("InductorError: out of memory while recording a CUDA graph")
            return fn(*args)

        return compiled

    return compile


def test_only_compiled_decoding_keeps_its_static_caches(tok, monkeypatch):
    monkeypatch.setattr(torch, "compile", identity_compile({"now": False}))
    model = lora_model(tok)
    rollout(model, tok, "static")
    # Failed before the fix (defect 1): an uncompiled static rollout kept its caches for good.
    assert fast_decode.kept_cache_bytes(model) == 0
    rollout(model, tok, "compiled")  # CUDA graphs need the same cache addresses on every rollout: kept
    # exactly the bytes the memory plan counts for it (prompts of at most 15 tokens + 10: 64 slots)
    assert fast_decode.kept_cache_bytes(model) == fast_decode.static_cache_bytes(
        model.config, len(PROMPTS) * 3, 25, torch.float32
    )
    rollout(model, tok, "compiled", max_new=60)  # a longer cache (96 slots) replaces the one it holds
    assert [key[:2] for key in fast_decode._state(model).caches] == [(12, 96)]
    # fewer rows, shorter: decoded in the kept cache (6 rows of 12, 64 of 96 slots needed), the same draws
    assert_same_rollout(
        rollout(model, tok, "compiled", max_new=10, G=2), rollout(model, tok, "eager", max_new=10, G=2)
    )
    assert [key[:2] for key in fast_decode._state(model).caches] == [(12, 96)]


# Failed before the fix (defect 2): after a failed compile the run decoded eagerly for good, but the
# static caches and the compiled step stayed allocated.
def test_a_failed_compile_frees_what_the_compiled_path_kept(tok, monkeypatch, caplog):
    fail = {"now": False}
    monkeypatch.setattr(torch, "compile", identity_compile(fail))
    model = lora_model(tok)
    eager = rollout(model, tok, "eager")
    assert_same_rollout(rollout(model, tok, "compiled"), eager)
    assert fast_decode.kept_cache_bytes(model) > 0 and fast_decode._state(model).compiled is not None
    fail["now"] = True
    with caplog.at_level(logging.WARNING, logger="lora_grpo.rollout.fast_decode"):
        assert_same_rollout(rollout(model, tok, "compiled"), eager)  # that rollout finishes uncompiled
    assert "out of memory while recording" in fast_decode.unavailable(model)
    assert fast_decode.kept_cache_bytes(model) == 0 and not fast_decode._state(model).caches
    assert fast_decode._state(model).compiled is None


# --------------------------------------------------------------------------- modes and config


# Failed before the fix (defect 3): 'auto' compiled on every CUDA device, also where Triton cannot
# serve the model's dtype (bf16 on a T4), so the static sampler ran uncompiled over padded slots.
def test_auto_compiles_only_where_it_pays_and_says_what_it_chose_once(tok, monkeypatch, caplog):
    from lora_grpo import device as device_module

    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    monkeypatch.setattr(device_module, "_triton_installed", lambda: True)
    cuda = torch.device("cuda")
    model = lora_model(tok)
    assert fast_decode.resolve_decode_mode("auto", model, torch.device("cpu")) == "eager"
    assert fast_decode.resolve_decode_mode("auto", lora_model(tok), cuda) == "compiled"
    capability["value"] = (7, 5)  # a T4: float32 compiles, emulated bf16 does not
    assert fast_decode.resolve_decode_mode("auto", lora_model(tok), cuda) == "compiled"
    bf16 = lora_model(tok).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="lora_grpo.rollout.fast_decode"):
        assert fast_decode.resolve_decode_mode("auto", bf16, cuda) == "eager"
        assert fast_decode.resolve_decode_mode("auto", bf16, cuda) == "eager"
    lines = [r for r in caplog.records if r.name == "lora_grpo.rollout.fast_decode"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    assert (
        "decode_mode auto → eager" in lines[0].getMessage() and "no native bfloat16" in lines[0].getMessage()
    )
    # forced modes are what they say
    assert fast_decode.resolve_decode_mode("static", model, torch.device("cpu")) == "static"
    assert fast_decode.resolve_decode_mode("compiled", bf16, cuda) == "compiled"
    with pytest.raises(ValueError, match="decode_mode='fast'"):
        rollout(model, tok, "fast")


def test_config_decode_mode():
    assert config_module.DECODE_MODES == fast_decode.DECODE_MODES
    assert GRPOConfig(model_name_or_path="tiny").decode_mode == "auto"
    assert GRPOConfig(model_name_or_path="tiny", decode_mode="compiled").decode_mode == "compiled"
    with pytest.raises(ConfigError, match="did you mean 'compiled'"):
        GRPOConfig(model_name_or_path="tiny", decode_mode="compile")


def test_cache_length_buckets():
    # powers of two and 1.5x them: attention over at most 1.5x the slots needed
    assert [fast_decode.cache_length(n) for n in (1, 64, 65, 96, 97, 128, 129, 700, 769)] == [
        64,
        64,
        96,
        96,
        128,
        128,
        192,
        768,
        1024,
    ]


def test_trainer_passes_decode_mode_to_the_rollout(tiny_base_dir, tmp_path, monkeypatch):
    from helpers import make_trainer

    from lora_grpo import sampler as sampler_module

    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", decode_mode="static")
    passed = {}
    monkeypatch.setattr(sampler_module, "generate_rollout", lambda *args, **kwargs: passed.update(kwargs))
    trainer.generate(["1+1="])
    assert passed["decode_mode"] == "static"


# --------------------------------------------------------------------------- graph breaks


class _RequiresGradCalls(torch.overrides.TorchFunctionMode):
    """Counts Tensor.requires_grad_() calls: what dynamo before torch 2.13 breaks a graph at."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.Tensor.requires_grad_
        return func(*args, **(kwargs or {}))


# Failed before the fix (issue 48): gradient checkpointing, switched on by the memory probe and left
# on or off, kept transformers' input-requires-grad hook on the embeddings, whose requires_grad_()
# ran in every compiled decode step: 7 graph breaks on the first GPU run (torch 2.11).
def test_the_compiled_decode_step_traces_as_one_graph_after_checkpointing_was_toggled(tok):
    from lora_grpo.model.load import set_gradient_checkpointing

    model = lora_model(tok)
    set_gradient_checkpointing(model, True)  # the probe's tries: on, then the plan's choice
    set_gradient_checkpointing(model, False)
    set_gradient_checkpointing(model, True)
    model.eval()
    inner = fast_decode._transformers_model(model)
    N, P = 3, 5
    ids = torch.randint(3, 40, (N, P), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(N, P, dtype=torch.long)
    with torch.no_grad():
        prefill = inner(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        decoder = fast_decode.StaticDecoder(model, prefill, mask, 4, compiled=False)
        args = (ids[:, -1:], decoder.attn, torch.full((N, 1), P), decoder.cache)
        with _RequiresGradCalls() as calls:
            decoder.forward(*args)
        assert calls.calls == 0, "the decode step reaches Tensor.requires_grad_()"
        # dynamo's own count, on this torch (no inductor: tracing only, seconds)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(decoder.forward)(*args)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


# --------------------------------------------------------------------------- compile cache


def test_the_compiled_decode_loads_the_compile_cache_first_and_saves_each_new_shape_once(tok, monkeypatch):
    from lora_grpo.rollout import compile_cache

    events = []
    stand_in = identity_compile({"now": False})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: events.append("compile") or stand_in(fn, **kw))
    monkeypatch.setattr(compile_cache, "load", lambda device: events.append(("load", device.type)) or 0)
    monkeypatch.setattr(compile_cache, "save", lambda device: events.append(("save", device.type)))
    model = lora_model(tok)
    rollout(model, tok, "compiled")
    assert events == [("load", "cpu"), "compile", ("save", "cpu")]  # saved after the first step
    rollout(model, tok, "compiled")  # the same shape: nothing new to save
    assert events == [("load", "cpu"), "compile", ("save", "cpu")]
    rollout(model, tok, "compiled", max_new=60)  # a new cache shape (96 slots) compiles again: saved
    assert events[3:] == [("save", "cpu")]
    rollout(model, tok, "static")  # the uncompiled static decoder touches no cache
    assert len(events) == 4
