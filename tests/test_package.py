"""The package works outside its clone: the built wheel ships the recipes, and a plain (non-editable)
install of it lists them and trains the default recipe from a directory that is not the clone.

The wheel is built from a copy of what setuptools reads (pyproject.toml, README.md, lora_grpo/), so
the shared source tree gets no build/ or *.egg-info, then installed without dependencies into its own
directory T; the subprocesses run with PYTHONPATH=T (the dependencies come from this environment),
and the tests check that `import lora_grpo` resolves to T, not to an editable install.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_RECIPES = sorted(p.name for p in (ROOT / "lora_grpo" / "recipes").glob("*.yaml"))


def _pip(*args, cwd):
    result = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def _setuptools_here() -> bool:
    """Build without isolation (offline, fast) when this environment's setuptools reads our
    pyproject (an SPDX `license` string needs setuptools >= 77); otherwise let pip fetch one."""
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) >= 77
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "lora_grpo", src / "lora_grpo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    isolation = ["--no-build-isolation"] if _setuptools_here() else []
    _pip("wheel", "--no-deps", *isolation, "-q", "-w", str(base / "dist"), str(src), cwd=base)
    (built,) = (base / "dist").glob("lora_grpo-*.whl")
    return built


# An editable install of the clone (setuptools' finder on sys.meta_path) would still serve any
# lora_grpo submodule missing from the wheel; this sitecustomize, run after the .pth files, removes it.
NO_EDITABLE_FINDERS = """
import sys
_editable = lambda f: str(getattr(f, "__module__", "")).startswith("__editable__")
sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
"""


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("target")
    _pip("install", "--no-deps", "-q", "--target", str(target), str(wheel), cwd=target)
    (target.parent / "no_editable").mkdir()
    (target.parent / "no_editable" / "sitecustomize.py").write_text(NO_EDITABLE_FINDERS)
    return target


def _run(installed: Path, cwd: Path, *args: str, env: dict | None = None, timeout: int = 900) -> str:
    """`python *args` in `cwd` (outside the clone) with only the installed copy of lora_grpo importable."""
    # One thread: on a shared 2-core machine two OpenMP threads per process oversubscribe the cores
    # and the toy pretraining runs several times slower (measured 2.6x), not faster.
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pythonpath = os.pathsep.join([str(installed), str(installed.parent / "no_editable")])
    environ.update(
        PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", **(env or {})
    )
    result = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture
def outside(tmp_path) -> Path:
    assert ROOT not in tmp_path.parents
    return tmp_path


def test_the_wheel_ships_every_recipe(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert SOURCE_RECIPES and {f"lora_grpo/recipes/{name}" for name in SOURCE_RECIPES} <= set(names)
    for module in (
        "lora_grpo/cli.py",
        "lora_grpo/tasks/countdown.py",
        "lora_grpo/rewards/scoring.py",
        "lora_grpo/rollout/generate.py",
    ):
        assert module in names, module  # the subpackages ship too


def test_the_installed_package_lists_its_recipes_outside_the_clone(installed, outside):
    probe = "import sys, lora_grpo.cli, lora_grpo.tasks.countdown; print(sys.meta_path); print(lora_grpo.__file__)"
    meta_path, where = _run(installed, outside, "-c", probe).strip().splitlines()[-2:]
    assert Path(where).parent == installed / "lora_grpo", (
        f"lora_grpo imported from {where}, not from the wheel"
    )
    assert "__editable__" not in meta_path
    listed = _run(installed, outside, "-m", "lora_grpo.cli", "recipes").splitlines()
    assert sorted(f"{line.split()[0]}.yaml" for line in listed) == SOURCE_RECIPES


@pytest.mark.slow
def test_the_installed_package_trains_the_default_recipe_outside_the_clone(installed, outside, toy_base):
    """`lora-grpo train` with no recipe: the shipped toy recipe, two steps, the eval on 8 prompts. Its
    base comes from the cache the session's toy_base fixture built in (the installed package finds the
    source tree's entry: the cache key is the same); the build itself is test_toy's and toy_base's."""
    run = outside / "run"
    cache = Path(toy_base).parent
    toys = sorted(cache.glob("toy_base-*"))
    out = _run(
        installed,
        outside,
        "-m",
        "lora_grpo.cli",
        "train",
        "--set",
        "max_steps=2",
        "--set",
        f"output_dir={run}",
        "--set",
        "eval_limit=8",
        env={"LORA_GRPO_CACHE": str(cache)},
    )
    assert "(recipe toy-addition)" in out and "[toy pretrain] building" not in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["accuracy_after"] is not None
    # The cached entry was used, no second one built (the cache may hold other bases too).
    assert Path(toy_base) in toys and sorted(cache.glob("toy_base-*")) == toys
    assert "dataset: toy" in (run / "config.yaml").read_text()
