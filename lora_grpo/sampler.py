"""The rollout stage of a run: the config's sampling settings, and the tools each rollout may call.

Without tools it is generate_rollout with the config's settings. With `tools` (typed, documented
functions) or an `environment_factory` (a class whose methods are the tools; one instance per
completion, reset with the row's dataset fields), a rollout is multi-turn (rollout/tools.py): a turn
that calls a tool gets the tool's reply appended on the same KV cache and sampling continues; the
reply tokens are context, not actions (Rollout.tool_mask: the loss skips them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .data.prompts import EMPTY_PROMPT, PROMPT_MESSAGES, chat_rendered
from .rewards.specs import _import_object
from .rollout import Rollout, Toolbox, eos_token_ids, generate_rollout
from .run.failures import stage


def resolve_callable(spec, what: str) -> Callable:
    """A function or class given as itself or as a dotted path 'pkg.module:name' (a recipe's)."""
    if callable(spec):
        return spec
    try:
        return _import_object(str(spec))
    except Exception as e:  # noqa: BLE001 - any import failure means: this path does not name it
        raise ValueError(
            f"cannot import {what} {spec!r} ({type(e).__name__}: {e}); give a dotted path "
            "'package.module:name' importable from here (`lora-grpo` imports from the current directory "
            "first; a script, from its own directory)"
        ) from e


def reset_fields(row: Mapping) -> dict:
    """What an environment's ``reset(**row)`` gets for a prompt dataset's row: its fields as TRL passes them,
    ``prompt`` the row's chat messages where it had them (as the policy sees them: ``system_prompt`` applied),
    else its text (rendered: the row's own unless prompt_template, use_chat_template or system_prompt changed
    it); never the loader's ``prompt_messages`` column beside it."""
    fields = {k: v for k, v in row.items() if k != PROMPT_MESSAGES}
    if row.get(PROMPT_MESSAGES) == EMPTY_PROMPT:
        # TRL's stand-in for a row without a prompt (its environment supplies one): TRL's reset(**row) never gets it
        del fields["prompt"]
    elif row.get(PROMPT_MESSAGES) is not None:
        fields["prompt"] = row[PROMPT_MESSAGES]
    return fields


class PolicySampler:
    """sample(prompts, ...) → a Rollout of the policy, with the run's tools when it has any."""

    def __init__(
        self,
        config,
        model,
        tokenizer,
        generator: torch.Generator,
        *,
        tools: Sequence = (),
        environment_factory=None,
    ):
        self.config, self.model, self.tokenizer, self.generator = config, model, tokenizer, generator
        tools = [resolve_callable(t, "tool") for t in tools]
        if isinstance(environment_factory, Mapping):  # TRL's dict of named environments
            factory = {
                name: resolve_callable(f, f"environment_factory[{name!r}]")
                for name, f in environment_factory.items()
            }
        else:
            factory = (
                None
                if environment_factory is None
                else resolve_callable(environment_factory, "environment_factory")
            )
        self.toolbox = None
        if tools or factory is not None:
            self.toolbox = Toolbox(
                tokenizer,
                tools,
                factory,
                stop_ids=eos_token_ids(model, tokenizer),
                timeout=config.tool_timeout,
                chat_template_kwargs=config.chat_template_kwargs,
            )
        self.environments = None  # the last rollout's environment instances (reward functions get them)
        self.observations = None  # their reset() texts or content blocks, per row (None where there is none)

    @property
    def prompt_template_kwargs(self) -> dict:
        """What the datasets' chat template gets: the config's kwargs, and the tools' schemas in a tool run."""
        # an environment without tool methods has no schemas: none passed, as TRL (Llama 3's template renders its
        # tool-calling preamble for tools=[])
        extra = {} if self.toolbox is None or not self.toolbox.schemas else {"tools": self.toolbox.schemas}
        return {**self.config.chat_template_kwargs, **extra}

    def sample(
        self,
        prompts: list[str],
        num_generations: int | None = None,
        temperature: float | None = None,
        generator: torch.Generator | None = None,
        rows: dict[str, list] | None = None,
    ) -> Rollout:
        """num_generations completions per prompt; `generator` defaults to the training sampling stream.
        `rows` (the prompts' dataset columns) reset a tool run's environments."""
        cfg, G = self.config, num_generations or self.config.num_generations
        # the prompts the chat template rendered (no BOS beyond the template's own, as TRL)
        chat = chat_rendered(rows.get(PROMPT_MESSAGES) if rows else None, len(prompts), cfg.use_chat_template)
        tools = None
        if self.toolbox is not None:
            row_dicts = (
                [reset_fields(dict(zip(rows, values))) for values in zip(*rows.values())] if rows else None
            )
            with stage("environment"):  # the environments' constructors and reset(**row): the user's code
                tools = self.toolbox.episode(
                    [r for r in row_dicts for _ in range(G)] if row_dicts else len(prompts) * G
                )
            messages = rows.get(PROMPT_MESSAGES) if rows else None
            if any(tools.observations) and not (messages and all(m is not None for m in messages)):
                with stage("environment"):
                    raise ValueError(
                        "an environment's reset() returned text, which joins the prompt's last chat message (as in "
                        "TRL), but these prompts are text, not chat messages, so the policy would never see it: give "
                        "the dataset's prompts as messages ([{'role': 'user', 'content': ...}]), or return None from "
                        "reset()"
                    )
            if (any(tools.observations) or self.toolbox.named) and messages:
                # reset texts join the prompts; with named environments each row lists its own one's tools
                prompts, G = self.toolbox.prompts(rows[PROMPT_MESSAGES], tools, G)
                chat = [True] * len(prompts)
            self.environments, self.observations = tools.environments, tools.observations
            if not self.toolbox.has_tools:  # environments without tool methods: a single-turn rollout
                tools = None
        return generate_rollout(
            self.model,
            self.tokenizer,
            prompts,
            num_generations=G,
            max_prompt_length=cfg.max_prompt_length,
            max_completion_length=cfg.max_completion_length,
            temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            repetition_penalty=cfg.repetition_penalty,
            decode_mode=cfg.decode_mode,
            generator=self.generator if generator is None else generator,
            tools=tools,
            max_tool_calling_iterations=cfg.max_tool_calling_iterations,
            chat=chat,
        )
