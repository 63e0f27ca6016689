"""Start-up checks (startup.py): what a run will really hold against the model's context, each prompt
tokenised once, and nothing probed or sampled by a trainer that only evaluates."""

import pytest
from helpers import PROMPTS, digit_share, make_trainer

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.model.adapters import POLICY
from lora_grpo.tasks.toy import make_tiny_model, make_tokenizer


def _model_with_context(context: int):
    tokenizer = make_tokenizer()
    model = make_tiny_model(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=context
    )
    return model, tokenizer


def _trainer(model, tokenizer, prompts, tmp_path, **fields):
    config = GRPOConfig(
        **{
            "model_name_or_path": "in-memory",
            "num_generations": 2,
            "prompts_per_step": 2,
            "max_steps": 1,
            "save_steps": 0,
            "micro_batch_size": 4,
            "gradient_checkpointing": False,
            "output_dir": str(tmp_path / "run"),
            **fields,
        }
    )
    from lora_grpo.model.load import attach_adapters

    return GRPOTrainer(
        config,
        reward_funcs=[digit_share],
        train_dataset=[{"prompt": p} for p in prompts],
        model=attach_adapters(model, config),
        tokenizer=tokenizer,
    )


@pytest.mark.parametrize("context, prompt_chars, new_tokens", [(64, 6, 4), (512, 32, 16)])
def test_a_run_that_fits_is_not_refused_for_the_default_max_prompt_length(
    tmp_path, context, prompt_chars, new_tokens
):
    # The default max_prompt_length (512) plus the completion exceeds both contexts; the prompts
    # as the rollout cuts them do not.
    model, tokenizer = _model_with_context(context)
    prompts = [f"{i}+1=".ljust(prompt_chars, " ") for i in range(4)]
    trainer = _trainer(model, tokenizer, prompts, tmp_path, max_completion_length=new_tokens)
    assert GRPOConfig.__dataclass_fields__["max_prompt_length"].default == 512
    assert trainer.prompt_lengths["train_dataset"].longest == prompt_chars
    assert trainer.train()["steps"] == 1


def test_a_prompt_that_does_not_fit_is_named(tmp_path):
    prompts = ["1+1=", "2+2=", "x" * 70, "3+3="]
    with pytest.raises(
        ValueError, match=r"1 of 4 prompts do not fit the model's context of 64 tokens.*prompt 2 \('xxxx"
    ) as info:
        _trainer(*_model_with_context(64), prompts, tmp_path, max_prompt_length=None, max_completion_length=4)
    # prompts are not cut (the TRL front door's, whose GRPOConfig has no max_prompt_length): no advice to cut them
    assert "Filter such prompts out of the dataset" in str(info.value)
    assert "max_prompt_length" not in str(info.value)
    # Cut by max_prompt_length, the same prompt fits (and the cut is announced once, at start).
    with pytest.warns(
        UserWarning, match=r"train_dataset: 1 of 4 prompts are longer than max_prompt_length=32"
    ):
        trainer = _trainer(
            *_model_with_context(64), prompts, tmp_path, max_prompt_length=32, max_completion_length=4
        )
    assert trainer.prompt_lengths["train_dataset"].longest == 32
    with pytest.raises(ValueError, match=r"max_completion_length=64 leaves no room for a prompt"):
        _trainer(*_model_with_context(64), prompts[:2], tmp_path, max_completion_length=64)


def test_each_prompt_is_tokenised_once_at_start(tiny_base_dir, tmp_path, monkeypatch):
    import lora_grpo.startup as startup

    seen = []
    real = startup.prompt_token_rows
    monkeypatch.setattr(
        startup,
        "prompt_token_rows",
        lambda tok, prompts, chat=None: seen.extend(prompts) or real(tok, prompts, chat),
    )
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        quantization="none",
        micro_batch_size="auto",
        gradient_checkpointing="auto",
        eval_dataset=PROMPTS[:5],
    )
    trainer.plan_memory()  # the probe reads the lengths measured at start
    train_prompts = [r["prompt"] for r in PROMPTS]
    assert sorted(seen) == sorted(train_prompts + train_prompts[:5])  # train and eval, each once
    assert trainer.memory_plan.tokens[0] == max(len(p) for p in train_prompts)


def test_an_eval_only_trainer_runs_no_memory_probe(tiny_base_dir, tmp_path, monkeypatch):
    import lora_grpo.memory.sizes as sizes_module

    def no_probe(*args, **kwargs):
        raise AssertionError("the memory probe ran for an evaluation")

    monkeypatch.setattr(sizes_module, "plan_run_memory", no_probe)
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        quantization="none",
        micro_batch_size="auto",
        gradient_checkpointing="auto",
        eval_dataset=PROMPTS[:4],
    )
    metrics = trainer.evaluate()
    assert "eval/digit_share" in metrics and trainer.memory_plan is None
    with pytest.raises(AssertionError, match="memory probe ran"):
        trainer.train()  # training does probe, first thing


# ------------------------------------------------------------------------- tokenizer against the model
# issue 17, defect 2: ids beyond the model's input embeddings ended the first forward in
# "IndexError: index out of range in self"; each case now fails (or is fixed) at start, by name.


def _base_dir_whose_tokenizer_has_no_pad(path, tokenizer_class="Qwen2Tokenizer"):
    """The issue's model dir: a tokenizer saved without a pad token; transformers 5 loads this class
    with pad '<|endoftext|>' added as id 82, for an 82-row embedding."""
    import json

    from transformers import PreTrainedTokenizerFast

    tokenizer = make_tokenizer()
    make_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1).save_pretrained(
        path
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": tokenizer_class})
    )
    return str(path)


def test_a_pad_token_transformers_added_beyond_the_embeddings_is_replaced_by_eos(tmp_path):
    from lora_grpo.model.load import load_tokenizer

    base = _base_dir_whose_tokenizer_has_no_pad(tmp_path / "base")
    assert load_tokenizer(GRPOConfig(model_name_or_path=base)).pad_token_id == 82  # the setting
    with pytest.warns(
        UserWarning,
        match=r"pad token '<\|endoftext\|>' \(id 82, the tokenizer's pad_token\) is beyond "
        r"the model's 82 input embeddings.*padding with '<eos>' \(id 1",
    ):
        trainer = make_trainer(
            base, tmp_path, quantization="none", max_steps=1, micro_batch_size=8, gradient_checkpointing=False
        )
    assert trainer.tokenizer.pad_token_id == trainer.tokenizer.eos_token_id == 1
    assert trainer.train()["steps"] == 1  # was: IndexError from F.embedding


def test_a_generation_config_asking_for_a_processor_the_sampler_lacks_is_refused(tiny_base_dir, tmp_path):
    """generate fills what a GenerationConfig leaves unset from the model's, so TRL samples with a model's
    suppress_tokens or no_repeat_ngram_size; the sampler here would ignore them, silently (found in review)."""
    import json
    import shutil

    from lora_grpo.startup import check_generation_config

    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    path = base / "generation_config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "suppress_tokens": [5], "no_repeat_ngram_size": 2})
    )
    with pytest.raises(
        ValueError,
        match=r"generation_config sets suppress_tokens=\[5\], no_repeat_ngram_size=2: transformers' generate.*"
        r"Set model.generation_config.suppress_tokens = None; model.generation_config.no_repeat_ngram_size = None",
    ):
        make_trainer(str(base), tmp_path / "run", max_steps=1)
    model, _ = _model_with_context(64)
    check_generation_config(model)  # transformers' defaults: nothing to refuse
    model.generation_config.guidance_scale, model.generation_config.min_length = 1.0, 0
    check_generation_config(model)  # set, but to what applies nothing
    model.generation_config.min_new_tokens = 3
    with pytest.raises(ValueError, match=r"sets min_new_tokens=3"):
        check_generation_config(model)


def test_an_eos_beyond_the_embeddings_is_refused_naming_it():
    from lora_grpo.startup import check_special_tokens

    model, tokenizer = _model_with_context(64)
    tokenizer.add_special_tokens({"eos_token": "<end>"})  # id 82: the model has rows 0-81
    model.generation_config.eos_token_id = None
    with pytest.raises(
        ValueError,
        match=r"every EOS token \('<end>' \(id 82, the tokenizer's eos_token\)\) is beyond the "
        r"model's 82 input embeddings.*resize_token_embeddings",
    ):
        check_special_tokens(model, tokenizer)


def test_a_bos_prepended_beyond_the_embeddings_is_refused_naming_it():
    from tokenizers.processors import TemplateProcessing

    from lora_grpo.startup import check_special_tokens

    model, tokenizer = _model_with_context(64)
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 82)]
    )
    assert tokenizer("a")["input_ids"] == [82, tokenizer.convert_tokens_to_ids("a")]
    with pytest.raises(
        ValueError,
        match=r"prepends '<s>' \(id 82, the tokenizer's bos_token\) to every prompt, beyond "
        r"the model's 82 input embeddings.*tokenizer_name_or_path",
    ):
        check_special_tokens(model, tokenizer)


def test_a_prompt_holding_a_token_beyond_the_embeddings_is_named(tmp_path):
    model, tokenizer = _model_with_context(64)
    tokenizer.add_tokens(["<tool>"])  # added without resizing the model
    with pytest.raises(
        ValueError,
        match=r"train_dataset: 1 of 4 prompts hold token ids beyond the model's 82 input "
        r"embeddings; the first, prompt 2 \('call <tool>'\), holds '<tool>' \(id 82\)",
    ):
        _trainer(model, tokenizer, ["1+1=", "2+2=", "call <tool>", "3+3="], tmp_path, max_completion_length=4)
    # Without such a prompt the run starts, and says which tokens it could never feed.
    with pytest.warns(
        UserWarning, match=r"1 token\(s\) beyond the model's 82 input embeddings \('<tool>' \(id 82\)\)"
    ):
        trainer = _trainer(
            *_model_with_context(64)[:1], tokenizer, ["1+1=", "2+2="], tmp_path, max_completion_length=4
        )
    assert trainer.train()["steps"] == 1


# ------------------------------------------------------------------------- model set-up (model.attach_adapters)


def _attach(**fields):
    from lora_grpo.model.load import attach_adapters

    model, _ = _model_with_context(64)
    return attach_adapters(model, GRPOConfig(model_name_or_path="in-memory", lora_r=4, **fields))


@pytest.mark.parametrize(
    "targets, message",
    [
        (
            ["q_prj", "v_proj"],
            r"entry 'q_prj' matches no module of this model; closest: 'q_proj'",
        ),  # peft ignored it
        (
            ["nothing"],
            r"entry 'nothing' matches no module of this model\. The layers LoRA can wrap here: \['down_proj'",
        ),
        (
            ["self_attn"],
            (
                r"entry 'self_attn' matches only \['LlamaAttention'\] modules \(e\.g\. model\.layers\.0\."
                r"self_attn\), which LoRA cannot wrap"
            ),
        ),
        (
            ".*q_prj",
            r"entry '\.\*q_prj' matches no module of this model; closest: 'q_proj'",
        ),  # a regular expression
    ],
)
def test_lora_target_modules_matching_no_module_name_the_closest(targets, message):
    with pytest.raises(ValueError, match=message):
        _attach(lora_target_modules=targets)
    with pytest.raises(ValueError, match=r"Use those names, or lora_target_modules: all-linear"):
        _attach(lora_target_modules=targets)


def test_lora_target_modules_that_match_are_untouched():
    assert _attach(lora_target_modules=["q_proj", "v_proj"]).peft_config[POLICY].target_modules == {
        "q_proj",
        "v_proj",
    }
    _attach(lora_target_modules=".*\\.(q|v)_proj")


def _saved_adapter(path, **model_kwargs):
    from lora_grpo.model.load import attach_adapters
    from lora_grpo.run.checkpoint import save_adapter

    tokenizer = make_tokenizer()
    model = attach_adapters(
        make_tiny_model(
            tokenizer,
            **{
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "num_kv_heads": 1,
                "max_positions": 64,
                **model_kwargs,
            },
        ),
        GRPOConfig(model_name_or_path="in-memory", lora_r=4),
    )
    save_adapter(model, path)
    return str(path)


def test_an_init_adapter_of_another_model_is_refused_naming_the_layer(tmp_path):
    wider = _saved_adapter(tmp_path / "wider", hidden_size=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(
        ValueError,
        match=r"init_adapter='.*wider' was saved for another model: its lora_A of "
        r"model\.layers\.0\.mlp\.down_proj has shape \(4, 128\), but this model's "
        r"down_proj has 64 inputs",
    ):
        _attach(init_adapter=wider)  # was: peft's size-mismatch RuntimeError, one line per tensor
    deeper = _saved_adapter(tmp_path / "deeper", num_layers=2)
    with pytest.raises(
        ValueError, match=r"it adapts 'model\.layers\.1\.mlp\.down_proj', which this model does not have"
    ):
        _attach(init_adapter=deeper)  # was: accepted, the second layer's weights silently dropped
    assert _attach(init_adapter=_saved_adapter(tmp_path / "same")).peft_config[POLICY].r == 4


def test_an_init_adapter_path_that_is_no_adapter_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match=r"init_adapter='.*missing' does not exist"):
        _attach(init_adapter=str(tmp_path / "missing"))
    checkpoint = tmp_path / "checkpoint-4"
    _saved_adapter(checkpoint / "policy")
    with pytest.raises(
        ValueError,
        match=r"no adapter_config\.json.*a checkpoint or run directory: pass '.*checkpoint-4/policy'",
    ):
        _attach(init_adapter=str(checkpoint))


def test_an_init_adapter_without_its_weights_file_says_so(tmp_path):
    saved = _saved_adapter(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(
        ValueError, match=r"adapter_model\.safetensors is missing, so it holds no adapter weights"
    ):
        _attach(init_adapter=saved)  # was: peft's "Repo id must be in the form ..." (read as a hub id)
