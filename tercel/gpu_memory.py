"""GPU memory torch keeps for the whole process, outside any engine: one cuBLAS workspace (32 MiB on
Hopper) per stream that ran a GEMM. An engine's graphs bake its workspaces' addresses in, so they may only
go while no engine is alive: the last engine to go (shutdown, or garbage-collected) gives them back, and
`del llm` then returns the memory the engine used (vLLM issues #1908, #6544)."""
from __future__ import annotations

import weakref

import torch

_LIVE: "weakref.WeakSet[object]" = weakref.WeakSet()  # CUDA engines of this process (cuBLAS's cache is per process)


def track(engine: object) -> None:
    """A CUDA engine is built: its workspaces go when it is the last one alive and it goes."""
    _LIVE.add(engine)
    weakref.finalize(engine, release_if_last).atexit = False  # at exit the process's memory goes anyway


def release_if_last(engine: object | None = None) -> bool:
    """engine shuts down (None: it was collected). With no other CUDA engine alive, free torch's cuBLAS
    workspaces (re-made on the next GEMM). True when they went."""
    if engine is not None:
        _LIVE.discard(engine)
    # iterate, not len(): from a finalizer the dying engine's entry may not be removed yet (its referent is gone)
    if any(e is not engine for e in _LIVE) or not torch.cuda.is_available():
        return False
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    torch.cuda.synchronize()
    clear()
    return True
