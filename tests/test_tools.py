"""Tool calls in rollouts: schemas, the template check, parsing, running (errors, timeouts, async),
the multi-turn sampler (reply tokens fed on the same KV cache, masked out of the loss, within the
budget and the rounds), environments, a 4-bit base. (Qwen2.5's template: test_calculator.py.)"""

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from helpers import DecodeLoopReads, char_tokenizer, load_4bit

from lora_grpo.algo.loss import grpo_loss
from lora_grpo.batch import Batch, loss_mask
from lora_grpo.rollout import (
    Toolbox,
    check_tool_template,
    generate_rollout,
    parse_tool_calls,
    tool_metrics,
    tool_schema,
    with_observation,
)
from lora_grpo.tasks import calculator, toy


def ping(x: str) -> str:
    return "PONG"


async def aping(x: str) -> str:
    await asyncio.sleep(0)
    return "APONG"


def boom(x: str) -> str:
    raise ZeroDivisionError("no way")


def sleepy(x: str) -> str:
    time.sleep(3)
    return "late"


async def asleepy(x: str) -> str:
    await asyncio.sleep(3)
    return "late"


# what get_json_schema reads: a description, each argument's
for _tool in (
    ping,
    aping,
    boom,
    sleepy,
    asleepy,
):
    _tool.__doc__ = f"The {_tool.__name__} test tool.\n\nArgs:\n    x: Anything.\n"


@pytest.fixture(scope="module")
def tok():
    return calculator.make_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def call_ids(tok, name: str = "ping", x: str = "a") -> list[int]:
    return ids(tok, f'<tool_call>{{"name": "{name}", "arguments": {{"x": "{x}"}}}}</tool_call>') + [
        tok.eos_token_id
    ]


class Script:
    """Makes a tiny random model write given completions: a bias on the LM head's logits for the
    token each script has at the predicted position after the input token (keyed by absolute
    position and input token, so rows with prompts of different lengths follow different scripts).
    Also records every forward: (input ids, positions, the logits it kept)."""

    def __init__(self, model, scripts, bias: float = 50.0):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.table, self.bias, self.calls = defaultdict(set), bias, []
        for prompt, completion in scripts:
            seq = list(prompt) + list(completion)
            for j in range(len(prompt), len(seq)):
                self.table[(j, seq[j - 1])].add(seq[j])
        clash = {k: v for k, v in self.table.items() if len(v) > 1}
        assert not clash, f"scripts disagree at (position, input token) {clash}"
        base.model.register_forward_pre_hook(self._inputs, with_kwargs=True)
        base.lm_head.register_forward_hook(self._logits)

    def _inputs(self, module, args, kwargs):
        self.ids, self.pos = kwargs["input_ids"], kwargs["position_ids"]

    def _logits(self, module, args, out):
        L = out.shape[1]
        add = torch.zeros_like(out)
        for n, (row_ids, row_pos) in enumerate(zip(self.ids[:, -L:].tolist(), self.pos[:, -L:].tolist())):
            for col, (t, p) in enumerate(zip(row_ids, row_pos)):
                for nxt in self.table.get((p + 1, t), ()):
                    add[n, col, nxt] = self.bias
        out = out + add
        self.calls.append((self.ids.clone(), self.pos.clone(), out.detach().clone()))
        return out


def tiny(tok, seed: int = 0, **kw):
    return toy.make_tiny_model(
        tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=seed, **kw
    ).eval()


def prompt_ids(tok, box, content: str) -> list[int]:
    return ids(tok, box.render_prompt([{"role": "user", "content": content}]))


def rollout(model, tok, box, contents, **kw):
    kw = {
        "num_generations": 1,
        "max_prompt_length": None,
        "max_completion_length": 120,
        "temperature": 0.0,
        "tools": box,
        **kw,
    }
    return generate_rollout(
        model, tok, [box.render_prompt([{"role": "user", "content": c}]) for c in contents], **kw
    )


def reply(tok, box, content: str, name: str = "ping") -> list[int]:
    return box.reply_ids([{"role": "tool", "name": name, "content": content}])


# --------------------------------------------------------------------------- schemas and the template


def test_tool_schema_from_a_typed_function():
    def add(a: int, b: float, label: str = "x") -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
            label: A name for the sum.
        """
        return a + b

    fn = tool_schema(add)["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two numbers."
    props = fn["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "The first number."}
    assert props["b"]["type"] == "number" and props["label"]["type"] == "string"
    assert fn["parameters"]["required"] == ["a", "b"]
    assert tool_schema(aping)["function"]["name"] == "aping"  # async functions too

    def untyped(a):
        """No hints.

        Args:
            a: Something.
        """

    with pytest.raises(ValueError, match=r"'untyped' has no JSON schema.*type hint on every argument"):
        tool_schema(untyped)
    with pytest.raises(ValueError, match="Google-style docstring"):
        tool_schema(lambda a: a)


def test_a_template_without_tool_support_is_refused_clearly():
    plain = toy.make_tokenizer()  # "role: content" only: drops tool_calls and ignores the tool's name
    with pytest.raises(ValueError, match=r"drops the assistant's tool_calls"):
        Toolbox(plain, [ping])
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"tokenizer.chat_template is None"):
        Toolbox(plain, [ping])
    plain.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(ValueError, match=r"does not support tool calling\..* fails on it: .*no tools here"):
        Toolbox(plain, [ping])
    tok = calculator.make_tokenizer()
    with pytest.raises(ValueError, match="ends an assistant turn that calls a tool with no EOS token"):
        check_tool_template(tok, stop_ids=[tok.pad_token_id])  # the turn ends with <eos>, not with these
    check_tool_template(tok, stop_ids=[tok.eos_token_id])  # the calculator template passes


def test_parsing_the_common_formats():
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    hermes = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><eos>'
    assert parse_tool_calls(hermes, ["<eos>"]) == ("Sure.", [call])
    two = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "f"}</tool_call>'
    assert parse_tool_calls(two)[1] == [
        call,
        {"type": "function", "function": {"name": "f", "arguments": {}}},
    ]
    unclosed = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'  # stopped before </tool_call>
    assert parse_tool_calls(unclosed)[1] == [call]
    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_tool_calls(as_string)[1] == [call]
    assert parse_tool_calls('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]')[1] == [call]
    assert parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}')[1] == [call]
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}') == ("", [call])
    assert parse_tool_calls("The answer is 3.") == ("The answer is 3.", [])
    # A turn as sampled ends with its end-of-turn token, which the formats read to the end must not take in.
    for text, ends in [
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]</s>', ["</s>"]),
        (
            '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}<|eom_id|>',
            ["<|eot_id|>", "<|eom_id|>"],
        ),
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>', ["<|eot_id|>"]),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}<|im_end|>', ["<|im_end|>"]),
    ]:
        assert parse_tool_calls(text, ends) == ("", [call]), text
    assert parse_tool_calls('{"answer": 3}') == ('{"answer": 3}', [])  # JSON, but no call
    content, calls = parse_tool_calls('<tool_call>{"name": add}</tool_call>')
    assert content == "" and len(calls) == 1 and calls[0].startswith("could not parse the tool call")
    _, calls = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert "string 'name'" in calls[0]


# --------------------------------------------------------------------------- running calls


def test_without_a_tool_timeout_each_call_runs_in_the_trainers_thread_as_in_trl(tok):
    """A tool over a connection made in this thread (sqlite3 refuses another's), as TRL runs it: one call after
    another in the trainer's thread. With a timeout each sync call has a thread of its own, and this tool failed on
    every call; tool_timeout: null (the TRL front door's) is that inline path (found in review)."""
    import sqlite3

    from lora_grpo import GRPOConfig
    from lora_grpo.trl import GRPOConfig as TRLConfig
    from lora_grpo.trl.translate import to_native

    db = sqlite3.connect(":memory:")
    db.execute("create table t(k text, v text)")
    db.execute("insert into t values ('a', 'alpha')")

    def lookup(k: str) -> str:
        """Look a key up.

        Args:
            k: The key.
        """
        return db.execute("select v from t where k = ?", (k,)).fetchone()[0]

    call = {"type": "function", "function": {"name": "lookup", "arguments": {"k": "a"}}}
    inline = Toolbox(tok, [lookup], timeout=None).episode(2).run({0: [call], 1: [call]})
    assert [out[0][1] for out in inline.values()] == ["alpha", "alpha"]
    threaded = Toolbox(tok, [lookup], timeout=10.0).episode(1).run({0: [call]})
    assert "SQLite objects created in a thread" in threaded[0][0][1]
    assert GRPOConfig(model_name_or_path="toy", tool_timeout=None).tool_timeout is None
    assert to_native(TRLConfig(output_dir="out", use_cpu=True), model_name_or_path="m").tool_timeout is None


def test_errors_and_timeouts_become_error_replies_the_model_sees(tok):
    box = Toolbox(tok, [ping, aping, boom, sleepy, asleepy], timeout=0.3)
    episode = box.episode(3)

    def call(name, **args):
        return {"type": "function", "function": {"name": name, "arguments": args or {"x": "a"}}}

    t0 = time.monotonic()
    out = episode.run(
        {
            0: [call("ping"), call("boom"), call("sleepy")],
            1: [call("aping"), call("asleepy"), call("nope")],
            2: [call("ping", y=1), "could not parse the tool call '{'", call("aping", y=2)],
        }
    )
    assert time.monotonic() - t0 < 2.5  # each round waits at most the timeout, not the 3 s sleeps
    assert out[0] == [
        ("ping", "PONG", False),
        ("boom", "{'error': 'no way'}", True),  # TRL's words: str(exception)
        ("sleepy", "{'error': 'sleepy timed out after 0.3 s'}", True),
    ]
    assert out[1][0] == ("aping", "APONG", False)
    assert out[1][1] == ("asleepy", "{'error': 'asleepy timed out after 0.3 s'}", True)
    assert out[1][2] == ("nope", "{'error': 'Tool nope not found.'}", True)  # TRL's words
    assert [failed for _, _, failed in out[2]] == [True, True, True]
    assert "unexpected keyword argument 'y'" in out[2][0][1]  # a sync tool called with wrong arguments
    assert out[2][1] == ("invalid", "{'error': \"could not parse the tool call '{'\"}", True)
    assert "unexpected keyword argument 'y'" in out[2][2][1]  # an async one
    assert tool_metrics(torch.tensor([3, 3, 3, 0]), torch.tensor([2, 2, 3, 0])) == {
        "tools/call_frequency": 2.25,
        "tools/failure_frequency": 7 / 9,
        "tools/calling_fraction": 0.75,
    }


# --------------------------------------------------------------------------- the multi-turn sampler


def test_multi_turn_rollout_masks_replies_and_finishes_rows_without_calls(tok):
    box = Toolbox(tok, [ping], timeout=None)
    model = tiny(tok)
    p_call, p_direct = prompt_ids(tok, box, "a"), prompt_ids(tok, box, "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb")
    first, answer = call_ids(tok), ids(tok, "ok") + [tok.eos_token_id]
    pong = reply(tok, box, "PONG")
    assert tok.decode(pong) == "\ntool: PONG\nassistant: "
    Script(model, [(p_call, first + pong + answer), (p_direct, ids(tok, "7") + [tok.eos_token_id])])
    r = rollout(model, tok, box, ["a", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"], num_generations=2)
    n = len(first) + len(pong) + len(answer)
    for row in (0, 1):  # called: the model's call, the reply, the model's answer
        assert r.completion_ids[row, :n].tolist() == first + pong + answer
        assert r.completion_mask[row].tolist() == [1] * n + [0] * (r.completion_ids.size(1) - n)
        assert r.tool_mask[row, :n].tolist() == [1] * len(first) + [0] * len(pong) + [1] * len(answer)
        assert (r.sampling_logprobs[row, len(first) : len(first) + len(pong)] == 0).all()
        assert r.messages[row] == [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "ping", "arguments": {"x": "a"}}}],
            },
            {"role": "tool", "name": "ping", "content": "PONG"},
            {"role": "assistant", "content": "ok"},
        ]
        assert r.completions[row] == tok.decode(first + pong + answer, skip_special_tokens=True)
    for row in (2, 3):  # answered at once: an ordinary completion
        assert r.completion_ids[row, :2].tolist() == ids(tok, "7") + [tok.eos_token_id]
        assert r.completion_mask[row].sum() == 2 and torch.equal(r.tool_mask[row], r.completion_mask[row])
        assert r.messages[row] == [{"role": "assistant", "content": "7"}]
    assert r.tool_calls.tolist() == [1, 1, 0, 0] and r.tool_failures.tolist() == [0, 0, 0, 0]
    assert not r.truncated.any()
    # The loss sees only what the policy drew: loss_mask drops the reply, micro-batches keep the answer after it.
    mask = loss_mask(r, mask_truncated_completions=False)
    assert torch.equal(mask, r.tool_mask) and mask[0, len(first)] == 0 and mask[0, n - 1] == 1
    batch = Batch.from_rollout(r, torch.tensor([1.0, -1.0, 0.5, -0.5]), mask_truncated_completions=False)
    mb = next(batch.micro_batches(4))
    assert mb.completion_length == n and torch.equal(mb.completion_mask, mask[:, :n])


def test_a_llama_3_1_json_call_runs_its_tool():
    """Llama 3.1's template renders a call as the turn's whole JSON, then <|eot_id|>: the turn as sampled,
    end-of-turn token included, is parsed and the tool runs."""
    tok = char_tokenizer(
        ["<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
    )
    tok.chat_template = (Path(__file__).parent / "fixtures" / "chat_templates" / "llama3_1.jinja").read_text()
    ran = []

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first.
            b: The second.
        """
        ran.append((a, b))
        return a + b

    box = Toolbox(tok, [add], timeout=None)
    model = tiny(tok, max_positions=2048)
    call = ids(tok, '{"name": "add", "parameters": {"a": 2, "b": 3}}') + [tok.eos_token_id]
    answer = ids(tok, "5") + [tok.eos_token_id]
    Script(model, [(prompt_ids(tok, box, "2+3?"), call + reply(tok, box, "5", name="add") + answer)])
    r = rollout(model, tok, box, ["2+3?"])
    assert ran == [(2, 3)] and r.tool_calls.tolist() == [1] and r.tool_failures.tolist() == [0]
    assert r.messages[0] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]


def test_tool_reply_log_probs_do_not_move_the_gradient(tok):
    box = Toolbox(tok, [ping], timeout=None)
    model = tiny(tok)
    p = prompt_ids(tok, box, "a")
    Script(model, [(p, call_ids(tok) + reply(tok, box, "PONG") + ids(tok, "ok") + [tok.eos_token_id])])
    r = rollout(model, tok, box, ["a"], num_generations=2)
    mask = loss_mask(r, mask_truncated_completions=False)
    assert (mask == 0).sum() > (r.completion_mask == 0).sum()  # reply tokens really are masked
    g = torch.Generator().manual_seed(0)
    base = torch.randn(mask.shape, generator=g) * 0.1 - 1.0
    adv, old = torch.tensor([1.0, -0.5]), base - 0.05

    def grad(logp):
        logp = logp.clone().requires_grad_(True)
        loss, _ = grpo_loss(logp, old, old + 0.1, adv, mask, loss_type="grpo", beta=0.04)
        loss.backward()
        return loss.detach(), logp.grad

    reply_positions = (r.completion_mask == 1) & (mask == 0)
    perturbed = base + reply_positions * torch.randn(mask.shape, generator=g) * 5
    (l1, g1), (l2, g2) = grad(base), grad(perturbed)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert (g1[mask.bool()] != 0).any() and (g1[reply_positions] == 0).all()


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_reply_tokens_are_fed_on_the_same_kv_cache(tok, mode):
    """One prefill; then one single-token forward per completion token (replies included); every
    step's logits equal a full forward's over the final sequence, so the cache held the replies."""
    box = Toolbox(tok, [ping], timeout=None)
    model = tiny(tok, seed=1)
    p = prompt_ids(tok, box, "a")
    two_calls = call_ids(tok) + reply(tok, box, "PONG") + call_ids(tok, x="b") + reply(tok, box, "PONG")
    script = Script(model, [(p, two_calls + ids(tok, "ok") + [tok.eos_token_id])])
    r = rollout(model, tok, box, ["a", "a"], num_generations=2, decode_mode=mode)
    T = int(r.completion_mask.sum(1).max())
    assert (r.completion_mask.sum(1) == T).all() and r.tool_calls.tolist() == [2] * 4
    prefill, *steps = script.calls
    assert prefill[0].shape == (2, len(p))  # the distinct prompts, once
    assert len(steps) == T - 1 and all(s[0].shape[1] == 1 for s in steps)
    script.calls.clear()
    mask = r.attention_mask
    with torch.no_grad():
        model(input_ids=r.input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    full = script.calls[0][2]  # (B, P+T, V), bias included
    P = r.prompt_ids.size(1)
    for t, (_, _, logits) in enumerate(steps, start=1):  # the forward that predicts completion token t
        torch.testing.assert_close(logits[:, -1], full[:, P + t - 1], atol=1e-4, rtol=1e-4)


def test_budget_and_max_tool_calling_iterations(tok):
    box = Toolbox(tok, [ping], timeout=None)
    model = tiny(tok, max_positions=1024)
    p = prompt_ids(tok, box, "a")
    turn, pong = call_ids(tok), reply(tok, box, "PONG")
    rounds = [call_ids(tok, x=x) + pong for x in "abcde"]  # five calls, each a different argument
    Script(model, [(p, [t for c in rounds for t in c] + ids(tok, "ok") + [tok.eos_token_id])])
    size = len(turn) + len(pong)
    r = rollout(model, tok, box, ["a"], max_tool_calling_iterations=2, max_completion_length=400)
    assert r.tool_calls.tolist() == [2] and not r.truncated.any()
    n = 2 * size + len(turn)  # two rounds, then the third call's turn ends the completion, unanswered
    assert r.completion_mask.sum() == n and r.tool_mask.sum() == n - 2 * len(pong)
    assert [m["role"] for m in r.messages[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert r.messages[0][-1]["tool_calls"][0]["function"]["arguments"] == {"x": "c"}
    # The budget counts every turn and reply: a reply that leaves no room for a drawn token is dropped.
    budget = size + len(turn) + len(pong)  # the second reply would fill it to the last token
    r = rollout(model, tok, box, ["a"], max_completion_length=budget)
    assert r.completion_mask.sum() == size + len(turn) and not r.truncated.any()
    assert r.tool_calls.tolist() == [2]  # run and counted, as TRL does, then rolled back
    assert [m["role"] for m in r.messages[0]] == ["assistant", "tool", "assistant"]
    r = rollout(
        model, tok, box, ["a"], max_completion_length=size + 5
    )  # room for the reply, not the next call
    assert r.truncated.tolist() == [True] and r.completion_mask.sum() == size + 5
    assert r.completion_ids.size(1) == size + 5 and r.tool_calls.tolist() == [1]
    assert r.messages[0][-1]["role"] == "assistant" and "tool_calls" not in r.messages[0][-1]


def test_a_tool_run_without_calls_draws_the_single_turn_tokens(tok):
    box = Toolbox(tok, [ping], timeout=None)
    model = tiny(tok, seed=3)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 12  # some rows end early
        model.lm_head.weight[tok.convert_tokens_to_ids("<tool_call>")] = -5 * model.lm_head.weight[0].abs()
    prompts = [box.render_prompt([{"role": "user", "content": c}]) for c in ("a", "bb cc", "1+2")]
    kw = dict(num_generations=3, max_prompt_length=None, max_completion_length=16, temperature=1.0)
    single = generate_rollout(model, tok, prompts, generator=torch.Generator().manual_seed(0), **kw)
    multi = generate_rollout(model, tok, prompts, generator=torch.Generator().manual_seed(0), tools=box, **kw)
    assert single.truncated.any() and (~single.truncated).any()
    # one read from the device a token, as without tools (turns' ends read their rows too): a second, whether
    # any turn ended, was read at every token (found in review). (The static sampler: the eager one's forward
    # has transformers' mask check besides.)
    with DecodeLoopReads() as reads:
        static = generate_rollout(
            model,
            tok,
            prompts,
            generator=torch.Generator().manual_seed(0),
            tools=box,
            decode_mode="static",
            **kw,
        )
    assert torch.equal(static.completion_ids, multi.completion_ids)
    assert "__bool__" not in reads.in_loop and reads.in_loop.count("__int__") == multi.completion_ids.size(1)
    for name in ("completion_ids", "completion_mask", "truncated", "sampling_logprobs"):
        assert torch.equal(getattr(single, name), getattr(multi, name)), name
    assert single.tool_mask is None and torch.equal(multi.tool_mask, multi.completion_mask)
    assert multi.tool_calls.sum() == 0 and single.completions == multi.completions


# --------------------------------------------------------------------------- async tools, environments


def test_async_tools_in_a_rollout(tok):
    box = Toolbox(tok, [aping], timeout=5.0)
    model = tiny(tok)
    p = prompt_ids(tok, box, "a")
    Script(
        model,
        [
            (
                p,
                call_ids(tok, "aping")
                + reply(tok, box, "APONG", "aping")
                + ids(tok, "ok")
                + [tok.eos_token_id],
            )
        ],
    )
    r = rollout(model, tok, box, ["a"])
    assert r.messages[0][1] == {"role": "tool", "name": "aping", "content": "APONG"}
    assert r.completions[0].endswith("tool: APONG\nassistant: ok") and r.tool_failures.tolist() == [0]


class Counter:
    """An environment: a counter per rollout; its method is the tool."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.count, self.start = 0, None

    def reset(self, start=0, **row) -> str:
        self.count, self.start = 0, start
        return f" from {start}"

    def bump(self, x: str) -> str:
        """Count one more.

        Args:
            x: Ignored.
        """
        self.count += 1
        return str(self.start + self.count)

    def get_reward(self) -> float:
        return float(self.count)


def test_environments_one_instance_per_row_with_reset_text_and_reward(tok):
    Counter.made = 0
    box = Toolbox(tok, environment_factory=Counter, timeout=None)
    assert box.names == ["bump"] and Counter.made == 1  # probed once for its tools
    rows = [{"start": 10}, {"start": 10}, {"start": 20}, {"start": 20}]
    episode = box.episode(rows)
    assert Counter.made == 4 and episode.observations == [" from 10", " from 10", " from 20", " from 20"]
    texts, G = box.prompts([[{"role": "user", "content": "go"}]] * 2, episode, 2)
    assert G == 2 and texts == [
        box.render_prompt([{"role": "user", "content": "go from 10"}]),
        box.render_prompt([{"role": "user", "content": "go from 20"}]),
    ]
    assert texts[0] == "tools: bump\nuser: go from 10\nassistant: "
    model = tiny(tok)
    p = ids(tok, texts[0])
    two = (
        call_ids(tok, "bump")
        + reply(tok, box, "11", "bump")
        + call_ids(tok, "bump", "b")
        + reply(tok, box, "12", "bump")
    )
    Script(model, [(p, two + ids(tok, "ok") + [tok.eos_token_id])])
    r = generate_rollout(
        model,
        tok,
        texts,
        num_generations=G,
        max_prompt_length=None,
        max_completion_length=200,
        temperature=0.0,
        tools=episode,
        micro_batch_prompts=1,
    )  # chunks map to their own rows
    assert [e.count for e in episode.environments] == [2, 2, 2, 2]  # each row its own instance
    assert [m["content"] for m in r.messages[0] if m["role"] == "tool"] == ["11", "12"]
    assert [m["content"] for m in r.messages[2] if m["role"] == "tool"] == ["21", "22"]
    [reward] = box.environment_rewards()
    assert (
        reward.__name__ == "Counter" and reward(environments=episode.environments, prompts=None) == [2.0] * 4
    )
    again = box.episode(rows[:2] + [{"start": 5}, {"start": 5}])  # pooled: reset, not rebuilt
    assert Counter.made == 4 and [e.count for e in again.environments] == [0] * 4
    texts, G = box.prompts(
        [[{"role": "user", "content": "go"}]] * 2, box.episode([{"start": i} for i in range(4)]), 2
    )
    assert G == 1 and len(texts) == 4  # a group's rows got different reset texts: one prompt per row
    with pytest.raises(ValueError, match=r"must define a callable `reset`"):
        Toolbox(tok, environment_factory=lambda: object())

    class Leveled:  # (a TypeError traceback before, as was a factory that is no class: found in review)
        def __init__(self, level):
            self.level = level

    with pytest.raises(ValueError, match=r"environment_factory 'Leveled' cannot be built with no arguments"):
        Toolbox(tok, environment_factory=Leveled)
    with pytest.raises(ValueError, match=r"environment_factory 3 \(int\) is not a class or a function"):
        Toolbox(tok, environment_factory=3)


def test_a_reset_text_or_blocks_join_the_last_message_as_trl_joins_them(tok):
    text, blocks = "go", [{"type": "text", "text": "go"}]
    more = [{"type": "text", "text": " from 1"}]
    user = [{"role": "system", "content": "s"}, {"role": "user", "content": text}]
    assert with_observation(user, " from 1")[-1]["content"] == "go from 1"
    assert with_observation(user, more)[-1]["content"] == blocks + more
    as_blocks = [{"role": "user", "content": blocks}]
    assert with_observation(as_blocks, " from 1")[-1]["content"] == blocks + more
    assert with_observation(as_blocks, None) == as_blocks and as_blocks[0]["content"] == blocks  # copies

    class Shows(Counter):
        def reset(self, **row):
            return [{"type": "image", "image": None}]

    with pytest.raises(
        ValueError, match=r"^Shows.reset\(\) returned a content block of type 'image'; lora_grpo"
    ):
        Toolbox(tok, environment_factory=Shows, timeout=None).episode(2)


def test_logged_lengths_and_tokens_count_what_the_model_drew_not_the_tool_replies():
    """As TRL: completions/*_length and num_tokens count the tokens the model generated (tool_mask 1); the
    reward keyword completion_lengths keeps every token of the completion."""
    from types import SimpleNamespace

    from transformers import TrainerState

    from lora_grpo import GRPOConfig
    from lora_grpo.rollout import Rollout
    from lora_grpo.scorer import RolloutScorer

    lengths_seen = []

    def reward(completions, completion_lengths, **kwargs):
        lengths_seen.extend(completion_lengths)
        return [0.0, 1.0]

    completion_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    drawn = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]])  # row 0: a 2-token reply in the middle
    rollout = Rollout(
        torch.ones(2, 3, dtype=torch.long),
        torch.ones(2, 3, dtype=torch.long),
        torch.ones(2, 6, dtype=torch.long),
        completion_mask,
        torch.zeros(2, dtype=torch.bool),
        ["p", "p"],
        ["a", "b"],
        tool_mask=drawn,
    )
    state = TrainerState()
    scorer = RolloutScorer(
        GRPOConfig(model_name_or_path="toy", num_generations=2),
        [reward],
        SimpleNamespace(num_processes=1),
        state,
    )
    _, metrics = scorer.advantages(rollout, {"prompt": ["p"]})
    assert (metrics["completion_length/mean"], metrics["completion_length/max"]) == (4.0, 4.0)
    assert metrics["num_tokens"] == 6 + 8 and state.num_input_tokens_seen == 14
    assert lengths_seen == [6, 4]


# --------------------------------------------------------------------------- a 4-bit base


def test_a_4bit_base_with_lora_runs_tools(tok, tmp_path):
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    toy.make_tiny_model(tok).save_pretrained(
        tmp_path
    )  # hidden 64: bitsandbytes' CPU kernels want >= its block
    base = load_4bit(tmp_path)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    box = Toolbox(tok, [ping], timeout=1.0)
    p = prompt_ids(tok, box, "a")
    done = call_ids(tok) + reply(tok, box, "PONG") + ids(tok, "ok") + [tok.eos_token_id]
    Script(model, [(p, done)])
    r = rollout(model, tok, box, ["a"], num_generations=2)
    assert r.completion_ids[:, : len(done)].tolist() == [done, done] and r.tool_calls.tolist() == [1, 1]


def loud_ping(x: str) -> str:
    """Ping, loudly.

    Args:
        x: Anything.
    """
    return "PONG" * 10


def test_the_eval_counts_the_policys_own_tokens_not_the_tool_replies(qwen_tool_base_dir, tmp_path):
    """eval/completion_length and eval/kl_to_base's tokens leave out what a tool replied, as training's
    completion_length and KL do (and TRL's eval_completions/mean_length); both counted the reply's 93 tokens
    (found in review)."""
    from lora_grpo import GRPOConfig, GRPOTrainer

    rows = [{"prompt": [{"role": "user", "content": "a"}]}]
    config = GRPOConfig(
        model_name_or_path=qwen_tool_base_dir,
        num_generations=2,
        prompts_per_step=1,
        max_completion_length=200,
        max_prompt_length=1024,  # the tools' schema in the system turn
        max_steps=1,
        save_steps=0,
        micro_batch_size=2,
        gradient_checkpointing=False,
        eval_kl_to_base=True,
        output_dir=str(tmp_path / "run"),
        eval_on_start=False,
        eval_on_end=False,
    )
    trainer = GRPOTrainer(
        config,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        train_dataset=rows * 2,
        eval_dataset=rows,
        tools=[loud_ping],
    )
    tok, box = trainer.tokenizer, trainer.sampler.toolbox
    call = call_ids(tok, "loud_ping")
    replied = reply(tok, box, "PONG" * 10, name="loud_ping")
    answer = ids(tok, "ok") + [tok.eos_token_id]
    Script(
        trainer.model,
        [(prompt_ids(tok, box, rows[0]["prompt"][0]["content"]), call + replied + answer)],
        80.0,
    )
    seen = []
    kl_to_base = trainer.evaluator.kl_to_base
    trainer.evaluator.kl_to_base = lambda rollout, n: seen.append(kl := kl_to_base(rollout, n)) or kl
    metrics = trainer.evaluate()
    assert metrics["eval/tools/call_frequency"] == 1.0, metrics
    assert metrics["eval/completion_length"] == len(call) + len(answer)
    assert float(seen[0][0, 1]) == len(call) + len(answer)
