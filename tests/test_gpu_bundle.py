"""benchmarks/gpu_bundle.py (the wheels a lent GPU machine needs) and the GPU check's --cpu dry run
(benchmarks/gpu_check/)."""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(REPO))

from benchmarks import gpu_bundle  # noqa: E402

RERUN_EXAMPLE = "9,12"  # the sections of the rerun command benchmarks/README.md shows


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
            *(sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--steps", "1"),
            *("--budget", "1200", "--out", str(out)),  # a loaded CPU may take longer than a GPU's 300 s
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    sections = {title.split(".")[0]: v for title, v in summary["sections"].items()}
    assert summary["passed"] and len(sections) == 15
    skipped = {n for n, v in sections.items() if v["status"] == "skipped"}
    assert skipped == {"8"} and sections["8"]["reason"].startswith("CUDA only")  # pytest -m gpu
    for n in ("2", "3", "4", "5", "6", "11", "13", "14", "15"):  # their CUDA-only parts, named
        assert sections[n]["findings"]["skipped_parts"], n
    paged = sections["11"]["findings"]  # from its worker process
    assert paged["optimizer"] == "PagedAdamW8bit" and paged["tensors_moved"] > 0 and len(paged["losses"]) == 3
    assert sections["7"]["findings"]["equal"] is True  # the resumed run's adapters, tensor by tensor
    text = (out / "summary.txt").read_text()
    assert text.count("PASS") == 14 and text.count("SKIP") == 1
    # Every section's heading in log.txt: the lanes' behind their labels.
    headings = re.findall(r"^(\[lane §[\d,]+\] )?## (\d+)\. ", (out / "log.txt").read_text(), re.MULTILINE)
    assert sorted(int(number) for _, number in headings) == list(range(1, 16))
    from benchmarks.gpu_check.harness import OUT_FILES
    from benchmarks.gpu_check.sections import LANES

    for lane in LANES:  # each lane's verdicts, from its own process's summary
        assert all(sections[str(n)]["lane"] == "lane §" + ",".join(map(str, lane)) for n in lane)
    # All of --out comes back from a lent machine: at most 8 files (the device tool's limit), plain names.
    written = [p for p in out.rglob("*") if p.is_file()]
    assert len(written) <= OUT_FILES and all(re.fullmatch(r"[\w.-]+", p.name) for p in written)
    summaries = {"log.txt", "summary.json", "summary.txt"}
    assert summaries <= {p.name for p in written}
    assert all(
        p.name in summaries or p.name.endswith("-trace.json.gz") for p in written
    )  # section 14's traces


def test_the_readme_shows_the_commands_the_bundle_prints():
    """The lent machine's commands: python3 -m pip into /tmp/site, no network, no editable install."""
    readme = (BENCHMARKS / "README.md").read_text()
    first = gpu_bundle.first_command()
    assert f"    {first}\n" in readme
    assert f"    {gpu_bundle.rerun_command(RERUN_EXAMPLE)}\n" in readme
    assert (
        first.startswith("python3 -m pip install ")
        and "--no-index" in first
        and "--target /tmp/site" in first
    )
    assert " -e ." not in first and "--budget 540" in first
    assert not {"peft", "xxhash"} & {p.split("==")[0] for p in gpu_bundle.PACKAGES}


@pytest.mark.slow
def test_the_printed_commands_install_the_bundle_offline_and_run_the_check(tmp_path):
    """The two commands benchmarks/README.md shows, the ones gpu_bundle prints, run in a checkout
    with the bundle in it, by the python3 of a fresh virtualenv standing in for the lent machine's
    image (it sees this environment's packages, as the image has torch and peft), no index, the
    proxy pointing nowhere. What differs from the lent machine, and only that: the wheels are for
    this interpreter (gpu_bundle --python-version; multiprocess is the one wheel whose tag names a
    Python), the install folder is a private one in place of /tmp/site, and `--cpu --only 1,11`
    (the first) and `--cpu` (the rerun) are appended to the check's arguments."""
    import os
    import shutil

    readme = (BENCHMARKS / "README.md").read_text()
    first, second = gpu_bundle.first_command(), gpu_bundle.rerun_command(RERUN_EXAMPLE)
    assert f"    {first}\n" in readme and f"    {second}\n" in readme
    checkout = tmp_path / "checkout"
    for folder in ("lora_grpo", "benchmarks", "recipes"):
        shutil.copytree(REPO / folder, checkout / folder, ignore=shutil.ignore_patterns("__pycache__"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        sizes = gpu_bundle.build(checkout / "gpu_bundle", limit_mib=60, python_version=version)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"pip download failed (no PyPI here?): {e}")
    assert f"{gpu_bundle.CALCULATOR_BASE}/" in sizes
    image = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", str(image)], check=True, capture_output=True)
    own = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (image / "lib" / f"python{version}" / "site-packages" / "the-image.pth").write_text(own + "\n")
    site = tmp_path / "site"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))},
        "PATH": f"{image / 'bin'}{os.pathsep}{os.environ['PATH']}",
        **dict.fromkeys(("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"), "http://127.0.0.1:9"),
    }

    def run(command: str, out: Path) -> dict:
        done = subprocess.run(
            ["bash", "-c", command.replace("/tmp/site", str(site))],
            cwd=checkout,
            env={**env, "OUT": str(out)},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads((out / "summary.json").read_text())

    summary = run(first + " --cpu --only 1,11", tmp_path / "first")
    assert {n for n, s in sections(summary).items() if s["status"] == "passed"} == {"1", "11"}
    places = sections(summary)["1"]["findings"]["imported_from"]
    assert places["transformers"] == places["bitsandbytes"] == str(site)  # the bundle, not the image's
    assert places["lora_grpo"] == str(checkout) and places["torch"] == own
    assert sorted(p.name.split("-")[0] for p in site.glob("*.dist-info")) == sorted(
        p.split("==")[0] for p in gpu_bundle.PACKAGES
    )
    shutil.rmtree(site)  # a machine started afresh for the second command: it installs first
    summary = run(second + " --cpu", tmp_path / "rerun")
    assert (site / "transformers").is_dir()
    ran = {n: s for n, s in sections(summary).items() if s["reason"] != "not in --only"}
    assert set(ran) == set(RERUN_EXAMPLE.split(",")) and summary["passed"], summary
    assert all(s["status"] == "passed" for s in ran.values()), ran
    assert ran["9"]["findings"]["base"] == str(checkout / "gpu_bundle" / gpu_bundle.CALCULATOR_BASE)


def sections(summary: dict) -> dict:
    """summary.json's sections by number."""
    return {title.split(".")[0]: v for title, v in summary["sections"].items()}
