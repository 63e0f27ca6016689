"""The JSON-lines logs a run writes (metrics.jsonl, completions.jsonl), read back: one reader for the plot, the
resume's truncation and the reporter.

A record is one line holding a JSON object with an integer "step". A run killed while writing leaves its last
line cut short ('{"step": 4, "rew'); a file edited by hand may hold anything. `read_log` keeps every complete
record and names each line it skipped (its number and why), so that a reader uses what is there and says what it
left out, instead of failing on the first bad line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunLog:
    """A JSON-lines log as read: its complete records, each one's line as written, and the lines skipped."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    # "line 7 (...)": each line that is no complete record, with why
    skipped: list[str] = field(default_factory=list)

    def skipped_note(self) -> str:
        """The lines skipped, in words: "skipped line 7 (...)" ("" when none was)."""
        return f"skipped {'; '.join(self.skipped)}" if self.skipped else ""


def read_log(path: str | Path) -> RunLog:
    """Every complete record of the JSON-lines log at `path`, in file order; blank lines are ignored, and a line
    that is not a JSON object with an integer "step" is skipped and named in `skipped`. FileNotFoundError when
    there is no file."""
    log = RunLog(Path(path))
    for number, raw in enumerate(log.path.read_bytes().splitlines(), 1):
        why = None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            why = "not UTF-8 text"
        else:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                found = e.msg[0].lower() + e.msg[1:].removesuffix(" at")
                why = f"not complete JSON, {found} at column {e.colno}: a run stopped while writing it?"
            else:
                step = record.get("step") if isinstance(record, dict) else None
                if not isinstance(step, int) or isinstance(step, bool):
                    why = 'not a record: no integer "step"'
        if why:
            log.skipped.append(f"line {number} ({why})")
            continue
        log.records.append(record)
        log.lines.append(line)
    return log
