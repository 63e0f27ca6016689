"""MkDocs hooks: the reference pages generated from the code, and the version on every page.

- ``reference/config.md``: every field of :class:`lora_grpo.config.GRPOConfig` from its metadata
  (``GRPOConfig.field_docs()``, the text ``lora-grpo train --help`` and ``help(GRPOConfig)`` show),
  grouped by the ``# --- section ---`` comments of ``lora_grpo/config.py``;
- ``reference/cli.md``: each subcommand's ``--help``, from ``lora_grpo.cli.build_parser()``;
- ``reference/layout.md``: every module of the package with its job, the first paragraph of its docstring,
  folder by folder in the order of the design's module map (a module without a docstring stops the build);
- a line under each page's title naming the version of lora_grpo it describes.

Nothing generated is written into the tree: the pages exist only in the built site.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
from pathlib import Path

from mkdocs.structure.files import File

import lora_grpo
from lora_grpo import cli
from lora_grpo.config import GRPOConfig

GENERATED = {"reference/config.md", "reference/cli.md", "reference/layout.md"}
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


PACKAGE = Path(lora_grpo.__file__).parent
# The design's module map, in its order: the top level (the config, the trainer, the loop's stages, what
# they share, the CLI), then the folders from the pure math up to the TRL front door. Modules and folders
# not named here follow in alphabetical order: a new one is on the page without an edit here.
TOP_ORDER = (
    "__init__ config config_checks trainer sampler scorer update evaluation dynamic_sampling startup state "
    "batch optim device rng base_cache cli"
).split()
FOLDER_ORDER = "algo model memory run data rollout rewards tasks trl".split()
_ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|obj):`~?([^`]+)`")


def module_job(path: Path) -> str:
    """The first paragraph of the module's docstring on one line, ready for a table cell: what the module is
    for. A module without a docstring is refused, naming the file and the fix."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc or not doc.strip():
        raise ValueError(
            f"{path} has no docstring: open it with one whose first paragraph says the module's job "
            "(the package layout page, docs/reference/layout.md, is generated from them)"
        )
    first = _ROLE.sub(r"`\1`", " ".join(doc.strip().split("\n\n")[0].split()))
    # A pipe ends a table cell, except inside a code span (where a backslash would show): escaped outside only.
    parts = re.split(r"(`+[^`]*`+)", first)
    return "".join(part if part.startswith("`") else _cell(part) for part in parts)


def _ordered(names, order):
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def _module_table(files: list[Path], package: Path) -> list[str]:
    rows = ["| module | its job |", "|---|---|"]
    for path in files:
        rows.append(f"| `{path.relative_to(package).as_posix()}` | {module_job(path)} |")
    return rows


def layout_page(package: Path = PACKAGE) -> str:
    """reference/layout.md: every module of `package` (lora_grpo/) with its docstring's first paragraph."""
    top = {p.stem: p for p in package.glob("*.py")}
    folders = {p.name: p for p in package.iterdir() if (p / "__init__.py").is_file()}
    lines = [
        "# Package layout",
        "",
        "Every module of `lora_grpo/` with its job: the first paragraph of its docstring (this page is",
        "generated from them when the site is built, so it names every module there is). The folders show",
        "the architecture: the loop and its stages at the top; below them the base and its adapters",
        "(`model/`), the memory plan (`memory/`), a run on disk (`run/`), the prompts (`data/`), sampling",
        "(`rollout/`), the rewards (`rewards/`) and the offline tasks (`tasks/`); at the bottom the pure",
        "tensor math (`algo/`), which imports nothing of ours. Arrows run down only: no module imports",
        "upward and no two import each other (`tests/test_import_graph.py` checks the import graph). The TRL",
        "front door (`trl/`) stands beside the CLI, above the trainer it translates onto.",
        "",
        "The math (advantages, loss variants, k3 KL, chunked log-probs, the weight-space sync) is pure tensor",
        "functions, each tested against hand-computed or dense reference values. The data flow of one step is",
        "in [GRPO in lora_grpo](../concepts/grpo.md), the reference slot in",
        "[its own page](../concepts/reference-slot.md).",
        "",
        "## The folders",
        "",
        "| folder | what it holds |",
        "|---|---|",
        f"| `{package.name}/` | the loop: the config, the trainer, the loop's stages and what they share |",
    ]
    ordered_folders = _ordered(folders, FOLDER_ORDER)
    for name in ordered_folders:
        lines.append(f"| [`{name}/`](#{name}) | {module_job(folders[name] / '__init__.py')} |")
    lines += [
        "",
        "Beside the package: `lora_grpo/recipes/` holds the shipped YAML recipes (`recipes/` links to them,",
        "with a Python-API example); `tests/` is pytest on a CPU, offline; `benchmarks/` measures speed,",
        "memory and learning (numbers go in notes and docs, not asserts); `docs/` is this site.",
        "",
        f"## The top level: `{package.name}/` {{ #top }}",
        "",
        *_module_table([top[n] for n in _ordered(top, TOP_ORDER)], package),
    ]
    for name in ordered_folders:
        files = sorted(folders[name].rglob("*.py"), key=lambda p: (p.name != "__init__.py", p.as_posix()))
        lines += ["", f"## `{name}/` {{ #{name} }}", "", *_module_table(files, package)]
    return "\n".join(lines) + "\n"


def on_files(files, config):
    for path, make in (
        ("reference/config.md", config_page),
        ("reference/cli.md", cli_page),
        ("reference/layout.md", layout_page),
    ):
        files.append(File.generated(config, path, content=make()))
    return files


def on_page_markdown(markdown: str, page, config, files):
    """Under the page's title: the version of lora_grpo the page describes."""
    note = f"*This page describes lora_grpo {lora_grpo.__version__}.*"
    head, sep, rest = markdown.partition("\n")
    if head.startswith("# "):
        return f"{head}\n\n{note}\n{rest}"
    return f"{note}\n\n{markdown}"
