"""The cost of tool calls in a rollout: a multi-turn rollout against a single-turn one of the same
total length, and against re-prefilling each turn (what TRL's tool loop does).

What is measured, per setting (R tool rounds, replies of K characters), on one model and the same
P prompts × G samples, every one of the P·G rows writing the same token sequence S of length T:

    S = R × [ a call (<tool_call>{"name": "echo", ...}</tool_call><eos>, 60 tokens), the reply
              ("\\ntool: " + K characters + "\\nassistant: ", K + 20 tokens) ] + "= 42<eos>"

- single   ``generate_rollout(..., max_completion_length=T)`` without tools: all T tokens drawn,
           one decode step each (the floor: the same sequence, no tool work; its turns end with a
           newline instead of EOS, which would end a single-turn completion).
- multi    the same call with ``tools=Toolbox(tokenizer, [echo])``: the calls are parsed and run,
           the replies rendered by the chat template and fed as forced tokens, one per decode step,
           on the same KV cache (lora_grpo/rollout/tools.py).
- reprefill  R + 1 single-turn calls, one per turn: each prefills the prompt plus everything so far
           (previous turns and replies) and draws the next turn (TRL 1.16's loop re-prefills the
           whole history after every round; here the replies are written into the next prompt as
           text, which the character tokenizer round-trips exactly).

The model writes S because a bias of +50 is added, in a forward hook, to the logit of the token S
has next (looked up by position and input token in a precomputed table: one gather per forward,
the same in every path); the drawn tokens are checked against S after each call. The model is a
random-init Llama-style model on lora_grpo's calculator tokenizer (characters; 90 ids); prompts are
"tools: echo\\nuser: " + 16 characters + "\\nassistant: ".

Expect multi ≈ single plus the tool work (small for a trivial tool), and reprefill slower when
the history is long and replies are short (it pushes the history through the model again every
round). Where this design does not win: long replies (K large) are fed one token per decode step,
while reprefill pushes them through one batched prefill, so with few rows and long replies
reprefill can be faster; the K = 256 rows show it.

Columns: time = median wall time of `repeats` calls after one warm-up; ratios over single.

    python benchmarks/tool_rollout_cost.py [--settings 1x8,3x8,1x256] [--prompts 4] [--generations 8]
                                           [--hidden 256] [--layers 4] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json

import torch
from _common import add_threads_argument, environment, median_seconds, parse_pairs, print_markdown_table

from lora_grpo.rollout import Toolbox, generate_rollout
from lora_grpo.tasks import calculator, toy


def echo(text: str) -> str:
    """Repeat the text back.

    Args:
        text: What to repeat.
    """
    return text


class Writer:
    """Adds +50 to the logit of the token each row's script has next (position, input token) -> token."""

    def __init__(self, model, table: torch.Tensor):
        self.table, self.inputs = table, {}  # table (positions, V) long, -1 where the script says nothing
        model.model.register_forward_pre_hook(lambda m, a, kw: self.inputs.update(kw), with_kwargs=True)
        model.lm_head.register_forward_hook(self.bias)

    def bias(self, module, args, out):
        L = out.shape[1]
        nxt = self.table[self.inputs["position_ids"][:, -L:] + 1, self.inputs["input_ids"][:, -L:]]
        return out.scatter_add(2, nxt.clamp(min=0)[..., None], 50.0 * (nxt >= 0)[..., None].to(out.dtype))


def script_table(prompts: list[list[int]], completion: list[int], vocab: int) -> torch.Tensor:
    width = max(map(len, prompts)) + len(completion) + 2
    table = torch.full((width, vocab), -1, dtype=torch.long)
    for prompt in prompts:
        seq = prompt + completion
        for j in range(len(prompt), len(seq)):
            table[j, seq[j - 1]] = seq[j]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--settings", default="1x8,3x8,1x256", help="RxK: R tool rounds, replies of K characters"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    add_threads_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = calculator.make_tokenizer()
    box = Toolbox(tok, [echo], timeout=None)
    P, G = args.prompts, args.generations
    contents = [f"{i:016d}" for i in range(P)]  # equal lengths: the rows share one script
    prompt_texts = [box.render_prompt([{"role": "user", "content": c}]) for c in contents]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in prompt_texts]
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    print(
        f"# tool rollout cost: {P} prompts x {G} samples, hidden {args.hidden}, {args.layers} layers; "
        f"{environment()}\n"
    )
    rows = []
    for R, K in parse_pairs(args.settings):
        reply_text = "x" * K
        call = ids(
            f'<tool_call>{{"name": "echo", "arguments": {json.dumps({"text": reply_text})}}}</tool_call>'
        )
        call = call + [tok.eos_token_id]
        reply = box.reply_ids([{"role": "tool", "name": "echo", "content": reply_text}])
        rounds = [call + reply] * R
        answer = ids("= 42") + [tok.eos_token_id]
        completion = [t for r in rounds for t in r] + answer
        T = len(completion)
        model = toy.make_tiny_model(
            tok,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            max_positions=max(map(len, prompts)) + T + len(call) + 8,
        ).eval()
        newline = ids("\n")[0]
        flat = [newline if t == tok.eos_token_id else t for t in completion[:-1]] + completion[-1:]
        writer = Writer(model, script_table(prompts, flat, len(tok)))
        tools_table = script_table(prompts, completion, len(tok))

        def run(**kw):
            return generate_rollout(
                model,
                tok,
                prompt_texts,
                num_generations=G,
                max_prompt_length=None,
                temperature=1.0,
                max_completion_length=T,
                generator=torch.Generator().manual_seed(0),
                **kw,
            )

        def reprefill():  # TRL's loop: each row re-prefilled with its whole history every round
            history = [t for t in prompt_texts for _ in range(G)]
            for turn in [*rounds, answer]:
                r = generate_rollout(
                    model,
                    tok,
                    history,
                    num_generations=1,
                    max_prompt_length=None,
                    temperature=1.0,
                    max_completion_length=len(call) + 4,
                    generator=torch.Generator().manual_seed(0),
                )
                expected = answer if turn is answer else call
                assert r.completion_ids[0, : len(expected)].tolist() == expected, (
                    "the script was not followed"
                )
                history = [h + tok.decode(turn, skip_special_tokens=False) for h in history]
            return r

        single_t, single = median_seconds(lambda: run(), args.repeats)
        writer.table = tools_table
        multi_t, multi = median_seconds(lambda: run(tools=box, max_tool_calling_iterations=R), args.repeats)
        re_t, _ = median_seconds(reprefill, args.repeats)
        for r, seq in ((single, flat), (multi, completion)):
            assert (r.completion_ids[:, :T] == torch.tensor(seq)).all(), "the rows did not write the script"
        assert multi.tool_calls.tolist() == [R] * P * G and int(multi.tool_mask.sum()) == P * G * (
            T - R * len(reply)
        )
        rows.append(
            [
                f"{R} x {K}",
                str(T),
                f"{single_t:.3f}",
                f"{multi_t:.3f}",
                f"{re_t:.3f}",
                f"{multi_t / single_t:.2f}",
                f"{re_t / single_t:.2f}",
            ]
        )
    print_markdown_table(
        [
            "rounds x reply chars",
            "tokens/row",
            "single (s)",
            "multi (s)",
            "reprefill (s)",
            "multi/single",
            "reprefill/single",
        ],
        rows,
        text_columns=1,
    )


if __name__ == "__main__":
    main()
