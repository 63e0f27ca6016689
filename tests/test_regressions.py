"""Regression tests: each one failed before the fix it guards (found in code review)."""

import json

import pytest
import torch
from tokenizers import processors

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.logprobs import sequence_log_probs
from lora_grpo.checkpoint import save_adapter
from lora_grpo.model import POLICY, REFERENCE, load_model
from lora_grpo.reference import lora_layers
from lora_grpo.rollout import _tokenize_left_padded
from lora_grpo.toy import make_tiny_model, make_tokenizer


def digit_share(prompts, completions, **kwargs):
    return [sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions]


PROMPTS = [{"prompt": f"{i}+{i % 7}="} for i in range(12)]


def small(tiny_base_dir, tmp_path, **kw):
    base = dict(model_name_or_path=tiny_base_dir, lora_r=4, num_generations=2, prompts_per_step=2,
                max_prompt_length=32, max_completion_length=4, max_steps=3, output_dir=str(tmp_path / "run"), save_steps=0,
                gradient_checkpointing=False, learning_rate=1e-2)
    base.update(kw)
    return GRPOTrainer(GRPOConfig(**base), reward_funcs=[digit_share], train_dataset=PROMPTS)


def test_lr_schedule_spans_every_update_when_the_batch_is_reused(tiny_base_dir, tmp_path):
    trainer = small(tiny_base_dir, tmp_path, num_iterations=3, max_steps=4, lr_scheduler="linear")
    trainer.train()
    lrs = [m["lr"] for m in trainer.history]  # lr of each step's last update
    assert all(lr > 0 for lr in lrs)
    # 12 updates in all, linear to 0: the last step's last update runs at lr·1/12.
    assert lrs[-1] == pytest.approx(1e-2 / 12)


def save_base_with_attention_dropout(path, p: float) -> str:
    tokenizer = make_tokenizer()
    model = make_tiny_model(tokenizer)
    model.config.attention_dropout = p
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_base_model_dropout_is_off(tmp_path):
    path = save_base_with_attention_dropout(tmp_path / "drop", 0.5)
    peft_model, _ = load_model(GRPOConfig(model_name_or_path=path, lora_r=4, gradient_checkpointing=False))
    peft_model.train()
    x = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(peft_model(input_ids=x).logits, peft_model(input_ids=x).logits)


def test_trainer_kl_is_exactly_zero_against_an_identical_reference_with_a_dropout_config(tmp_path):
    trainer = small(save_base_with_attention_dropout(tmp_path / "drop", 0.3), tmp_path, max_steps=1)
    trainer.train()
    assert trainer.history[0]["kl"] == 0.0


def test_log_probs_apply_the_models_logit_softcapping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, final_logit_softcapping=2.0, max_position_embeddings=64)
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # large logits, so the cap matters
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones_like(ids)
    logp, _ = sequence_log_probs(model, ids, mask, 4, chunk_size=3)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1).logits
    ref = torch.log_softmax(logits[:, -5:-1].float(), -1).gather(-1, ids[:, -4:, None]).squeeze(-1)
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)


def test_a_reference_slot_smaller_than_the_policy_builds_for_soft_syncs(tiny_base_dir):
    model, _ = load_model(GRPOConfig(model_name_or_path=tiny_base_dir, lora_r=8, ref_rank=4, ref_sync_alpha=0.5,
                                     gradient_checkpointing=False))
    for _, m in lora_layers(model):
        assert m.lora_A[REFERENCE].weight.shape[0] == 4
        assert not m.lora_B[REFERENCE].weight.any()  # ΔW_ref = 0 = ΔW_policy of a fresh LoRA


def test_init_adapter_takes_the_configs_dropout(tiny_base_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    sft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir),
                         LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear"), adapter_name=POLICY)
    save_adapter(sft, tmp_path / "sft", POLICY)
    model, _ = load_model(GRPOConfig(model_name_or_path=tiny_base_dir, lora_r=4, init_adapter=str(tmp_path / "sft"),
                                     gradient_checkpointing=False))
    dropouts = [m.lora_dropout[POLICY] for _, m in lora_layers(model)]
    assert dropouts and all(not isinstance(d, torch.nn.Dropout) or d.p == 0.0 for d in dropouts)


def test_resume_rewrites_the_metrics_log_from_the_checkpoint(tiny_base_dir, tmp_path):
    small(tiny_base_dir, tmp_path, max_steps=4, save_steps=2, save_total_limit=5).train()
    run = tmp_path / "run"
    small(tiny_base_dir, tmp_path, max_steps=4, resume_from_checkpoint=str(run / "checkpoint-2")).train()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_plain_prompts_get_bos_once_when_the_tokenizer_uses_one():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    assert tokenizer("a")["input_ids"][0] == bos
    ids, mask = _tokenize_left_padded(tokenizer, ["ab", "<s>cd"], None)
    assert ids[0].tolist()[-3:] == [bos] + tokenizer("ab", add_special_tokens=False)["input_ids"]
    assert (ids[1] == bos).sum() == 1  # already there: not doubled
    plain = make_tokenizer()  # no BOS: nothing added
    ids, _ = _tokenize_left_padded(plain, ["ab"], None)
    assert ids[0].tolist() == plain("ab")["input_ids"]


@pytest.mark.parametrize("kwargs", [{"logging_steps": 0}, {"min_p": 1.5}, {"repetition_penalty": 0.0}])
def test_more_config_validation(kwargs):
    from lora_grpo.config import ConfigError

    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        GRPOConfig(model_name_or_path="m", **kwargs)


def test_saved_tiny_base_loads_back_with_the_same_tokenizer(tiny_base_dir):
    # transformers 5 swaps the tokenizer of any qwen2 checkpoint for Qwen2Tokenizer (byte-level BPE):
    # spaces and letters of our character tokenizer would then encode differently.
    from lora_grpo.model import load_tokenizer

    text = "user: <think>a b</think> 12+35=\nassistant: "
    loaded = load_tokenizer(GRPOConfig(model_name_or_path=tiny_base_dir))
    assert loaded(text, add_special_tokens=False)["input_ids"] == make_tokenizer()(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
