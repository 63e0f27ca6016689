"""Every `from_pretrained` of a run, with an error that says what was loading and why it could not be.

transformers and peft report a missing model as what went wrong last: offline, a reward model id gives
"We couldn't connect to 'https://huggingface.co'" with neither the id nor its role; a local path that
does not exist gives "Repo id must be in the form 'repo_name' ...", which suggests a wrong fix.
`loading(role, what, path)` wraps one load: a failure inside it becomes a `LoadError` naming the role
(the policy model, reward function 2's model, ...), what was loading (model, tokenizer, adapter), the
path, whether it exists locally, and whether the hub could be reached (HF_HUB_OFFLINE, no network),
with the original error chained.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from .adapter_files import missing_adapter_files

# What a failed from_pretrained raises: transformers, peft and huggingface_hub (OSError, ValueError), and safetensors
# for a weights file that is damaged or cut short.
_LOAD_FAILURES = (OSError, ValueError, SafetensorError)
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
# What transformers' refusal of a model's own code says (its last line names the setting: "pass the argument
# `trust_remote_code=True`").
_REMOTE_CODE = "trust_remote_code=True"
_NO_NETWORK = (
    "couldn't connect",
    "could not connect",
    "connection error",
    "failed to resolve",
    "name resolution",
    "network is unreachable",
    "max retries exceeded",
    "timed out",
)


class LoadError(OSError):
    """A model, tokenizer or adapter of the run could not be loaded: the message names it, its role and why."""


def hub_offline() -> str | None:
    """The environment variable that turns the Hugging Face hub off, when one does."""
    return next(
        (
            name
            for name in _OFFLINE_VARIABLES
            if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        ),
        None,
    )


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def explain(role: str, what: str, path, error: BaseException) -> str:
    """The message for a failed load of `what` (model, tokenizer, adapter) in `role` from `path`."""
    local = Path(str(path)).expanduser()
    first = (str(error).strip().splitlines() or [""])[0]
    message = f"could not load the {role}'s {what} from {str(path)!r}: "
    if any(_REMOTE_CODE in str(e) for e in _chain(error)):
        return message + _remote_code(local)
    if local.exists():
        if any(type(e).__name__ == "HFValidationError" for e in _chain(error)):
            # peft (and huggingface_hub) take a local directory lacking the file they read for a hub id.
            held = sorted(p.name for p in local.iterdir())[:12] if local.is_dir() else []
            return message + (
                f"{local} exists locally, but the file the loader reads is not in it, so it took the path for a "
                f"hub id ({first}); the directory holds {held or 'nothing'}"
                + (f": no {', '.join(_expected(what, local))}" if _expected(what, local) else "")
            )
        message += f"{local} exists locally, but loading it failed ({type(error).__name__}: {first})"
        if local.is_dir() and not any(local.iterdir()):
            message += "; the directory is empty"
        if any(isinstance(e, SafetensorError) for e in _chain(error)):
            message += "; a .safetensors file there is damaged or cut short (a download or copy that did not finish): "
            message += "fetch it again"
        return message
    looks_local = (
        str(path).startswith((".", "/", "~"))
        or str(path).count("/") > 1
        or os.sep == "\\"
        and "\\" in str(path)
    )
    message += "there is no such local path" + (
        " (it looks like one: is the path right?)" if looks_local else ""
    )
    offline = hub_offline()
    text = " ".join(f"{type(e).__name__} {e}" for e in _chain(error)).lower()
    if offline:
        message += (
            f", and {offline} is set, so the Hugging Face hub is not reachable: download it first (without "
            f"{offline}) or give a local path"
        )
    elif any(marker in text for marker in _NO_NETWORK):
        message += (
            ", and the Hugging Face hub is not reachable (no network?): give a local path, or check "
            "the connection"
        )
    else:
        message += (
            f"; as a hub id it failed too ({type(error).__name__}: {first}): check the id (and access to it)"
        )
    return message


def _remote_code(local: Path) -> str:
    """Why a model with code of its own was refused, and the fix (transformers' own last line, which names the
    setting, is cut off by the one-line messages above)."""
    try:
        auto_map = json.loads((local / "config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        auto_map = {}
    modules = sorted({str(v) for v in (auto_map.values() if isinstance(auto_map, dict) else [])})
    named = f" (config.json's auto_map: {', '.join(modules)})" if modules else ""
    return (
        f"it ships Python code of its own{named}, which transformers runs to load it, and trust_remote_code is "
        "false, so it was refused and none of that code ran. Read the code; if you trust it, set "
        "trust_remote_code: true in the recipe (--set trust_remote_code=true); else use a model that "
        "transformers supports without code of its own"
    )


def _expected(what: str, local: Path) -> list[str]:
    """The files a local `what` (an adapter) needs that `local` lacks ([] where we do not know them)."""
    if "adapter" not in what or not local.is_dir():
        return []
    return missing_adapter_files(local)


@contextmanager
def loading(role: str, what: str, path):
    """Run one from_pretrained (or peft load) inside: its failure becomes a LoadError (see the module docstring)."""
    try:
        yield
    except _LOAD_FAILURES as error:
        if isinstance(error, LoadError):
            raise
        raise LoadError(explain(role, what, path, error)) from error
