"""The offline calculator task: sums of 3–4 digit numbers, a calculator tool, and a tiny base that
sometimes calls it. GRPO's job is to make the model call the tool and copy its result.

Everything is built locally (nothing is downloaded): a character-level tokenizer (the toy's
characters plus ``{}"_[]``, and ``<tool_call>`` / ``</tool_call>`` as single tokens, as Qwen2.5 has
them) with a chat template that renders ``tools=``, assistant tool calls in the Hermes/Qwen format
and tool replies::

    tools: calculator
    user: 1234+5678
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "1234+5678"}}</tool_call><eos>
    tool: 6912
    assistant: = 6912<eos>

``ensure_calculator_base`` pre-trains a ~0.3M parameter Llama-style model (as tasks.toy does) on such
transcripts: with probability ``call_share`` the transcript calls the tool and copies its result;
otherwise it answers at once with the carry-free sum (every column mod 10: "1234+5678" -> "= 6802"),
wrong whenever a column carries, which is most 3–4 digit sums. Both answers open with "= ", so the
first token is "<tool_call>" with probability ~``call_share`` and "=" with the rest: the base calls
in about ``call_share`` of its samples and never greedily, and its direct answers are mostly wrong;
calling is what pays. ``calculator_problems``, ``calculator_reward`` and ``tool_use`` are the data, the
reward and the before/after measurement.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import operator
import re
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from ..rollout import Toolbox, generate_rollout, reply_ids
from .pretrain import ensure_cached_base
from .toy import CHARS as TOY_CHARS
from .toy import EOS, carry_free_sum, default_cache_dir, pretrain_base
from .toy import make_tokenizer as make_char_tokenizer

CHARS = TOY_CHARS + list('{}"_[]')
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
# transformers renders templates with trim_blocks: newlines are written as {{ '\n' }} so none is lost.
CHAT_TEMPLATE = (
    "{% if tools %}{{ 'tools:' }}{% for t in tools %}"
    "{{ ' ' + (t.function.name if t.function is defined else t.name) }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}{{ 'assistant: ' + (m.content or '') }}"
    "{% for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}"
    "{{ '<tool_call>{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}</tool_call>' }}"
    "{% endfor %}{{ '<eos>\\n' }}"
    "{% elif m.role == 'tool' %}{{ 'tool: ' + m.content + '\\n' }}"
    "{% else %}{{ m.role + ': ' + m.content + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The toy's character tokenizer over CHARS, plus the tool tokens and the tool chat template."""
    tok = make_char_tokenizer(CHARS, CHAT_TEMPLATE)
    tok.add_tokens(TOOL_TOKENS)  # not special: decoded text keeps them, as Qwen2.5's
    return tok


# ---------------------------------------------------------------------------------------------- the tool

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent or base too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "1234+5678" or "(3.5*4)-2".
    """
    value = _evaluate(ast.parse(expression.replace(",", "").replace("^", "**").strip(), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        value = int(value) if value.is_integer() else round(value, 6)
    return str(value)


# ---------------------------------------------------------------------------------------------- data

EVAL_PERCENT = 20  # share of operand pairs held out, chosen by a hash of the pair (fixed, seed-independent)
LOW, HIGH = 100, 9999  # operands: 3 or 4 digits


def _held_out(a: int, b: int) -> bool:
    return hashlib.sha256(f"{a}+{b}".encode()).digest()[0] * 100 < EVAL_PERCENT * 256


def _pairs(n: int, gen: torch.Generator, split: str) -> list[tuple[int, int]]:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    out = []
    while len(out) < n:
        a, b = torch.randint(LOW, HIGH + 1, (2,), generator=gen).tolist()
        if _held_out(a, b) == (split == "eval"):
            out.append((a, b))
    return out


def calculator_problems(n: int, seed: int = 0, split: str = "train"):
    """``n`` sums as a ``datasets.Dataset``: "prompt" (chat messages ``[{"role": "user", "content":
    "1234+5678"}]``) and "answer" ("6912"). Train and eval draw from disjoint operand pairs (a fixed
    hash split, 20% held out); deterministic by ``seed``."""
    import datasets

    pairs = _pairs(n, torch.Generator().manual_seed(seed), split)
    return datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}+{b}"}] for a, b in pairs],
            "answer": [str(a + b) for a, b in pairs],
        }
    )


_INT = re.compile(r"\s*(?:=\s*)?(-?\d+)\s*")


def final_answer(completion) -> int | None:
    """The integer a completion ends with: a message list's last assistant content (None when that
    turn is a call that was never answered), or the text after the last "assistant: " (a tool reply's
    opening); None unless it is exactly one integer, optionally after "=" ("= 6912")."""
    if isinstance(completion, list):
        last = completion[-1] if completion else {}
        text = (
            "" if last.get("tool_calls") or last.get("role") != "assistant" else str(last.get("content", ""))
        )
    else:
        text = str(completion).rsplit("assistant: ", 1)[-1].split(EOS, 1)[0]
    match = _INT.fullmatch(text)
    return int(match.group(1)) if match else None


def calculator_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the "answer" column, else 0.0 (TRL's contract)."""
    return [float(final_answer(c) == int(a)) for c, a in zip(completions, answer, strict=True)]


# ---------------------------------------------------------------------------------------------- the base

# bump when the task or the training code changes what a seed produces (2: 1200 steps; the 600 of version 1
# stopped before the model learnt to copy)
FORMAT_VERSION = 2
RECORD = "pretrain.json"  # the pretraining record beside the weights (settings, losses, format_version)


def _transcripts(tokenizer, pairs, calls: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), right-padded: each rendered exactly as a rollout lays it out (prompt,
    then the model's turns, the tool reply in between); labels -100 on the prompt, the reply and pads."""
    if not pairs:
        return torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1), dtype=torch.long)
    box_prompt = tokenizer.apply_chat_template
    seqs, labels = [], []
    for (a, b), call in zip(pairs, calls):
        prompt = box_prompt(
            [{"role": "user", "content": f"{a}+{b}"}],
            tools=[{"name": "calculator"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        lab = [-100] * len(ids)
        if call:
            args = json.dumps({"expression": f"{a}+{b}"})
            turn = tokenizer(
                f'<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>',
                add_special_tokens=False,
            )["input_ids"] + [tokenizer.eos_token_id]
            reply = reply_ids(
                tokenizer,
                [{"role": "tool", "name": "calculator", "content": str(a + b)}],
                [tokenizer.eos_token_id],
            )
            ids, lab = ids + turn + reply, lab + turn + [-100] * len(reply)
        answer = tokenizer(f"= {a + b if call else carry_free_sum(a, b)}", add_special_tokens=False)[
            "input_ids"
        ]
        answer += [tokenizer.eos_token_id]
        seqs.append(ids + answer)
        labels.append(lab + answer)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    return (
        torch.tensor([s + [pad] * (width - len(s)) for s in seqs]),
        torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    )


def pretrain_calculator_base(
    out_dir,
    *,
    seed: int = 0,
    steps: int = 1200,
    batch_size: int = 48,
    learning_rate: float = 2e-3,
    warmup_steps: int = 40,
    call_share: float = 0.3,
    hidden_size: int = 96,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    log_every: int = 100,
) -> str:
    """Pre-train the calculator base on transcripts (``call_share`` of them call the tool) and save
    model, tokenizer and ``pretrain.json`` (settings, losses, seconds) to ``out_dir``. AdamW, warmup
    then cosine to 10%; next-token loss on the model's own turns. Deterministic by ``seed`` (on a
    fixed thread count); the caller's RNG state is untouched.

    Copying (the sum into the call's JSON, the tool's reply into the answer) is learnt late: the loss
    sits near 0.55 for hundreds of steps, then falls as the copy forms. 600 steps stopped at the start
    of that fall (seeds 0 and 1 copied the reply in 0.18 and 0.01 of their calls); at 1200 seed 0, the
    shipped base, copies in 0.93, seed 1 in 0.50 (still in the fall: another seed may need more steps)."""
    settings = {k: v for k, v in locals().items() if k != "out_dir"}
    out_dir, tokenizer = Path(out_dir), make_tokenizer()

    def batch_loss(model, gen):
        calls = (torch.rand(batch_size, generator=gen) < call_share).tolist()
        pairs = _pairs(batch_size, gen, "train")
        # Two forwards, calls and direct answers, each padded to its own length (direct ones are short).
        total, count = 0.0, 0
        for kind in (True, False):
            chosen = [p for p, c in zip(pairs, calls) if c == kind]
            ids, labels = _transcripts(tokenizer, chosen, [kind] * len(chosen))
            if len(ids):
                logits = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits
                total = total + torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
                )
                count += int((labels[:, 1:] != -100).sum())
        return total / count

    return pretrain_base(
        out_dir,
        tokenizer,
        batch_loss,
        settings,
        version=FORMAT_VERSION,
        record=RECORD,
        label="calculator pretrain",
    )


def ensure_calculator_base(cache_dir=None, seed: int = 0, **overrides) -> str:
    """Path of the pre-trained calculator base, trained on first use and cached under ``cache_dir``
    (default ``$LORA_GRPO_CACHE`` or ``~/.cache/lora_grpo``) in a directory named by a hash of the
    settings; built in a temporary directory and renamed into place, an incomplete entry rebuilt.
    Under torch.distributed every process calls it: LOCAL_RANK 0 builds, the others wait
    (pretrain.ensure_cached_base)."""
    return ensure_cached_base(
        pretrain_calculator_base,
        name="calculator_base",
        version=FORMAT_VERSION,
        record=RECORD,
        cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
        seed=seed,
        overrides=overrides,
        label="calculator pretrain",
    )


# ---------------------------------------------------------------------------------------------- measuring


def tool_use(
    model,
    tokenizer,
    dataset,
    *,
    temperature: float = 0.0,
    num_generations: int = 1,
    max_completion_length: int = 112,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, float]:
    """Rollouts with the calculator tool over ``dataset`` (calculator_problems rows) -> accuracy,
    call_frequency (completions that called), copy_rate (of those whose call succeeded: final answer
    equals the tool's reply), direct_accuracy (of those that did not call), failure_frequency."""
    box = Toolbox(tokenizer, [calculator], stop_ids=[tokenizer.eos_token_id], timeout=None)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    n = called = copied = succeeded = direct_right = right = failed = calls = 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        prompts = [box.render_prompt(m) for m in rows["prompt"]]
        r = generate_rollout(
            model,
            tokenizer,
            prompts,
            num_generations=num_generations,
            max_prompt_length=None,
            max_completion_length=max_completion_length,
            temperature=temperature,
            generator=gen,
            tools=box,
            max_tool_calling_iterations=1,
        )
        truth = [a for a in rows["answer"] for _ in range(num_generations)]
        for messages, c, f, a in zip(r.messages, r.tool_calls.tolist(), r.tool_failures.tolist(), truth):
            value, n, calls, failed = final_answer(messages), n + 1, calls + c, failed + f
            right += value == int(a)
            if c:
                called += 1
                replies = [m["content"] for m in messages if m["role"] == "tool"]
                if f == 0 and replies:
                    succeeded += 1
                    copied += str(value) == replies[-1]
            else:
                direct_right += value == int(a)
    return {
        "accuracy": right / n,
        "call_frequency": called / n,
        "copy_rate": copied / max(succeeded, 1),
        "direct_accuracy": direct_right / max(n - called, 1),
        "failure_frequency": failed / max(calls, 1),
    }
