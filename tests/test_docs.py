"""A newcomer's house: one source for every config field's meaning (``help()``, the CLI, the docs
site), error hints whose commands exist, local modules found from the current directory by every
subcommand, and the documentation site building without a warning."""

import ast
import doctest
import importlib.util
import inspect
import json
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import PROMPTS, write_recipe

import lora_grpo.config
from lora_grpo.cli import build_parser, main
from lora_grpo.config import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]


def flat(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------- one source for a field's meaning


def test_help_of_the_config_lists_every_field_with_its_type_default_and_help():
    doc = flat(inspect.getdoc(GRPOConfig))  # what help(GRPOConfig) prints under the class
    fields = GRPOConfig.field_docs()
    assert [d.name for d in fields] == list(GRPOConfig.__dataclass_fields__)
    for d in fields:
        assert d.help, f"{d.name} has no help"
        assert flat(f"{d.name} ({d.type}, default: {d.default!r}): {d.help}") in doc, d.name
    assert GRPOConfig.field_docs()[0].type == "str | None"
    assert [d.default for d in fields if d.name in ("lora_r", "eval_pass_k")] == [16, []]
    assert "-----" not in (inspect.getdoc(GRPOConfig.__post_init__) or "")  # not the stray comment above it


def test_the_cli_and_the_docs_show_the_same_text_as_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    cli_help = flat(capsys.readouterr().out)
    doc = flat(inspect.getdoc(GRPOConfig))
    pytest.importorskip("mkdocs")
    page = flat(load_hooks().config_page())
    for d in GRPOConfig.field_docs():
        assert flat(f"{d.name} {d.help} [default: {d.default!r}]") in cli_help, d.name
        assert flat(d.help) in doc
        assert flat(d.help.replace("|", "\\|")) in page, d.name
        assert f'<span id="{d.name}"></span>`{d.name}`' in page


def test_the_config_docstring_examples_run():
    result = doctest.testmod(lora_grpo.config)
    assert result.attempted >= 5 and result.failed == 0


def load_hooks():
    spec = importlib.util.spec_from_file_location("lora_grpo_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------- every suggested command exists


def message_strings(tree: ast.AST):
    """Every string literal of a module that is not a docstring; an f-string with its fields as VALUE."""
    docstrings, parts = set(), set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr):
            parts.update(id(v) for v in node.values)
    for node in ast.walk(tree):
        if id(node) in docstrings or id(node) in parts:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "VALUE" for v in node.values)


# `lora-grpo` and what follows it up to a backtick, a quote, a bracket, ';' or a shell redirection
HINT = re.compile(r"lora-grpo((?: (?!>)[^\s`'\"();]+)+)")


def suggested_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted((ROOT / "lora_grpo").rglob("*.py")):
        for text in message_strings(ast.parse(path.read_text())):
            for m in HINT.finditer(text):
                args = [a for a in m.group(1).split() if a != "..."]
                args[-1] = args[-1].rstrip(".,:")
                args = ["toy-addition" if a == "<recipe>" else a for a in args]  # the placeholder of a recipe
                found.append((f"{path.relative_to(ROOT)}: lora-grpo{m.group(1)}", args))
    return found


def test_every_command_an_error_or_help_suggests_parses():
    commands = suggested_commands()
    seen = {" ".join(args) for _, args in commands}
    # the scan finds the hints it must (a config typo, a resume, an unknown recipe)
    assert {"train --help", "recipes", "train VALUE"} <= seen, seen
    # the resume hint is built from the run's own recipe and --set overrides: the one a run prints
    from lora_grpo.cli import resume_command

    resume = resume_command("toy-addition", ["max_steps=40", "output_dir=runs/a b"])
    commands.append(("cli.resume_command", shlex.split(resume)[1:]))
    assert shlex.split(resume)[1:3] == ["train", "toy-addition"] and "resume_from_checkpoint=latest" in resume
    for where, args in commands:
        parser = build_parser()
        try:
            ns, extra = parser.parse_known_args(args)
        except SystemExit as e:  # --help exits 0; an unknown command or flag exits 2
            assert e.code == 0, f"{where} suggests a command that does not parse"
            continue
        assert ns.command == "trl" or not extra, f"{where}: unrecognized {extra}"


def test_a_config_typo_points_at_a_command_that_lists_the_fields(tmp_path, capsys):
    with pytest.raises(lora_grpo.config.ConfigError, match=r"`lora-grpo train --help` lists the fields") as e:
        GRPOConfig.from_dict({"lora_rank": 8})
    assert "did you mean 'lora_r'" in str(e.value)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0 and "lora_r " in capsys.readouterr().out


# ------------------------------------------------------------- local modules: the current directory first


def local_reward_module(folder: Path) -> str:
    name = f"cwd_rewards_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(
        "CALLS = []\n\n\ndef short(completions, **kwargs):\n"
        "    CALLS.append(len(completions))\n    return [-float(len(str(c))) for c in completions]\n"
    )
    return name


@pytest.fixture
def cwd_not_on_path(tmp_path, monkeypatch):
    """Run from tmp_path with sys.path as the `lora-grpo` script has it: the current directory not on it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    return tmp_path


def test_train_imports_a_reward_module_from_the_current_directory(cwd_not_on_path, tiny_base_dir):
    name = local_reward_module(cwd_not_on_path)
    recipe = write_recipe(
        cwd_not_on_path,
        tiny_base_dir,
        reward_funcs=[f"{name}:short"],
        max_steps=1,
        save_steps=0,
        eval_on_start=False,
        eval_on_end=False,
    )
    assert main(["train", str(recipe)]) == 0
    module = sys.modules[name]
    assert Path(module.__file__).parent == cwd_not_on_path and module.CALLS
    assert json.loads((cwd_not_on_path / "run" / "summary.json").read_text())["steps"] == 1


def test_trl_imports_a_reward_module_from_the_current_directory(cwd_not_on_path, tiny_base_dir):
    import yaml

    name = local_reward_module(cwd_not_on_path)
    data = cwd_not_on_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in PROMPTS[:8])
    )
    recipe = cwd_not_on_path / "grpo.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(tiny_base_dir),
                "dataset_name": str(data),
                "reward_funcs": [f"{name}.short"],
                "use_peft": True,
                "lora_r": 4,
                "lora_alpha": 8,
                "lora_target_modules": ["q_proj", "v_proj"],
                "output_dir": str(cwd_not_on_path / "trl-run"),
                "per_device_train_batch_size": 4,
                "num_generations": 4,
                "max_completion_length": 4,
                "max_steps": 1,
                "save_strategy": "no",
                "use_cpu": True,
                "dtype": "float32",
            }
        )
    )
    assert main(["trl", "--config", str(recipe)]) == 0
    module = sys.modules[name]
    assert Path(module.__file__).parent == cwd_not_on_path and module.CALLS


# ------------------------------------------------------------- the site


def test_the_docs_site_builds_strictly(tmp_path):
    for package in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(package)
    site = tmp_path / "site"
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(ROOT.glob("docs/reference/config.md")), "generated pages are not written into the tree"
    config_page = (site / "reference" / "config" / "index.html").read_text()
    assert "ref_sync_alpha" in config_page and "This page describes lora_grpo" in config_page
    assert "lora-grpo train" in (site / "reference" / "cli" / "index.html").read_text()
    # The package layout is generated too, every module on it.
    assert not list(ROOT.glob("docs/reference/layout.md")), "generated pages are not written into the tree"
    assert "<code>algo/loss.py</code>" in (site / "reference" / "layout" / "index.html").read_text()


# ------------------------------------------------------------- the package layout page


def test_the_layout_page_names_every_module_with_its_docstrings_first_paragraph():
    hooks = load_hooks()
    page = hooks.layout_page()
    package = ROOT / "lora_grpo"
    modules = sorted(package.rglob("*.py"))
    assert len(modules) > 40
    for path in modules:
        rel = path.relative_to(package).as_posix()
        first = flat(ast.get_docstring(ast.parse(path.read_text())).split("\n\n")[0])
        row = next((line for line in page.splitlines() if line.startswith(f"| `{rel}` | ")), None)
        assert row is not None, f"{rel} is not on the layout page"
        # the job as the docstring words it, on one line (Sphinx roles and table escapes aside)
        job = row[len(f"| `{rel}` | ") : -len(" |")].replace("\\|", "|")
        assert job == re.sub(r":\w+:`~?", "`", first), rel
    # in the design's order: the config before the trainer before its stages; the math first among the folders
    assert page.index("| `config.py` |") < page.index("| `trainer.py` |") < page.index("| `update.py` |")
    assert page.index("## `algo/`") < page.index("## `model/`") < page.index("## `trl/`")


def test_the_layout_page_takes_a_new_module_and_refuses_one_without_a_docstring(tmp_path):
    hooks = load_hooks()
    package = tmp_path / "pkg"
    for rel, text in {
        "__init__.py": '"""The package."""\n',
        "config.py": '"""The config.\n\nMore about it."""\n',
        "algo/__init__.py": '"""The math."""\n',
        "newfolder/__init__.py": '"""A folder the design does not name yet."""\n',
        "newfolder/piece.py": '"""A piece | with a pipe, and `a | b` in code."""\n',
    }.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    page = hooks.layout_page(package)
    assert "| `config.py` | The config. |" in page and "More about it" not in page
    assert "| `newfolder/piece.py` | A piece \\| with a pipe, and `a | b` in code. |" in page
    assert page.index("## `algo/`") < page.index("## `newfolder/`")
    (package / "algo" / "loss.py").write_text("import torch\n")
    with pytest.raises(
        ValueError, match=r"algo/loss\.py has no docstring: open it with one whose first paragraph"
    ):
        hooks.layout_page(package)
