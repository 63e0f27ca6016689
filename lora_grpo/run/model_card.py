"""A trained adapter's model card (README.md): what it is, how to load it, how it was trained.

In the Hub's format: YAML metadata (huggingface_hub's ModelCardData) above Markdown. The TRL front door's
create_model_card writes it where TRL's does (output_dir/README.md). A card carries MARKER, so that a later card
replaces only a card of ours, never a README the user wrote.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any

from ..model.adapters import TAGS

MARKER = "<!-- model card written by lora_grpo -->"
# Shao et al. 2024, the paper that introduced GRPO (arXiv:2402.03300), as its authors list it.
GRPO_CITATION = """@article{shao2024deepseekmath,
    title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
    author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and
               Y. K. Li and Y. Wu and Daya Guo},
    year    = 2024,
    eprint  = {arXiv:2402.03300},
}"""
VERSIONS = ("lora_grpo", "transformers", "peft", "torch", "datasets", "bitsandbytes")


# The "Use it" calls that name the adapter's location (the base's own from_pretrained names the base).
_LOADS = re.compile(
    r"((?:AutoPeftModelForCausalLM|AutoTokenizer)\.from_pretrained\(|PeftModel\.from_pretrained\(base, )"
    r'"(?:[^"\\]|\\.)*"'  # a string literal, its escapes included
)


def relocated(card: str, repo_id: str) -> str:
    """A card of ours (`card`'s text) for the same adapter pushed to the hub repository `repo_id`: titled with the
    repository's name, its "Use it" code loading the adapter and tokenizer from there. A card not ours is kept."""
    head, marker, body = card.partition(MARKER)
    if not marker:
        return card
    body = re.sub(r"^# .*$", f"# {repo_id.split('/')[-1]}", body, count=1, flags=re.MULTILINE)
    return head + marker + _LOADS.sub(lambda m: m.group(1) + json.dumps(repo_id), body)


def is_ours(path: Path) -> bool:
    """Whether the README.md at `path` is a card this module wrote (or there is none)."""
    return not path.exists() or MARKER in path.read_text(errors="replace")


def model_card(
    config,
    *,
    steps: int,
    reward_names: list[str],
    syncs: int,
    where: str,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: list[str] = (),
    adapter=None,
) -> str:
    """The card's text for the adapter in `where` (a directory or a Hub id), trained under the native `config`
    for `steps` optimizer steps with `syncs` reference syncs. `adapter`: its peft LoraConfig (an init_adapter's
    rank and alpha are its own, not the config's); None: the config's lora_r and lora_alpha."""
    from huggingface_hub import ModelCardData

    base = str(config.model_name_or_path)
    hub_id, base_shown = _base(base)
    metadata = ModelCardData(
        base_model=hub_id,
        library_name="peft",
        pipeline_tag="text-generation",
        datasets=[dataset_name] if dataset_name else None,
        tags=list(
            dict.fromkeys([*TAGS, "lora", *(["qlora"] if config.quantization == "4bit" else []), *tags])
        ),
    )
    dataset_shown = (
        f" on [{dataset_name}](https://huggingface.co/datasets/{dataset_name})" if dataset_name else ""
    )
    weights = config.reward_weights or [1.0] * len(reward_names)
    quantized = {
        "4bit": f", 4-bit {getattr(config, 'bnb_4bit_quant_type', 'nf4').upper()} (QLoRA)",
        "8bit": ", 8-bit",
    }
    r, alpha, rslora = (
        (config.lora_r, config.lora_alpha, config.use_rslora)
        if adapter is None
        else (adapter.r, adapter.lora_alpha, bool(adapter.use_rslora))
    )
    revision = getattr(config, "revision", None)
    rows = {
        "base": base_shown
        + (f" at revision `{revision}`" if revision else "")
        + quantized.get(config.quantization, ""),
        "adapter": f"LoRA r {r}, alpha {alpha:g}" + (" (rsLoRA: scaled by alpha / √r)" if rslora else ""),
        "reward functions": ", ".join(f"{name} (weight {w:g})" for name, w in zip(reward_names, weights)),
        "completions per prompt": config.num_generations,
        "optimizer steps": steps,
        "learning rate": f"{config.learning_rate:g}",
        "KL weight (beta)": f"{config.beta:g}",
        "loss type": config.loss_type,
        "reference": _reference(config, syncs),
    }
    table = "\n".join(f"| {name} | {value} |" for name, value in rows.items())
    installed = {name: package_version(name) for name in VERSIONS}
    versions = "\n".join(f"- {name}: {version}" for name, version in installed.items() if version)
    return f"""---
{metadata.to_yaml()}
---
{MARKER}

# {model_name or Path(where).name}

A LoRA adapter of {base_shown} trained with GRPO (Shao et al., 2024){dataset_shown} by lora_grpo.

## Use it

```python
{_loading(hub_id, where, getattr(config, "gguf_file", None), revision)}
```

## Training

| | |
|---|---|
{table}

## Framework versions

{versions}

## Citation

GRPO:

```bibtex
{GRPO_CITATION}
```
"""


def _loading(
    hub_id: str | None, where: str, gguf_file: str | None = None, revision: str | None = None
) -> str:
    """The Python that loads the adapter on its base: the hub's base by its id (a GGUF repository's with its
    file; at the revision it was trained on), or else the base its adapter_config.json names (a path on the
    machine that trained it)."""
    # each a Python string literal (a path may hold quotes or backslashes): JSON's escapes are Python's
    where, hub_id, gguf_file, revision = (
        json.dumps(v) if v is not None else None for v in (where, hub_id, gguf_file, revision)
    )
    if hub_id is None:
        return (
            "from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
            f"model = AutoPeftModelForCausalLM.from_pretrained({where})  # its base: adapter_config.json's path\n"
            f"tokenizer = AutoTokenizer.from_pretrained({where})"
        )
    return (
        "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f"base = AutoModelForCausalLM.from_pretrained({hub_id}"
        + (f", gguf_file={gguf_file}" if gguf_file else "")
        + (f", revision={revision}" if revision else "")
        + ")\n"
        f"model = PeftModel.from_pretrained(base, {where})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({where})"
    )


def _base(name: str) -> tuple[str | None, str]:
    """(the base's hub id or None, the base in the card's words): a hub id links to its page; an offline task's base
    and a local directory or GGUF file have none; a packaged GGUF names the hub model it was made from."""
    from ..model.bases import LOCAL_BASES, PACKAGED

    if name in LOCAL_BASES:
        return None, f"`{name}` (an offline task's base, built locally)"
    if (packaged := PACKAGED.get(name.lower())) is not None:
        return packaged.original, (
            f"`{name}`, the {packaged.file} of [{packaged.original}](https://huggingface.co/{packaged.original}) "
            f"({packaged.distribution} {packaged.version})"
        )
    if Path(name).expanduser().exists():
        return None, f"`{name}`"
    return name, f"[{name}](https://huggingface.co/{name})"


def _reference(config, syncs: int) -> str:
    """The KL penalty's reference in words: fixed, or when and how it was re-synced to the policy."""
    if not config.beta:
        return "none (beta 0)"
    when = [
        *([f"every {config.ref_sync_steps} steps"] if config.ref_sync_steps else []),
        *(["every epoch"] if config.ref_sync_every_epoch else []),
        *([f"when the KL passed {config.ref_sync_kl:g}"] if config.ref_sync_kl is not None else []),
        *(["on an eval plateau"] if config.ref_sync_on_plateau else []),
    ]
    if not when:
        return "fixed (the adapter it started from)"
    how = "hard copy" if config.ref_sync_alpha == 1 else f"mix alpha {config.ref_sync_alpha:g}"
    return f"iterative: re-synced to the policy {' or '.join(when)} ({how}), {syncs} times"


def package_version(name: str) -> str | None:
    """The installed version of the package `name`; None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def sync_count(log_history: list[dict[str, Any]], upto: int | None = None) -> int:
    """The reference syncs a run's records hold (one record a step: of the first `upto` steps, when given)."""
    return sum(1 for record in log_history[:upto] if record.get("sync/event"))
