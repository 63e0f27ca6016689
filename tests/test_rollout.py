"""Rollout: prefix-shared sampling matches plain generation, masks/shapes, and the logit filters."""

import warnings

import pytest
import torch
from helpers import HYBRIDS, load_4bit, tiny_config
from tokenizers import processors

from lora_grpo.rollout import (
    Rollout,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    generate_rollout,
    sample_next,
    tokenize_prompts,
    warp_logits,
)
from lora_grpo.tasks.toy import make_tiny_model, make_tokenizer

NEG = float("-inf")
# Different lengths, so the batch is really left-padded.
RAGGED_PROMPTS = ["1+2=", "what is 12*3? ", "hi"]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def tiny_model(tok, eos_scale: float):
    """A tiny random model whose EOS row of the LM head is scaled, so EOS is emitted sometimes."""
    model = make_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= eos_scale
    return model.eval()


def full_forward_logits(model, rollout: Rollout) -> torch.Tensor:
    """No-cache forward over prompt+completion -> (B, T, V) logits that predicted each completion token."""
    mask = rollout.attention_mask
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=rollout.input_ids, attention_mask=mask, position_ids=position_ids).logits
    P, T = rollout.prompt_ids.size(1), rollout.completion_ids.size(1)
    return logits[:, P - 1 : P + T - 1]


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 20, 0.9, 0.02)],
)
def test_sampling_logprobs_match_full_forward(tok, temperature, top_k, top_p, min_p):
    model = tiny_model(tok, eos_scale=25.0)
    g = torch.Generator().manual_seed(0)
    r = generate_rollout(
        model,
        tok,
        RAGGED_PROMPTS,
        num_generations=4,
        max_prompt_length=None,
        max_completion_length=12,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generator=g,
    )
    # The case the test relies on: some rows stopped at EOS, some ran to the limit.
    assert r.truncated.any() and (~r.truncated).any()
    warped = warp_logits(
        full_forward_logits(model, r), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    expected = warped.log_softmax(-1).gather(2, r.completion_ids[..., None]).squeeze(2)
    m = r.completion_mask.bool()
    torch.testing.assert_close(r.sampling_logprobs[m], expected[m], atol=1e-5, rtol=0)
    assert (r.sampling_logprobs[~m] == 0).all()


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_a_hybrid_models_samples_carry_the_log_probs_of_each_prompt_alone(tok, model_type):
    """Qwen3.5 (linear attention) and LFM2 (short convolutions): the prefill's convolution and recurrent states are
    repeated for the G samples and dropped with the rows that end, as keys and values are; each completion's
    log-probs are those of its prompt and completion forwarded alone, without the batch's padding."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(
        model_type,
        len(tok),
        num_hidden_layers=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **HYBRIDS[model_type],
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 25.0
    r = generate_rollout(
        model,
        tok,
        RAGGED_PROMPTS,
        num_generations=4,
        max_prompt_length=None,
        max_completion_length=12,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    assert r.truncated.any() and (~r.truncated).any()  # rows ended early and were dropped from the cache
    for row in range(r.completion_ids.size(0)):
        prompt = r.prompt_ids[row][r.prompt_mask[row].bool()]
        completion = r.completion_ids[row][r.completion_mask[row].bool()]
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1]
        alone = logits.log_softmax(-1).gather(1, completion[:, None]).squeeze(1)
        torch.testing.assert_close(r.sampling_logprobs[row, : len(completion)], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("repetition_penalty", [1.0, 1.5])
def test_greedy_equals_hf_generate(tok, repetition_penalty):
    model = tiny_model(tok, eos_scale=3.0)
    r = generate_rollout(
        model,
        tok,
        RAGGED_PROMPTS,
        num_generations=2,
        max_prompt_length=None,
        max_completion_length=12,
        temperature=0.0,
        repetition_penalty=repetition_penalty,
    )
    enc = tok(
        RAGGED_PROMPTS, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    ref = model.generate(
        **enc,
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        repetition_penalty=repetition_penalty,
    )[:, enc.input_ids.size(1) :]
    ref = torch.nn.functional.pad(ref, (0, 12 - ref.size(1)), value=tok.pad_token_id)
    ours = torch.nn.functional.pad(
        r.completion_ids, (0, 12 - r.completion_ids.size(1)), value=tok.pad_token_id
    )
    assert torch.equal(ours, ref.repeat_interleave(2, 0))
    assert torch.equal(r.prompt_ids, enc.input_ids.repeat_interleave(2, 0))
    if repetition_penalty == 1.0:  # mixed case, so the comparison covers stopping too
        assert r.truncated.any() and (~r.truncated).any()


def test_prefix_is_prefilled_once_and_micro_batches_agree(tok):
    model = tiny_model(tok, eos_scale=3.0)
    calls = []
    record = lambda mod, args, kw: calls.append(tuple(kw["input_ids"].shape))  # noqa: E731
    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    kwargs = dict(num_generations=3, max_prompt_length=None, max_completion_length=6, temperature=0.0)
    r = generate_rollout(model, tok, RAGGED_PROMPTS, **kwargs)
    P = r.prompt_ids.size(1)
    assert calls[0] == (3, P)  # the 3 distinct prompts, not 9 rows
    # Then one token per running row per step: a row leaves the batch once it has emitted EOS, so
    # the decode call for token t holds exactly the rows with no EOS among their first t tokens.
    T = r.completion_ids.size(1)
    assert calls[1:] == [(int(r.completion_mask[:, t].sum()), 1) for t in range(1, T)]
    assert calls[-1][0] < 9  # rows really finished and were dropped
    calls.clear()
    r2 = generate_rollout(model, tok, RAGGED_PROMPTS, micro_batch_prompts=2, **kwargs)
    hook.remove()
    assert [c[0] for c in calls if c[1] > 1] == [2, 1]  # two prefills: 2 prompts, then 1
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(r, name), getattr(r2, name)), name
    assert r.completions == r2.completions


# --------------------------------------------------------------------------- structure


def test_shapes_groups_masks_and_decoding(tok):
    model = tiny_model(tok, eos_scale=25.0)
    G, T = 4, 12
    r = generate_rollout(
        model,
        tok,
        RAGGED_PROMPTS,
        num_generations=G,
        max_prompt_length=None,
        max_completion_length=T,
        generator=torch.Generator().manual_seed(1),
    )
    B, P = len(RAGGED_PROMPTS) * G, max(len(p) for p in RAGGED_PROMPTS)  # char tokenizer: one token per char
    assert r.prompt_ids.shape == r.prompt_mask.shape == (B, P)
    assert r.completion_ids.shape == r.completion_mask.shape == (B, T)
    assert r.input_ids.shape == r.attention_mask.shape == (B, P + T)
    assert r.truncated.shape == (B,) and len(r.prompts) == len(r.completions) == B
    assert r.prompts == [p for p in RAGGED_PROMPTS for _ in range(G)]
    assert r.prompt_mask.sum(1).tolist() == [len(p) for p in RAGGED_PROMPTS for _ in range(G)]
    # Left padding: the real prompt tokens sit at the right end of each row.
    assert (r.prompt_ids[r.prompt_mask == 0] == tok.pad_token_id).all()
    assert (r.prompt_mask[:, -1] == 1).all()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert r.truncated.any() and (~r.truncated).any()
    for i in range(B):
        ids, mask = r.completion_ids[i].tolist(), r.completion_mask[i].tolist()
        if r.truncated[i]:
            assert eos not in ids and all(mask)
            n = T
        else:
            n = ids.index(eos) + 1  # first EOS, inclusive
            assert mask == [1] * n + [0] * (T - n)
            assert ids[n:] == [pad] * (T - n)
        assert r.completion_lengths[i] == n
        text = "".join(t for t in tok.convert_ids_to_tokens(ids[:n]) if t not in ("<eos>", "<pad>"))
        assert r.completions[i] == text
    moved = r.to("cpu")
    assert isinstance(moved, Rollout) and torch.equal(moved.completion_ids, r.completion_ids)


def test_left_truncation_keeps_last_tokens_and_warns(tok):
    model = tiny_model(tok, eos_scale=1.0)
    prompts = ["abcdefghij", "xyz"]
    with pytest.warns(UserWarning, match=r"1 of 2 prompts.*max_prompt_length=5"):
        r = generate_rollout(
            model,
            tok,
            prompts,
            num_generations=2,
            max_prompt_length=5,
            max_completion_length=2,
            temperature=0.0,
        )
    assert r.prompt_ids.size(1) == 5
    assert tok.decode(r.prompt_ids[0]) == "fghij"
    assert r.prompt_mask[2].tolist() == [0, 0, 1, 1, 1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate_rollout(
            model,
            tok,
            prompts,
            num_generations=1,
            max_prompt_length=10,
            max_completion_length=2,
            temperature=0.0,
        )
    assert not [w for w in caught if "max_prompt_length" in str(w.message)]


# --------------------------------------------------------------------------- input errors


def test_prompt_longer_than_context_raises_before_the_model_runs(tok):
    model = make_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=32)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    prompts = ["1+2=", "x" * 30, "y" * 40]
    with pytest.raises(ValueError) as info:
        generate_rollout(
            model,
            tok,
            prompts,
            num_generations=2,
            max_prompt_length=None,
            max_completion_length=8,
            temperature=0.0,
        )
    msg = str(info.value)
    assert "2 of 3 prompts do not fit the model's context of 32 tokens" in msg
    assert "max_completion_length=8" in msg
    assert "prompt 1 ('xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'), has 30 tokens" in msg
    assert "Set max_prompt_length to at most 24" in msg and "filter" in msg
    assert not calls
    with pytest.warns(UserWarning, match="left-truncated"):  # the fix works
        r = generate_rollout(
            model,
            tok,
            prompts,
            num_generations=2,
            max_prompt_length=24,
            max_completion_length=8,
            temperature=0.0,
        )
    assert r.prompt_ids.size(1) == 24


def test_pad_token_equal_to_eos(tok):
    """A tokenizer without a pad token gets EOS as pad (model.load_tokenizer): the rollout is the same."""
    model = tiny_model(tok, eos_scale=3.0)
    pad_is_eos = make_tokenizer()
    pad_is_eos.pad_token = pad_is_eos.eos_token
    assert pad_is_eos.pad_token_id == pad_is_eos.eos_token_id
    kwargs = dict(
        num_generations=3,
        max_prompt_length=None,
        max_completion_length=12,
        temperature=0.0,
        micro_batch_prompts=2,
    )
    r, r_eos = (
        generate_rollout(model, tok, RAGGED_PROMPTS, **kwargs),
        generate_rollout(model, pad_is_eos, RAGGED_PROMPTS, **kwargs),
    )
    assert r.truncated.any() and (~r.truncated).any()
    for name in ("prompt_mask", "completion_mask", "truncated", "sampling_logprobs"):
        assert torch.equal(getattr(r, name), getattr(r_eos, name)), name
    m = r.completion_mask.bool()
    assert torch.equal(r.completion_ids[m], r_eos.completion_ids[m])
    assert (r_eos.completion_ids[~m] == tok.eos_token_id).all()
    assert r.completions == r_eos.completions


def test_missing_eos_or_pad_token_says_how_to_fix(tok):
    model = tiny_model(tok, eos_scale=3.0)
    no_eos = make_tokenizer()
    no_eos.eos_token = None
    assert no_eos.eos_token_id is None
    kwargs = dict(num_generations=1, max_prompt_length=None, max_completion_length=4, temperature=0.0)
    generate_rollout(model, no_eos, RAGGED_PROMPTS, **kwargs)  # the generation config's EOS is enough
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError) as info:
        generate_rollout(model, no_eos, RAGGED_PROMPTS, **kwargs)
    msg = str(info.value)
    assert "no EOS token" in msg and "tokenizer.eos_token_id is None" in msg
    assert "set tokenizer.eos_token = " in msg and "model.generation_config.eos_token_id = " in msg
    no_pad = make_tokenizer()
    no_pad.pad_token = None
    with pytest.raises(ValueError, match=r"no pad token.*tokenizer.pad_token = tokenizer.eos_token"):
        generate_rollout(model, no_pad, RAGGED_PROMPTS, **kwargs)
    # neither pad nor EOS in the tokenizer, the generation config's EOS: pad_token = eos_token would set None
    no_pad.eos_token = None
    model.generation_config.eos_token_id = tok.eos_token_id
    with pytest.raises(ValueError) as info:
        generate_rollout(model, no_pad, RAGGED_PROMPTS, **kwargs)
    token = tok.convert_ids_to_tokens(tok.eos_token_id)
    msg = str(info.value)
    assert f"tokenizer.pad_token = {token!r}" in msg and "= tokenizer.eos_token" not in msg
    no_pad.pad_token = token  # what the message says to set: the rollout runs
    generate_rollout(model, no_pad, RAGGED_PROMPTS, **kwargs)


# Failed before the fix it guards (code review): plain-text prompts reached models that expect BOS
# (Llama, Gemma) without one.
def test_plain_prompts_get_bos_once_when_the_tokenizer_uses_one():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    assert tokenizer("a")["input_ids"][0] == bos
    ids, mask = tokenize_prompts(tokenizer, ["ab", "<s>cd"], None)
    assert ids[0].tolist()[-3:] == [bos] + tokenizer("ab", add_special_tokens=False)["input_ids"]
    assert (ids[1] == bos).sum() == 1  # already there: not doubled
    plain = make_tokenizer()  # no BOS: nothing added
    ids, _ = tokenize_prompts(plain, ["ab"], None)
    assert ids[0].tolist() == plain("ab")["input_ids"]


def test_chat_prompts_get_only_their_templates_special_tokens_and_text_prompts_bos(tmp_path):
    """A tokenizer that puts BOS before text and a chat template that does not write it (ChatML on a Llama-style
    tokenizer): a chat-rendered prompt is fed as apply_chat_template(tokenize=True) gives it (TRL's prompt ids),
    a text prompt with BOS once; in the rollout of a run and in the start-up's prompt lengths alike."""
    from transformers import AutoTokenizer

    from lora_grpo import GRPOConfig, GRPOTrainer
    from lora_grpo.data.prompts import PROMPT_MESSAGES
    from lora_grpo.tasks.toy import save_tiny_base

    base = save_tiny_base(tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.bos_token = "<unk>"  # a token the model has
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<unk> $A", special_tokens=[("<unk>", tokenizer.bos_token_id)]
    )
    tokenizer.save_pretrained(base)
    messages = [{"role": "user", "content": "1+2="}]

    def trainer_of(rows, **fields):
        return GRPOTrainer(
            GRPOConfig(
                model_name_or_path=str(base),
                output_dir=str(tmp_path / "run"),
                num_generations=2,
                prompts_per_step=2,
                max_completion_length=2,
                gradient_checkpointing=False,
                **fields,
            ),
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            train_dataset=rows,
        )

    trainer = trainer_of([{"prompt": messages}, {"prompt": messages}])
    tok, bos = trainer.tokenizer, trainer.tokenizer.bos_token_id
    assert tok("a")["input_ids"][0] == bos
    chat = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert chat[0] != bos  # the template writes no BOS
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rollout = trainer.sampler.sample(
        [text, "1+2="], 1, 0.0, None, {"prompt": [text, "1+2="], PROMPT_MESSAGES: [messages, None]}
    )
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)]
    assert rows == [chat, [bos] + tok("1+2=", add_special_tokens=False)["input_ids"]]
    assert trainer.prompt_lengths["train_dataset"].longest == len(chat)
    # text prompts that use_chat_template renders as a user message are chat-rendered too
    trainer = trainer_of([{"prompt": "1+2="}, {"prompt": "1+2="}], use_chat_template=True)
    rollout = trainer.sampler.sample([text], 1, 0.0, None, {"prompt": [text], PROMPT_MESSAGES: [None]})
    assert rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist() == chat
    assert trainer.prompt_lengths["train_dataset"].longest == len(chat)


# --------------------------------------------------------------------------- pure filters


def test_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0]])
    out = apply_top_k(logits, 2)
    assert torch.equal(out[0], torch.tensor([NEG, 3.0, 2.0, NEG]))
    assert torch.equal(apply_top_k(logits, 1)[1], torch.tensor([NEG, 2.0, 2.0, NEG]))  # ties kept
    assert torch.equal(apply_top_k(logits, 0), logits)


def test_top_p():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.05, 0.15, 0.3, 0.5]])
    logits = probs.log()
    finite = lambda x: torch.isfinite(x).tolist()  # noqa: E731
    assert finite(apply_top_p(logits, 0.7)) == [[False, True, False, True], [False, False, True, True]]
    assert finite(apply_top_p(logits, 0.85)) == [[True, True, False, True], [False, True, True, True]]
    assert finite(apply_top_p(logits, 0.4)) == [[False, True, False, False], [False, False, False, True]]
    kept = apply_top_p(logits, 0.7)
    assert torch.equal(kept[torch.isfinite(kept)], logits[torch.isfinite(kept)])  # survivors untouched
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def test_top_p_keeps_the_tokens_generates_warper_keeps_when_tokens_tie_at_the_cut():
    """bfloat16 logits tie often; which of the tied tokens at the nucleus's edge survive is what transformers'
    TopPLogitsWarper (TRL's sampler) keeps: they differed in most rows before (found in review)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(200, 2000, generator=g) * 2.5).to(torch.bfloat16).float()
    for p in (0.5, 0.9, 0.95):
        ours = torch.isfinite(apply_top_p(logits, p))
        theirs = torch.isfinite(TopPLogitsWarper(p)(None, logits))
        assert torch.equal(ours, theirs), (p, (ours != theirs).any(-1).sum())


def test_min_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(apply_min_p(logits, 0.2)).tolist() == [[True, True, True, False]]  # < 0.1 dropped
    assert torch.isfinite(apply_min_p(logits, 0.5)).tolist() == [[True, True, False, False]]  # < 0.25 dropped
    assert torch.equal(apply_min_p(logits, 0.0), logits)


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert torch.equal(apply_repetition_penalty(logits, seen, 2.0), torch.tensor([[1.0, -2.0, 0.5, -3.0]]))
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.0), logits)


def test_temperature_before_top_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # At T=1 the top token (0.5) is short of 0.6; at T=0.5 it has ~0.68 and stands alone.
    assert torch.isfinite(warp_logits(logits, temperature=1.0, top_k=0, top_p=0.6, min_p=0.0)).sum() == 2
    cold = warp_logits(logits, temperature=0.5, top_k=0, top_p=0.6, min_p=0.0)
    assert torch.isfinite(cold).tolist() == [[True, False, False, False]]
    assert cold[0, 0] == logits[0, 0] / 0.5


def test_sample_next_greedy_and_distribution():
    params = dict(top_k=0, top_p=1.0, min_p=0.0)
    logits = torch.tensor([[2.0, 1.5]])
    seen = torch.tensor([[True, False]])
    tok, lp = sample_next(logits, seen, temperature=0.0, repetition_penalty=2.0, generator=None, **params)
    assert tok.tolist() == [1] and lp.tolist() == [0.0]  # penalty flips the argmax
    probs = torch.tensor([0.5, 0.3, 0.2])
    many = probs.log().expand(20000, 3)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(many, None, temperature=1.0, repetition_penalty=1.0, generator=g, **params)
    freq = torch.bincount(tok, minlength=3).float() / tok.numel()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    torch.testing.assert_close(lp, probs.log()[tok])
    g2 = torch.Generator().manual_seed(0)
    tok2, _ = sample_next(many, None, temperature=1.0, repetition_penalty=1.0, generator=g2, **params)
    assert torch.equal(tok, tok2)


def _draw_as_before(logits, seen, temperature, penalty, generator):
    """The draw written out as the sampler computed it before it reused buffers: a new tensor per op."""
    x = logits.float()
    if seen is not None:
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    lp = (x / temperature).log_softmax(-1)
    tok = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1)
    return tok, lp.gather(1, tok[:, None]).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("overwrite", [False, True])
def test_buffer_reuse_draws_the_same_bits(dtype, temperature, penalty, overwrite):
    logits = (torch.randn(16, 3001, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    seen = torch.rand(16, 3001, generator=torch.Generator().manual_seed(2)) < 0.05 if penalty != 1.0 else None
    want = _draw_as_before(logits, seen, temperature, penalty, torch.Generator().manual_seed(3))
    given = logits.clone()
    got = sample_next(
        given,
        seen,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=penalty,
        generator=torch.Generator().manual_seed(3),
        overwrite=overwrite,
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if not overwrite:
        assert torch.equal(given, logits)  # the caller's logits are left alone unless it says otherwise


def test_without_filters_one_vocabulary_sized_temporary_is_made():
    from torch.profiler import ProfilerActivity, profile

    def peak(fn):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        live = top = 0
        for e in sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]"
        ):
            live += e[1]
            top = max(top, live)
        return top

    N, V = 8, 151936  # Qwen2.5's vocabulary
    logits, row = torch.randn(N, V), N * V * 4
    args = dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    ours = (
        peak(
            lambda: sample_next(
                logits.clone(), None, temperature=0.7, generator=torch.Generator(), overwrite=True, **args
            )
        )
        - row
    )  # the clone is the caller's
    before = peak(lambda: _draw_as_before(logits, None, 0.7, 1.0, torch.Generator()))
    assert (
        ours < 2.2 * row < before
    )  # the log-probs and multinomial's own scratch; before: 3 more (N, V) tensors


# --------------------------------------------------------------------------- peft + 4-bit


def test_peft_lora_on_4bit_base(tiny_base_dir):
    peft = pytest.importorskip("peft")
    from transformers import AutoTokenizer

    base = load_4bit(tiny_base_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_dir)
    # Random (non-zero) B so the adapter, and hence LoRA dropout, changes the output.
    lora = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.5,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(base, lora)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    enable_ckpt = (
        getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    )
    enable_ckpt()  # the trainer's setting; the rollout must still use its KV cache
    model.train()
    model.base_model.model.model.layers[0].eval()  # a mixed state, restored exactly
    before = {name: m.training for name, m in model.named_modules()}
    with warnings.catch_warnings():  # the cache goes in under its current keyword, not a deprecated one
        warnings.filterwarnings("error", message=".*past_key_values.*")
        r = generate_rollout(
            model,
            tokenizer,
            RAGGED_PROMPTS,
            num_generations=2,
            max_prompt_length=None,
            max_completion_length=8,
            temperature=0.0,
        )
    assert {name: m.training for name, m in model.named_modules()} == before
    assert r.completion_ids.shape[0] == 6
    # Greedy tokens are the argmax of an eval-mode (dropout off) full forward at every real position.
    model.eval()
    logits = full_forward_logits(model, r)
    m = r.completion_mask.bool()
    assert torch.equal(logits.argmax(-1)[m], r.completion_ids[m])


def test_a_context_extended_by_yarn_without_raising_max_position_embeddings_counts_the_extension():
    """Qwen2.5's model cards enable YaRN as rope_scaling (yarn, factor 4, original 32768) and leave
    max_position_embeddings at 32768: transformers runs 131072 positions, the context check refused above 32768
    (found in review). A config that raised max_position_embeddings itself (Phi-3's longrope) stays as it is."""
    from transformers import Qwen2Config

    from lora_grpo.rollout.generate import context_limit

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_limit(Qwen2Config(max_position_embeddings=32768, rope_scaling=yarn)) == 131072
    assert context_limit(Qwen2Config(max_position_embeddings=131072, rope_scaling=yarn)) == 131072
    assert context_limit(Qwen2Config(max_position_embeddings=32768)) == 32768


@pytest.mark.parametrize("decode_mode", ["static", "eager"])
def test_the_decode_loop_reads_one_number_back_per_token(decode_mode):
    """On a GPU every read of a tensor's value on the host waits for the device: the loop needs one per token
    (how many rows finished). A step where rows finished read their indices back too (nonzero), 13 more reads
    over 32 tokens of 64 rows (found in review); their number is known on the host already."""
    from helpers import DecodeLoopReads

    tok = make_tokenizer()
    model = make_tiny_model(tok, max_positions=512).eval()
    with torch.no_grad():  # rows end at many different steps
        model.lm_head.weight[tok.eos_token_id] += 0.08 * model.lm_head.weight.mean(0) + 0.02
    prompts = [f"{i:02d}+{(7 * i) % 100:02d}=" for i in range(8)]
    counted = DecodeLoopReads()
    with counted:
        rollout = generate_rollout(
            model,
            tok,
            prompts,
            num_generations=8,
            max_prompt_length=None,
            max_completion_length=32,
            temperature=1.0,
            decode_mode=decode_mode,
            generator=torch.Generator().manual_seed(0),
        )
    lengths = rollout.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 5  # rows finished at many steps
    assert counted.in_loop.count("__int__") == int(lengths.max()) and "nonzero" not in counted.in_loop
    # (eager: transformers' sdpa mask check reads the padding mask at each forward)
    if decode_mode == "static":
        assert counted.in_loop == ["__int__"] * int(lengths.max())


def test_a_chat_completion_is_the_message_the_tokenizers_response_parser_reads_as_in_trl():
    """TRL builds a conversational completion with the tokenizer's response parser when it has one (a tokenizer
    a TRL tool run saved carries Qwen's): reasoning in reasoning_content, the answer in content. The decoded text
    whole was the content here, so a reward reading the answer scored 0 where TRL's scored 1 (found in review)."""
    from helpers import QWEN_RESPONSE_TEMPLATE, qwen_style_tokenizer

    from lora_grpo.rollout.generate import response_messages

    trl_chat = pytest.importorskip("trl.chat_template_utils")
    tok = qwen_style_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "2+3?"}], tokenize=False, add_generation_prompt=True
    )
    prefix = tok(prompt, add_special_tokens=False)["input_ids"]
    answers = ["<think>\n2 plus 3 is 5\n</think>\n\nThe answer is 5<|im_end|>", "5<|im_end|>", "no end"]
    ids = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
    assert response_messages(tok, ids, [prefix] * 3, [True] * 3) is None  # no parser: the text is the content
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    ours = response_messages(tok, ids, [prefix] * 3, [True, True, False])
    theirs = [trl_chat.parse_response(tok, i, prefix=prefix) for i in ids[:2]]
    assert ours[:2] == [[m] for m in theirs] and ours[2] is None
    assert ours[0][0]["content"] == "The answer is 5" and ours[0][0]["reasoning_content"] == "2 plus 3 is 5"
