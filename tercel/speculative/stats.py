"""Engine-wide speculative decoding counters (LLMEngine.spec_stats, tercel bench)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    """Engine-wide speculative decoding counters (all requests since the engine started)."""
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accept_histogram: list[int] = field(default_factory=list)
    width_histogram: dict[int, int] = field(default_factory=dict)  # adaptive: steps per chosen width (1: plain)
    plain_window_steps: int = 0  # adaptive: plain steps run as the engine's decode windows (part of width 1)
    # chained steps read back on a GPU, and the host's time blocked at those reads: about a step's time each when
    # the device sets the pace, near zero when the host does (a benchmark's diagnosis, tercel bench / spec_rounds)
    chain_reads: int = 0
    chain_wait_s: float = 0.0
    # steps that went through the worker (speculative or probe steps, a batch's first decode, prefill chunks) and
    # the host's wall time inside them, draft_extend and reads included: what leaving the plain windows costs
    worker_steps: int = 0
    worker_step_s: float = 0.0
    # adaptive: deferred draft_extends run before a speculative step (the switch from plain) and their synced wall
    flushes: int = 0
    flush_s: float = 0.0
    flush_host_s: float = 0.0  # ... of which the host's, up to the sync (the rest: the device's queue)
    flush_rows: int = 0  # deferred rows extended by them
    # adaptive: probes measured whole (from the plain window read before one to the first after it) and what they
    # cost beyond the plain steps they stood in for (CostModel.observe_probe)
    probes: int = 0
    probe_s: float = 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if len(self.accept_histogram) <= num_accepted:
            self.accept_histogram.extend([0] * (num_accepted + 1 - len(self.accept_histogram)))
        self.accept_histogram[num_accepted] += 1

    @property
    def mean_accept_length(self) -> float | None:
        return None if not self.verify_steps else (self.accepted_tokens + self.verify_steps) / self.verify_steps

    @property
    def accept_rate(self) -> float | None:
        return None if not self.draft_tokens else self.accepted_tokens / self.draft_tokens
