"""The executor: what runs a step's forward (docs/architecture.md, "One step, top to bottom").

It owns the target model, the KV pool, the host -> device upload of a step's integer inputs, one
CUDA-graph runner per step kind and, on the CPU with --cpu-compile, the compiled steps. `run(kind, batch)`
replays that kind's graph when its runner can serve the batch, else runs the step's eager forward (the
runner counts and logs why, graphs/runner.py); a kind with no step of its own is a target forward
(`forward`: the compiled CPU step when it serves the batch, else eager). The engine keeps requests,
scheduling and outputs and calls `run`; the speculative worker and the drafters `register` their own step
kinds (verify widths, the draft loop, draft_extend, the chained step) here instead of building runners.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .forward_batch import CaptureHiddenMode, ForwardBatch, ModelOutput
from .graphs.runner import CudaGraphRunner, GraphConfig, StepKind
from .graphs.staging import HostStager, pack_longs, split_views

if TYPE_CHECKING:
    from .graphs.compiled import CompiledSteps
    from .graphs.sampler import SamplerGraphs
    from .kv import PagedKVCache
    from .models.interface import TargetModel


@dataclass(frozen=True, slots=True)
class StepKey:
    """Which step a runner serves: its kind's name, and for verify the tokens per request."""
    name: str
    width: int = 1


DECODE = StepKey("decode")  # the target, one token per request (plain decode, decode windows)
DRAFT = StepKey("draft")  # EAGLE's greedy chain draft loop
DRAFT_EXTEND = StepKey("draft_extend")  # EAGLE's draft over the accepted rows
DRAFT_TREE = StepKey("draft_tree")  # EAGLE's top-k tree draft loop (every draft step, the candidates)
DRAFT_BLOCK = StepKey("draft_block")  # DFlash's block forward (the drafts' logits of DDTREE / unchained DFLASH)
CHAIN = StepKey("chain")  # draft, verify, accept and draft_extend as one chained EAGLE step
CHAIN_SAMPLED = StepKey("chain_sampled")  # the same for batches with sampled (T > 0) requests


def sampled_decode_key(filtered: bool, mixed: bool, base: StepKey = DECODE) -> StepKey:
    """A one-token step (the decode, or the one-token verify of adaptive speculation's plain windows) with each
    row's draw inside it (graphs/sampled_decode.py), per variant."""
    return StepKey(f"{base.name}_sampled" + ("+filtered" if filtered else "") + ("+mixed" if mixed else ""),
                   base.width)


def verify_key(width: int) -> StepKey:
    """Target verify of `width` tokens per request."""
    return StepKey("verify", width)


class Executor:
    def __init__(self, model: TargetModel, kv: PagedKVCache, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.stager = None  # a GPU's pinned staging buffers: a step's inputs go up in one copy
        if device.type == "cuda":
            self.stager = HostStager(device)
        self.compiled: CompiledSteps | None = None  # CPU (--cpu-compile): uniform steps run compiled code
        self.steps: dict[StepKey, StepKind] = {}  # kinds with their own eager forward (not the target's)
        self.runners: dict[StepKey, CudaGraphRunner] = {}
        self.sampler: SamplerGraphs | None = None  # GPU: decode windows' sampled rows as graphs (graphs/sampler.py)
        # every runner warms up and captures on this one stream: torch keeps a cuBLAS workspace per stream that
        # ran a GEMM, for the process's life (gpu_memory.py gives them back when the last engine goes)
        self.capture_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def upload(self, lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Small integer lists to the device as int64 tensors: one pinned copy on a GPU."""
        if self.stager is not None:
            return self.stager.upload(lists)
        flat = pack_longs(lists)
        return split_views(flat if self.device.type == "cpu" else flat.to(self.device), lists)

    def register(self, kind: StepKey, step: StepKind, config: GraphConfig | None = None,
                 mode: CaptureHiddenMode = CaptureHiddenMode.NULL, lazy: bool = False,
                 pool_of: StepKey | None = None) -> CudaGraphRunner | None:
        """`step` serves `kind`. With a graph config, a runner for it is built and every bucket captured
        now (at `mode`), or with `lazy` each bucket when a batch first needs it; without, the step runs eagerly
        until a later register captures it. pool_of: share that kind's graph memory pool (steps that never
        run concurrently, as every step here)."""
        self.steps[kind] = step
        if config is None:
            return None
        shared = self.runners.get(pool_of) if pool_of is not None else None
        runner = CudaGraphRunner(step, config, self.device, stream=self.capture_stream,
                                 pool=shared.pool if shared is not None else None)
        if not lazy:
            with torch.inference_mode():
                runner.capture_all(mode)
        self.runners[kind] = runner
        return runner

    def use(self, kind: StepKey, runner: CudaGraphRunner | None) -> None:
        """A runner built elsewhere (tests, benchmarks) serves `kind`; None: no graphs for it."""
        if runner is None:
            self.runners.pop(kind, None)
        else:
            self.runners[kind] = runner

    def sampled(self, base: StepKey, filtered: bool, mixed: bool) -> StepKey | None:
        """The kind that runs `base` (a one-token model step with graphs) and draws each row's token in the same
        replay, registered on first use with base's graph config and memory pool, each bucket captured when a
        batch first needs it; None when base has no graphs."""
        kind = sampled_decode_key(filtered, mixed, base)
        if kind in self.runners:
            return kind
        from .graphs.sampled_decode import SampledDecodeStep, SampledVariant
        from .graphs.steps import ModelStep

        runner = self.runners.get(base)
        step = None if runner is None else runner.step
        if not isinstance(step, ModelStep) or step.tokens_per_request != 1 or step.custom_mask:
            return None
        self.register(kind, SampledDecodeStep(step.model, step.kv, step.max_blocks, SampledVariant(filtered, mixed),
                                              name=f"{step.name}_sampled"), runner.config, lazy=True, pool_of=base)
        return kind

    def runner(self, kind: StepKey) -> CudaGraphRunner | None:
        return self.runners.get(kind)

    def widths(self, name: str) -> dict[int, CudaGraphRunner]:
        """The runners of one kind by width (verify: the adaptive candidate widths)."""
        return {k.width: r for k, r in self.runners.items() if k.name == name}

    def run(self, kind: StepKey, batch: Any) -> Any:
        """The step's forward for this batch: its runner (a replay, or the eager fallback it counts), else
        the step's eager forward; a kind nobody registered is a target forward."""
        runner = self.runners.get(kind)
        if runner is not None:
            return runner.run(batch)
        step = self.steps.get(kind)
        return step.eager(batch) if step is not None else self.forward(batch)

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """The target forward without a CUDA graph: the compiled CPU step when it serves the batch (uniform
        decode / verify steps), else eager (prefill chunks and mixed steps)."""
        if self.compiled is not None:
            out = self.compiled.run(batch)
            if out is not None:
                return out
        return self.model(batch, self.kv)
