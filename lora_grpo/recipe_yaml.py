"""YAML as recipes and ``--set`` values are read: safely, and with errors that say where.

One loader (`RecipeLoader`) for both. It is PyYAML's SafeLoader, so no tag can build a Python object and
nothing in a recipe runs; a tag it does not know (``!!python/object/apply:os.system``) is refused at its line,
not left to PyYAML's "could not determine a constructor" naming ``"<unicode string>"``. It also reads ``1e-4``
as a number, as YAML 1.2 does (YAML 1.1 wants a dot and a signed exponent, and reads it as text).

`read_recipe` reads a recipe file: a mapping of config fields to values, with the line of each field, so that
a value refused later (config_checks) is named at its line. Syntax errors, tags, a key given twice and a
file that is not a mapping are refused naming the file, the line and the column.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from .config_checks import ConfigError

_SYNTAX_FIX = (
    "a recipe holds one `field: value` a line; quote a value that holds ': ', ' #' or starts with a bracket, "
    "and close every [ ] and { }"
)


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader that reads 1e-4 as a number and refuses unknown tags at their line (the module docstring)."""


# YAML 1.2's floats with an exponent and no dot (1e-4, 5E+3); the dotted ones SafeLoader reads already.
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class UnsafeTag(yaml.MarkedYAMLError):
    """A tag that would build a Python object (or any tag SafeLoader does not know)."""


def _refuse_tag(loader: RecipeLoader, node: yaml.Node) -> None:
    tag = node.tag.replace("tag:yaml.org,2002:", "!!")
    raise UnsafeTag(
        problem=f"the tag {tag} asks for a Python object, and recipes are read as plain YAML (nothing in them "
        "runs): write the value itself (text, a number, a list or a mapping); a reward function, tool or "
        "environment is named by its dotted path, e.g. 'my_rewards:accuracy'",
        problem_mark=node.start_mark,
    )


RecipeLoader.add_constructor(None, _refuse_tag)


class RecipeDumper(yaml.SafeDumper):
    """SafeDumper whose text reads back as text under RecipeLoader: a string that RecipeLoader would read as
    another type (``1e-4``, ``5e3``, a commit such as ``4410e53``: YAML 1.1 leaves them plain) is quoted."""


_RESOLVER = RecipeLoader("")  # how a plain scalar reads back


def _represent_str(dumper: RecipeDumper, value: str) -> yaml.ScalarNode:
    node = dumper.represent_str(value)
    if (
        node.style is None
        and _RESOLVER.resolve(yaml.ScalarNode, value, (True, False)) != "tag:yaml.org,2002:str"
    ):
        node.style = "'"
    return node


RecipeDumper.add_representer(str, _represent_str)


def dump_recipe(values: dict[str, Any]) -> str:
    """``values`` as a recipe's YAML, in their order, that read_recipe reads back as the same values."""
    return yaml.dump(values, Dumper=RecipeDumper, sort_keys=False, allow_unicode=True)


def load_value(text: str) -> Any:
    """One ``--set`` value, read as a recipe's value is: ``[1, 8]`` → [1, 8], ``1e-4`` → 0.0001."""
    return yaml.load(text, Loader=RecipeLoader)


def read_recipe(path: str | Path, *, not_a_mapping: str = "") -> tuple[dict[str, Any], dict[str, int]]:
    """A recipe file's fields → values, and fields → the line (1-based) each is on.

    not_a_mapping: the sentence the refusal of a file that is not a mapping starts with (the TRL front
    door: TRL's own); given, an empty file is refused too (a recipe may be empty: every field its default).

    Raises:
        ConfigError: the file is not UTF-8, not valid YAML, holds a tag, gives a field twice or is not a
            mapping; the message names the file, the line and the column, and ends with the fix.
    """
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}, line {line}: byte {data[e.start : e.start + 1]!r} is not UTF-8: save the recipe as UTF-8"
        ) from None
    try:
        # the reader refuses control characters here, before any parsing
        loader = RecipeLoader(text)
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        column = e.position - text.rfind("\n", 0, e.position)
        raise ConfigError(
            f"{path}, line {line}, column {column}: the control character {chr(e.character)!r} cannot be in YAML: "
            'remove it, or write it as an escape in double quotes, e.g. "a\\tb"'
        ) from None
    try:
        node = loader.get_single_node()
        values = loader.construct_document(node) if node is not None else {}
    except yaml.MarkedYAMLError as e:
        raise ConfigError(_where(path, e.problem_mark) + _problem(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e}): {_SYNTAX_FIX}") from None
    finally:
        loader.dispose()
    if not isinstance(values, dict) or (not_a_mapping and node is None):
        got = "an empty file" if node is None else type(values).__name__
        raise ConfigError(
            f"{not_a_mapping + ' ' if not_a_mapping else ''}{path}: a recipe is a mapping of config fields to "
            f"values, got {got}: write one `field: value` a line, e.g. `model_name_or_path: toy`"
        )
    lines: dict[str, int] = {}
    for key, _ in node.value if node is not None else ():
        name = key.value
        if name in lines:
            raise ConfigError(
                f"{_where(path, key.start_mark)}{name!r} is given twice (also on line {lines[name]}), and "
                "only the last would count: keep one"
            )
        lines[name] = key.start_mark.line + 1
    return values, lines


def _where(path, mark) -> str:
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else f"{path}: "


def _problem(e: yaml.MarkedYAMLError) -> str:
    if isinstance(e, UnsafeTag):
        return e.problem
    context = ""
    if e.context and e.context_mark is not None:
        context = f" ({e.context} that starts at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
    return f"not valid YAML: {e.problem}{context}: {_SYNTAX_FIX}"
