"""Shared helpers for benchmark scripts: environment record and result files."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's tercel package
from tercel.bench.environment import command_line, copy_bandwidth, cpu_name, git_commit  # noqa: E402,F401

# TERCEL_RESULTS_DIR redirects result files (e.g. to $OUT on the device machine)
RESULTS = Path(os.environ.get("TERCEL_RESULTS_DIR") or Path(__file__).parent / "results")


def environment() -> dict:
    env = {"commit": git_commit(), "torch": torch.__version__, "python": platform.python_version(),
           "cpu": cpu_name(), "threads": torch.get_num_threads(), "command": command_line("python", sys.argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def exact_dtype(device: str) -> str:
    """fp32 on the CPU, the exact reference these scripts' CPU results were recorded in (dtype "auto" picks bf16
    on a CPU with a fast bf16 path); "auto" (bf16) on a GPU, as before."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return "float32" if on_cpu else "auto"


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
