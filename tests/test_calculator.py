"""The calculator task (tool, data, reward, transcripts, its pre-trained base and cache) and the
GSM8K calculator recipe's rollout offline, on a tiny model with Qwen2.5-Instruct's chat template."""

import importlib
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml
from helpers import QWEN25_TEMPLATE, QWEN_RESPONSE_TEMPLATE, TINY_PRETRAIN, qwen_style_tokenizer  # noqa: F401
from transformers import AutoModelForCausalLM

from lora_grpo.rewards import answer_accuracy, think_answer_format
from lora_grpo.rollout import Toolbox, generate_rollout
from lora_grpo.tasks import calculator, toy

RECIPES = Path(calculator.__file__).resolve().parent.parent / "recipes"
TINY = TINY_PRETRAIN


# --------------------------------------------------------------------------- the task


def test_the_calculator_tool():
    assert calculator.calculator("1234+5678") == "6912"
    assert calculator.calculator("(3.5*4)-2") == "12" and calculator.calculator("7/2") == "3.5"
    assert calculator.calculator("1,000 * 3") == "3000" and calculator.calculator("2^10") == "1024"
    assert calculator.calculator("-4 // 3") == "-2"
    for bad, why in [
        ("__import__('os')", "not arithmetic"),
        ("x+1", "not arithmetic"),
        ("9**9**9", "too large"),
    ]:
        with pytest.raises(ValueError, match=why):
            calculator.calculator(bad)
    with pytest.raises(ZeroDivisionError):
        calculator.calculator("1/0")
    fn = Toolbox(calculator.make_tokenizer(), [calculator.calculator]).schemas[0]["function"]
    assert fn["name"] == "calculator" and fn["parameters"]["required"] == ["expression"]


def test_problems_are_deterministic_disjoint_and_right():
    a, b = calculator.calculator_problems(300, seed=3), calculator.calculator_problems(300, seed=3)
    assert (
        a["prompt"] == b["prompt"] and a["answer"] == b["answer"] and a.column_names == ["prompt", "answer"]
    )
    assert calculator.calculator_problems(300, seed=4)["prompt"] != a["prompt"]
    held = calculator.calculator_problems(300, seed=3, split="eval")
    train_set = {m[0]["content"] for m in a["prompt"]}
    assert not train_set & {m[0]["content"] for m in held["prompt"]}
    for messages, answer in zip(
        list(a["prompt"]) + list(held["prompt"]), list(a["answer"]) + list(held["answer"])
    ):
        x, y = map(int, messages[0]["content"].split("+"))
        assert (
            messages[0]["role"] == "user" and 100 <= x <= 9999 and 100 <= y <= 9999 and answer == str(x + y)
        )
    with pytest.raises(ValueError):
        calculator.calculator_problems(5, split="test")


@pytest.mark.parametrize(
    "completion, value",
    [
        ("= 6912", 6912),
        ("6912", 6912),
        ('<tool_call>{"name": "calculator"}</tool_call>\ntool: 6912\nassistant: = 6912', 6912),
        ("= 69 12", None),
        ("about 6912", None),
        ("", None),
        ([{"role": "assistant", "content": "= 6912"}], 6912),
        (
            [
                {"role": "assistant", "content": "", "tool_calls": [{}]},
                {"role": "tool", "content": "6912"},
                {"role": "assistant", "content": "= 6912"},
            ],
            6912,
        ),
        (
            [{"role": "assistant", "content": "= 1", "tool_calls": [{}]}],
            None,
        ),  # ended on a call never answered
        (
            [{"role": "assistant", "content": "", "tool_calls": [{}]}, {"role": "tool", "content": "6912"}],
            None,
        ),
    ],
)
def test_final_answer(completion, value):
    assert calculator.final_answer(completion) == value


def test_reward():
    completions = ["= 6912", [{"role": "assistant", "content": "6912"}], "= 6802", "= x"]
    assert calculator.calculator_reward(completions=completions, answer=["6912"] * 4, prompts=None) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]


def test_pretraining_transcripts_are_laid_out_as_a_rollout_lays_them_out():
    tok = calculator.make_tokenizer()
    box = Toolbox(tok, [calculator.calculator], timeout=None)
    ids, labels = calculator._transcripts(tok, [(1234, 5678), (296, 1889)], [True, False])
    prompt = tok(box.render_prompt([{"role": "user", "content": "1234+5678"}]), add_special_tokens=False)[
        "input_ids"
    ]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234+5678"}}</tool_call>'
    turn = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    reply = box.reply_ids([{"role": "tool", "name": "calculator", "content": "6912"}])
    answer = tok("= 6912", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[0].tolist() == prompt + turn + reply + answer
    assert labels[0].tolist() == [-100] * len(prompt) + turn + [-100] * len(reply) + answer
    assert (
        tok.decode(ids[1], skip_special_tokens=True) == "tools: calculator\nuser: 296+1889\nassistant: = 1075"
    )
    assert (labels[1] != -100).sum() == len("= 1075") + 1  # the direct answer: the carry-free sum, then EOS
    assert box.parse(turn, prompt)[1] == [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1234+5678"}}}
    ]


def test_the_base_is_built_once_and_cached(tmp_path, capsys):
    first = calculator.ensure_calculator_base(tmp_path, **TINY)
    assert "[calculator pretrain] building" in capsys.readouterr().out
    weights = Path(first) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert (
        calculator.ensure_calculator_base(tmp_path, **TINY) == first and weights.stat().st_mtime_ns == stamp
    )
    assert "building" not in capsys.readouterr().out
    assert (
        calculator.ensure_calculator_base(tmp_path, **{**TINY, "steps": 4}) != first
    )  # settings are in the name
    weights.unlink()  # an incomplete entry is rebuilt
    assert calculator.ensure_calculator_base(tmp_path, **TINY) == first and weights.is_file()
    record = json.loads((Path(first) / "pretrain.json").read_text())
    assert record["settings"]["steps"] == 3 and len(record["losses"]) == 3
    again = calculator.pretrain_calculator_base(tmp_path / "again", **TINY)
    from safetensors.torch import load_file

    a, b = load_file(weights), load_file(Path(again) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # deterministic by seed


@pytest.mark.slow
def test_the_pretrained_base_calls_sometimes_copies_and_guesses_wrong():
    """The shipped base (built once per machine, 1200 steps on CPU): never calls greedily, calls in
    some samples and then copies the reply; its direct answers are mostly wrong. GRPO's starting point."""
    path = calculator.ensure_calculator_base()
    model, tok = AutoModelForCausalLM.from_pretrained(path), calculator.make_tokenizer()
    held = calculator.calculator_problems(100, split="eval")
    greedy = calculator.tool_use(model, tok, held)
    assert greedy["call_frequency"] == 0.0 and greedy["accuracy"] < 0.1
    sampled = calculator.tool_use(model, tok, held, temperature=1.0, num_generations=4)
    assert 0.1 < sampled["call_frequency"] < 0.5 and sampled["copy_rate"] > 0.7
    assert sampled["direct_accuracy"] < 0.2 and sampled["accuracy"] > greedy["accuracy"]


# --------------------------------------------------------------------------- the GSM8K recipe, Qwen2.5's template
# Qwen2.5-Instruct's chat template as it ships (kept verbatim in TRL 1.16, trl/chat_templates/qwen2_5.jinja).
def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def script(model, prompt: list[int], completion: list[int], bias: float = 50.0) -> None:
    """Make a tiny random model write ``completion`` after ``prompt`` (as tests/test_tools.py's Script):
    a bias on the LM head for the token at each next position after each input token."""
    table = defaultdict(set)
    seq = prompt + completion
    for j in range(len(prompt), len(seq)):
        table[(j, seq[j - 1])].add(seq[j])
    seen = {}
    model.model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(ids=kw["input_ids"], pos=kw["position_ids"]), with_kwargs=True
    )

    def add(module, args, out):
        L, extra = out.shape[1], torch.zeros_like(out)
        for n, (row_ids, row_pos) in enumerate(
            zip(seen["ids"][:, -L:].tolist(), seen["pos"][:, -L:].tolist())
        ):
            for col, (t, p) in enumerate(zip(row_ids, row_pos)):
                for nxt in table.get((p + 1, t), ()):
                    extra[n, col, nxt] = bias
        return out + extra

    model.lm_head.register_forward_hook(add)


@pytest.mark.parametrize("response_template", [False, True], ids=["text formats", "response_template"])
def test_the_gsm8k_calculator_recipe_rolls_out_with_qwen25s_template(response_template):
    """The recipe's tools (by dotted path), system prompt and rounds, on Qwen2.5's template: the prompt
    carries the schema, the call is parsed (by the text formats, or transformers' parser with TRL's
    response template), the reply lands where the template puts it, and the rewards read the final turn."""
    recipe = yaml.safe_load((RECIPES / "qwen2.5-1.5b-gsm8k-calculator-qlora.yaml").read_text())
    tools = [getattr(importlib.import_module(m), f) for m, f in (t.split(":") for t in recipe["tools"])]
    tok = qwen_style_tokenizer()
    if response_template:
        tok.response_template = QWEN_RESPONSE_TEMPLATE
    box = Toolbox(tok, tools, timeout=recipe["tool_timeout"])
    question = [
        {"role": "system", "content": recipe["system_prompt"]},
        {"role": "user", "content": "A box holds 48 pens. How many pens are in 3 boxes?"},
    ]
    prompt = box.render_prompt(question)
    assert prompt.startswith("<|im_start|>system\n" + recipe["system_prompt"] + "\n\n# Tools")
    assert '"name": "calculator"' in prompt and prompt.endswith("3 boxes?<|im_end|>\n<|im_start|>assistant\n")
    reply = box.reply_ids([{"role": "tool", "name": "calculator", "content": "144"}])
    assert (
        tok.decode(reply)
        == "\n<|im_start|>user\n<tool_response>\n144\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    turn = ids(
        tok,
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48*3"}}\n</tool_call><|im_end|>',
    )
    final = "<think>3 boxes of 48 is 144.</think>\n<answer>144</answer>"
    done = turn + reply + ids(tok, final + "<|im_end|>")
    model = toy.make_tiny_model(
        tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=2048
    )
    script(model, ids(tok, prompt), done)
    r = generate_rollout(
        model,
        tok,
        [prompt],
        num_generations=2,
        max_prompt_length=None,  # characters here, not BPE
        max_completion_length=recipe["max_completion_length"],
        temperature=0.0,
        tools=box,
        max_tool_calling_iterations=recipe["max_tool_calling_iterations"],
    )
    assert r.completion_ids[:, : len(done)].tolist() == [done, done] and r.tool_calls.tolist() == [1, 1]
    assert r.tool_mask[0, : len(done)].tolist() == [1] * len(turn) + [0] * len(reply) + [1] * (
        len(done) - len(turn) - len(reply)
    )
    # TRL's response template reads <think> into reasoning_content (so a think/answer format reward, which
    # reads the content, scores 0 there, as in TRL); the text formats keep the whole text as the content.
    last = (
        {"role": "assistant", "content": "<answer>144</answer>", "reasoning_content": "3 boxes of 48 is 144."}
        if response_template
        else {"role": "assistant", "content": final}
    )
    assert r.messages[0] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48*3"}}}
            ],
        },
        {"role": "tool", "name": "calculator", "content": "144"},
        last,
    ]
    assert answer_accuracy(completions=r.messages, answer=["... = 144\n#### 144"] * 2) == [1.0, 1.0]
    assert think_answer_format(completions=r.messages) == [0.0 if response_template else 1.0] * 2
    if not response_template:  # the prompt and the messages rendered again give the sampled sequence
        again = tok.apply_chat_template(question + r.messages[0], tools=box.schemas, tokenize=False)
        assert again == prompt + tok.decode(done) + "\n"
