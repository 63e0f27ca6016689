"""Tool calls inside a rollout: tools from Python functions, the chat template's tool format, the
model's calls parsed and run, and the per-chunk loop the sampler drives.

    Toolbox      once per run, from ``tools=[fn, ...]`` and/or ``environment_factory``: JSON schemas
                 (transformers' ``get_json_schema``), the start-up template check, parsing, replies
    ToolEpisode  one rollout: each row's tools and environment instance; runs a row's calls (an
                 exception or a timeout becomes an error reply, counted)
    ToolTurns    the sampler's side (:mod:`lora_grpo.rollout.generate`): at a drawn EOS, parse, run,
                 and schedule the reply's tokens to be fed, one per decode step, on the same KV cache

As TRL 1.16's GRPOTrainer: a result is ``str(result)`` (a list of content blocks, such as
``[{"type": "text", "text": ...}]``, goes to the chat template as it is), an error ``str({"error": message})``; the
reply tokens are what the template adds after the assistant's end of turn (a dummy conversation
rendered with and without the tool messages); a reply that would overflow ``max_completion_length``
is dropped and the row ends at its turn; after ``max_tool_calling_iterations`` rounds a turn's calls
are not run; ``reset(**row)`` may return text (or content blocks) for the prompt, ``get_reward()`` may score
the rollout; a call that names no tool gets TRL's error reply ("Tool <name> not found."), a tool that raises
``{"error": str(exception)}``. Where we differ: each call has a timeout; a call that cannot be parsed gets an
error reply (TRL ends the completion); a block that is not text (an image, which TRL shows a vision-language
model) stops the step, naming the tool or environment: lora_grpo trains text models.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
from torch import Tensor

from .. import event_loop

# What a call past its time raises: one class from Python 3.11 on; on 3.10, concurrent.futures' and asyncio's are
# their own (caught as Exception there, the model read "{'error': ''}").
_TIMEOUTS = (TimeoutError, FutureTimeout, asyncio.TimeoutError)

# ------------------------------------------------------------------------------------- schemas


def tool_schema(fn: Callable) -> dict:
    """``fn``'s JSON schema for ``apply_chat_template(tools=...)`` (transformers' ``get_json_schema``)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ValueError(
            f"tool {getattr(fn, '__name__', fn)!r} has no JSON schema ({e}); a tool needs a type hint on "
            "every argument and a Google-style docstring with an 'Args:' section, one line per argument "
            "('    a: The first number.')"
        ) from None


def _first_environment(factory):
    """One instance of `environment_factory`, built as the rollout builds each: with no arguments."""
    if not callable(factory):
        raise ValueError(
            f"environment_factory {factory!r} ({type(factory).__name__}) is not a class or a function: give the "
            "class whose instances are the environments (each rollout row builds one with no arguments)"
        )
    try:
        inspect.signature(factory).bind()
    except ValueError:  # no signature to read (a builtin): built as it is
        pass
    except TypeError as error:
        raise ValueError(
            f"environment_factory {getattr(factory, '__name__', factory)!r} cannot be built with no arguments "
            f"({error}): each rollout row builds one as environment_factory(); give its __init__ defaults, or pass "
            "a function or functools.partial that builds it"
        ) from error
    return factory()


def _environment_methods(instance) -> list[Callable]:
    """An environment's tools: its public methods but reset and get_reward (TRL's rule; via the class)."""
    names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)]
    return [getattr(instance, n) for n in names if not n.startswith("_") and n not in ("reset", "get_reward")]


# ------------------------------------------------------------------------------------- the template


def _token_ids(out) -> list[int]:
    ids = out["input_ids"] if isinstance(out, Mapping) else out  # a BatchEncoding or ids, batched or not
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def _dummy_turn(name: str, arguments: dict) -> list[dict]:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]


def reply_ids(
    tokenizer, tool_messages: Sequence[Mapping], stop_ids: Sequence[int], **template_kwargs
) -> list[int]:
    """The token ids a chat template puts after an assistant turn that called tools (after its end of
    turn, one of ``stop_ids``): the ``tool_messages`` (``{"role": "tool", "name", "content"}``) and the
    next assistant turn's opening, cut from a dummy conversation (as TRL does): nothing the model wrote
    is re-tokenised. The cut is after the stop token that ends the dummy assistant turn (counted in
    the rendering without the replies), so a template that renders earlier assistant turns otherwise
    once more turns follow (Qwen3 drops their reasoning: not prefix-preserving) still gives the reply's
    tokens; the sequence trained on is the model's own tokens plus these. ValueError when no stop token
    ends the turn."""
    turn = _dummy_turn(tool_messages[0]["name"], {})
    before = _token_ids(
        tokenizer.apply_chat_template(turn, tokenize=True, return_dict=False, **template_kwargs)
    )
    after = _token_ids(
        tokenizer.apply_chat_template(
            turn + list(tool_messages),
            tokenize=True,
            return_dict=False,
            add_generation_prompt=True,
            **template_kwargs,
        )
    )
    stops = set(stop_ids)
    ends = [i for i, t in enumerate(before) if t in stops]
    if not ends:
        raise ValueError(
            f"the chat template ends an assistant turn that calls a tool with no EOS token (ids "
            f"{sorted(stop_ids)}): rendered {tokenizer.decode(before)[-60:]!r}. A rollout ends a turn at "
            "EOS; add the template's end-of-turn token to model.generation_config.eos_token_id"
        )
    # the assistant turn is the len(ends)-th turn a stop token closes, with or without replies after it
    ends_after = [i for i, t in enumerate(after) if t in stops]
    if len(ends_after) < len(ends):
        raise ValueError(
            "the chat template drops the assistant turn that called a tool once tool replies follow it "
            f"(rendered {tokenizer.decode(after)[-80:]!r}), so a reply cannot be appended to the model's own "
            "tokens; use a chat template that renders assistant tool calls and tool replies"
        )
    return after[ends_after[len(ends) - 1] + 1 :]


# TRL 1.16's refusal (GRPOTrainer.__init__, when supports_tool_calling is False), which ours starts with.
NO_TOOL_CALLING = (
    "The provided chat template does not support tool calling. The template must be able to render a full "
    "tool-calling conversation (user -> assistant with tool_calls -> tool)."
)
TOOL_TEMPLATE_FIX = (
    "tools need a template that renders both, such as Qwen2.5-Instruct's or Qwen3's (for a ChatML model "
    "such as SmolLM2, whose <|im_start|> / <|im_end|> they share): set tokenizer.chat_template to one"
)


def check_tool_template(tokenizer, stop_ids: Sequence[int], schemas: Sequence[dict] = ()) -> None:
    """At start: the chat template renders an assistant tool call and a tool reply (as TRL's
    ``supports_tool_calling``: user → assistant with tool_calls → tool, every part in the text), and
    the reply tokens can be cut from it (:func:`reply_ids`). ValueError saying what fails; a warning
    when ``tools=`` schemas are not rendered into prompts (the model is never told of the tools)."""
    template = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{NO_TOOL_CALLING} Tools need a chat template that renders tool calls and tool replies, but "
            f"{template!r} has none (tokenizer.chat_template is None); set tokenizer.chat_template"
        )
    name, key, value, content = "tool_name_a8f3", "arg_key_b9d4", "arg_val_d6e7", "tool_content_c4f9"
    messages = _dummy_turn(name, {key: value}) + [{"role": "tool", "name": name, "content": content}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # jinja2 TemplateError, a template that indexes a missing field
        raise ValueError(
            f"{NO_TOOL_CALLING} The chat template of {template!r} fails on it: {type(e).__name__}: {e}; "
            f"{TOOL_TEMPLATE_FIX}"
        ) from None
    if lost := [
        what
        for what, marks in (
            ("the assistant's tool_calls", (name, key, value)),
            ("the tool reply", (content,)),
        )
        if not all(m in text for m in marks)
    ]:
        raise ValueError(
            f"{NO_TOOL_CALLING} The chat template of {template!r} drops {' and '.join(lost)} "
            f"(rendered: {text[-200:]!r}); {TOOL_TEMPLATE_FIX}"
        )
    reply_ids(tokenizer, messages[2:], stop_ids)
    names = [s.get("function", s)["name"] for s in schemas]
    if names and not any(
        n in tokenizer.apply_chat_template(messages[:1], tools=list(schemas), tokenize=False) for n in names
    ):
        warnings.warn(
            f"the chat template does not render tools=[...] into prompts (no tool name of {names} in it): "
            "the model is not told which tools it has",
            stacklevel=2,
        )


# ------------------------------------------------------------------------------------- parsing


def _call(obj) -> dict:
    """One parsed call in TRL's form ``{"type": "function", "function": {"name", "arguments"}}``."""
    if isinstance(obj, Mapping) and isinstance(obj.get("function"), Mapping):
        obj = obj["function"]
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call is a JSON object with a string 'name'")
    args = obj.get("arguments", obj.get("parameters")) or {}
    args = json.loads(args) if isinstance(args, str) else args
    if not isinstance(args, Mapping):
        raise ValueError("a tool call's 'arguments' is a JSON object")
    return {"type": "function", "function": {"name": obj["name"], "arguments": dict(args)}}


def _blocks(pattern: re.Pattern, many: bool):
    def find(text: str):
        blobs = [m.group(1) for m in pattern.finditer(text)]
        return (
            None
            if not blobs
            else (pattern.sub("", text), [b for x in blobs for b in (_json_list(x) if many else [x])])
        )

    return find


def _loads(blob: str, default):
    try:
        return json.loads(blob)
    except ValueError:
        return default


def _json_list(blob: str) -> list:
    value = _loads(blob, [blob])  # an unparseable blob stays text: reported by the caller
    return value if isinstance(value, list) else [value]


def _bare_json(text: str):
    """Llama 3.x JSON tool calling: the whole turn is ``{"name": ..., "parameters": {...}}``."""
    obj = _loads(text.strip(), None) if text.strip().startswith("{") else None
    return (
        ("", [obj])
        if isinstance(obj, dict) and "name" in obj and ({"arguments", "parameters"} & obj.keys())
        else None
    )


# The common formats, tried in order; the first that finds a call wins. Each: text -> (content, call blobs) or None.
TOOL_CALL_FORMATS: dict[str, Callable] = {
    "hermes": _blocks(
        re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S), many=False
    ),  # Qwen, Hermes
    "mistral": _blocks(re.compile(r"\[TOOL_CALLS\]\s*(.*)\Z", re.S), many=True),
    "llama3": _blocks(re.compile(r"<\|python_tag\|>\s*(.*)\Z", re.S), many=True),
    "json": _bare_json,
}


def _without_end_tokens(text: str, special_tokens: Sequence[str]) -> str:
    """``text`` without the special tokens (and the whitespace) at its end."""
    ends = [t for t in special_tokens if t]
    text = text.rstrip()
    while end := next((t for t in ends if text.endswith(t)), None):
        text = text[: -len(end)].rstrip()
    return text


def parse_tool_calls(text: str, special_tokens: Sequence[str] = ()) -> tuple[str, list[dict | str]]:
    """A turn's text -> (content, calls): each call TRL's dict, or a str saying why that call could not
    be parsed (answered with an error reply). ``special_tokens`` are removed from the content.

    >>> parse_tool_calls('ok<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    ('ok', [{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}}])
    """
    # The turn as sampled ends with the end-of-turn token drawn (<|eot_id|>, <|eom_id|>, </s>); the formats
    # that read to the end of the text would take it into the call's JSON.
    text = _without_end_tokens(text, special_tokens)
    content, blobs = text, []
    for find in TOOL_CALL_FORMATS.values():
        found = find(text)
        if found is not None:
            content, blobs = found
            break
    calls: list[dict | str] = []
    for blob in blobs:
        try:
            calls.append(_call(json.loads(blob) if isinstance(blob, str) else blob))
        except (ValueError, TypeError) as e:
            shown = blob if isinstance(blob, str) else json.dumps(blob)
            calls.append(f"could not parse the tool call {shown[:120]!r}: {e}")
    for tok in special_tokens:
        content = content.replace(tok, "")
    return content.strip(), calls


# ------------------------------------------------------------------------------------- toolbox


def _error(message: str) -> str:
    return str({"error": message})


class _Unrunnable(Exception):
    """A call that could not be parsed, or names no tool."""


class Toolbox:
    """The tools of a run: plain or ``async def`` functions with type hints and a Google-style docstring,
    and/or an ``environment_factory``: a class (or callable) whose public methods are tools, ``reset(**row)``
    returning text for the prompt or None and ``get_reward()`` optional; or, as TRL, a dict of them by
    name, each row's ``environment`` column naming its own (that column is not passed to ``reset``). An
    environment may have no tool methods at all (its ``reset`` supplies the prompt, ``get_reward`` scores).
    ``stop_ids``: the ids that end a turn (the rollout's EOS ids; default the tokenizer's EOS). ``timeout``:
    seconds per call (None: no limit, sync calls run inline; else each sync call runs in a daemon thread,
    abandoned when it overruns, so tools shared by rows must be thread-safe). Checks the chat template
    (:func:`check_tool_template`) when there are tools."""

    def __init__(
        self,
        tokenizer,
        tools: Sequence[Callable] = (),
        environment_factory=None,
        *,
        stop_ids: Sequence[int] | None = None,
        timeout: float | None = 10.0,
        chat_template_kwargs=None,
    ):
        self.tokenizer, self.timeout = tokenizer, timeout
        self.tools = list(tools)
        self.named = isinstance(environment_factory, Mapping)  # TRL's dict: rows pick theirs by `environment`
        self.factories = (
            dict(environment_factory)
            if self.named
            else {}
            if environment_factory is None
            else {None: environment_factory}
        )
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.stop_ids = list(stop_ids) if stop_ids is not None else [tokenizer.eos_token_id]
        self._replies = {}
        self._pools: dict = {}  # environment name -> its instances, reused (reset) from rollout to rollout
        self.env_schemas: dict = {}  # environment name -> the schemas a row of it sees (standalone + its methods)
        functions = list(self.tools)
        for name, factory in self.factories.items():
            probe = _first_environment(factory)
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(
                    "Each environment instance returned by `environment_factory` must define a callable "
                    f"`reset`. {factory!r} has none: add reset(self, **row) returning the prompt's text "
                    "or None."
                )
            self._pools[name] = [probe]
            methods = _environment_methods(probe)
            self.env_schemas[name] = [tool_schema(f) for f in self.tools + methods]
            functions += [m for m in methods if m.__name__ not in {f.__name__ for f in functions}]
        if not all(map(callable, functions)) or not (functions or self.factories):
            raise ValueError(
                f"tools must be functions (or an environment_factory's methods), got {functions!r}"
            )
        self.names = [f.__name__ for f in functions]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"two tools share a name: {self.names}")
        self.schemas = [
            tool_schema(f) for f in functions
        ]  # every tool of the run (the parser's, the checks')
        if self.schemas:
            check_tool_template(tokenizer, self.stop_ids, self.schemas)

    @property
    def has_tools(self) -> bool:
        """False for environments without tool methods: rollouts are then single-turn."""
        return bool(self.schemas)

    def environments_for(self, rows: Sequence[Mapping]) -> list:
        """One instance per row (its environment's, by the row's `environment` field when they are named),
        drawn from the pools, which grow when a rollout needs more instances than exist."""
        names = [row.get("environment") if self.named else None for row in rows]
        unknown = sorted({repr(n) for n in names if n not in self.factories})
        if unknown:
            raise ValueError(
                f"Example has `environment={unknown[0]}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.factories)}. (Rows name their "
                "environment in their `environment` column.)"
            )
        taken: dict = {}
        out = []
        for name in names:
            pool, index = self._pools[name], taken.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            taken[name] = index + 1
            out.append(pool[index])
        return out

    def render_prompt(self, messages: Sequence[Mapping], observation: str | None = None, schemas=None) -> str:
        """Chat messages -> prompt text with the tools' schemas (``schemas``: a row's own, default every
        tool); ``observation`` (an environment's reset text) is appended to the last message's content, as
        TRL does."""
        schemas = self.schemas if schemas is None else schemas
        return self.tokenizer.apply_chat_template(
            with_observation(messages, observation),
            tools=schemas or None,
            tokenize=False,
            add_generation_prompt=True,
            **self.template_kwargs,
        )

    def prompts(self, messages: Sequence[Sequence[Mapping]], episode: ToolEpisode, num_generations: int):
        """The rollout's prompts for P message lists and an episode of P·G rows -> (texts, G'): P texts
        and G when every group's rows agree (each prompt prefilled once), else P·G texts and 1 (each row
        its own prompt; the rollout's rows line up with the episode's either way). Each row lists its own
        environment's tools."""
        G, seen = num_generations, episode.observations
        texts = [
            self.render_prompt(m, seen[i * G + g], episode.schemas[i * G + g])
            for i, m in enumerate(messages)
            for g in range(G)
        ]
        same = all(len(set(texts[i : i + G])) == 1 for i in range(0, len(texts), G))
        return (texts[::G], G) if same else (texts, 1)

    def environment_rewards(self) -> list[Callable]:
        """A reward function per environment class that defines ``get_reward()`` (TRL's: keyword
        ``environments``, weight 1, named after the class; a row of another environment gets None)."""
        out, classes = [], []
        for pool in self._pools.values():
            cls = type(pool[0])
            if cls in classes or not callable(getattr(cls, "get_reward", None)):
                continue
            classes.append(cls)

            def reward(*, environments, _cls=cls, **kwargs) -> list[float | None]:
                return [
                    None
                    if type(e) is not _cls
                    else event_loop.run(e.get_reward())
                    if inspect.iscoroutinefunction(e.get_reward)
                    else e.get_reward()
                    for e in environments
                ]

            reward.__name__ = cls.__name__
            out.append(reward)
        return out

    def episode(self, rows: int | Sequence[Mapping]) -> ToolEpisode:
        """One rollout's tools for ``rows`` (a count, or each row's dataset fields for ``reset(**row)``)."""
        return ToolEpisode(self, rows)

    def parse(self, ids: list[int], prefix_ids: list[int]) -> tuple[dict, list[dict | str]]:
        """A turn's token ids -> (assistant message, calls). transformers' response parser where the
        tokenizer has a ``response_template``; else (or when it fails) :data:`TOOL_CALL_FORMATS`."""
        tok = self.tokenizer
        content, calls, extra = None, [], {}
        if getattr(tok, "response_template", None) is not None:
            try:  # its other fields (reasoning_content) are kept, as TRL keeps them
                extra = {
                    k: v
                    for k, v in tok.parse_response(ids, prefix=prefix_ids, tools=self.schemas).items()
                    if k != "role"
                }
                calls = [_call(c) for c in extra.pop("tool_calls", None) or []]
                content = str(extra.pop("content", None) or "").removesuffix(str(tok.eos_token))
            except Exception:  # noqa: BLE001 - malformed output: the text formats below report the failing call
                content, calls, extra = None, [], {}
        if content is None:
            content, calls = parse_tool_calls(
                tok.decode(ids, skip_special_tokens=False), tok.all_special_tokens
            )
        valid = [c for c in calls if isinstance(c, dict)]
        return {
            "role": "assistant",
            "content": content,
            **extra,
            **({"tool_calls": valid} if valid else {}),
        }, calls

    def reply_ids(self, tool_messages: Sequence[Mapping]) -> list[int]:
        # replies recur (an error, a fixed answer); content blocks are keyed by their repr
        key = tuple(
            (m["name"], m["content"] if isinstance(m["content"], str) else repr(m["content"]))
            for m in tool_messages
        )
        if key not in self._replies:
            self._replies = {} if len(self._replies) > 4096 else self._replies
            self._replies[key] = reply_ids(
                self.tokenizer, tool_messages, self.stop_ids, **self.template_kwargs
            )
        return self._replies[key]

    def start(self, fn: Callable, arguments: dict) -> Future:
        """Start one call -> a Future of its result (an async one on the process's event loop, the reward
        functions' too, as in TRL)."""
        if inspect.iscoroutinefunction(fn):
            return event_loop.submit(asyncio.wait_for(fn(**arguments), self.timeout))
        future: Future = Future()

        def work():
            future.set_running_or_notify_cancel()  # running: a later cancel() (a timeout) leaves it be
            try:
                future.set_result(fn(**arguments))
            except BaseException as e:  # noqa: BLE001 - becomes the error reply
                future.set_exception(e)

        work() if self.timeout is None else threading.Thread(
            target=work, daemon=True, name="lora_grpo-tool"
        ).start()
        return future

    def result(self, name: str, future: Future, deadline: float | None) -> tuple[str | list, bool]:
        """-> (reply content: text, or the tool's list of content blocks; failed)."""
        try:
            value = future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except _TIMEOUTS:
            future.cancel()  # an async call's task is cancelled; a thread runs on, its result unused
            return _error(f"{name} timed out after {self.timeout:g} s"), True
        except _Unrunnable as e:  # could not be parsed, or no such tool: the message says it all
            return _error(str(e.args[0])), True
        except Exception as e:  # noqa: BLE001 - the model sees the error, in TRL's words: str(exception)
            return _error(str(e)), True
        if not isinstance(value, list):
            return str(value), False
        refuse_non_text(value, f"the tool {name!r} returned")
        return value, False


def non_text_block(blocks: Sequence) -> str | None:
    """The type of the first content block whose type is set and is not text (an image, audio...): what TRL gives
    a vision-language model, which a text model here would never see; None when there is none (plain text
    blocks, untyped parts, any other list)."""
    return next(
        (b["type"] for b in blocks if isinstance(b, Mapping) and b.get("type") not in (None, "text")), None
    )


def refuse_non_text(blocks: Sequence, what: str) -> None:
    """ValueError when a list of content blocks holds one of a type other than text (:func:`non_text_block`);
    any other list passes, as in TRL."""
    kind = non_text_block(blocks)
    if kind is not None:
        raise ValueError(
            f"{what} a content block of type {kind!r}; lora_grpo trains text models, which would never see it "
            "(TRL gives such blocks to a vision-language model): return text, or a list of "
            "{'type': 'text', 'text': ...} blocks"
        )


def with_observation(messages: Sequence[Mapping], observation: str | list | None) -> list[dict]:
    """Chat messages with an environment's reset text (or content blocks) appended to the last message's
    content, as TRL does: text joins text, and where either is a list of blocks the text becomes a text block.
    Copies; the row's own messages are left as they are."""
    messages = [dict(m) for m in messages]
    content = messages[-1]["content"]
    if observation is None:
        return messages
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    messages[-1]["content"] = content + observation
    return messages


class ToolEpisode:
    """One rollout's tools: per row (B = prompts × G rows), the standalone tools and its own
    environment instance (pooled by the Toolbox, reset here with the row's fields); ``observations``
    are the reset texts or content blocks (None where there is none), ``environments`` the instances (None without a
    factory; TRL passes them to reward functions as ``environments``)."""

    def __init__(self, toolbox: Toolbox, rows: int | Sequence[Mapping]):
        fields = [{}] * rows if isinstance(rows, int) else [dict(r) for r in rows]
        standalone = {f.__name__: f for f in toolbox.tools}
        self.toolbox, self.environments, self.functions = toolbox, None, [standalone] * len(fields)
        self.observations: list[str | list | None] = [None] * len(fields)
        self.schemas = [toolbox.schemas] * len(fields)  # what each row's prompt lists
        if toolbox.factories:
            self.environments = toolbox.environments_for(fields)
            if toolbox.named:  # `environment` routes the row; it is not one of reset's fields (TRL)
                self.schemas = [toolbox.env_schemas[row["environment"]] for row in fields]
                fields = [{k: v for k, v in row.items() if k != "environment"} for row in fields]
            self.observations = [env.reset(**row) for env, row in zip(self.environments, fields)]
            for env, seen in zip(self.environments, self.observations):
                if isinstance(seen, list):
                    refuse_non_text(seen, f"{type(env).__name__}.reset() returned")
            self.functions = [
                {**standalone, **{m.__name__: m for m in _environment_methods(env)}}
                for env in self.environments
            ]

    def __len__(self) -> int:
        return len(self.functions)

    def run(self, calls: Mapping[int, Sequence[dict | str]]) -> dict[int, list[tuple[str, str | list, bool]]]:
        """Run each row's calls (row -> calls as :meth:`Toolbox.parse` gives them) -> row -> [(tool name,
        reply content, failed)], in call order. A row's calls run one after another (they may change its
        environment); rows run side by side, each call under the timeout."""
        box, out = self.toolbox, {row: [None] * len(items) for row, items in calls.items()}
        for k in range(max(map(len, calls.values()), default=0)):
            pending = [
                (row, k, *self._start(row, items[k])) for row, items in calls.items() if k < len(items)
            ]
            deadline = None if box.timeout is None else time.monotonic() + box.timeout
            for row, k, name, future in pending:
                out[row][k] = (name, *box.result(name, future, deadline))
        return out

    def _start(self, row: int, call: dict | str) -> tuple[str, Future]:
        """(tool name, the Future of its result); a call that cannot run gets a failed Future."""
        name = "invalid" if isinstance(call, str) else call["function"]["name"]
        fn = None if isinstance(call, str) else self.functions[row].get(name)
        try:
            if fn is None:
                # (TRL's words for a tool it does not have)
                raise _Unrunnable(call if isinstance(call, str) else f"Tool {name} not found.")
            return name, self.toolbox.start(fn, call["function"]["arguments"])
        except Exception as e:  # noqa: BLE001 - also an async tool called with wrong arguments
            future: Future = Future()
            future.set_exception(e)
            return name, future


# ------------------------------------------------------------------------------------- the sampler's side


class ToolTurns:
    """The tool loop of a decode chunk of N rows (episode rows ``offset ..``), driven by the sampling loop
    (``generate._sample_tokens``): :meth:`force` after each draw, :meth:`end_turns` for the rows done.
    A reply is scheduled as forced tokens at the next steps (``forced`` (N, T), ``forced_ids``), fed as
    if drawn: into the KV cache one per decode step, beside rows still sampling."""

    def __init__(
        self,
        episode: ToolEpisode,
        *,
        offset: int,
        prompts: list[list[int]],
        max_new: int,
        stop_ids: Sequence[int],
        max_iterations: int | None,
        device,
    ):
        N = len(prompts)
        self.episode, self.offset, self.max_new = episode, offset, max_new
        self.max_iterations = float("inf") if max_iterations is None else max_iterations
        self.stop = torch.tensor(list(stop_ids), device=device)
        self.forced = torch.zeros((N, max_new), dtype=torch.bool, device=device)
        self.forced_ids = torch.zeros((N, max_new), dtype=torch.long, device=device)
        self.prefix = list(prompts)  # what came before each row's current turn (for the response parser)
        self.start, self.rounds, self.end = [0] * N, [0] * N, [None] * N
        self.messages: list[list[dict]] = [[] for _ in range(N)]
        self.calls, self.failures = [0] * N, [0] * N

    def force(self, rows: Tensor, step: int, tok: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
        """Replace the draws of rows inside a tool reply by the reply's token (log-prob 0)."""
        f = self.forced[rows, step]
        return torch.where(f, self.forced_ids[rows, step], tok), logp.masked_fill(f, 0.0)

    def end_turns(self, rows: Tensor, step: int, tok: Tensor, tokens: Tensor) -> tuple[Tensor, int]:
        """((R,) bool over ``rows``: finished; how many). A drawn stop token ends a turn; its calls are run and
        the reply scheduled (the row goes on), unless it has none, the rounds are used up, or the reply would
        leave no room for a drawn token within max_new (the row ends at this turn). The count is the decode
        loop's one read from the device at a token where no turn ends."""
        ended = torch.isin(tok, self.stop) & ~self.forced[rows, step]
        n = int(ended.sum())
        if not n:
            return ended, 0
        at = torch.nonzero_static(ended, size=n).squeeze(1)
        at, out = torch.stack([at, rows[at]]).tolist()  # (n known: one read for both)
        going = 0
        parsed = {
            r: self.episode.toolbox.parse(tokens[r, self.start[r] : step + 1].tolist(), self.prefix[r])
            for r in out
        }
        todo = {
            self.offset + r: parsed[r][1]
            for r in out
            if parsed[r][1] and self.rounds[r] < self.max_iterations
        }
        results = self.episode.run(todo)
        done = ended.clone()
        for i, r in zip(at, out):
            message, _ = parsed[r]
            replies = results.get(self.offset + r)
            if replies is not None:
                self.calls[r] += len(replies)
                self.failures[r] += sum(failed for _, _, failed in replies)
                tool_messages = [{"role": "tool", "name": n, "content": c} for n, c, _ in replies]
                ids = self.episode.toolbox.reply_ids(tool_messages)
                if len(ids) <= self.max_new - step - 2:  # the reply, then at least one drawn token
                    span = slice(step + 1, step + 1 + len(ids))
                    self.forced[r, span] = True
                    self.forced_ids[r, span] = torch.tensor(ids, device=self.forced_ids.device)
                    self.messages[r] += [message, *tool_messages]
                    self.start[r], self.prefix[r], self.rounds[r], done[i] = (
                        span.stop,
                        ids,
                        self.rounds[r] + 1,
                        False,
                    )
                    going += 1
                    continue
            self.messages[r].append(message)
            self.end[r] = step
        return done, n - going

    def finish(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """After the loop, tokens (N, T) -> (lengths (N,) long, tool_mask (N, T) long: 1 on drawn tokens
        of the completion, truncated (N,) bool); a truncated row's last turn joins its messages."""
        N, T = tokens.shape
        for r in range(N):
            if self.end[r] is None:
                self.messages[r].append(
                    self.episode.toolbox.parse(tokens[r, self.start[r] : T].tolist(), self.prefix[r])[0]
                )
        truncated, lengths = (
            torch.tensor(v, device=tokens.device)
            for v in ([e is None for e in self.end], [T if e is None else e + 1 for e in self.end])
        )
        inside = torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]
        return lengths, (inside & ~self.forced[:, :T]).long(), truncated


def tool_metrics(calls: Tensor, failures: Tensor) -> dict[str, float]:
    """A rollout's tool metrics from its per-completion counts (gather them first under several
    processes): TRL's ``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency``
    (failed / calls, 0 without calls), and ``tools/calling_fraction`` (completions with a call)."""
    n, total = max(calls.numel(), 1), int(calls.sum())
    return {
        "tools/call_frequency": total / n,
        "tools/failure_frequency": int(failures.sum()) / total if total else 0.0,
        "tools/calling_fraction": float((calls > 0).sum()) / n,
    }
