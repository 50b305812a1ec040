"""Breakable CUDA graphs (docs/gpu.md; SGLang's --cuda-graph-backend breakable).

Some ops cannot live inside a graph (host syncs, data-dependent shapes, an attention planner).
`@eager_break` marks such a function. Under a breakable capture, calling it ends the current graph
segment, runs the function eagerly, records the call, and opens the next segment in the same
memory pool; replay alternates segment replays with re-runs of the recorded calls, whose results
are copied into the tensors the next segment was captured reading. Outside a breakable capture
the decorator is a plain call.

The recorded call keeps its argument objects: tensors are static buffers or outputs of the previous
segment (same addresses every replay), and objects with host fields (a ForwardBatch) are updated in
place by the runner before each replay, so the eager function sees the live values.

debug_eager=True runs the whole forward as one eager break: no graph at all, same buffers and
marshalling, to tell a graph bug from a marshalling bug.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

_ACTIVE: contextvars.ContextVar["BreakableGraph | None"] = contextvars.ContextVar("tercel_breakable", default=None)


def eager_break(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        capture = _ACTIVE.get()
        if capture is None:
            return fn(*args, **kwargs)
        return capture.break_here(fn, args, kwargs)

    wrapper.eager_break = True  # type: ignore[attr-defined]
    return wrapper


def copy_into(dst: Any, src: Any) -> None:
    """Copy a result (tensors, nested in tuples, lists, dicts or dataclasses) into the captured one."""
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
            raise RuntimeError(f"an eager break returned {type(src).__name__} "
                               f"{tuple(src.shape) if isinstance(src, torch.Tensor) else ''} on replay, captured "
                               f"{tuple(dst.shape)}: eager breaks must keep their output shapes.")
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            copy_into(d, s)
    elif isinstance(dst, dict):
        for k in dst:
            copy_into(dst[k], src[k])
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            copy_into(getattr(dst, f.name), getattr(src, f.name))


class EagerCall:
    def __init__(self, fn: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        self.fn, self.args, self.kwargs, self.out = fn, args, kwargs, out

    def replay(self) -> None:
        copy_into(self.out, self.fn(*self.args, **self.kwargs))


class BreakableGraph:
    """capture(fn) once, then replay(); the same interface the runner uses for a whole-forward graph."""

    def __init__(self, pool: Any, debug_eager: bool = False, graph_factory: Callable[[], Any] | None = None) -> None:
        self.pool = pool
        self.debug_eager = debug_eager
        self.graph_factory = graph_factory or torch.cuda.CUDAGraph
        self.items: list[Any] = []
        self._segment: Any = None
        self._tick: torch.Tensor | None = None

    @property
    def num_segments(self) -> int:
        return sum(1 for i in self.items if not isinstance(i, EagerCall))

    @property
    def num_eager_calls(self) -> int:
        return sum(1 for i in self.items if isinstance(i, EagerCall))

    def capture(self, fn: Callable[[], Any]) -> Any:
        if self.debug_eager:
            out = fn()
            self.items = [EagerCall(fn, (), {}, out)]
            return out
        token = _ACTIVE.set(self)
        try:
            self._begin()
            out = fn()
            self._end()
        except BaseException:
            if self._segment is not None:  # never leave the stream capturing after a failed capture
                try:
                    self._segment.capture_end()
                except Exception:
                    pass
                self._segment = None
            raise
        finally:
            _ACTIVE.reset(token)
        return out

    def _begin(self) -> None:
        self._segment = self.graph_factory()
        self._segment.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        if self._tick is None:
            self._tick = torch.zeros(1, device="cuda")
        self._tick.add_(1)  # one kernel so that no segment is empty (an empty graph cannot replay)

    def _end(self) -> None:
        self._segment.capture_end()
        self.items.append(self._segment)
        self._segment = None

    def break_here(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self._end()
        token = _ACTIVE.set(None)  # breaks nested inside an eager call run as plain calls
        try:
            out = fn(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)
        self.items.append(EagerCall(fn, args, kwargs, out))
        self._begin()
        return out

    def replay(self) -> None:
        for item in self.items:
            item.replay()
