"""What a GGUF file holds, checked before it is converted into a base (gguf.py).

transformers reads whatever a GGUF file holds and fills the rest of the model with random weights: a
file with a vocabulary and no tensors loads as a randomly initialised model, a file cut short fails deep
in numpy ("cannot reshape array of size 7284 into shape (128,64)"), and a LoRA adapter in GGUF fails in
the tokenizer. ``check_gguf`` reads the file's header with the gguf package's reader (``GGUFReader``)
and refuses, naming the file, what is wrong and the fix:

- a file that is not GGUF (its first four bytes are not ``GGUF``);
- a file cut short: the header, or a tensor its header lists, ends past the file's last byte (walked
  here with bounds checks, since the reader itself fails on such a file with a numpy error);
- a file that is not a model: ``general.type`` ``adapter`` (a LoRA adapter, ``adapter.type``), or another
  kind (an importance matrix);
- a model without the tensors a model needs: none at all, no ``token_embd.weight``, or a block of
  ``{arch}.block_count`` with no tensor; or without a vocabulary (``tokenizer.ggml.tokens``).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from .loading import LoadError

# What the gguf package needs to be for transformers to read GGUF files (its GGUF_MIN_VERSION).
GGUF_REQUIREMENT = "gguf>=0.10"
INSTALL = "pip install 'lora_grpo[gguf]'"
# Bytes of each scalar GGUF value type, by the type's name (gguf.GGUFValueType).
_SCALAR_BYTES = {
    "UINT8": 1,
    "INT8": 1,
    "BOOL": 1,
    "UINT16": 2,
    "INT16": 2,
    "UINT32": 4,
    "INT32": 4,
    "FLOAT32": 4,
    "UINT64": 8,
    "INT64": 8,
    "FLOAT64": 8,
}


class GGUFFileError(LoadError):
    """A GGUF file that cannot be a base: the message names the file, what is wrong and the fix."""


@dataclass(frozen=True)
class GGUFContents:
    """What a checked GGUF file holds."""

    architecture: str
    tensors: int
    vocabulary: int


def gguf_package():
    """The gguf package, which transformers reads GGUF files with; a LoadError with the install command
    when it is missing or too old."""
    from transformers.utils import is_gguf_available

    try:
        import gguf
    except ImportError as error:
        raise LoadError(
            f"reading a GGUF file needs the gguf package ({GGUF_REQUIREMENT}), which is not installed "
            f"({error}): transformers reads GGUF files through it. Install it: {INSTALL}"
        ) from None
    if not is_gguf_available():
        raise LoadError(
            f"reading a GGUF file needs {GGUF_REQUIREMENT}, and the installed gguf package is older: "
            f"{INSTALL} --upgrade"
        )
    return gguf


def check_gguf(path) -> GGUFContents:
    """Check that the GGUF file ``path`` holds a whole model (see the module docstring); a
    GGUFFileError naming what is wrong otherwise."""
    gguf = gguf_package()
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFFileError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF' ({size} bytes): give the "
            "path of a .gguf model file"
        )
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - the reader fails on a damaged file with any numpy error
        cut = _cut_short(path, size, gguf)
        first = (str(error).splitlines() or [""])[0]
        if cut is not None:
            raise GGUFFileError(
                f"GGUF file {path} is cut short: it holds {size:,} bytes, and {cut}. Download or copy it "
                "again (a partial download or a full disk leaves such a file)"
            ) from error
        raise GGUFFileError(
            f"GGUF file {path} is damaged: the gguf package cannot read it ({type(error).__name__}: {first}): "
            "download or copy it again"
        ) from error
    fields = reader.fields

    def value(key: str):
        field = fields.get(key)
        return field.contents() if field is not None else None

    kind, adapter = value("general.type"), value("adapter.type")
    architecture = value("general.architecture")
    if kind == "adapter" or adapter is not None:
        raise GGUFFileError(
            f"GGUF file {path} holds a {adapter or 'an'} adapter (general.type {kind!r}, adapter.type "
            f"{adapter!r}, for {architecture or 'an unnamed'} models), not a model: give the GGUF of the base "
            "model as model_name_or_path; to start from the adapter, give its peft directory "
            "(adapter_config.json + adapter_model.safetensors) as init_adapter"
        )
    if kind not in (None, "model"):
        raise GGUFFileError(
            f"GGUF file {path} holds a {kind!r} (general.type), not a model: give the path of a model's "
            ".gguf file"
        )
    if not architecture:
        raise GGUFFileError(
            f"GGUF file {path} names no architecture (general.architecture), so it is no model transformers "
            "can build: give the path of a model's .gguf file"
        )
    names = {tensor.name for tensor in reader.tensors}
    tokens = fields.get("tokenizer.ggml.tokens")
    vocabulary = len(tokens.data) if tokens is not None else 0
    if not names:
        raise GGUFFileError(
            f"GGUF file {path} holds no tensors (a {architecture} header"
            + (f" and a vocabulary of {vocabulary} tokens" if vocabulary else "")
            + "): there are no weights to train, and loading it would start from random ones. Give a GGUF "
            "that holds the model's weights"
        )
    blocks = value(f"{architecture}.block_count") or 0
    missing = [] if "token_embd.weight" in names else ["token_embd.weight"]
    missing += [
        f"blk.{i}.*" for i in range(int(blocks)) if not any(name.startswith(f"blk.{i}.") for name in names)
    ]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise GGUFFileError(
            f"GGUF file {path} lacks tensors a {architecture} model needs: {shown} (it holds {len(names)} "
            f"tensors, {blocks} blocks by {architecture}.block_count): loading it would fill them with random "
            "weights. Give a GGUF that holds the whole model"
        )
    if not vocabulary:
        raise GGUFFileError(
            f"GGUF file {path} has no vocabulary (tokenizer.ggml.tokens), which the conversion builds the "
            "tokenizer from: give a GGUF that holds its tokenizer (llama.cpp's convert_hf_to_gguf.py writes one)"
        )
    return GGUFContents(architecture=architecture, tensors=len(names), vocabulary=vocabulary)


class _Short(Exception):
    """A read past the end of the file: what was being read and the byte it needs."""


def _cut_short(path: Path, size: int, gguf) -> str | None:
    """Where the file ``path`` (``size`` bytes) is cut short, walking its header with bounds checks
    ("tensor 'blk.1.ffn_up.weight' needs bytes up to 90,240"); None when the header and every tensor it
    lists fit in the file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _walk(data, size, gguf)


def _walk(data, size: int, gguf) -> str | None:
    value_type = gguf.GGUFValueType
    position = 0
    order = "<"

    def take(n: int, what: str) -> bytes:
        nonlocal position
        if position + n > size:
            raise _Short(f"its {what} needs bytes up to {position + n:,}")
        position += n
        return data[position - n : position]

    def number(fmt: str, what: str) -> int:
        return struct.unpack(order + fmt, take(struct.calcsize(fmt), what))[0]

    def string(what: str) -> str:
        return take(number("Q", what), what).decode("utf-8", "replace")

    def skip_value(kind: int, what: str) -> int | str | None:
        kind = value_type(kind)
        if kind == value_type.STRING:
            return string(what)
        if kind == value_type.ARRAY:
            item, count = number("I", what), number("Q", what)
            if value_type(item).name in _SCALAR_BYTES:
                take(count * _SCALAR_BYTES[value_type(item).name], what)
            else:
                for _ in range(count):
                    skip_value(item, what)
            return None
        raw = take(_SCALAR_BYTES[kind.name], what)
        return struct.unpack(order + {1: "B", 2: "H", 4: "I", 8: "Q"}[len(raw)], raw)[0]

    try:
        take(4, "header")
        version = struct.unpack("<I", take(4, "header"))[0]
        # A file written on a machine of the other byte order reads as 0 in the low half.
        order = ">" if version & 0xFFFF == 0 else "<"
        tensors, keys = number("Q", "header"), number("Q", "header")
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for _ in range(keys):
            key = string("metadata")
            found = skip_value(number("I", f"metadata ({key})"), f"metadata ({key})")
            if key == "general.alignment" and isinstance(found, int) and found > 0:
                alignment = found
        infos = []
        for _ in range(tensors):
            name = string("tensor list")
            dims = [number("Q", f"tensor list ({name})") for _ in range(number("I", f"tensor list ({name})"))]
            kind, offset = number("I", f"tensor list ({name})"), number("Q", f"tensor list ({name})")
            infos.append((name, dims, kind, offset))
        start = -(-position // alignment) * alignment
        for name, dims, kind, offset in infos:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            elements = 1
            for d in dims:
                elements *= d
            end = start + offset + elements * block_bytes // block
            if end > size:
                return f"tensor {name!r} (of {tensors}) needs bytes up to {end:,}"
    except _Short as short:
        return str(short)
    except (ValueError, KeyError):
        # An unknown value or tensor type: the file is damaged, not (only) short.
        return None
    return None
