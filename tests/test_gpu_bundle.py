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
    """Every section's code runs on a CPU in a tiny shape; what only CUDA has is skipped and listed."""
    out = tmp_path / "out"
    result = subprocess.run(
        [
            *(sys.executable, str(BENCHMARKS / "gpu_check.py"), "--cpu", "--steps", "1"),
            *("--budget", "1200", "--out", str(out)),  # a loaded CPU may take longer than a GPU's 300 s
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=BENCHMARKS.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    sections = {title.split(".")[0]: v for title, v in summary["sections"].items()}
    assert summary["passed"] and len(sections) == 12
    skipped = {n for n, v in sections.items() if v["status"] == "skipped"}
    assert skipped == {"8"} and sections["8"]["reason"].startswith("CUDA only")  # pytest -m gpu
    for n in ("2", "3", "4", "5", "6", "11"):  # their CUDA-only parts, named
        assert sections[n]["findings"]["skipped_parts"], n
    paged = sections["11"]["findings"]  # from its worker process
    assert paged["optimizer"] == "PagedAdamW8bit" and paged["tensors_moved"] > 0 and len(paged["losses"]) == 3
    assert sections["7"]["findings"]["equal"] is True  # the resumed run's adapters, tensor by tensor
    text = (out / "summary.txt").read_text()
    assert text.count("PASS") == 11 and text.count("SKIP") == 1
    assert (out / "log.txt").read_text().count("\n## ") == 12


def test_the_readme_shows_the_commands_the_bundle_prints():
    """The lent machine's commands: python3 -m pip into /tmp/site, no network, no editable install."""
    readme = (BENCHMARKS / "README.md").read_text()
    first = gpu_bundle.first_command()
    assert f"    {first}\n" in readme
    assert f"    {gpu_bundle.rerun_command('4,9,12')}\n" in readme
    assert (
        first.startswith("python3 -m pip install ")
        and "--no-index" in first
        and "--target /tmp/site" in first
    )
    assert " -e ." not in first and "--budget 300" in first
    assert not {"peft", "xxhash"} & {p.split("==")[0] for p in gpu_bundle.PACKAGES}
