"""RewardModel: a tiny sequence-classification model built here, scored against its own backbone and
score head run by hand on hand-built token ids; nothing is downloaded."""

import pytest
import torch
from helpers import tiny_reward_model

from lora_grpo.rewards import RewardModel
from lora_grpo.tasks.toy import make_tokenizer

PROMPTS = ["07+45=", "9+9=", "1+22="]
COMPLETIONS = ["052", "18", "abc 23\n"]
CHAT_PROMPTS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}],
    [{"role": "user", "content": "3+4=?"}],
]
CHAT_COMPLETIONS = [
    [{"role": "assistant", "content": "hello"}],
    [{"role": "assistant", "content": "4"}],
    [{"role": "assistant", "content": "7 it is"}],
]
# The toy chat template, written out: "role: content\n" per message, no generation prompt.
CHAT_TEXTS = [
    "user: hi\nassistant: hello\n",
    "system: add\nuser: 2+2=\nassistant: 4\n",
    "user: 3+4=?\nassistant: 7 it is\n",
]


@torch.no_grad()
def by_hand(model, tokenizer, texts):
    """Score 0 at the last token of each text alone: backbone → last hidden state → score head."""
    out = []
    for text in texts:
        ids = torch.tensor([[tokenizer.convert_tokens_to_ids(ch) for ch in text]])  # one token per character
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
        out.append((hidden @ model.score.weight[0]).item())
    return out


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_reward_model(tok)


def test_text_rows_score_prompt_plus_completion(model, tok):
    rm = RewardModel(model, tok)
    expected = by_hand(model, tok, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    scores = rm(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 3, trainer_state=None)
    assert isinstance(scores, list) and all(isinstance(s, float) for s in scores)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 3  # the texts really differ in score
    # Not the prompt alone, nor the completion alone.
    assert scores[0] != pytest.approx(by_hand(model, tok, [PROMPTS[0]])[0], abs=1e-4)


def test_conversational_rows_go_through_the_chat_template(model, tok):
    rm = RewardModel(model, tok)
    scores = rm(prompts=CHAT_PROMPTS, completions=CHAT_COMPLETIONS)
    assert scores == pytest.approx(by_hand(model, tok, CHAT_TEXTS), abs=1e-5)
    # A text completion after message prompts is one assistant message.
    assert rm(prompts=CHAT_PROMPTS[:1], completions=["hello"]) == pytest.approx(scores[:1], abs=1e-6)


@pytest.mark.parametrize("batch_size", [1, 2, 64])
def test_batching_gives_the_same_numbers(model, tok, batch_size):
    # Mixed lengths, so batches are right-padded; the model reads each row at its last real token.
    prompts, completions = PROMPTS + CHAT_PROMPTS, COMPLETIONS + CHAT_COMPLETIONS
    one_at_a_time = [
        RewardModel(model, tok, batch_size=1)(prompts=[p], completions=[c])[0]
        for p, c in zip(prompts, completions)
    ]
    scores = RewardModel(model, tok, batch_size=batch_size)(prompts=prompts, completions=completions)
    assert scores == pytest.approx(one_at_a_time, abs=1e-5)
    assert scores == pytest.approx(
        by_hand(model, tok, [p + c for p, c in zip(PROMPTS, COMPLETIONS)] + CHAT_TEXTS), abs=1e-5
    )


def test_eval_mode_and_no_grad(tok):
    model = tiny_reward_model(tok, seed=1, dropout=0.5)
    expected = by_hand(model, tok, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    model.train()
    rm = RewardModel(model, tok)
    assert not model.training
    model.train()  # whatever the caller does in between, scoring runs without dropout
    grad_enabled = []
    model.register_forward_hook(lambda *a: grad_enabled.append(torch.is_grad_enabled()))
    assert rm(prompts=PROMPTS, completions=COMPLETIONS) == pytest.approx(expected, abs=1e-5)
    assert grad_enabled == [False] and all(p.grad is None for p in model.parameters())


def test_saved_and_loaded_by_path(model, tok, tmp_path):
    path = tmp_path / "tiny-rm"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    rm = RewardModel(str(path))  # the tokenizer is loaded from the same path
    assert rm.__name__ == "tiny-rm"
    assert rm.model.config.num_labels == 1
    expected = RewardModel(model, tok)(prompts=PROMPTS, completions=COMPLETIONS)
    assert rm(prompts=PROMPTS, completions=COMPLETIONS) == pytest.approx(expected, abs=1e-6)
    assert RewardModel(path, batch_size=2)(
        prompts=CHAT_PROMPTS, completions=CHAT_COMPLETIONS
    ) == pytest.approx(by_hand(model, tok, CHAT_TEXTS), abs=1e-5)


def test_a_reward_model_loaded_in_4bit_or_in_a_dtype_of_its_own_keeps_it_on_the_runs_device(tok, tmp_path):
    """Placed for a run (scorer.place_reward_models): one loaded by path takes the run's dtype, unless model_kwargs
    chose one (kept) or a quantization (transformers refuses to cast a bitsandbytes model: the trainer's
    constructor raised, on the 8 GB setup where a 4-bit reward model is the natural choice; found in review)."""
    from helpers import tiny_config
    from transformers import BitsAndBytesConfig, LlamaForSequenceClassification

    from lora_grpo.scorer import place_reward_models

    path = tmp_path / "tiny-rm"
    # bitsandbytes' CPU layout wants layers of at least one 64-weight block a row
    config = tiny_config("llama", len(tok), num_hidden_layers=1, intermediate_size=128, num_labels=1)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    plain = RewardModel(str(path))
    chosen = RewardModel(str(path), model_kwargs={"dtype": torch.bfloat16})
    quantized = RewardModel(
        str(path), model_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True)}
    )
    place_reward_models([plain, chosen, quantized], torch.device("cpu"), torch.float16)
    assert plain.model.dtype == torch.float16 and chosen.model.dtype == torch.bfloat16
    assert quantized.model.is_quantized and len(quantized(prompts=PROMPTS, completions=COMPLETIONS)) == len(
        PROMPTS
    )


def test_missing_pad_token_becomes_eos_and_the_model_learns_it(tok):
    no_pad = make_tokenizer()
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    model = tiny_reward_model(tok, seed=2)
    model.config.pad_token_id = None
    rm = RewardModel(model, no_pad, batch_size=3)
    assert no_pad.pad_token_id == no_pad.eos_token_id == model.config.pad_token_id
    scores = rm(prompts=PROMPTS, completions=COMPLETIONS)  # padded with eos, read before it
    assert scores == pytest.approx(
        by_hand(model, tok, [p + c for p, c in zip(PROMPTS, COMPLETIONS)]), abs=1e-5
    )


def test_name_and_errors(model, tok):
    assert RewardModel(model, tok).__name__ == "LlamaForSequenceClassification"  # built in memory: no path
    with pytest.raises(ValueError, match="pass tokenizer="):
        RewardModel(model)
    with pytest.raises(ValueError, match="batch_size"):
        RewardModel(model, tok, batch_size=0)


def test_a_sequence_classification_model_in_reward_funcs_is_scored_as_a_reward_model(model, tok, tmp_path):
    """As TRL takes one: wrapped in RewardModel (its tokenizer from its path). It went through as a callable, passed
    the start-up column check and failed at the first step, model(prompts=..., completions=...) (found in review)."""
    from transformers import AutoModelForSequenceClassification

    from lora_grpo.rewards.specs import resolve_reward_funcs

    model.save_pretrained(tmp_path / "tiny-rm")
    tok.save_pretrained(tmp_path / "tiny-rm")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "tiny-rm")
    (fn,) = resolve_reward_funcs([loaded])
    assert isinstance(fn, RewardModel) and fn.model is loaded and fn.__name__ == "tiny-rm"
    assert fn(prompts=PROMPTS, completions=COMPLETIONS) == pytest.approx(
        RewardModel(model, tok)(prompts=PROMPTS, completions=COMPLETIONS), abs=1e-6
    )
