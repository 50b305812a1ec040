"""What the speculative package sees of the layers above it, as Protocols.

The engine builds the speculative worker and passes itself in; the worker passes itself to its chain
loop. Neither is imported here (tercel.engine imports tercel.speculative, never the reverse), so the
speculative code names the engine and the worker only through these interfaces. LLMEngine implements
SpecEngine, SpecWorker implements ChainHost. What runs the forwards is the engine's executor
(tercel/executor.py, below the engine): the worker and the drafters register their step kinds with it
and run them through it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..config import EngineConfig, ModelConfig
    from ..executor import Executor
    from ..kv import PagedKVCache
    from ..models.interface import TargetModel
    from ..output_sink import OutputSink
    from ..request import Request
    from ..sampling import Sampler
    from ..scheduler import Scheduler
    from .adaptive import AdaptiveSpec
    from .config import SpecConfig
    from .drafter import Drafter
    from .profile import StepProfile
    from .stats import SpecStats


class SpecEngine(Protocol):
    """The engine as the speculative worker and the drafters use it (tercel.engine.LLMEngine)."""
    device: torch.device
    dtype: torch.dtype
    config: EngineConfig
    model_config: ModelConfig
    model: TargetModel  # the executor's
    kv: PagedKVCache  # the executor's
    executor: Executor  # runs every forward: one graph runner per step kind, the input upload
    scheduler: Scheduler
    sampler: Sampler
    overlap_schedule: bool
    spec_config: SpecConfig | None
    sink: OutputSink  # where generated tokens go: stop checks, finishing, step outputs

    @property
    def draft_target(self) -> TargetModel:
        """What a draft reads of the target: the target itself, or rank 0's whole copies under TP."""
        ...


class ChainHost(Protocol):
    """The speculative worker as its chain loop uses it (tercel.speculative.worker.SpecWorker)."""
    engine: SpecEngine
    num_draft_tokens: int
    drafter: Drafter
    adaptive: AdaptiveSpec | None
    profile: StepProfile
    stats: SpecStats

    def free_unused_blocks(self, r: Request) -> None: ...

    def emit_verified(self, r: Request, num_drafts: int, num_kept: int, tokens: list[int],
                      logprobs: list[dict[int, float]] | None = None, record: bool = True,
                      offered: int = 0) -> bool: ...
