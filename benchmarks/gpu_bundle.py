"""The folder of wheels a lent GPU machine needs to run benchmarks/gpu_check.py, built here.

The lent machine (one H200: Python 3.12, torch 2.11 + CUDA 13, transformers 5.17 preinstalled) has no
network and lacks bitsandbytes, datasets, dill and multiprocess; what travels with the working tree is
capped at 64 MiB (the carry limit). So this script `pip download`s, from PyPI, the py3.12 manylinux
wheels of the packages below (without their dependencies: the machine has torch, numpy, ...), and
trims bitsandbytes' wheel to its Python files and its CUDA 13 and CPU libraries (the wheel ships one
library per CUDA version, ~100 MB in all; the trimmed one is ~5 MB). It fails when the folder would
not fit under --limit-mib.

    python benchmarks/gpu_bundle.py [--out gpu_bundle] [--limit-mib 60]

Then, on the lent machine, one command (carry the folder; it installs offline and runs the check
within its 450 s budget, writing summary.json / summary.txt to $OUT):

    pip install --no-index --no-deps gpu_bundle/*.whl && pip install --no-deps --no-build-isolation -e . \
      && python benchmarks/gpu_check.py --budget 450 --out "$OUT"

The folder is gitignored (/gpu_bundle/): wheels are never committed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# name==version: what the lent machine lacks (and the transformers, peft and TRL this project is tested with).
PACKAGES = [
    "bitsandbytes==0.50.2",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "xxhash==4.1.0",
    "peft==0.21.2",
    "transformers==5.24.0",
    "trl==1.16.0",
]
PLATFORM = [
    "--python-version",
    "3.12",
    "--only-binary=:all:",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_24_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
    "--implementation",
    "cp",
]
KEEP_LIBRARY = re.compile(r"libbitsandbytes_(cpu|cuda13\d*)\.(so|dylib)$")  # CUDA 13 and CPU only
MiB = 2**20


def download(packages: list[str], out: Path) -> None:
    """pip download each package's wheel (no dependencies) for the lent machine's Python and platform."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(out), *PLATFORM, *packages]
    subprocess.run(cmd, check=True)


def trim_bitsandbytes(wheel: Path) -> Path:
    """Rewrite bitsandbytes' wheel without the native libraries of other CUDA versions; the RECORD
    lists only what is kept (pip checks the files it lists)."""
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = set()
        for item in src.infolist():
            name = item.filename
            native = name.endswith((".so", ".dylib", ".dll"))
            if native and not KEEP_LIBRARY.search(name):
                dropped.add(name)
                continue
            if name.endswith(".dist-info/RECORD"):
                continue  # written below, without the dropped files
            dst.writestr(item, src.read(name))
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = [line for line in src.read(record).decode().splitlines() if line.split(",")[0] not in dropped]
        dst.writestr(record, "\n".join(lines) + "\n")
    trimmed.replace(wheel)
    return wheel


def build(out: Path, limit_mib: float, packages: list[str] = PACKAGES) -> dict[str, int]:
    """Download, trim, check the size; returns {wheel: bytes}. Raises SystemExit over the limit."""
    out.mkdir(parents=True, exist_ok=True)
    download(packages, out)
    for wheel in out.glob("bitsandbytes-*.whl"):
        trim_bitsandbytes(wheel)
    sizes = {p.name: p.stat().st_size for p in sorted(out.glob("*.whl"))}
    total = sum(sizes.values())
    for name, size in sizes.items():
        print(f"{size / MiB:8.2f} MiB  {name}")
    print(f"{total / MiB:8.2f} MiB  in all (limit {limit_mib} MiB)")
    if total > limit_mib * MiB:
        raise SystemExit(
            f"the bundle is {total / MiB:.1f} MiB, over --limit-mib {limit_mib}: drop a package "
            "(peft is the largest that may already be on the machine)"
        )
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="gpu_bundle", help="the folder of wheels (gitignored)")
    parser.add_argument(
        "--limit-mib",
        type=float,
        default=60.0,
        help="the most the wheels may take (the carry limit is 64 MiB with the working tree)",
    )
    args = parser.parse_args()
    build(Path(args.out), args.limit_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
