"""What the speculative package sees of the layers above it, as Protocols.

The engine builds the speculative worker and passes itself in; the worker passes itself to its chain
loop. Neither is imported here (tercel.engine imports tercel.speculative, never the reverse), so the
speculative code names the engine and the worker only through these interfaces. LLMEngine implements
SpecEngine, SpecWorker implements ChainHost.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..config import EngineConfig, ModelConfig
    from ..forward_batch import ForwardBatch, ModelOutput
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
    model: TargetModel
    kv: PagedKVCache
    scheduler: Scheduler
    sampler: Sampler
    overlap_schedule: bool
    spec_config: SpecConfig | None
    sink: OutputSink  # where generated tokens go: stop checks, finishing, step outputs

    @property
    def draft_target(self) -> TargetModel:
        """What a draft reads of the target: the target itself, or rank 0's whole copies under TP."""
        ...

    def upload(self, lists: list[list[int]]) -> list[torch.Tensor]: ...

    def run_model(self, batch: ForwardBatch) -> ModelOutput: ...

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """The target forward without a CUDA graph (compiled on the CPU when on, else eager)."""
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
                      logprobs: list[dict[int, float]] | None = None, record: bool = True) -> bool: ...
