"""Counting the kernels a stretch of code launches, on any device: the kernel budget of a step, checked on the CPU.

At SmolLM2's size every GPU kernel costs ~2-3 µs whatever it does, so a step's kernel count is its cost
(../shared/GPU.md). torch.profiler counts kernels only on a GPU; `LaunchCounter` counts what would launch one:
every ATen op that computes (views, metadata and allocations excluded) and every Triton launch. Under
TRITON_INTERPRET=1 the CPU runs the GPU's code paths (kernels.use_triton), so a CPU run of a step counts the
launches its GPU replay holds, give or take library internals (a cuBLAS split-K reduce, a multi-pass sort
count as one). Ops the Triton interpreter makes while it emulates a kernel are not counted.

Reads that wait for the device (`.item()`, `.tolist()`, a copy to the host) are counted apart as syncs.
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# ops that allocate or describe memory without a kernel
_NO_KERNEL = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
              _aten.new_empty.default, _aten.new_empty_strided.default, _aten.lift_fresh.default,
              _aten.detach.default, _aten.detach_.default, _aten.alias.default, _aten._unsafe_view.default,
              _aten.resize_.default, _aten.set_.source_Storage, _aten.set_.source_Storage_storage_offset,
              _aten.set_.source_Tensor,
              _aten.record_stream.default, _aten.is_same_size.default, _aten.sym_size.int, _aten.sym_stride.int,
              _aten.sym_numel.default, _aten.sym_storage_offset.default, _aten.is_nonzero.default}
_SYNCS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
          _aten._unique2.default}


class LaunchCounter(TorchDispatchMode):
    """with LaunchCounter() as c: ... -> c.launches (kernels), c.syncs (host reads), c.ops (kernels by op name)."""

    def __init__(self, paused: bool = False) -> None:
        """paused: count nothing until `counting()` (to count one step kind inside a whole run)."""
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs = 0
        self._paused = int(paused)

    @property
    def launches(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        if func in _SYNCS:
            self.syncs += 1
        elif func in (_aten._to_copy.default, _aten.copy_.default) and _to_host(func, args, out):
            self.syncs += 1
            self.ops["copy to host"] += 1
        elif func not in _NO_KERNEL and not func.is_view:
            self.ops[func.__name__] += 1
        return out

    def triton_launch(self, name: str) -> None:
        if not self._paused:
            self.ops[f"triton:{name}"] += 1

    def pause(self) -> None:
        self._paused += 1

    def resume(self) -> None:
        self._paused -= 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count inside this block even when the counter was made paused (nests with `paused`)."""
        self._paused -= 1
        try:
            yield
        finally:
            self._paused += 1

    def __enter__(self) -> "LaunchCounter":
        self._unpatch = _patch_triton(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._unpatch()


def _to_host(func: Any, args: tuple, out: Any) -> bool:
    """A device -> host copy (the read that waits). On the CPU nothing is a host copy: count it as a kernel."""
    src = args[1] if func is _aten.copy_.default else args[0]
    dst = args[0] if func is _aten.copy_.default else out
    return isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.is_cuda and not dst.is_cuda


def _patch_triton(counter: LaunchCounter):
    """Count each Triton launch once (compiled or interpreted) and pause the count inside it: the interpreter
    emulates a kernel with torch / numpy ops that are not launches."""
    try:
        from triton.runtime import interpreter, jit
    except Exception:  # no triton: nothing launches through it
        return lambda: None
    patched = []
    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        original = cls.run

        def run(self, *args, __original=original, **kwargs):
            if not kwargs.get("warmup", False):
                fn = getattr(self, "fn", None)
                counter.triton_launch(getattr(fn, "__name__", type(self).__name__))
            with counter.paused():
                return __original(self, *args, **kwargs)

        cls.run = run
        patched.append((cls, original))

    def unpatch() -> None:
        for cls, original in patched:
            cls.run = original

    return unpatch
