"""The package's import graph, read from the source with ast, function-local and TYPE_CHECKING imports
included (DESIGN.md: "no import cycles, not even ones hidden by function-local imports"): no import circle
between modules, nor between folders; no import running back up (DESIGN.md's module map: "the loop's stages
use model/, memory/, run/, data/, rollout/, rewards/; those use algo/; nothing imports upward"); algo/
imports nothing of ours outside algo/; at most 20 modules directly under lora_grpo/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lora_grpo"
ROOT = PACKAGE.name
# The folders below the loop: what they import of the top level must be FLOOR.
FOLDERS = ("algo", "model", "memory", "run", "data", "rollout", "rewards", "tasks")
# The TRL front door stands above the trainer (it translates onto it): it may import anything, and only
# the CLI (the `lora-grpo trl` subcommand) and the front door itself import it.
FRONT_DOOR = "trl"
# The top-level modules the folders may import, each with its reason: shared definitions that sit below
# the folders, importing nothing of ours but algo/ and each other (test_the_floor_stays_below_the_folders).
# Every other top-level module (the trainer, the stages, state, optim, cli, ...) is above them.
FLOOR = {
    "config": "the run's one typed config: model/load builds the model from a GRPOConfig, run/reporting "
    "reads its TRACKERS and ConfigError",
    "config_checks": "GRPOConfig's validation, imported with config",
    "recipe_yaml": "YAML read safely, with file and line: config reads recipes and --set values with it",
    "device": "what depends on the accelerator (dtypes, the clock, MiB, placing a model), asked by model/, "
    "memory/, rollout/ and run/",
    "rng": "every generator's state: run/checkpoint saves and restores it, memory/probe puts it back after "
    "its probe",
    "base_cache": "the machine's cache of built bases: model/bases and model/gguf read it, tasks/ publish "
    "their tiny bases into it",
    "event_loop": "the process's one asyncio loop: rewards/ awaits async reward functions and rollout/ async tools "
    "and environments on it, the same loop every step as in TRL",
    "batch": "the records that move between the stages (a rollout made ready for the loss, its "
    "micro-batches): memory/probe builds the worst-case micro-batch the update will see",
}


def modules() -> dict[str, Path]:
    """Dotted module name → its file, packages under their own name (lora_grpo.model → model/__init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of `known` that module `name`'s source imports, anywhere in it (inside functions and
    `if TYPE_CHECKING:` too). `from X import y` is an import of X.y when that is a module, else of X;
    an import of a name inside a module counts as one of the longest known module that holds it.
    is_package: `name` is a package's __init__ (its relative imports start from the package itself)."""
    here = name.split(".") if is_package else name.split(".")[:-1]

    def module_of(dotted: str) -> str | None:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in known:
                return ".".join(parts[:end])
        return None

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = here[: len(here) - (node.level - 1)]
                base = ".".join(prefix + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(m for t in targets if (m := module_of(t)) and m != name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Every module of the package → the modules of the package it imports."""
    found = modules()
    return {
        name: imports_of(name, path.read_text(), set(found), path.name == "__init__.py")
        for name, path in found.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None when there is none."""
    done, on_path = set(), []

    def visit(node):
        if node in on_path:
            return on_path[on_path.index(node) :] + [node]
        if node in done:
            return None
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt):
                return cycle
        on_path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start):
            return cycle
    return None


def folder_of(module: str) -> str | None:
    """The folder of lora_grpo a module lies in (its first part under the package), None at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def top_name(module: str) -> str:
    """A top-level module's name without the package's: lora_grpo.trainer → trainer."""
    return module.split(".", 1)[1] if "." in module else module


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_reader_sees_relative_function_local_and_type_checking_imports():
    known = {
        "lora_grpo",
        "lora_grpo.config",
        "lora_grpo.model",
        "lora_grpo.model.adapters",
        "lora_grpo.rng",
        "lora_grpo.run",
        "lora_grpo.run.failures",
    }
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from ..rng import set_rng_state\n"
        "if TYPE_CHECKING:\n"
        "    from lora_grpo.config import GRPOConfig\n"
        "def f():\n"
        "    from ..model import adapters\n"
        "    from . import failures\n"
    )
    assert imports_of("lora_grpo.run.checkpoint", source, known) == {
        "lora_grpo.rng",
        "lora_grpo.config",
        "lora_grpo.model.adapters",
        "lora_grpo.run.failures",
    }
    # In a package's __init__, `.` is the package itself.
    source = "from .adapters import POLICY\n"
    assert imports_of("lora_grpo.model", source, known, is_package=True) == {"lora_grpo.model.adapters"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_is_read_from_the_package(graph):
    # The reader found the package and its imports: the trainer calls its stages, a folder's module its neighbour.
    assert {"lora_grpo.trainer", "lora_grpo.algo.loss", "lora_grpo.run.checkpoint"} <= graph.keys()
    assert "lora_grpo.scorer" in graph["lora_grpo.trainer"]
    assert "lora_grpo.model.adapters" in graph["lora_grpo.run.checkpoint"]


def test_no_import_circle_between_modules(graph):
    cycle = find_cycle(graph)
    assert cycle is None, (
        f"import circle: {' -> '.join(cycle)}; move what both need into the lower one (DESIGN.md, point 15)"
    )


def test_no_import_circle_between_folders(graph):
    # Each folder one node, each top-level module its own: a circle through folders is a circle of the design.
    def node(module):
        return folder_of(module) or module

    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folded.setdefault(node(module), set()).update(node(t) for t in targets if node(t) != node(module))
    cycle = find_cycle(folded)
    assert cycle is None, f"import circle between folders: {' -> '.join(cycle)}"


def test_no_import_runs_back_up_from_a_folder(graph):
    up = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if folder_of(module) in FOLDERS
        for target in targets
        if folder_of(target) is None and top_name(target) not in FLOOR
    )
    assert not up, (
        f"imports running back up from a folder to the loop: {up}; pass what the folder needs as an argument, "
        "or move the shared piece down (into the folder, or into the floor with a reason in FLOOR)"
    )


def test_the_floor_stays_below_the_folders(graph):
    # FLOOR's modules may be imported by the folders only while they import nothing above algo/.
    above = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if folder_of(module) is None and top_name(module) in FLOOR
        for target in targets
        if folder_of(target) != "algo" and top_name(target) not in FLOOR
    )
    assert not above, f"a module the folders may import imports more than algo/ and the floor: {above}"


def test_only_the_cli_enters_the_trl_front_door(graph):
    inside = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if folder_of(module) != FRONT_DOOR and module != f"{ROOT}.cli"
        for target in targets
        if folder_of(target) == FRONT_DOOR
    )
    assert not inside, f"the TRL front door is above the trainer; only cli.py may import it: {inside}"


def test_algo_imports_nothing_of_ours_outside_algo(graph):
    outside = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if folder_of(module) == "algo"
        for target in targets
        if folder_of(target) != "algo"
    )
    assert not outside, f"algo/ is pure tensor math and imports nothing of ours outside it: {outside}"


def test_at_most_20_modules_directly_under_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 20, (
        f"{len(top)} modules directly under {ROOT}/ (at most 20): {top}; give some a folder"
    )
