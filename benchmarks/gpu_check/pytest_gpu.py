"""Section 8, pytest -m gpu: the suite's GPU tests in a subprocess, with a time cap inside the budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks._common import run_child
from benchmarks.gpu_check.harness import REPO, Late, Run, Skip


def check_pytest_gpu(run: Run) -> None:
    if not run.cuda:
        raise Skip("CUDA only: without a GPU every test it selects is skipped")
    if run.left() < 60:
        raise Late(f"{run.left():.0f} s of the budget left: too little for the GPU tests' subprocess")
    files = [str(p) for p in sorted((REPO / "tests").glob("test_*.py")) if "pytest.mark.gpu" in p.read_text()]
    cap = 240.0
    limit = run.limit(cap)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-n", "0", "-p", "no:cacheprovider", *files]
    print(" ".join(command[2:]), f"(limit {limit:.0f} s)")
    try:
        done = run_child(command, timeout=limit, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as e:
        print((e.stdout or "")[-3000:])
        run.over_time("pytest -m gpu", limit, cap)
        return
    output = done.stdout + done.stderr
    print("\n".join(output.splitlines()[-30:]))
    tally = [
        line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)
    ]
    counts = {
        k: int(n)
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", tally[-1] if tally else "")
    }
    run.findings.update({"counts": counts, "exit": done.returncode, "files": [Path(f).name for f in files]})
    run.expect(done.returncode == 0, f"pytest -m gpu passed (exit {done.returncode}, {counts})")
    run.expect(
        counts.get("passed", 0) >= 1 and not counts.get("skipped"),
        "every selected GPU test ran (none skipped)",
    )
