"""Host -> device upload of a step's small integer inputs in ONE copy.

The step's lists (ids, positions, slots, seq lens, block tables, logits rows) are packed into a
pinned host buffer and sent with one non-blocking copy; the device tensors are views of it. Two
pinned buffers alternate, each guarded by an event, so a buffer is never rewritten while its copy
may still be reading it.

The copy runs on a side stream that the compute stream then waits for: inputs depend on nothing the
GPU computes, so under the overlap schedule the next step's upload happens while the current step's
kernels run, instead of queueing behind them (one DMA latency less between the steps).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class HostStager:
    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._bufs = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self._stream = torch.cuda.Stream(device)

    def upload(self, lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        flat = list(itertools.chain.from_iterable(lists))
        i = self._next
        self._next ^= 1
        if self._events[i] is not None:
            self._events[i].synchronize()
        if len(flat) > self._bufs[i].numel():
            self._bufs[i] = torch.empty(max(len(flat), 2 * self._bufs[i].numel()), dtype=torch.long, pin_memory=True)
        host = self._bufs[i][:len(flat)]
        host.copy_(torch.tensor(flat, dtype=torch.long))
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            dev = host.to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        compute.wait_event(ev)
        dev.record_stream(compute)  # the allocator must not hand the block out while compute may still read it
        self._events[i] = ev
        out, start = [], 0
        for seq in lists:
            out.append(dev[start:start + len(seq)])
            start += len(seq)
        return out
