"""The drafter interface: what n-gram, EAGLE / EAGLE-3 and DFlash implement for the spec worker.

A drafter proposes a DraftTree per decoding request (propose), and hears about every target
forward so it can keep its own state in step: after_extend for prefill chunks and plain decodes
(the normal path), after_verify for the accepted tokens of a verify (its draft_extend).
Per-request state lives on `Request.spec_state`, so it goes away with the request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..forward_batch import CaptureHiddenMode
from ..request import Request
from .tree import DraftTree
from .verify import Accepted

if TYPE_CHECKING:
    from ..graphs.runner import GraphConfig


@dataclass(slots=True)
class ExtendedChunk:
    """One request's tokens [start, end) that a normal-path forward just computed.
    rows: where they sit in the forward's flat batch (and in FULL hidden states)."""
    request: Request
    start: int
    end: int
    row_offset: int


@dataclass(slots=True)
class DeviceChains:
    """Greedy chains drafted on the device and not read by the host yet: [B, W] target ids, the root
    first. The host learns them with the verify result, in the step's one sync."""
    tokens: torch.Tensor


class Drafter:
    # which hidden states the target must return on every forward (NULL: none)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # target layer outputs (layer-id convention: output of layer L) that the hidden states hold
    aux_layer_ids: tuple[int, ...] = ()
    # True when proposals may branch (verify then needs tree masks)
    uses_trees: bool = False
    # prefix caching (tercel.prefix_cache): the drafter keeps KV in the target pool's slots, written for
    # positions < Request.draft_kv_len (a block is shared only once that covers it), and the KV at position p
    # also depends on the tokens up to p + kv_lookahead
    has_kv: bool = False
    kv_lookahead: int = 0

    def one_row_model(self) -> torch.nn.Module | None:
        """The draft model whose forwards run one row at a time (an EAGLE chain at batch 1), for the engine's
        batch-1 GEMV tuning; None: this drafter has none."""
        return None

    def init_graphs(self, config: "GraphConfig", max_blocks: int) -> None:
        """Capture the drafter's own steps (draft loop, draft_extend) for every bucket; default: none."""

    def chain_step(self, max_blocks: int, sampled: bool = False):
        """A step kind that runs draft, verify, accept and draft_extend as one chained graph step
        (spec/chain.py; sampled: for batches with sampled requests), or None: this drafter has none."""
        return None

    def chain_batch(self, reqs: list[Request], roots: torch.Tensor, base: torch.Tensor, tables: torch.Tensor,
                    live: torch.Tensor, sampling: Any, step: Any) -> Any:
        """The chained step's first inputs: the staged roots, positions, block tables and live flags, plus
        this drafter's own state of each request (chain_loop.py)."""
        raise NotImplementedError

    def chains_ended(self, reqs: list[Request], rows: list[int], out: Any) -> None:
        """A chain ended after a step whose outputs are `out`: each request takes its draft state from its row
        there (reqs[k] from row rows[k]), in a few launches for the whole batch, not a few per request."""
        raise NotImplementedError

    def ready(self, req: Request) -> bool:
        """Can this decoding request be drafted for now (its draft state is current)?"""
        return True

    def propose(self, reqs: list[Request]) -> list[DraftTree] | DeviceChains:
        raise NotImplementedError

    def after_extend(self, chunks: list[ExtendedChunk], hidden: torch.Tensor | None) -> None:
        """Normal-path forward done (KV of [start, end) written; a completed sequence already has its
        sampled token appended). hidden: the forward's FULL hidden states, or None."""

    def after_verify(self, reqs: list[Request], trees: list[DraftTree], accepted: list[Accepted],
                     row_offsets: list[int], hidden: torch.Tensor | None) -> None:
        """Verify done for requests that go on: num_computed_tokens already counts the root and the
        accepted drafts, and the bonus token is appended (draft_extend goes here)."""
