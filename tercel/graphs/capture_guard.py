"""What a CUDA graph capture refuses, caught on the CPU.

The CPU tests capture step kinds with a stand-in graph, where nothing forbids a host-to-device copy; on the GPU
the same line fails the capture. The one such copy a step body can make without naming the host is writing a
Python scalar through an index tensor (`t[idx] = True`, `t[mask] = 0`): torch wraps the scalar in a CPU tensor
and index_put_ copies it to the device, which a capture rejects. A slice write (`t[:, 0] = 1`) or `fill_` takes
the scalar as a kernel argument and is fine. `CaptureGuard` is a dispatch mode the runner wraps a CPU capture in
so those writes fail where CI can see them.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_INDEXED_WRITES = {torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
                   torch.ops.aten._index_put_impl_.default}


class CaptureGuard(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._scalars: dict[int, weakref.ref] = {}  # tensors torch made from Python scalars, by id

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _INDEXED_WRITES:
            values = args[2] if len(args) > 2 else kwargs.get("values")
            ref = self._scalars.get(id(values))
            if ref is not None and ref() is values:
                raise RuntimeError(
                    "a captured step writes a Python scalar through an index tensor (t[idx] = value): on the GPU "
                    "that copies a CPU tensor into the graph, which CUDA graph capture refuses. Write through a "
                    "slice or fill_ (t[:, a:b].fill_(value)), or use a device tensor of the value.")
        out = func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default and isinstance(out, torch.Tensor) and out.dim() == 0:
            self._scalars = {k: r for k, r in self._scalars.items() if r() is not None}
            self._scalars[id(out)] = weakref.ref(out)
        return out
