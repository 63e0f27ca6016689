"""Prompt dataset loading/rendering and resumable seeded batching (CPU, offline, no model)."""

import json
import re

import datasets
import pytest

from lora_grpo.data.prompts import PROMPT_MESSAGES, PromptBatches, load_prompt_dataset
from lora_grpo.tasks.toy import make_tokenizer

ROWS = [
    {"question": "1+1?", "answer": "2", "level": 1},
    {"question": "2*3?", "answer": "6", "level": 2},
    {"question": "9-4?", "answer": "5", "level": 1},
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


# ------------------------------------------------------------------------------------ sources


def _write(tmp_path, kind, rows):
    path = tmp_path / f"data.{kind}"
    if kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    elif kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


@pytest.mark.parametrize("kind", ["json", "jsonl", "csv", "parquet"])
def test_load_files_with_template_keeps_columns(tmp_path, kind):
    path = _write(tmp_path, kind, ROWS)
    ds = load_prompt_dataset(path, prompt_template="Q: {question}\nA:")
    assert ds["prompt"] == ["Q: 1+1?\nA:", "Q: 2*3?\nA:", "Q: 9-4?\nA:"]
    assert [str(a) for a in ds["answer"]] == ["2", "6", "5"]  # csv infers ints
    assert ds["level"] == [1, 2, 1]
    assert set(ds.column_names) == {"question", "answer", "level", "prompt"}


def test_load_str_path_dataset_list_and_save_to_disk(tmp_path):
    path = _write(tmp_path, "jsonl", ROWS)
    assert load_prompt_dataset(str(path), prompt_column="question")["prompt"] == ["1+1?", "2*3?", "9-4?"]
    assert load_prompt_dataset(ROWS, prompt_column="question")["prompt"][1] == "2*3?"
    in_memory = datasets.Dataset.from_list(ROWS)
    assert load_prompt_dataset(in_memory, prompt_column="question")["prompt"][2] == "9-4?"
    in_memory.save_to_disk(str(tmp_path / "saved"))
    assert load_prompt_dataset(tmp_path / "saved", prompt_column="question")["answer"] == ["2", "6", "5"]
    datasets.DatasetDict({"train": in_memory, "test": in_memory.select([0])}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert len(load_prompt_dataset(tmp_path / "dd", split="test", prompt_column="question")) == 1
    with pytest.raises(ValueError, match=r"split 'dev'.*\['train', 'test'\]"):
        load_prompt_dataset(tmp_path / "dd", split="dev", prompt_column="question")


def test_load_missing_or_unknown_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompt_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"unknown file type '.txt'"):
        load_prompt_dataset(tmp_path / "data.txt")
    with pytest.raises(TypeError, match="list of dicts"):
        load_prompt_dataset(["just text"])


GOOD_LINE = b'{"prompt": "1+1=", "answer": "2"}\n'
_TRUNCATED_PARQUET = "truncated"  # built in the test: a real Parquet file cut short


@pytest.mark.parametrize(
    "name, data, message",
    [
        (
            "not-json.jsonl",
            GOOD_LINE + b'{"prompt": "2+2=", "answer": 4,,}\n',
            r"line 2, column 32: not JSON \(Expecting property name enclosed in double quotes\); each line must be "
            r"one JSON object",
        ),
        (
            "list.jsonl",
            GOOD_LINE + b"[1, 2]\n",
            r"line 2: a JSON list, not an object; each line must be one JSON",
        ),
        (
            "latin1.jsonl",
            GOOD_LINE + GOOD_LINE + b'{"prompt": "caf\xe9", "answer": "1"}\n',
            r"line 3, column 16: the bytes b'\\xe9' are not UTF-8 \(invalid continuation byte\); save the file "
            r"as UTF-8 \(from Latin-1, say: iconv -f latin1 -t utf-8 IN > OUT\)",
        ),
        (
            "nul.jsonl",
            GOOD_LINE + b'{"prompt": "a\x00b", "answer": "1"}\n',
            r"line 2, column 14: a NUL byte \(\\x00\); the file is binary or damaged there",
        ),
        (
            "document.json",
            b'[{"prompt": "1+1="},\n {"prompt": "2+2=" "answer": 1}]',
            r"line 2, column 20: not JSON \(Expecting ',' delimiter\); the file must be one JSON list of row objects",
        ),
        (
            "lines.json",
            GOOD_LINE + b'{"prompt": "2+2=",}\n',
            r"line 2, column 19: not JSON \(Expecting property name enclosed in double quotes\); each line must be",
        ),
        ("latin1.json", b'[{"prompt": "caf\xe9"}]', r"line 1, column 17: the bytes b'\\xe9' are not UTF-8"),
        # (datasets' JSON builder raised a bare StopIteration: found in review)
        ("empty.jsonl", b"", r"the file is empty; each line must be one JSON object"),
        ("blank.json", b"\n  \n", r"the file is empty"),
        (
            "fields.csv",
            b"prompt,answer\n1+1=,2\n3+3=,6,7\n",
            r"line 3: 3 fields, but the header \(line 1\) has 2 \(prompt, answer\); quote a value that holds a comma",
        ),
        (
            "quote.csv",
            b'prompt,answer\n1+1=,2\n"2+2=,4\n3+3=,6\n',
            r"line 3: a quoted field opens there and is never closed \(unexpected end of data\); close the quote",
        ),
        ("utf16.csv", "prompt,answer\n1+1=,2\n".encode("utf-16"), r"line 1: .* UTF-16 .*; save it as UTF-8"),
        ("nul.csv", b"prompt,answer\n1+1=,2\nab\x00c,3\n", r"line 3, column 3: a NUL byte"),
        (
            "text.parquet",
            b"prompt,answer\n1+1=,2\n",
            r"not a readable Parquet file \(ArrowInvalid: .*\): it does not start with Parquet's magic bytes PAR1 "
            r"\(a CSV or JSON file with the wrong extension\?\); .*write it again \(Dataset.to_parquet\(path\)",
        ),
        (
            "cut.parquet",
            _TRUNCATED_PARQUET,
            r"not a readable Parquet file \(ArrowInvalid: .*\): it is damaged or truncated",
        ),
    ],
)
def test_a_bad_data_file_is_named_with_its_line_what_is_wrong_and_the_fix(tmp_path, name, data, message):
    import re

    path = tmp_path / name
    if data == _TRUNCATED_PARQUET:
        datasets.Dataset.from_list(ROWS * 20).to_parquet(str(tmp_path / "whole.parquet"))
        data = (tmp_path / "whole.parquet").read_bytes()[:-30]
    path.write_bytes(data)
    # was: "Expected object or value at position 29", a bare UnicodeDecodeError, or datasets' "An error occurred
    # while generating the dataset" (and a NUL in a CSV, or Latin-1 in a JSON-lines file, loaded as they were)
    with pytest.raises(ValueError, match="^" + re.escape(f"cannot load {path}: ") + message):
        load_prompt_dataset(path, prompt_column="prompt")


def test_data_files_with_non_ascii_text_load_as_before(tmp_path):
    rows = [{"prompt": "café ×2 = ?", "answer": "ü"}, {"prompt": "日本", "answer": "2"}]
    for kind in ("json", "jsonl", "csv", "parquet"):
        loaded = load_prompt_dataset(_write(tmp_path, kind, rows))
        assert loaded["prompt"] == [r["prompt"] for r in rows] and loaded["answer"] == ["ü", "2"], kind


def test_prompt_column_text_and_system_prompt():
    ds = load_prompt_dataset([{"prompt": "Say hi", "answer": "hi"}], system_prompt="Be brief.")
    assert ds["prompt"] == ["Be brief.\nSay hi"] and ds["answer"] == ["hi"]


# ---------------------------------------------------------------------------------- chat


def test_messages_column_with_chat_template(tokenizer):
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    ds = load_prompt_dataset(rows, tokenizer=tokenizer)
    assert ds["prompt"] == ["user: 2+2?\nassistant: "]
    # The messages move to prompt_messages (they reach reward functions once, as `prompts`).
    assert ds["answer"] == ["4"] and ds[PROMPT_MESSAGES] == [rows[0]["messages"]]
    assert sorted(ds.column_names) == ["answer", "prompt", "prompt_messages"]
    ds = load_prompt_dataset(rows, tokenizer=tokenizer, system_prompt="Think.")
    assert ds["prompt"] == ["system: Think.\nuser: 2+2?\nassistant: "]
    assert ds[PROMPT_MESSAGES] == [
        [{"role": "system", "content": "Think."}, *rows[0]["messages"]]
    ]  # as prompted


def test_prompt_messages_only_for_chat_prompts(tokenizer):
    chat = [{"role": "system", "content": "old"}, {"role": "user", "content": "hi"}]
    ds = load_prompt_dataset([{"prompt": chat, "id": 7}], tokenizer=tokenizer, system_prompt="new")
    assert ds.column_names == ["id", "prompt", "prompt_messages"]
    assert ds[0] == {
        "id": 7,
        "prompt": "system: new\nuser: hi\nassistant: ",
        "prompt_messages": [{"role": "system", "content": "new"}, chat[1]],
    }
    # A messages column that is not the prompt's source (the template wins) stays a plain column.
    rows = [{"messages": chat, "question": "t"}]
    ds = load_prompt_dataset(rows, prompt_template="{question}!", tokenizer=tokenizer)
    assert sorted(ds.column_names) == ["messages", "prompt", "question"] and ds["messages"] == [chat]
    # Text prompts (even wrapped by use_chat_template) are not conversational; a stale column goes.
    ds = load_prompt_dataset(
        [{"prompt": "q", PROMPT_MESSAGES: "stale"}], tokenizer=tokenizer, use_chat_template=True
    )
    assert ds.column_names == ["prompt"] and ds["prompt"] == ["user: q\nassistant: "]
    # A chat prompt_column other than "prompt" is consumed too.
    ds = load_prompt_dataset([{"conv": chat[1:], "a": 1}], prompt_column="conv", tokenizer=tokenizer)
    assert sorted(ds.column_names) == ["a", "prompt", "prompt_messages"] and ds[PROMPT_MESSAGES] == [chat[1:]]


def test_system_prompt_replaces_a_leading_system_message(tokenizer):
    rows = [{"messages": [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]}]
    assert load_prompt_dataset(rows, tokenizer=tokenizer)["prompt"] == ["system: old\nuser: q\nassistant: "]
    got = load_prompt_dataset(rows, tokenizer=tokenizer, system_prompt="new")["prompt"]
    assert got == ["system: new\nuser: q\nassistant: "]


def test_prompt_column_holding_messages_is_chat_rendered(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "id": 7}]
    ds = load_prompt_dataset(rows, tokenizer=tokenizer)
    assert ds["prompt"] == ["user: hi\nassistant: "] and ds["id"] == [7]


def test_template_wrapped_in_chat_template(tokenizer):
    ds = load_prompt_dataset(
        ROWS[:1],
        prompt_template="Solve {question}",
        tokenizer=tokenizer,
        use_chat_template=True,
        system_prompt="S",
    )
    assert ds["prompt"] == ["system: S\nuser: Solve 1+1?\nassistant: "]


def test_template_takes_precedence_over_messages(tokenizer):
    rows = [{"messages": [{"role": "user", "content": "m"}], "question": "t"}]
    assert load_prompt_dataset(rows, prompt_template="{question}!", tokenizer=tokenizer)["prompt"] == ["t!"]


def test_chat_errors(tokenizer):
    rows = [{"messages": [{"role": "user", "content": "q"}]}]
    with pytest.raises(ValueError, match="tokenizer="):
        load_prompt_dataset(rows)
    no_template = make_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat_template is None"):
        load_prompt_dataset(rows, tokenizer=no_template)
    with pytest.raises(ValueError, match=r"column 'messages' must hold .*'role'.*rows \[0\]"):
        load_prompt_dataset([{"messages": ["not a message"]}], tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"column 'prompt' must hold non-empty text.*rows \[1\]"):
        load_prompt_dataset([{"prompt": "ok"}, {"prompt": None}])


def test_chat_dataset_without_chat_template_names_column_and_fix():
    no_template = make_tokenizer()
    no_template.chat_template = None
    for rows, column in [
        ([{"messages": [{"role": "user", "content": "q"}]}], "messages"),
        ([{"prompt": [{"role": "user", "content": "q"}]}], "prompt"),
    ]:
        with pytest.raises(ValueError) as info:
            load_prompt_dataset(rows, tokenizer=no_template)
        msg = str(info.value)
        assert f"column {column!r} (chat messages" in msg
        assert "needs a chat template, but the tokenizer has none (tokenizer.chat_template is None)" in msg
        assert "set tokenizer.chat_template" in msg and "give the prompts as text" in msg


@pytest.mark.parametrize(
    "rows, column, n_bad, bad_rows",
    [
        ([{"prompt": "a"}, {"prompt": ""}, {"prompt": "b"}, {"prompt": None}], "prompt", 2, "[1, 3]"),
        ([{"q": "a"}] + [{"q": None}] * 12, "q", 12, "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ...]"),
        (
            [{"messages": [{"role": "user", "content": "q"}]}, {"messages": None}, {"messages": []}],
            "messages",
            2,
            "[1, 2]",
        ),
    ],
)
def test_empty_or_none_prompts_fail_at_load_naming_column_rows_and_fix(
    tokenizer, rows, column, n_bad, bad_rows
):
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(rows, prompt_column="q" if column == "q" else "prompt", tokenizer=tokenizer)
    msg = str(info.value)
    assert f"column {column!r} must hold" in msg
    assert f"{n_bad} of {len(rows)} rows do not: rows {bad_rows}" in msg
    assert f"filter them out before loading, e.g. ds = ds.filter(lambda row: bool(row[{column!r}]))" in msg


def test_none_in_a_template_field_fails_at_load():
    with pytest.raises(ValueError) as info:
        load_prompt_dataset([{"q": "a"}, {"q": None}], prompt_template="Q: {q}")
    msg = str(info.value)
    assert "column 'q' must hold a value for prompt_template in every row" in msg
    assert "rows [1] (row 1 holds None)" in msg and "ds.filter(lambda row: row['q'] is not None)" in msg


# ------------------------------------------------------------------------------- errors


def test_template_missing_field_names_field_and_columns():
    # was a KeyError, which the CLI showed as a traceback
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(ROWS, prompt_template="{question} ({difficulty})")
    assert str(info.value) == (
        "prompt_template='{question} ({difficulty})' uses the field {difficulty}, which is not a column (the "
        "columns: ['question', 'answer', 'level']): use a column's name, or add the column to the data"
    )
    with pytest.raises(ValueError, match=r"uses the field \{questoin\}.*did you mean \{question\}\?"):
        load_prompt_dataset(ROWS, prompt_template="Q: {questoin}")


def test_a_template_that_is_not_a_format_string_is_named_when_loading_too():
    # load_prompt_dataset is public: the config's check (config_checks.template_columns) runs here as well
    with pytest.raises(ValueError, match=r"^prompt_template='Q: \{question' is not a format string"):
        load_prompt_dataset(ROWS, prompt_template="Q: {question")


def test_a_row_the_template_cannot_be_filled_from_is_named():
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(ROWS, prompt_template="Q: {question} level {level:.1%} of {answer:d}")
    assert str(info.value).startswith(
        "prompt_template='Q: {question} level {level:.1%} of {answer:d}' cannot be filled from row 0 ("
        "{'question': '1+1?', 'level': 1, 'answer': '2'}): ValueError: Unknown format code 'd'"
    )
    assert str(info.value).endswith("make its fields and format specs fit those values")


def test_no_prompt_column_lists_columns_and_options():
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(ROWS)
    msg = str(info.value)
    assert "'question'" in msg and "'answer'" in msg
    assert "prompt_column" in msg and "messages_column" in msg and "prompt_template" in msg
    # The fix every front door can apply first: rename the column (TRL's GRPOConfig has none of those fields).
    assert "rename the column that holds them (ds = ds.rename_column('question', 'prompt'))" in msg
    # Without a messages column to look for (the TRL front door's), none is named.
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(ROWS, messages_column=None)
    assert "cannot find the prompts: no column 'prompt' (prompt_column) in columns" in str(info.value)
    assert "None" not in str(info.value)


# A chat dataset (ultrachat's shape) whose `messages` hold the whole conversation, the reference answer last, beside
# its `prompt`: read from `messages`, the policy was prompted with the answer, and the prompt column was dropped.
def test_a_prompt_column_beside_a_messages_column_is_the_prompt_as_in_trl(tokenizer, caplog):
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ds = load_prompt_dataset([{"prompt": "2+2?", "messages": chat}], tokenizer=tokenizer)
    assert ds["prompt"] == ["2+2?"] and ds["messages"] == [
        chat
    ]  # the messages reach reward functions as they are
    # From a messages column alone, a last assistant turn is prompted with, and said so.
    with caplog.at_level("WARNING", logger="lora_grpo.data.prompts"):
        ds = load_prompt_dataset([{"messages": chat}, {"messages": chat[:1]}], tokenizer=tokenizer)
    assert ds["prompt"] == ["user: 2+2?\nassistant: 4\nassistant: ", "user: 2+2?\nassistant: "]
    assert (
        "1 of 2 rows of column 'messages' (chat messages) end with an assistant turn (row 0 first)"
        in caplog.text
    )


# Dataset.from_list reads its columns from the first row: a column the first row lacked was gone from every row.
def test_a_list_of_rows_keeps_every_column_any_row_has():
    ds = load_prompt_dataset([{"prompt": "1+1?"}, {"prompt": "2+2?", "answer": "4"}])
    assert ds["answer"] == [None, "4"]  # None: does not apply to that row
    # A column of text in one row and messages in another: named, not Arrow's error.
    with pytest.raises(ValueError) as info:
        load_prompt_dataset([{"prompt": "1+1?"}, {"prompt": [{"role": "user", "content": "2+2?"}]}])
    assert str(info.value).startswith("column 'prompt' holds a str in row 0 and a list in row 1")


def test_empty_dataset():
    with pytest.raises(ValueError, match="empty"):
        load_prompt_dataset(datasets.Dataset.from_dict({"prompt": []}))


# ------------------------------------------------------------------------------- batching


def _ds(n):
    return datasets.Dataset.from_dict({"prompt": [f"p{i}" for i in range(n)], "i": list(range(n))})


def _take(batches, k):
    return [(epoch, rows["i"]) for epoch, rows in (next(batches) for _ in range(k))]


def test_batches_deterministic_by_seed():
    a = _take(PromptBatches(_ds(10), 3, seed=1), 9)
    assert a == _take(PromptBatches(_ds(10), 3, seed=1), 9)
    assert a != _take(PromptBatches(_ds(10), 3, seed=2), 9)


def test_batches_epoch_boundaries_and_drop_last():
    batches = PromptBatches(_ds(10), 3, seed=0)
    assert len(batches) == batches.steps_per_epoch == 3
    got = _take(batches, 9)
    assert [e for e, _ in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for epoch in range(3):
        rows = [i for e, r in got if e == epoch for i in r]
        assert len(rows) == len(set(rows)) == 9  # no repeats inside an epoch; one row dropped
        assert rows == batches.order(epoch)[:9].tolist()
    assert batches.order(0).tolist() != batches.order(1).tolist()  # reshuffled per epoch


def test_batches_rows_hold_every_column():
    epoch, rows = next(PromptBatches(_ds(4), 2, shuffle=False))
    assert epoch == 0 and rows == {"prompt": ["p0", "p1"], "i": [0, 1]}


def test_batches_no_shuffle_and_num_epochs():
    got = list(PromptBatches(_ds(5), 2, shuffle=False, num_epochs=2))
    assert [(e, r["i"]) for e, r in got] == [(0, [0, 1]), (0, [2, 3]), (1, [0, 1]), (1, [2, 3])]


def test_batches_exact_fit_and_too_small():
    assert _take(PromptBatches(_ds(4), 4, shuffle=False), 2) == [(0, [0, 1, 2, 3]), (1, [0, 1, 2, 3])]
    with pytest.raises(
        ValueError, match=r"has 3 rows, fewer than one batch of prompts_per_step=4 \(the prompts"
    ):
        PromptBatches(_ds(3), 4)
    with pytest.raises(
        ValueError, match=r"has 3 rows, fewer than one batch of prompts_per_step=2 × 2 processes"
    ):
        PromptBatches(_ds(3), 2, num_processes=2)


def test_each_process_takes_its_slice_of_every_batch_of_the_whole_dataset():
    """As TRL's sampler: the processes together draw what one process drawing their batches draws, so over the
    epochs every process sees every row (a fixed shard per process never trained on the others' rows, and its
    len % processes rows were never drawn)."""
    one = _take(PromptBatches(_ds(7), 2, seed=3), 30)
    parts = [PromptBatches(_ds(7), 1, seed=3, num_processes=2, process_index=p) for p in (0, 1)]
    assert all(len(part) == part.steps_per_epoch == 3 for part in parts)
    both = [_take(part, 30) for part in parts]
    assert [(e0, r0 + r1) for (e0, r0), (_, r1) in zip(*both)] == one
    for rank in (0, 1):  # 10 epochs
        assert {i for _, rows in both[rank] for i in rows} == set(range(7))
    assert parts[0].epochs_done == 10.0


@pytest.mark.parametrize("stop", [1, 3, 4, 7])
def test_resume_equals_uninterrupted(stop):
    uninterrupted = _take(PromptBatches(_ds(11), 3, seed=5), 10)
    first = PromptBatches(_ds(11), 3, seed=5)
    head = _take(first, stop)
    state = first.state_dict()
    resumed = PromptBatches(_ds(11), 3, seed=5)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 10 - stop) == uninterrupted
    # The same position given at construction.
    rebuilt = PromptBatches(_ds(11), 3, seed=5, start_epoch=state["epoch"], start_index=state["index"])
    assert head + _take(rebuilt, 10 - stop) == uninterrupted


def test_state_dict_position_and_mismatch_errors():
    batches = PromptBatches(_ds(7), 3, seed=0)
    assert batches.state_dict() == {"epoch": 0, "index": 0, "seed": 0, "num_rows": 7, "prompts_per_step": 3}
    _take(batches, 2)  # the 7th row is dropped: the next batch starts epoch 1
    assert (batches.state_dict()["epoch"], batches.state_dict()["index"]) == (1, 0)
    with pytest.raises(
        ValueError, match=r"ordered its prompts with seed=0, this run has seed=1.*resume with seed=0"
    ):
        PromptBatches(_ds(7), 3, seed=1).load_state_dict(batches.state_dict())
    # issue 17: a resumed run whose dataset changed length is told what happened and the ways on
    with pytest.raises(ValueError) as info:
        PromptBatches(_ds(8), 3, seed=0).load_state_dict(batches.state_dict())
    msg = str(info.value)
    assert "the checkpoint's run drew its prompts from 7 rows, this run's train dataset has 8" in msg
    assert "data position (epoch 1, row 0" in msg and "Resume with the same dataset" in msg
    assert "init_adapter=<checkpoint>/policy" in msg


def test_prompt_only_dataset_keeps_its_rows():
    ds = load_prompt_dataset([{"prompt": "a"}, {"prompt": "b"}], system_prompt="S")
    assert ds.column_names == ["prompt"] and ds["prompt"] == ["S\na", "S\nb"]


# ------------------------------------------------------------------------------- issue 17: faulty datasets


def _config(**fields):
    from lora_grpo import GRPOConfig

    return GRPOConfig(
        **{"model_name_or_path": "x", "prompts_per_step": 2, "num_generations": 2, "max_steps": 3, **fields}
    )


def _resolve(train, eval_=None, tokenizer=None, **fields):
    from lora_grpo.data.prompts import resolve_datasets

    return resolve_datasets(_config(**fields), train, eval_, tokenizer)


def test_an_empty_train_or_eval_dataset_is_named_with_the_fix():
    empty = datasets.Dataset.from_dict({"prompt": []})
    with pytest.raises(
        ValueError, match=r"^train_dataset: the prompt dataset from Dataset is empty: check its file"
    ):
        _resolve(empty)
    with pytest.raises(
        ValueError, match=r"^eval_dataset: .* is empty.*leave eval_dataset unset to train without evaluation"
    ):
        _resolve([{"prompt": "a"}, {"prompt": "b"}], empty)
    with pytest.raises(ValueError, match=r"^eval_dataset: .* from list is empty"):
        _resolve([{"prompt": "a"}], [])


def test_no_prompt_column_names_the_dataset():
    with pytest.raises(
        ValueError, match=r"^eval_dataset: cannot find the prompts: no column 'prompt'.*\['q'\]"
    ):
        _resolve([{"prompt": "a"}], [{"q": "b"}])


@pytest.mark.parametrize(
    "rows, column, problem",
    [
        ([{"messages": [{"content": "hi"}]}], "messages", "its message 0 has no 'role' ({'content': 'hi'})"),
        (
            [{"messages": [{"role": "user", "content": "q"}]}, {"messages": [{"role": "user"}]}],
            "messages",
            "its message 0 has no 'content' ({'role': 'user', 'content': None})",
        ),  # datasets fills a missing key with None
        ([{"prompt": [{"role": "", "content": "q"}]}], "prompt", "its message 0 has an empty 'role'"),
        (
            [{"messages": [{"role": "system", "content": "s"}, {"role": None, "content": "q"}]}],
            "messages",
            "its message 1 has no 'role'",
        ),
    ],
)
def test_chat_messages_without_role_or_content_name_the_message_and_a_filter_that_works(
    tokenizer, rows, column, problem
):
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(rows, tokenizer=tokenizer)
    msg = str(info.value)
    assert f"column {column!r} must hold" in msg and problem in msg
    import re

    bad = int(re.search(r"(\d+) of \d+ rows do not", msg).group(1))
    keep = msg.split("ds.filter(lambda row: ", 1)[1][:-1]  # up to the closing parenthesis
    kept = datasets.Dataset.from_list(rows).filter(
        eval(f"lambda row: {keep}")
    )  # the filter the message gives
    assert len(kept) == len(rows) - bad  # drops exactly the bad rows
    if len(kept):
        assert len(load_prompt_dataset(kept, tokenizer=tokenizer)) == len(kept)


def test_a_streamed_dataset_is_read_once_the_rows_the_run_needs():
    stream = datasets.Dataset.from_list(
        [{"prompt": f"p{i}", "i": i} for i in range(100)]
    ).to_iterable_dataset()
    train, _ = _resolve(stream)  # max_steps 3 × prompts_per_step 2
    assert isinstance(train, datasets.Dataset) and train["i"] == list(range(6))
    train, _ = _resolve(stream, steps_per_generation=2, max_steps=4)  # 2 rollouts of 4 prompts
    assert len(train) == 8
    # dynamic sampling: up to dynamic_sampling_max_rounds rollouts a step, every one of fresh prompts
    train, _ = _resolve(stream, dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    assert train["i"] == list(range(24))
    short = datasets.Dataset.from_list(
        [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]
    ).to_iterable_dataset()
    assert len(_resolve(short)[0]) == 3  # a stream that ends sooner: its rows, visited in epochs
    held_out = datasets.IterableDatasetDict({"test": stream})
    assert _resolve(stream, held_out, eval_limit=5)[1]["i"] == list(range(5))


def test_a_streamed_dataset_without_a_bound_is_refused_clearly():
    stream = datasets.Dataset.from_list([{"prompt": "a"}] * 4).to_iterable_dataset()
    with pytest.raises(
        ValueError, match=r"^train_dataset is a streamed IterableDataset, which has no length.*set max_steps"
    ):
        _resolve(stream, max_steps=0)
    with pytest.raises(
        ValueError, match=r"^eval_dataset is a streamed IterableDataset, which may never end: set eval_limit"
    ):
        _resolve([{"prompt": "a"}], stream)
    with pytest.raises(ValueError, match=r"^train_dataset: .* is empty"):
        _resolve(datasets.Dataset.from_list([{"prompt": "a"}]).to_iterable_dataset().filter(lambda r: False))
    with pytest.raises(
        TypeError, match=r"streamed datasets\.IterableDataset has no length: pass it to GRPOTrainer"
    ):
        load_prompt_dataset(stream)  # the loader alone does not guess how many rows to read


# ------------------------------------------------------------------------------------- images


@pytest.mark.parametrize("column", ["image", "images"])
def test_an_image_column_is_refused_and_either_fix_loads(tokenizer, column):
    from PIL import Image

    picture = Image.new("RGB", (4, 4))
    rows = datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "What colour is it?"}]] * 2, column: [picture] * 2}
    )
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(rows, tokenizer=tokenizer)
    msg = str(info.value)
    assert msg.startswith(f"column {column!r}: TRL's GRPOTrainer shows") and "trains text models" in msg
    # Each fix the message gives, run as written, loads: the column dropped, or kept for the rewards alone.
    fixes = re.findall(r"ds = (ds\.\w+\([^)]*\))", msg)
    assert len(fixes) == 2
    kept = [load_prompt_dataset(eval(fix, {"ds": rows}), tokenizer=tokenizer).column_names for fix in fixes]
    assert kept == [["prompt", PROMPT_MESSAGES], [f"{column}_ref", "prompt", PROMPT_MESSAGES]]


@pytest.mark.parametrize("column", ["prompt", "messages"])
def test_an_image_in_a_chat_message_is_refused_and_its_text_kept_by_the_fix(tokenizer, column):
    def turn(*parts):
        return [{"role": "user", "content": list(parts)}]

    text = {"type": "text", "text": "What colour is it?"}
    image = {"type": "image", "text": None}
    untyped = {"type": None, "text": "?"}  # a part of no type (datasets fills a missing key with None) passes
    rows = datasets.Dataset.from_dict(
        {column: [turn(text), turn(untyped, image, text)], "answer": ["red", "blue"]}
    )
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(rows, tokenizer=tokenizer, prompt_column=column)
    msg = str(info.value)
    assert msg.startswith(f"column {column!r}: row 1's message 0 has a content part of type 'image'")
    fixed = eval(msg.split("e.g. keep each message's text parts: ds = ", 1)[1], {"ds": rows})
    loaded = load_prompt_dataset(fixed, tokenizer=tokenizer, prompt_column=column)
    plain = load_prompt_dataset(
        [{column: [{"role": "user", "content": "What colour is it?"}]}] * 2,
        tokenizer=tokenizer,
        prompt_column=column,
    )
    assert loaded["prompt"] == plain["prompt"]
    # A prompt given by a template reads no messages: its other columns are not looked into.
    assert len(load_prompt_dataset(rows, prompt_template="{answer}?")) == 2


def test_a_prompt_holding_an_earlier_tool_call_renders_as_its_template_renders_it():
    """An assistant turn that called a tool has no content, only tool_calls (standard chat data, rendered by
    the template): accepted, and rendered as apply_chat_template renders it. A message lacking content without
    tool calls is still refused."""
    from helpers import qwen_style_tokenizer

    tok = qwen_style_tokenizer()
    prompt = [
        {"role": "user", "content": "What is 2+2? Use the tool."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}],
        },
        {"role": "tool", "name": "add", "content": "4"},
    ]
    rows = datasets.Dataset.from_list([{"prompt": prompt, "answer": "4"}] * 2)
    loaded = load_prompt_dataset(rows, tokenizer=tok)
    expected = tok.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert loaded[0]["prompt"] == expected and '"name": "add"' in expected
    bare = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    with pytest.raises(ValueError, match=r"its message 1 has no 'content'"):
        load_prompt_dataset(datasets.Dataset.from_list([{"prompt": bare}] * 2), tokenizer=tok)
