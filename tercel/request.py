"""Per-request state the scheduler and engine share."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .outputs import RequestMetrics
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator  # per-request RNG: sampling is independent of batch composition
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # prefix caching (tercel.prefix_cache): the content keys of the full blocks hashed so far, how many
    # leading blocks of block_table are published (or came from the cache), and the leading positions whose
    # draft KV (EAGLE, DFlash: in the target's slots) is written
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    draft_kv_len: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    output_text: str = ""
    output_text_safe_len: int = 0  # streaming may hand out output_text[:this]
    # incremental detokenization (tercel.detokenizer): output_text[:detok_committed_len] is the text of
    # output_token_ids[:detok_read_offset]; [detok_prefix_offset, detok_read_offset) is decode context
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    detok_committed_len: int = 0
    sent_text_len: int = 0  # streaming: text already handed out
    sent_token_len: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # empty when ignore_eos
    spec_state: object | None = None  # the drafter's per-request state (tercel.speculative), if any
    spec_adaptive: object | None = None  # adaptive speculation's running acceptance (tercel.speculative.adaptive)
    # token draws come from a counter-based stream: draw k's noise is a hash of (seed, k) (tercel.sampling)
    seed: int = 0
    draws: int = 0
    grammar: object | None = None  # structured output: the request's GrammarState (tercel.structured.backend)

    @property
    def stop_ids_for_min_tokens(self) -> frozenset[int]:
        """Token ids masked out until min_tokens are generated."""
        return self.eos_token_ids | frozenset(self.params.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
