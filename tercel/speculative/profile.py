"""Per-phase time of speculative steps (draft / verify / accept / emit / extend), for benchmarks.

Off by default (no cost). When on, each phase boundary records a CUDA event (GPU time between two events:
what the device spent on the phase, idle gaps included) and a host clock (the phase's wall time on the
host). The step's end waits for its last event, one extra sync per step: profile in a separate pass."""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch


class StepProfile:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = False
        self._marks: list[tuple[str, object, float]] = []
        self.gpu_us: dict[str, list[float]] = defaultdict(list)
        self.host_us: dict[str, list[float]] = defaultdict(list)

    def mark(self, phase: str) -> None:
        """Phase `phase` starts now (the previous one ends)."""
        if not self.enabled:
            return
        ev = None
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self._marks.append((phase, ev, time.perf_counter()))

    def end_step(self) -> None:
        if not self.enabled or not self._marks:
            return
        self.mark("end")
        last = self._marks[-1][1]
        if last is not None:
            last.synchronize()
        for (name, ev, t), (_, ev2, t2) in zip(self._marks, self._marks[1:]):
            self.host_us[name].append((t2 - t) * 1e6)
            if ev is not None:
                self.gpu_us[name].append(ev.elapsed_time(ev2) * 1e3)
        self._marks.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Median µs per phase: {'gpu': {...}, 'host': {...}, 'steps': n}."""
        med = lambda d: {k: round(statistics.median(v), 1) for k, v in d.items() if v}  # noqa: E731
        return {"gpu_us": med(self.gpu_us), "host_us": med(self.host_us),
                "steps": len(next(iter(self.host_us.values()), []))}
