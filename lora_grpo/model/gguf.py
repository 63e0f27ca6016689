"""A GGUF file as a base: converted once into a cached safetensors model and tokenizer.

transformers reads a GGUF (``from_pretrained(dir, gguf_file=name)``: it dequantises every tensor and
builds the tokenizer from the file's vocabulary), but a model loaded that way refuses
``save_pretrained`` ("The model is quantized with gguf and is not serializable"), and reading the
file again costs seconds to minutes at every start (30–90 s of tokenizer building for SmolLM2-135M
on a CPU). So the file is converted once: the dequantised weights go into a plain model of the same
config, which is saved with the tokenizer, checked (its greedy outputs on a few prompts must equal the
GGUF-loaded model's), and published whole into the cache of built bases (base_cache) under a name
holding the file's SHA-256, so another file, or the same path with other bytes, is a new entry.
From then on it is an ordinary local model: quantization (4-bit, 8-bit), LoRA and the reference slot
apply as to any other.

Before any of that the file is checked (gguf_check: a whole file, a model and not an adapter, the
tensors a model needs), and after transformers loads it every weight must have come from the file:
nothing built from a damaged or incomplete file is ever cached.

The weights are the GGUF's dequantised ones (float32): a Q4_1 file gives a model that is exactly as
good as that Q4_1 file, not the original checkpoint it was quantised from.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ..base_cache import default_cache_dir, ensure_entry
from .gguf_check import GGUFFileError, check_gguf
from .loading import loading

# 2: the file is checked before conversion (entries of version 1 may hold random weights).
FORMAT_VERSION = 2
RECORD = "gguf_source.json"
# The conversion's check: greedy continuations of these (after the chat template, where there is one).
CHECK_PROMPTS = ("What is 2 + 3?", "The capital of France is", "Hello")
CHECK_NEW_TOKENS = 8


def is_gguf(path) -> bool:
    return str(path).lower().endswith(".gguf")


def file_sha256(path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def gguf_entry_name(path, digest: str) -> str:
    """The cache entry's name: the file's stem (made path-safe) and the start of its SHA-256."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).stem).strip("-.") or "model"
    return f"gguf-{stem}-v{FORMAT_VERSION}-{digest[:16]}"


def converted_gguf(path, cache_dir=None) -> str:
    """The local directory of the GGUF file ``path`` converted to safetensors (model + tokenizer),
    converting it on first use (see the module docstring). Says in one line which file it is and that
    the weights are its dequantised ones."""
    path = Path(path).expanduser().resolve()
    if path.is_dir():
        refuse_directory(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    digest = file_sha256(path)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / gguf_entry_name(path, digest)
    out = ensure_entry(
        final,
        lambda out_dir: convert_gguf(path, out_dir, digest),
        record=RECORD,
        version=FORMAT_VERSION,
        label="gguf",
        how_long="dequantising and checking it; seconds for a small model, minutes for billions of parameters",
    )
    print(
        f"[gguf] base {path.name} (sha256 {digest[:12]}): the weights are the GGUF's dequantised ones, "
        f"as float32 safetensors in {out}",
        flush=True,
    )
    return out


def convert_gguf(path: Path, out_dir: Path, digest: str) -> dict:
    """Write the GGUF file ``path`` into ``out_dir`` as a plain safetensors model and tokenizer, check
    the written model against the GGUF-loaded one, and write the record. Returns the record."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    contents = check_gguf(path)
    where, name = str(path.parent), path.name
    with loading("policy", "GGUF tokenizer", path):
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    with loading("policy", "GGUF model", path):
        loaded, info = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, output_loading_info=True
        )
    if missing := sorted(info["missing_keys"]):
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise GGUFFileError(
            f"GGUF file {path} lacks weights its {contents.architecture} model needs ({shown}): transformers "
            "would fill them with random values. Give a GGUF that holds the whole model"
        )
    loaded.eval()
    # The same architecture without the GGUF marker, holding the dequantised tensors: this one saves.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del plain
    written = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    prompts = check_prompts(tokenizer)
    for prompt in prompts:
        expected, got = (_greedy(model, tokenizer, prompt) for model in (loaded, written))
        if expected != got:
            raise RuntimeError(
                f"converting {path} changed the model: on {prompt!r} the GGUF gives "
                f"{tokenizer.decode(expected)!r} and the converted model {tokenizer.decode(got)!r}"
            )
    record = {
        "format_version": FORMAT_VERSION,
        "source": str(path),
        "sha256": digest,
        "bytes": path.stat().st_size,
        "dtype": "float32",
        "architecture": type(loaded).__name__,
        "parameters": sum(p.numel() for p in written.parameters()),
        "tensors": contents.tensors,
        "check": {"prompts": len(prompts), "new_tokens": CHECK_NEW_TOKENS, "greedy_equal": True},
        "transformers": transformers.__version__,
    }
    (Path(out_dir) / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def check_prompts(tokenizer) -> list[list[int]]:
    """The check's prompts as token ids: through the chat template where the tokenizer has one."""
    out = []
    for text in CHECK_PROMPTS:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids))
    return out


def _greedy(model, tokenizer, ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=CHECK_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        )
    return out[0, len(ids) :].tolist()


def refuse_directory(path: Path) -> None:
    """Refuse the directory ``path`` given where a GGUF file or a model directory belongs (named
    ``*.gguf``, or holding ``.gguf`` files and no ``config.json``): a GGUFFileError naming the GGUF files
    in it and how to give one."""
    path = Path(path)
    found = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
    if is_gguf(path.name):
        what = f"{path} is a directory, not a GGUF file"
    else:
        what = f"{path} holds no model (no config.json)"
    if found:
        fix = (
            f"it holds the GGUF file{'s' if len(found) > 1 else ''} {', '.join(found)}: give the file's path "
            f"({path / found[0]}) as model_name_or_path, or this directory with gguf_file: {found[0]} "
            f"(--set gguf_file={found[0]})"
        )
    else:
        fix = "it holds no .gguf file: give the path of a .gguf file"
    raise GGUFFileError(f"{what}; {fix}")
