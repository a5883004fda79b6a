"""gpu_check step a: the tests that take a device: ``pytest -m gpu`` (run on CUDA there, skipped on a CPU)
and the rest of the files that hold them: the trainer's device and precision tests, and the paths
that span the GPU and the CPU (no proxy test takes a device). One process, no xdist (pyproject's
addopts are cleared).
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

from common import ROOT, emit, log, parse, step_env

FILES = ["tests/trainer/test_memory_lean.py", "tests/trainer/test_cuda_devices.py"]
OUTCOMES = ("passed", "failed", "skipped", "error", "errors", "deselected")


def pytest(*args: str) -> dict[str, Any]:
    # Only the plugins these tests use: the image's own (pytest-benchmark, -cov, ...) were built for its
    # pytest, not the one the wheels bring.
    plugins = ["-p", "pytest_asyncio.plugin", "-p", "pytest_timeout", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", *plugins, "-q", "-rfEs", *args, *FILES]
    env = {**step_env(), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary) if word in OUTCOMES}
    result: dict[str, Any] = {"rc": done.returncode, "summary": summary, **counts}
    if done.returncode != 0:
        result["error"] = output[-2000:]
    log("pytest %s: %s", " ".join(args), summary)
    return result


def main() -> None:
    args = parse(__doc__ or "")
    gpu = pytest("-m", "gpu")
    emit({"gpu": gpu})  # what is known so far, should the step's time run out
    rest = pytest("-m", "not gpu")
    result: dict[str, Any] = {"gpu": gpu, "device_tests": rest}
    errors = [f"{name}: {r['summary']}" for name, r in result.items() if r["rc"] != 0]
    if not args.dry_run and gpu.get("passed", 0) == 0:
        errors.append("the gpu tests were skipped: torch sees no CUDA device")
    if errors:
        result["error"] = "; ".join(errors)
    emit(result)


if __name__ == "__main__":
    main()
