"""How many threads PyTorch's CPU kernels use: --threads, else one per physical core this process may run
on. A decode step is bound by memory bandwidth and each core's vector units; a hyperthread sibling shares
both with its core, so a second thread there only adds contention (and OpenMP spinning)."""
from __future__ import annotations

import os
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")


def physical_cores(allowed: set[int] | None = None, topology: Path = _TOPOLOGY) -> int:
    """The physical cores among the CPUs this process may run on (Linux: sched_getaffinity and each CPU's
    package and core id under /sys); elsewhere, or when the topology is unreadable, the usable CPUs."""
    if allowed is None:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        top = topology / f"cpu{cpu}" / "topology"
        try:
            cores.add(((top / "physical_package_id").read_text().strip(), (top / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(allowed))
    return max(1, len(cores))


def default_threads() -> int | None:
    """The default for --threads: the physical cores, unless OMP_NUM_THREADS chose already (None: keep it)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return physical_cores()


def apply_threads(threads: int | None) -> None:
    """Set PyTorch's intra-op threads to `threads`, or to the default above."""
    n = threads or default_threads()
    if n is not None:
        import torch

        torch.set_num_threads(n)
