"""A trained policy out of lora_grpo: merged into its base (`lora-grpo merge`), or as one GGUF file that
llama.cpp, ollama and LM Studio run (`lora-grpo export`, ``export_gguf``).

Both take what eval takes (an adapter dir, a checkpoint dir or a run dir: run/checkpoint.resolve_adapter,
which names the newest complete checkpoint when a run has no final adapter) and merge it alike
(``merge_policy``): by default into the weights it was trained against (a 4-bit base dequantised: what the
trained policy computes), with base "full" into the original weights; then say how far the merged model's
logits are from the policy's (base as trained + adapter) on a few prompts. The GGUF file itself is written
by model/gguf_export.py; here it is placed (run/owned_dir.write_file: beside the target, renamed into place,
never over the base, the adapter or an existing file without overwrite).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, GRPOConfig
from .model.adapter_files import check_adapter_fits, trained_base
from .model.loading import loading

BASES = ("trained", "full")
# What the merge is checked on: short texts any tokenizer can encode.
MERGE_CHECK_PROMPTS = ("12+7=", "Question: what is 3 + 4? Answer:", "The capital of France is")


def other_base_fix(adapter: Path, action: str) -> str:
    """How to eval or merge (`action`: "Evaluate it on", "Merge it into") an adapter with the base it was trained
    on, in the CLI's words."""
    saved_for = trained_base(adapter)
    if saved_for is None:
        return f"{action} the base it was trained on: the recipe (or --set model_name_or_path=...) of its run"
    return f"{action} that base: --set model_name_or_path={saved_for} (or the recipe it was trained with)"


@dataclass(frozen=True)
class MergeSource:
    """What a merge reads, resolved before any weight is loaded (so a refused target costs nothing): the
    adapter and what it is ("the final adapter of the run runs/x"), the base's path and dtype, and the
    paths no output may be written over (owned_dir.protected_paths)."""

    adapter: Path
    what: str
    path: str
    dtype: object
    protected: dict


@dataclass(frozen=True)
class MergedPolicy:
    """The merged model (a plain transformers model), its tokenizer, what it was merged into, and the largest
    logit difference between it and the policy as trained (base as trained + adapter)."""

    model: object
    tokenizer: object
    into: str
    gap: float


def merge_source(config: GRPOConfig, adapter: str | os.PathLike) -> MergeSource:
    from .model.load import resolve_dtype, resolve_model_path
    from .run.checkpoint import resolve_adapter
    from .run.owned_dir import protected_paths

    found, what = resolve_adapter(adapter)
    path = resolve_model_path(config)
    return MergeSource(
        adapter=found,
        what=what,
        path=path,
        dtype=resolve_dtype(config.torch_dtype),
        protected=protected_paths(config, path, found),
    )


def merge_policy(config: GRPOConfig, source: MergeSource, base: str = "trained") -> MergedPolicy:
    """The adapter of `source` merged into its base (`base`: "trained" or "full", see the module docstring),
    checked against the policy as trained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .model.load import load_base_model, load_tokenizer

    if base not in BASES:
        raise ConfigError(f"base {base!r} is not one of {', '.join(BASES)}")
    tokenizer = load_tokenizer(config, source.path, saved_with=source.adapter)  # the one the run trained with
    trained = load_base_model(config, source.path)
    check_adapter_fits(
        trained,
        source.adapter,
        label=source.what[0].upper() + source.what[1:],
        base_given=(config.model_name_or_path, source.path),
        fix=other_base_fix(source.adapter, "Merge it into"),
    )
    with loading("merge", "adapter", source.adapter):
        policy = PeftModel.from_pretrained(trained, str(source.adapter)).eval()
    if base == "trained" and config.quantization != "none":
        weights, into = (
            load_base_model(config, source.path).dequantize(),
            f"the dequantised {config.quantization} base it was trained on",
        )
        _as_published(weights.config, source.path, config)
    else:
        with loading("merge", "base model", source.path):
            weights = AutoModelForCausalLM.from_pretrained(
                source.path,
                dtype=source.dtype,
                trust_remote_code=config.trust_remote_code,
                revision=config.revision,
            )
        into = "the original weights" + (
            f" (it was trained on the {config.quantization} base)" if config.quantization != "none" else ""
        )
    with loading("merge", "adapter", source.adapter):
        adapted = PeftModel.from_pretrained(weights, str(source.adapter))
    _untie_a_trained_head(adapted)
    merged = adapted.merge_and_unload().eval()
    gap = largest_logit_difference(policy, merged, tokenizer, MERGE_CHECK_PROMPTS)
    return MergedPolicy(model=merged, tokenizer=tokenizer, into=into, gap=gap)


def _as_published(loaded_config, path: str, config: GRPOConfig) -> None:
    """The settings a base was loaded for training with (no cache in the training forward, dropout off) back
    to its own, so that the merged model's config.json is the base's, not the trainer's."""
    from transformers import AutoConfig

    from .model.load import DROPOUT_ATTRS

    published = AutoConfig.from_pretrained(
        path,
        trust_remote_code=config.trust_remote_code,
        revision=config.revision,
    )
    for name in ("use_cache", *DROPOUT_ATTRS):
        if hasattr(published, name):
            setattr(loaded_config, name, getattr(published, name))


def _untie_a_trained_head(adapted) -> None:
    """An adapter on the LM head of a base whose head is its input embeddings (tied: SmolLM2, Qwen2.5 up to
    3B, Llama 3.2, Gemma): the head gets a weight of its own before the merge, and the config says so, so that
    the merge changes the head alone, as the adapter did in training (merging into the one shared matrix would
    change the input embeddings too)."""
    import torch

    model = adapted.get_base_model()
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    base_head = getattr(head, "base_layer", None)  # a LoRA layer wraps the head
    if base_head is None or embeddings is None or base_head.weight is not embeddings.weight:
        return
    base_head.weight = torch.nn.Parameter(base_head.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False


def largest_logit_difference(a, b, tokenizer, prompts) -> float:
    """max |logits_a - logits_b| over every position of `prompts` (each run alone: no padding involved)."""
    import torch

    gap = 0.0
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            la = a(input_ids=ids.to(a.device)).logits.float().cpu()
            lb = b(input_ids=ids.to(b.device)).logits.float().cpu()
            gap = max(gap, (la - lb).abs().max().item())
    return gap


# ----------------------------------------------------------------------------- GGUF
def run_config_file(adapter: str | os.PathLike) -> Path | None:
    """The config.yaml a run wrote, for an adapter of it: in the dir given (a run dir, a checkpoint-N/) or in its
    parent (a run's adapter/, a checkpoint's policy/); None when there is none."""
    given = Path(adapter)
    for where in (given, given.parent):
        if (where / "config.yaml").is_file():
            return where / "config.yaml"
    return None


def run_config(adapter: str | os.PathLike, overrides: dict | None = None) -> GRPOConfig:
    """The config a run was trained with, for what export, eval and merge take without a recipe: the run's
    config.yaml (run_config_file), `overrides` on top; without one, the overrides alone."""
    found = run_config_file(adapter)
    if found is not None:
        return GRPOConfig.from_yaml(found, overrides)
    return GRPOConfig.from_dict(dict(overrides or {}), source="--set")


@dataclass(frozen=True)
class ExportedGGUF:
    """What export_gguf wrote, and the line it printed."""

    path: Path
    gguf_type: str
    bytes: int
    vocabulary: str
    merge_gap: float
    summary: str


def export_gguf(
    run: str | os.PathLike,
    gguf: str | os.PathLike,
    *,
    config: GRPOConfig | None = None,
    gguf_type: str = "f16",
    base: str = "trained",
    overwrite: bool = False,
) -> ExportedGGUF:
    """Write the policy of `run` (a run dir, a checkpoint dir or an adapter dir), merged into its base, as the
    GGUF file `gguf` (``*.gguf``) that llama.cpp loads as a chat model.

    Args:
        config: the run's config (its base, quantization); default: the run's own config.yaml.
        gguf_type: "f16" (matrices in float16) or "q8_0" (8-bit blocks, about half the size).
        base: "trained" (the weights the adapter was trained against; a 4-bit base dequantised) or "full"
            (the original weights), as `lora-grpo merge --base`.
        overwrite: replace an existing file at `gguf`.

    Example:
        >>> export_gguf("runs/smollm2", "smollm2-grpo.gguf", gguf_type="q8_0")  # doctest: +SKIP
    """
    from .model.gguf_export import GGUF_TYPES, check_exportable, write_gguf
    from .run.owned_dir import check_file_target, write_file

    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    config = config if config is not None else run_config(run)
    source = merge_source(config, run)
    target = dict(protected=source.protected, overwrite=overwrite, label="--gguf", flag="--overwrite")
    # Before any weight is loaded: a refused --gguf costs nothing.
    replaced = check_file_target(gguf, **target, suffix=".gguf")
    check_exportable(source.path, trust_remote_code=config.trust_remote_code)
    merged = merge_policy(config, source, base)
    try:
        with write_file(gguf, **target, suffix=".gguf") as tmp:
            written = write_gguf(
                merged.model,
                merged.tokenizer,
                tmp,
                gguf_type=gguf_type,
                provenance=provenance(config, source),
                pre=source_pre_tokenizer(source.path),
            )
    except OSError as error:  # a full disk says "4096 requested and 1824 written" (numpy's tofile)
        folder = Path(gguf).resolve().parent
        free = shutil.disk_usage(folder).free / 2**20 if folder.is_dir() else 0.0
        raise OSError(
            error.errno,
            f"could not write the GGUF file {gguf} ({error.strerror or error}); {free:,.0f} MiB are free in "
            f"{folder}. Nothing was left under that name (a file there before is as it was): free space, or "
            "name a file on another disk",
        ) from error
    size = Path(gguf).stat().st_size
    kept = (
        f"; {len(written.kept_f16)} matrices kept in float16 (rows not whole Q8_0 blocks)"
        if written.kept_f16
        else ""
    )
    summary = (
        f"exported {source.what} merged into {merged.into} of {config.model_name_or_path} → {gguf} "
        f"({gguf_type}, {size / 2**20:.1f} MiB, {written.tensors} tensors, {written.architecture}, "
        f"tokenizer {written.vocabulary}{kept}); the merged model's logits differ from the trained "
        f"policy's by at most {merged.gap:.3g} on {len(MERGE_CHECK_PROMPTS)} prompts"
        + (f" ({replaced})" if replaced else "")
    )
    return ExportedGGUF(
        path=Path(gguf),
        gguf_type=gguf_type,
        bytes=size,
        vocabulary=written.vocabulary,
        merge_gap=merged.gap,
        summary=summary,
    )


def provenance(config: GRPOConfig, source: MergeSource):
    """The file's general.* facts: the base by its name (a hub id, a packaged model's original, or a local
    file's or directory's own name: never its path on this machine) and that lora_grpo trained it."""
    from .model.bases import PACKAGED
    from .model.gguf_export import Provenance

    given = str(config.model_name_or_path)
    packaged = PACKAGED.get(given.lower())
    if packaged is not None:
        repo = packaged.original
    elif not Path(given).expanduser().exists() and given.count("/") == 1:
        repo = given
    else:
        repo = None
    name = repo.split("/")[-1] if repo else Path(config.gguf_file or given).name.removesuffix(".gguf")
    return Provenance(
        name=f"{name} GRPO",
        base_name=name,
        base_repo=repo,
        description=f"{name} with a LoRA adapter trained by GRPO with lora_grpo, merged in",
    )


def source_pre_tokenizer(path: str) -> str | None:
    """The ``tokenizer.ggml.pre`` of the GGUF file a base was converted from (gguf.RECORD names it), when
    it still exists: transformers' GGUF reader keeps no split it has no regex for (SmolLM2's "smollm":
    digits one by one), so the file's own name is the truer one. None for any other base."""
    from .model.gguf import RECORD
    from .model.gguf_check import gguf_package

    try:
        source = json.loads((Path(path) / RECORD).read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not Path(source).is_file():
        return None
    field = gguf_package().GGUFReader(source).fields.get("tokenizer.ggml.pre")
    return field.contents() if field is not None else None
