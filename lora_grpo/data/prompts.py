"""Prompt datasets: loading, rendering prompts to text, and seeded epoch batching with resume.

``load_prompt_dataset`` returns a ``datasets.Dataset`` whose ``prompt`` column holds the prompt
TEXT the policy is sampled from; every other column is kept, because columns reach the reward
functions as keyword lists (e.g. ``answer`` for :func:`lora_grpo.rewards.answer_accuracy`). A
streamed ``IterableDataset`` given to a run is read once, the rows the run needs (read_stream).

Conversational prompts: when the prompts are chat messages (the ``messages_column``, or a
``prompt_column`` holding message lists), the messages the policy is prompted with (the row's
messages, with ``system_prompt`` applied) move to the column ``prompt_messages`` (None in a row
whose prompt is text), replacing the column they were read from. The trainer passes them to the
reward functions as ``prompts`` (TRL's conversational format), never under their column name, so
they arrive exactly once; ``prompt`` and ``prompt_messages`` are the two columns that never reach
a reward function as keywords.

``PromptBatches`` (data/batches.py) walks that dataset in seeded, reshuffled epochs, ``prompts_per_step`` rows at a
time, and can be checkpointed and resumed exactly.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from ..config_checks import template_columns
from ..rollout.tools import non_text_block
from ..tasks.calculator import calculator_problems
from ..tasks.chat_arithmetic import chat_sum_problems
from ..tasks.countdown import countdown_problems
from ..tasks.countdown_toy import countdown_toy_problems
from ..tasks.toy import toy_problems
from .batches import PromptBatches
from .files import FILE_BUILDERS, load_data_file

logger = logging.getLogger(__name__)

__all__ = [
    "PROMPT_MESSAGES",
    "PromptBatches",
    "chat_rendered",
    "load_prompt_dataset",
    "resolve_dataset",
    "resolve_datasets",
]

# The column holding each row's prompt as chat messages (None for a text prompt); see the module docstring.
PROMPT_MESSAGES = "prompt_messages"
# TRL's prompt where an environment supplies it (a dataset without a prompt column, or none at all): an empty user
# message that reset()'s text fills. A stand-in, not a field of the row: reset(**row) does not get it.
EMPTY_PROMPT = [{"role": "user", "content": ""}]


# ------------------------------------------------------------------------------------- loading


def _load_source(source: Any, split: str, config_name: str | None = None) -> datasets.Dataset:
    """A ``datasets.Dataset`` from any accepted source (see :func:`load_prompt_dataset`)."""
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, datasets.DatasetDict):
        return _pick_split(source, split, "the DatasetDict")
    if isinstance(source, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise TypeError(
            "a streamed datasets.IterableDataset has no length: pass it to GRPOTrainer with max_steps set (the rows "
            "the run needs are read once), or read rows yourself: Dataset.from_list(list(stream.take(n)))"
        )
    if isinstance(source, (list, tuple)):
        if not all(isinstance(row, Mapping) for row in source):
            raise TypeError("a list source must be a list of dicts (one per row)")
        return from_rows(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"unsupported dataset source of type {type(source).__name__}: pass a datasets.Dataset, "
            "a list of dicts, a .json/.jsonl/.csv/.parquet file, a save_to_disk directory or a hub name"
        )
    path = Path(source).expanduser()
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            return _pick_split(loaded, split, f"the dataset saved at {path}")
        return loaded
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix not in FILE_BUILDERS:
            raise ValueError(
                f"cannot load {path}: unknown file type {suffix!r}; supported: {sorted(FILE_BUILDERS)}"
            )
        # A single file is one split; `split` does not apply to it.
        return load_data_file(path)
    if suffix in FILE_BUILDERS or str(source).startswith((".", "/", "~")):
        raise FileNotFoundError(f"dataset file or directory not found: {path}")
    return datasets.load_dataset(str(source), config_name, split=split)  # a hub dataset name


def from_rows(rows: Sequence[Mapping]) -> datasets.Dataset:
    """A Dataset of dict rows with every key any row has (None where a row lacks it): Dataset.from_list
    takes its columns from the first row alone, and would drop a column that row lacks from every row.
    A column whose values Arrow cannot hold as one type (text in some rows, chat messages in others) is
    named with the first two rows that differ."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    try:
        return datasets.Dataset.from_list([{key: row.get(key) for key in keys} for row in rows])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        for key in keys:
            kinds = {}
            for i, row in enumerate(rows):
                if row.get(key) is not None:
                    kinds.setdefault(type(row[key]).__name__, i)
            if len(kinds) > 1:
                (a, i), (b, j) = list(kinds.items())[:2]
                raise ValueError(
                    f"column {key!r} holds a {a} in row {i} and a {b} in row {j}: a column holds one type "
                    "(give every row's prompt as text, or every row's as chat messages)"
                ) from error
        raise


def _pick_split(dd: datasets.DatasetDict, split: str, what: str) -> datasets.Dataset:
    if split not in dd:
        raise ValueError(f"split {split!r} not in {what}; available splits: {list(dd)}")
    return dd[split]


def _check_rows(ds: datasets.Dataset, column: str, ok, expected: str, keep: str) -> None:
    """Raise, naming the column, the rows and a filter, when rows of ``column`` fail ``ok``: at load,
    not when a bad row comes up mid-training. A row of chat messages gets its first bad message named."""
    values = ds[column]
    bad = [i for i, value in enumerate(values) if not ok(value)]
    if bad:
        rows = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
        problem = next(filter(None, map(_message_problem, (values[i] for i in bad))), None)
        if problem:  # rows of messages lacking a role or content: a filter that keeps only whole ones
            keep = (
                f"row[{column!r}] and all(m.get('role') and (m.get('content') is not None or m.get('tool_calls')) "
                f"for m in row[{column!r}])"
            )
        raise ValueError(
            f"column {column!r} must hold {expected}, but {len(bad)} of {len(ds)} rows do not: rows "
            f"[{rows}] (row {bad[0]} holds {values[bad[0]]!r:.120}{f'; {problem}' if problem else ''}); "
            f"filter them out before loading, e.g. ds = ds.filter(lambda row: {keep})"
        )


def _message_problem(value: Any) -> str | None:
    """The first message of a non-empty list of dicts without a 'role' (a non-empty str) or a
    'content' (datasets stores a missing key as None); None for anything else or a good list. An assistant
    turn that calls tools may have no content (its 'tool_calls' are the turn), as chat templates render it."""
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(m, Mapping) for m in value)
    ):
        for j, m in enumerate(value):
            for key in ("role", "content"):
                if key == "content" and m.get("tool_calls"):
                    continue
                if m.get(key) is None or (key == "role" and not (isinstance(m[key], str) and m[key])):
                    return f"its message {j} has {'no' if m.get(key) is None else 'an empty'} {key!r} ({dict(m)!r:.80})"
    return None


def chat_rendered(messages: Sequence | None, rows: int, use_chat_template: bool) -> list[bool] | None:
    """Per prompt of ``rows`` loaded ones, whether the chat template rendered its text (its messages, a
    ``PROMPT_MESSAGES`` entry that is not None; or, with ``use_chat_template``, every prompt); None when none
    was. The rollout adds no BOS to those beyond the template's own, as TRL (rollout.prompt_token_rows)."""
    if use_chat_template:
        return [True] * rows
    return None if messages is None else [m is not None for m in messages]


# The columns TRL's GRPOTrainer shows a vision-language model beside each prompt.
IMAGE_COLUMNS = ("image", "images")


def _refuse_images(ds: datasets.Dataset, columns: list[str], message_columns: Sequence[str]) -> None:
    """lora_grpo trains text models: a dataset whose images TRL would show the model (an ``image`` /
    ``images`` column, a chat message with a part other than text) is refused at load, never trained on as
    if the model had seen them."""
    for column in IMAGE_COLUMNS:
        if column in columns:
            raise ValueError(
                f"column {column!r}: TRL's GRPOTrainer shows a dataset's {' / '.join(IMAGE_COLUMNS)} column to a "
                "vision-language model with each prompt; lora_grpo trains text models, which would never see "
                f"these images. Drop the column (ds = ds.remove_columns([{column!r}])), or, if only your reward "
                f"functions read it, rename it (ds = ds.rename_column({column!r}, '{column}_ref'))"
            )
    for column in message_columns:
        for i, messages in enumerate(ds[column]):
            if not isinstance(messages, Sequence) or isinstance(messages, str):
                continue
            for j, message in enumerate(messages):
                content = message.get("content") if isinstance(message, Mapping) else None
                if isinstance(content, str) or not isinstance(content, Sequence):
                    continue
                other = non_text_block(content)
                if other is not None:
                    raise ValueError(
                        f"column {column!r}: row {i}'s message {j} has a content part of type {other!r}; lora_grpo "
                        "trains text models, which would never see it (TRL gives such parts to a vision-language "
                        "model). Give the prompts as text, e.g. keep each message's text parts: ds = ds.map("
                        f"lambda row: {{{column!r}: [{{**m, 'content': '\\n'.join(p['text'] for p in m['content'] "
                        f"if p['type'] == 'text')}} for m in row[{column!r}]]}})"
                    )


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(isinstance(m, Mapping) for m in value)
        and _message_problem(value) is None
    )


class _Renderer:
    """Renders one row's prompt to text; holds the options shared by every row."""

    def __init__(
        self, tokenizer, system_prompt: str | None, use_chat_template: bool, template_kwargs: dict | None
    ):
        self.tokenizer, self.system_prompt, self.use_chat_template = (
            tokenizer,
            system_prompt,
            use_chat_template,
        )
        self.template_kwargs = dict(template_kwargs or {})  # chat_template_kwargs, e.g. enable_thinking
        if use_chat_template:
            self._check_tokenizer("use_chat_template=True")

    def _check_tokenizer(self, why: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{why} needs a chat template: pass tokenizer=... (one with a chat_template)")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"{why} needs a chat template, but the tokenizer has none (tokenizer.chat_template is None); "
                "set tokenizer.chat_template (a Jinja template string), or give the prompts as text "
                "(prompt_column / prompt_template)"
            )

    def messages(self, messages: Sequence[Mapping]) -> list[dict]:
        """The conversation the policy is prompted with: system prompt (replacing a leading system
        message) + messages, as new dicts."""
        messages = [dict(m) for m in messages]
        if self.system_prompt is not None:
            if messages and messages[0].get("role") == "system":
                messages = messages[1:]
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def chat(self, messages: Sequence[Mapping], where: str) -> str:
        """Messages (system prompt already applied, see ``messages``) -> chat-template text."""
        self._check_tokenizer(where)
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )

    def text(self, text: str, where: str) -> str:
        """A plain-text prompt: wrapped as a user message when use_chat_template, else raw."""
        if self.use_chat_template:
            return self.chat(self.messages([{"role": "user", "content": text}]), where)
        return text if self.system_prompt is None else f"{self.system_prompt}\n{text}"


def load_prompt_dataset(
    source: Any,
    *,
    split: str = "train",
    prompt_column: str = "prompt",
    messages_column: str = "messages",
    prompt_template: str | None = None,
    system_prompt: str | None = None,
    tokenizer=None,
    use_chat_template: bool = False,
    config_name: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> datasets.Dataset:
    """Load prompts from anywhere and render each to text in a ``prompt`` column.

    Args:
        source: a ``datasets.Dataset`` (or ``DatasetDict``: ``split`` is taken), a list of dicts, a
            local ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file (``split`` does not apply),
            a directory written by ``save_to_disk``, or a hub dataset name (``load_dataset(name,
            split=split)``).
        prompt_column: column with the prompt, as text or as a list of chat messages.
        messages_column: column with chat messages ``[{"role": ..., "content": ...}, ...]``.
        prompt_template: a ``str.format`` template over the row's columns, e.g.
            ``"Question: {question}\\nAnswer:"``.
        system_prompt: prepended as a system message to chat-rendered prompts (replacing a leading
            system message of the row), or as ``system_prompt + "\\n"`` before a text prompt.
        tokenizer: needed for chat rendering: its ``apply_chat_template(messages, tokenize=False,
            add_generation_prompt=True)`` makes the text.
        config_name: the hub dataset's configuration, for datasets that have several (gsm8k: "main").
        use_chat_template: also wrap text prompts (from the template or the prompt column) as one
            user message and render them with the chat template (for instruction-tuned models).

    The prompt is taken by the first rule that applies:
        1. ``prompt_template`` given: ``prompt_template.format(**row)``;
        2. ``prompt_column`` present: its text (or, if it holds chat messages, the chat template), as
           TRL reads it; a ``messages_column`` beside it stays a plain column (a chat dataset's
           ``messages`` often hold the reference answer);
        3. ``messages_column`` present: the chat template over the messages (a warning where they
           end with an assistant turn: the policy is prompted with it).

    Returns:
        the dataset with ``prompt`` (str) set for every row; other columns kept unchanged (an
        existing ``prompt`` column is replaced by the rendered text). When prompts were read from
        chat messages (rule 2, or rule 3 with messages), also ``prompt_messages``: each row's
        messages as the policy sees them (``system_prompt`` applied; None for a text prompt),
        replacing the column they were read from. An existing ``prompt_messages`` column is
        always dropped (it is the loader's own).

    Raises:
        ValueError: a data file its loader cannot read (the message names the file, the first bad line and
            what is wrong there: data_files.load_data_file); empty dataset; neither column present (the
            message lists the columns and the options to set); chat rendering without a tokenizer or chat
            template; rows whose prompt is None, empty, or neither text nor chat messages (a message without
            a role or content is named), or whose template field is None (the message names the column, the
            rows and a ``ds.filter`` that drops them); a template field missing from the columns (names the
            field and the columns) or a row the template cannot be filled from (names the row); a
            prompt_template that is not a format string over column names (ConfigError); images (an
            ``image`` / ``images`` column, a chat message with a part other than text; the message names the
            column, or the row and message, and the fix).
        TypeError: a streamed ``IterableDataset`` (:func:`resolve_dataset` reads one), or an
            unsupported source.
    """
    ds = _load_source(source, split, config_name)
    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"expected a map-style datasets.Dataset, got {type(ds).__name__}")
    if len(ds) == 0:
        raise ValueError(
            f"the prompt dataset from {_describe(source)} is empty: check its file, split and filters"
        )
    columns = list(ds.column_names)
    # The column the prompts are read from (rule 2 or 3), None for a template.
    source_column = None
    if prompt_template is None:
        source_column = next(
            (c for c in (prompt_column, messages_column) if c is not None and c in columns), None
        )
    _refuse_images(ds, columns, [source_column] if source_column else [])
    render = _Renderer(tokenizer, system_prompt, use_chat_template, chat_template_kwargs)

    if prompt_template is not None:
        for field in template_columns(prompt_template):
            if field not in columns:
                close = difflib.get_close_matches(field, columns, n=1)
                raise ValueError(
                    f"prompt_template={prompt_template!r} uses the field {{{field}}}, which is not a column "
                    f"(the columns: {columns}): use a column's name"
                    + (f" (did you mean {{{close[0]}}}?)" if close else "")
                    + ", or add the column to the data"
                )
            # A None would be rendered as the text "None".
            _check_rows(
                ds,
                field,
                lambda v: v is not None,
                "a value for prompt_template in every row",
                f"row[{field!r}] is not None",
            )

        def one(row: dict, i: int) -> tuple[str, list[dict] | None]:
            try:
                text = prompt_template.format(**row)
            except (LookupError, AttributeError, ValueError, TypeError) as e:
                values = {k: row[k] for k in template_columns(prompt_template)}
                raise ValueError(
                    f"prompt_template={prompt_template!r} cannot be filled from row {i} ({values!r:.200}): "
                    f"{type(e).__name__}: {e}; make its fields and format specs fit those values"
                ) from e
            return render.text(text, f"prompt_template (row {i})"), None

    elif source_column == prompt_column:
        _check_rows(
            ds,
            prompt_column,
            lambda v: (isinstance(v, str) and v != "") or _is_messages(v),
            "non-empty text or a non-empty list of chat messages",
            f"bool(row[{prompt_column!r}])",
        )

        def one(row: dict, i: int) -> tuple[str, list[dict] | None]:
            value = row[prompt_column]
            if isinstance(value, str):
                return render.text(value, f"column {prompt_column!r} (row {i})"), None
            messages = render.messages(value)
            return render.chat(messages, f"column {prompt_column!r} (chat messages, row {i})"), messages

    elif source_column is not None:  # messages_column
        _check_rows(
            ds,
            messages_column,
            _is_messages,
            "a non-empty list of {'role', 'content'} chat messages",
            f"bool(row[{messages_column!r}])",
        )
        render._check_tokenizer(f"column {messages_column!r} (chat messages)")

        def one(row: dict, i: int) -> tuple[str, list[dict] | None]:
            messages = render.messages(row[messages_column])
            if messages[-1].get("role") == "assistant":
                answered.append(i)
            return render.chat(messages, f"column {messages_column!r} (chat messages, row {i})"), messages

    else:
        looked = f"no column {prompt_column!r} (prompt_column)" + (
            f" or {messages_column!r} (messages_column)" if messages_column is not None else ""
        )
        other = next((c for c in columns if c != PROMPT_MESSAGES), "question")
        raise ValueError(
            f"cannot find the prompts: {looked} in columns {columns}; rename the column that holds them "
            f"(ds = ds.rename_column({other!r}, {prompt_column!r})), or, in lora_grpo's GRPOConfig, set "
            "prompt_column=..., messages_column=..., or prompt_template='...{column}...'"
        )

    prompts: list[str] = []
    answered: list[int] = []  # rows of a messages column ending with an assistant turn
    chats: list[list[dict] | None] = []
    for batch in ds.iter(batch_size=1000):
        for row in (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)):
            text, messages = one(row, len(prompts))
            prompts.append(text)
            chats.append(messages)
    if answered:
        logger.warning(
            "%d of %d rows of column %r (chat messages) end with an assistant turn (row %d first): the policy is "
            "prompted with it and answers after it. If it is the reference answer of a chat dataset, keep it out "
            "of the prompt: ds.map(lambda row: {%r: row[%r][:-1]}), and give the reward function the answer in "
            "a column of its own",
            len(answered),
            len(prompts),
            messages_column,
            answered[0],
            messages_column,
            messages_column,
        )
    new = {"prompt": prompts}
    replaced = {"prompt", PROMPT_MESSAGES}
    if any(m is not None for m in chats):
        new[PROMPT_MESSAGES] = chats
        # The messages reach reward functions once, as `prompts`: not also under their column's name.
        replaced.add(source_column)
    # Add before removing: a dataset left with no columns would also be left with no rows.
    for name, values in new.items():
        ds = ds.add_column(f"_new_{name}", values)
    ds = ds.remove_columns([c for c in columns if c in replaced])
    for name in new:
        ds = ds.rename_column(f"_new_{name}", name)
    return ds


def _describe(source: Any) -> str:
    return repr(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__


# ------------------------------------------------------------------------------- from a config
# Datasets generated locally, by name (nothing is downloaded):
# name -> (problems(n, seed, split), train rows, eval rows).
LOCAL_DATASETS = {
    "toy": (toy_problems, 2000, 200),
    "countdown": (countdown_problems, 10_000, 500),
    "calculator": (calculator_problems, 2000, 200),
    "countdown-toy": (countdown_toy_problems, 2000, 200),
    "chat-sum": (chat_sum_problems, 600, 210),
}


def stream_rows(config, split: str, num_processes: int | None = None) -> int:
    """Rows a run reads from a streamed train dataset (every rollout's prompts for max_steps updates,
    on every process; with dynamic_sampling, dynamic_sampling_max_rounds rollouts a step, the most a step
    may draw), or a streamed eval dataset (eval_limit); ValueError when nothing bounds it."""
    if split == "eval":
        if not config.eval_limit:
            raise ValueError(
                "eval_dataset is a streamed IterableDataset, which may never end: set eval_limit "
                "(the eval prompts read from it), or pass a map-style Dataset"
            )
        return config.eval_limit
    if not config.max_steps:
        raise ValueError(
            "train_dataset is a streamed IterableDataset, which has no length, so epochs (num_epochs) "
            "cannot be counted: set max_steps, as TRL requires too, or pass a map-style Dataset"
        )
    updates = config.num_iterations * getattr(
        config, "steps_per_generation", 1
    )  # optimizer steps per rollout
    rollouts, processes = (
        -(-config.max_steps // updates),
        num_processes or int(os.environ.get("WORLD_SIZE", "1")),
    )
    if getattr(config, "dynamic_sampling", False):
        rollouts *= config.dynamic_sampling_max_rounds
    return rollouts * getattr(config, "prompts_per_generation", config.prompts_per_step) * processes


def read_stream(stream, config, split: str) -> datasets.Dataset:
    """The first stream_rows(...) rows of a stream as a Dataset: accepted (as TRL does, with max_steps) by
    reading at start the rows the run consumes, so every prompt is checked and the batches stay seeded,
    split across processes and resumable. A stream that ends sooner gives fewer rows, visited in epochs."""
    if isinstance(stream, datasets.IterableDatasetDict):
        stream = _pick_split(
            stream, config.dataset_split if split == "train" else config.eval_split, "the stream"
        )
    rows = list(stream.take(stream_rows(config, split)))
    return from_rows(rows) if rows else datasets.Dataset.from_dict({config.prompt_column: []})


def resolve_dataset(
    source, config, tokenizer, split: str, template_kwargs: dict | None = None, name: str | None = None
) -> datasets.Dataset | None:
    """The train or eval prompts a config names (or `source` as given), loaded and rendered; None stays
    None. A streamed dataset is read (read_stream); errors name the dataset: `name`, by default
    train_dataset / eval_dataset (one set of a dict of eval sets: eval_dataset['math'])."""
    if source is None:
        return None
    if isinstance(source, str) and source in LOCAL_DATASETS:
        problems, train_rows, eval_rows = LOCAL_DATASETS[source]
        source = problems(eval_rows if split == "eval" else train_rows, seed=config.seed, split=split)
    in_dict = name is not None
    name, streamed = (
        name or f"{split}_dataset",
        isinstance(source, (datasets.IterableDataset, datasets.IterableDatasetDict)),
    )
    try:
        return load_prompt_dataset(
            read_stream(source, config, split) if streamed else source,
            split=config.dataset_split if split == "train" else config.eval_split,
            prompt_column=config.prompt_column,
            messages_column=config.messages_column,
            prompt_template=config.prompt_template,
            system_prompt=config.system_prompt,
            use_chat_template=config.use_chat_template,
            config_name=config.dataset_config,
            tokenizer=tokenizer,
            chat_template_kwargs=config.chat_template_kwargs if template_kwargs is None else template_kwargs,
        )
    except (ValueError, KeyError, TypeError) as e:
        if type(e) not in (ValueError, KeyError, TypeError) or str(e).startswith(name):
            raise
        fix = (
            ""
            if "is empty" not in str(e) or split != "eval"
            else " (fill that set, or leave it out of the dict of eval sets)"
            if in_dict
            else " (leave eval_dataset unset to train without evaluation)"
        )
        raise type(e)(f"{name}: {e.args[0] if e.args else e}{fix}") from e


def resolve_eval_dataset(
    source, config, tokenizer, template_kwargs: dict | None = None, name: str | None = None
):
    """The eval prompts of a run (None when there are none), each set cut to eval_limit rows: one
    Dataset, or {name: Dataset} for a plain dict of named sets (each evaluated on its own; metrics
    eval/<name>/...; an error names the set: eval_dataset['math']). A DatasetDict is not a dict of
    sets here: its eval_split is taken."""
    if isinstance(source, dict) and not isinstance(
        source, (datasets.DatasetDict, datasets.IterableDatasetDict)
    ):
        if not source:
            raise ValueError("eval_dataset: an empty dict of eval sets; pass at least one {name: dataset}")
        return {
            str(key): resolve_eval_dataset(
                ds, config, tokenizer, template_kwargs, f"eval_dataset[{str(key)!r}]"
            )
            for key, ds in source.items()
        }
    held_out = resolve_dataset(source, config, tokenizer, "eval", template_kwargs, name)
    if held_out is not None and config.eval_limit:
        held_out = held_out.select(range(min(config.eval_limit, len(held_out))))
    return held_out


def named_eval_sets(eval_dataset) -> dict[str | None, datasets.Dataset]:
    """{name: Dataset} of resolved eval prompts; one unnamed set is {None: it}; none is {}."""
    if eval_dataset is None:
        return {}
    return dict(eval_dataset) if isinstance(eval_dataset, dict) else {None: eval_dataset}


def resolve_datasets(config, train_dataset, eval_dataset, tokenizer, template_kwargs: dict | None = None):
    """(train, eval) prompts of a run: the ones passed, else the config's `dataset` / `eval_dataset`
    (eval: resolve_eval_dataset). template_kwargs: the chat template's (the config's
    chat_template_kwargs, and a tool run's schemas)."""
    train_source = train_dataset if train_dataset is not None else config.dataset
    if train_source is None:
        raise ValueError("no training prompts: pass train_dataset=... or set `dataset` in the config")
    train = resolve_dataset(train_source, config, tokenizer, "train", template_kwargs)
    held_out = resolve_eval_dataset(
        eval_dataset if eval_dataset is not None else config.eval_dataset, config, tokenizer, template_kwargs
    )
    return train, held_out
