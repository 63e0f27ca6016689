"""MkDocs hooks: the reference pages generated from the code, and the version on every page.

- ``reference/config.md``: every field of :class:`lora_grpo.config.GRPOConfig` from its metadata
  (``GRPOConfig.field_docs()``, the text ``lora-grpo train --help`` and ``help(GRPOConfig)`` show),
  grouped by the ``# --- section ---`` comments of ``lora_grpo/config.py``;
- ``reference/cli.md``: each subcommand's ``--help``, from ``lora_grpo.cli.build_parser()``;
- a line under each page's title naming the version of lora_grpo it describes.

Nothing generated is written into the tree: the pages exist only in the built site.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re

from mkdocs.structure.files import File

import lora_grpo
from lora_grpo import cli
from lora_grpo.config import GRPOConfig

GENERATED = {"reference/config.md", "reference/cli.md"}
_SECTION = re.compile(r"^\s*# --- (?P<name>[^-]+?) -+")
_FIELD = re.compile(r"^\s{4}(?P<name>\w+)\s*:")


def _sections() -> dict[str, str]:
    """field name → the section comment above it in config.py."""
    section, out = "", {}
    for line in inspect.getsource(GRPOConfig).splitlines():
        if m := _SECTION.match(line):
            section = m["name"].strip()
        elif (m := _FIELD.match(line)) and section:
            out.setdefault(m["name"], section)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_page() -> str:
    docs, sections = GRPOConfig.field_docs(), _sections()
    lines = [
        "# Configuration",
        "",
        "Every field of `GRPOConfig`, the names of the YAML recipes and of `--set KEY=VALUE`. This page is",
        "generated from the fields' metadata in `lora_grpo/config.py`, the same text that",
        "`lora-grpo train --help` and `help(GRPOConfig)` show.",
        "",
    ]
    current = None
    for d in docs:
        section = sections.get(d.name, "other")
        if section != current:
            current = section
            lines += [
                "",
                f"## {section[:1].upper()}{section[1:]}",
                "",
                "| field | type | default | meaning |",
                "|---|---|---|---|",
            ]
        anchor = f'<span id="{d.name}"></span>'  # reference/config.md#lora_r links to the field
        lines.append(
            f"| {anchor}`{d.name}` | `{_cell(d.type)}` | `{_cell(repr(d.default))}` | {_cell(d.help)} |"
        )
    return "\n".join(lines) + "\n"


def _help(parser) -> str:
    with _columns(100):
        return parser.format_help()


@contextlib.contextmanager
def _columns(width: int):
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old


def cli_page() -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    lines = [
        "# Command line",
        "",
        "Generated from the `lora-grpo` command's argparse parser (`lora_grpo.cli.build_parser`): what",
        "`lora-grpo --help` and `lora-grpo COMMAND --help` print. `--set KEY=VALUE` takes any field of the",
        "[configuration](config.md).",
        "",
        "```text",
        _help(parser).rstrip(),
        "```",
    ]
    for name, subparser in sub.choices.items():
        lines += ["", f"## lora-grpo {name}", ""]
        if name == "trl":
            lines += [
                "`lora-grpo trl` passes its arguments to TRL's grpo script parser (ScriptArguments, TRL's",
                "GRPOConfig, ModelConfig): `--config recipe.yaml` and any of their fields as flags;",
                "`lora-grpo trl --help` lists them. See [Coming from TRL](../guides/from-trl.md).",
                "",
            ]
        lines += ["```text", _help(subparser).rstrip(), "```"]
    return "\n".join(lines) + "\n"


def on_files(files, config):
    for path, make in (("reference/config.md", config_page), ("reference/cli.md", cli_page)):
        files.append(File.generated(config, path, content=make()))
    return files


def on_page_markdown(markdown: str, page, config, files):
    """Under the page's title: the version of lora_grpo the page describes."""
    note = f"*This page describes lora_grpo {lora_grpo.__version__}.*"
    head, sep, rest = markdown.partition("\n")
    if head.startswith("# "):
        return f"{head}\n\n{note}\n{rest}"
    return f"{note}\n\n{markdown}"
