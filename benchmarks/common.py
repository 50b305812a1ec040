"""Shared helpers for benchmark scripts: environment record and result files."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's tercel package
from tercel.bench.environment import command_line, copy_bandwidth, cpu_name, git_commit  # noqa: E402,F401
from tercel.dev_overrides import OVERRIDES  # noqa: E402

# TERCEL_RESULTS_DIR redirects result files (e.g. to $OUT on the device machine)
RESULTS = Path(os.environ.get("TERCEL_RESULTS_DIR") or Path(__file__).parent / "results")


def environment() -> dict:
    env = {"commit": git_commit(), "torch": torch.__version__, "python": platform.python_version(),
           "cpu": cpu_name(), "threads": torch.get_num_threads(), "command": command_line("python", sys.argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    # developer switches set for the whole run (a configuration's own @VAR=VALUE are in its name)
    switches = {k: os.environ[k] for k, o in OVERRIDES.items() if o.kind == "developer" and k in os.environ}
    if switches:
        env["switches"] = switches
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


def split_config(name: str) -> tuple[str, dict[str, str]]:
    """A configuration name with developer switches, for side-by-side runs in one process (the host's speed
    drifts between processes): 'eagle3-chain@TERCEL_VERIFY_ATTN=rope' -> ('eagle3-chain',
    {'TERCEL_VERIFY_ATTN': 'rope'}). Each switch must be one of tercel.dev_overrides' variables."""
    base, *pairs = name.split("@")
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in OVERRIDES:
            raise SystemExit(f"configuration {name!r}: {pair!r} is not VAR=VALUE with VAR one of "
                             f"{', '.join(OVERRIDES)} (tercel/dev_overrides.py)")
        env[key] = value
    return base, env


@contextlib.contextmanager
def switches(env: dict[str, str]):
    """The environment with `env` set for the block (an engine's build, warm-up and runs: graphs captured inside
    keep what the switches chose), restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
