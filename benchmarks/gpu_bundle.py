"""The folder of wheels a lent GPU machine needs to run the GPU check (benchmarks/gpu_check/), built here.

The lent machine (one H200: Python 3.12, torch 2.11 + CUDA 13, transformers 5.17 preinstalled) has no
network and lacks bitsandbytes, datasets, dill and multiprocess; what travels with the working tree is
capped at 64 MiB (the carry limit). So this script `pip download`s, from PyPI, the py3.12 manylinux
wheels of the packages below (without their dependencies: the machine has torch, numpy, ...), and
trims bitsandbytes' wheel to its Python files and its CUDA 13 and CPU libraries (the wheel ships one
library per CUDA version, ~100 MB in all; the trimmed one is ~5 MB). It also copies the bases the
check loads into the folder (CALCULATOR_BASE: the calculator task's pre-trained base, 1.2 MB, from
this machine's cache, pre-trained here first if it is not there), so that the lent machine spends
no device time pre-training on its CPU. It fails when the folder would not fit under --limit-mib.

    python benchmarks/gpu_bundle.py [--out gpu_bundle] [--limit-mib 60]

Then, on the lent machine (carry the folder), the command this script prints (first_command): it
installs the wheels offline beside the image's own packages (--target /tmp/site, first on
PYTHONPATH with the checkout; the image's environment is left as it is) with the image's python3,
and runs the check, writing summary.json / summary.txt / log.txt to $OUT. A second command, only
when the check prints one (rerun_command; filled in, its last line), runs the sections the first
one stopped or skipped for want of time, on the same warm machine without reinstalling (it installs
first only when /tmp/site is gone: a machine started afresh). benchmarks/README.md has the
device-time plan.

The folder is gitignored (/gpu_bundle/): wheels are never committed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# name==version: what the lent machine lacks (and the transformers and TRL this project is tested with).
# peft and xxhash are not here: the image holds them already (peft 0.21.0 on the first GPU run; issue 36).
PACKAGES = [
    "bitsandbytes==0.50.2",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "transformers==5.24.0",
    "trl==1.16.0",
]
# Seconds: one command of a lent machine's visit (a 600 s command limit; the plan, ~521 s by the
# estimates: benchmarks/README.md), and a second for what the first stopped or skipped for want of time.
FIRST_BUDGET, RERUN_BUDGET = 540, 250
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    "--target /tmp/site gpu_bundle/*.whl"
)
ENVIRONMENT = "export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1"


def check_command(budget: float, only: str | None = None) -> str:
    """The line that runs the check on the lent machine (after ENVIRONMENT, which puts the checkout on
    PYTHONPATH)."""
    selected = f" --only {only}" if only else ""
    return f'python3 -m benchmarks.gpu_check{selected} --budget {budget:g} --out "$OUT"'


def first_command(budget: float = FIRST_BUDGET) -> str:
    """The first command on the lent machine: install the bundle beside the image, then the check."""
    return f"{INSTALL} && {ENVIRONMENT} && {check_command(budget)}"


def rerun_command(only: str, budget: float = RERUN_BUDGET) -> str:
    """The second command: the sections `only` (e.g. "9,12") that the first one stopped or skipped
    for want of time. On the same warm machine the install in /tmp/site is still there and is not
    repeated; a machine started afresh (the last one went back after its idle wait) installs first."""
    return f"(test -d /tmp/site || {INSTALL}) && {ENVIRONMENT} && {check_command(budget, only)}"


PYTHON = "3.12"  # the lent machine's interpreter
PLATFORM = [
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
CALCULATOR_BASE = "calculator-base"  # the folder in the bundle: lora_grpo.tasks.calculator's base
KEEP_LIBRARY = re.compile(r"libbitsandbytes_(cpu|cuda13\d*)\.(so|dylib)$")  # CUDA 13 and CPU only
MiB = 2**20


def download(packages: list[str], out: Path, python_version: str = PYTHON) -> None:
    """pip download each package's wheel (no dependencies) for `python_version` on the lent machine's
    platform."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--dest",
        str(out),
        "--python-version",
        python_version,
        *PLATFORM,
        *packages,
    ]
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


def copy_bases(out: Path) -> dict[str, int]:
    """The bases gpu_check loads, copied into `out` from this machine's cache (pre-trained here
    first when missing, by the task's own cached-base function); returns {folder: bytes}."""
    from lora_grpo.tasks.calculator import ensure_calculator_base

    source = Path(ensure_calculator_base())
    target = out / CALCULATOR_BASE
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    return {f"{CALCULATOR_BASE}/": sum(f.stat().st_size for f in target.rglob("*") if f.is_file())}


def build(
    out: Path, limit_mib: float, packages: list[str] = PACKAGES, python_version: str = PYTHON
) -> dict[str, int]:
    """Download, trim, copy the bases, check the size; returns {wheel or folder: bytes}. Raises
    SystemExit over the limit. `python_version`: the interpreter the wheels are for (the lent
    machine's by default)."""
    out.mkdir(parents=True, exist_ok=True)
    download(packages, out, python_version)
    for wheel in out.glob("bitsandbytes-*.whl"):
        trim_bitsandbytes(wheel)
    sizes = {p.name: p.stat().st_size for p in sorted(out.glob("*.whl"))}
    sizes.update(copy_bases(out))
    total = sum(sizes.values())
    for name, size in sizes.items():
        print(f"{size / MiB:8.2f} MiB  {name}")
    print(f"{total / MiB:8.2f} MiB  in all (limit {limit_mib} MiB)")
    if total > limit_mib * MiB:
        raise SystemExit(
            f"the bundle is {total / MiB:.1f} MiB, over --limit-mib {limit_mib}: drop a package "
            "(peft is the largest that may already be on the machine)"
        )
    print(f"\non the lent machine, carrying {out.name}/:\n  {first_command()}")
    print(
        "then, at once, the command the check prints as its last line (summary.txt's rerun: line), "
        f"the sections it stopped or skipped for want of time in place of N,M:\n  {rerun_command('N,M')}"
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
    parser.add_argument(
        "--python-version",
        default=PYTHON,
        help="the interpreter the wheels are for (the lent machine's; tests/test_gpu_bundle.py asks for its own)",
    )
    args = parser.parse_args()
    build(Path(args.out), args.limit_mib, python_version=args.python_version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
