"""The drafter interface: what n-gram, EAGLE / EAGLE-3 and DFlash implement for the spec worker.

A drafter proposes a DraftTree per decoding request (propose), and hears about every target
forward so it can keep its own state in step: after_extend for prefill chunks and plain decodes
(the normal path), after_verify for the accepted tokens of a verify (its draft_extend).
Per-request state lives on `Request.spec_state`, so it goes away with the request.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward_batch import CaptureHiddenMode
from ..request import Request
from .tree import DraftTree
from .verify import Accepted


@dataclass(slots=True)
class ExtendedChunk:
    """One request's tokens [start, end) that a normal-path forward just computed.
    rows: where they sit in the forward's flat batch (and in FULL hidden states)."""
    request: Request
    start: int
    end: int
    row_offset: int


class Drafter:
    # which hidden states the target must return on every forward (NULL: none)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # target layer outputs (layer-id convention: output of layer L) that the hidden states hold
    aux_layer_ids: tuple[int, ...] = ()

    def ready(self, req: Request) -> bool:
        """Can this decoding request be drafted for now (its draft state is current)?"""
        return True

    def propose(self, reqs: list[Request]) -> list[DraftTree]:
        raise NotImplementedError

    def after_extend(self, chunks: list[ExtendedChunk], hidden: torch.Tensor | None) -> None:
        """Normal-path forward done (KV of [start, end) written; a completed sequence already has its
        sampled token appended). hidden: the forward's FULL hidden states, or None."""

    def after_verify(self, reqs: list[Request], trees: list[DraftTree], accepted: list[Accepted],
                     row_offsets: list[int], hidden: torch.Tensor | None) -> None:
        """Verify done for requests that go on: num_computed_tokens already counts the root and the
        accepted drafts, and the bonus token is appended (draft_extend goes here)."""
