"""A local data file (.json, .jsonl, .csv, .parquet) read through datasets' own loaders; when a loader fails, the
file is read again here to say where and what is wrong.

datasets reports a bad file as its reader's last words: "Expected object or value at position 29" (no file, no
line), a bare UnicodeDecodeError, or "An error occurred while generating the dataset". `load_data_file` keeps
datasets' loaders for the reading (their types, their cache) and, only on their failure, finds the first bad line
itself (`find_problem`): a NUL byte, bytes that are not UTF-8, a line that is not JSON (or not a JSON object),
a CSV row with another number of fields or a quote never closed, a Parquet file that is not one. The ValueError
names the file, the line (and column), what is wrong there and the fix, chained from the loader's error.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from pathlib import Path

import datasets
import pyarrow
from datasets.exceptions import DatasetGenerationError

# File extension -> datasets builder name.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}

_JSONL_FIX = 'each line must be one JSON object, e.g. {"prompt": "2+2=", "answer": "4"}'
_UTF8_FIX = "save the file as UTF-8 (from Latin-1, say: iconv -f latin1 -t utf-8 IN > OUT)"
_NUL_FIX = (
    "the file is binary or damaged there (an interrupted write or copy?); remove the byte or write it again"
)


def load_data_file(path: Path) -> datasets.Dataset:
    """The one split of a local data file, by datasets' loader for its extension (FILE_BUILDERS); a file that
    loader cannot read raises ValueError naming the file, the first bad line, what is wrong and the fix."""
    builder = FILE_BUILDERS[path.suffix.lower()]
    if builder != "parquet" and not _is_clean_text(path):
        # datasets' JSON loader takes bytes that are not UTF-8 and fails later, when a row is read; a CSV loads a
        # NUL byte as data: both are refused here, at the line, before any loader runs.
        raise ValueError(f"cannot load {path}: {_text_problem(path.read_bytes())}")
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except LOAD_FAILURES as error:
        raise ValueError(f"cannot load {path}: {load_problem(path, error)}") from error


# What datasets' file loaders raise on a file they cannot read
LOAD_FAILURES = (DatasetGenerationError, ValueError, pyarrow.ArrowException, StopIteration)


def load_problem(path: Path, error: BaseException) -> str:
    """What is wrong with a data file a loader failed on: empty, or where and what (find_problem), else the
    loader's own innermost words."""
    if path.suffix.lower() in (".json", ".jsonl") and _is_empty(path):  # (a bare StopIteration from datasets)
        return f"the file is empty; {_JSONL_FIX}"
    found = find_problem(path)
    if found is None:
        cause = _innermost(error)
        builder = FILE_BUILDERS.get(path.suffix.lower(), "file")
        found = f"datasets' {builder} loader failed ({type(cause).__name__}: {_first_line(cause)})"
    return found


def _is_empty(path: Path, chunk: int = 1 << 16) -> bool:
    """Whether a text file holds nothing but white space (read until the first other byte)."""
    with path.open("rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return False
    return True


def _is_clean_text(path: Path, chunk: int = 1 << 24) -> bool:
    """Whether a file is UTF-8 without NUL bytes, read in chunks at the codec's speed (the error path finds the
    line)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with path.open("rb") as f:
        while block := f.read(chunk):
            if b"\0" in block:
                return False
            try:
                decoder.decode(block)
            except UnicodeDecodeError:
                return False
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:  # a character cut off at the end of the file
        return False
    return True  # (a UTF-16 file starts with 0xff 0xfe or 0xfe 0xff, never UTF-8: it fails above)


def find_problem(path: Path) -> str | None:
    """Where and what is wrong in a data file ("line 3, column 12: ... ; fix"), or None when no check here
    finds anything (the loader failed for another reason)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_problem(path)
    data = path.read_bytes()
    problem = _text_problem(data)
    if problem is not None:
        return problem
    text = data.decode("utf-8-sig")
    if suffix == ".jsonl":
        return _json_lines_problem(text)
    if suffix == ".json":
        return _json_problem(text)
    if suffix == ".csv":
        return _csv_problem(text)
    return None


def _text_problem(data: bytes) -> str | None:
    """The first NUL byte or non-UTF-8 byte sequence of a text file, by line and column."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "line 1: the file starts with a UTF-16 byte-order mark: it is UTF-16 text; save it as UTF-8"
    # UTF-8 never uses the byte 0x0A inside a character, so splitting on it keeps every character whole.
    for number, line in enumerate(data.split(b"\n"), 1):
        column = line.find(b"\0") + 1
        if column:
            return f"line {number}, column {column}: a NUL byte (\\x00); {_NUL_FIX}"
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            column = len(line[: e.start].decode("utf-8")) + 1  # in characters, as an editor counts
            return (
                f"line {number}, column {column}: the bytes {line[e.start : e.end]!r} are not UTF-8 ({e.reason}); "
                f"{_UTF8_FIX}"
            )
    return None


def _json_lines_problem(text: str) -> str | None:
    """The first line of a JSON-lines text that is not one JSON object."""
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {number}, column {e.colno}: not JSON ({e.msg}); {_JSONL_FIX}"
        if not isinstance(value, dict):
            return f"line {number}: a JSON {type(value).__name__}, not an object; {_JSONL_FIX}"
    return None


def _json_problem(text: str) -> str | None:
    """A .json file: one JSON document (a list of row objects), or JSON lines (datasets reads both)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        first = next((line for line in text.split("\n") if line.strip()), "")
        try:
            one_line_object = isinstance(json.loads(first), dict)
        except json.JSONDecodeError:
            one_line_object = False
        if one_line_object and e.lineno > 1:  # JSON lines in a .json file: check it line by line
            return _json_lines_problem(text)
        return (
            f"line {e.lineno}, column {e.colno}: not JSON ({e.msg}); the file must be one JSON list of row objects, "
            'e.g. [{"prompt": "2+2=", "answer": "4"}], or one JSON object per line'
        )
    if isinstance(value, list):
        bad = next((i for i, row in enumerate(value) if not isinstance(row, dict)), None)
        if bad is not None:
            return (
                f"element {bad} of its list is a JSON {type(value[bad]).__name__}, not an object: every row must be "
                'an object, e.g. {"prompt": "2+2=", "answer": "4"}'
            )
    return None


def _csv_problem(text: str) -> str | None:
    """The first CSV row whose field count is not the header's, or a quoted field never closed."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header, start = None, 1
    try:
        for row in reader:
            if row:
                if header is None:
                    header = row
                elif len(row) != len(header):
                    where = (
                        f"line {start}" if start == reader.line_num else f"lines {start}-{reader.line_num}"
                    )
                    return (
                        f"{where}: {len(row)} fields, but the header (line 1) has {len(header)} ({', '.join(header)}); "
                        'quote a value that holds a comma ("a, b"), or fix the row'
                    )
            start = reader.line_num + 1
    except csv.Error as e:
        if "end of data" in str(e) or "EOF" in str(e):
            return (
                f"line {start}: a quoted field opens there and is never closed ({e}); close the quote, or double a "
                'quote inside a quoted value ("a ""b"" c")'
            )
        return f"line {reader.line_num}: {e}; fix the row"
    return None


def _parquet_problem(path: Path) -> str | None:
    import pyarrow.parquet as pq

    try:
        pq.ParquetFile(path).read()
    except (pyarrow.ArrowException, OSError) as e:
        with path.open("rb") as f:
            head = f.read(4)
        what = (
            "it does not start with Parquet's magic bytes PAR1 (a CSV or JSON file with the wrong extension?)"
            if head != b"PAR1"
            else "it is damaged or truncated (an interrupted write or copy?)"
        )
        return (
            f"not a readable Parquet file ({type(e).__name__}: {_first_line(e)}): {what}; Parquet is binary, so no "
            "line can be named: write it again (Dataset.to_parquet(path), DataFrame.to_parquet(path))"
        )
    return None


def _innermost(error: BaseException) -> BaseException:
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return error


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]
