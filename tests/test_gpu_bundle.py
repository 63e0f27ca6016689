"""benchmarks/gpu_bundle.py (the wheels a lent GPU machine needs) and benchmarks/gpu_check.py's --cpu dry run."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_bundle  # noqa: E402


def test_trimming_keeps_the_python_files_and_the_cuda13_and_cpu_libraries(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.0-py3-none-manylinux_2_24_x86_64.whl"
    files = {
        "bitsandbytes/__init__.py": b"x = 1\n",
        "bitsandbytes/libbitsandbytes_cpu.so": b"c" * 10,
        "bitsandbytes/libbitsandbytes_cuda130.so": b"a" * 10,
        "bitsandbytes/libbitsandbytes_cuda128.so": b"b" * 1000,
        "bitsandbytes/libbitsandbytes_rocm72.so": b"r" * 1000,
    }
    record = (
        "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items())
        + "bitsandbytes-0.0.dist-info/RECORD,,\n"
    )
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("bitsandbytes-0.0.dist-info/RECORD", record)
    gpu_bundle.trim_bitsandbytes(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        kept_record = z.read("bitsandbytes-0.0.dist-info/RECORD").decode()
    assert names == {
        "bitsandbytes/__init__.py",
        "bitsandbytes/libbitsandbytes_cpu.so",
        "bitsandbytes/libbitsandbytes_cuda130.so",
        "bitsandbytes-0.0.dist-info/RECORD",
    }
    assert "cuda128" not in kept_record and "rocm72" not in kept_record and "cuda130" in kept_record


@pytest.mark.slow
def test_the_bundle_downloads_and_fits_the_carry_limit(tmp_path):
    """Needs PyPI (CI has it): the real wheels, trimmed, under the limit the lent machine's carry allows."""
    try:
        sizes = gpu_bundle.build(tmp_path / "bundle", limit_mib=60)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"pip download failed (no PyPI here?): {e}")
    assert {name.split("-")[0] for name in sizes} >= {"bitsandbytes", "datasets", "dill", "multiprocess"}
    bnb = next(size for name, size in sizes.items() if name.startswith("bitsandbytes"))
    assert bnb < 10 * gpu_bundle.MiB  # trimmed: the full wheel is ~43 MB
    assert sum(sizes.values()) <= 60 * gpu_bundle.MiB


@pytest.mark.slow
def test_the_gpu_checks_dry_run_passes_and_writes_its_summary(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--cpu", "--steps", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=BENCHMARKS.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and len(summary["sections"]) == 5
    assert (out / "summary.txt").read_text().count("PASS") == 5
