"""Shared helpers for benchmark scripts: environment record and result files."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

# TERCEL_RESULTS_DIR redirects result files (e.g. to $OUT on the device machine)
RESULTS = Path(os.environ.get("TERCEL_RESULTS_DIR") or Path(__file__).parent / "results")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    env = {"commit": git_commit(), "torch": torch.__version__, "python": platform.python_version(),
           "cpu": cpu_name(), "threads": torch.get_num_threads(), "command": " ".join([sys.executable] + sys.argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def copy_bandwidth(device: str, nbytes: int = 1 << 28, reps: int = 5) -> float:
    """Measured copy bandwidth in bytes/s (read + write counted), the roofline's denominator."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
