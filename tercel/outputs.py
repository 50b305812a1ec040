"""What generate() returns: vLLM-shaped RequestOutput / CompletionOutput plus timing metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    # Speculative decoding (zero when it is off): verify steps, draft tokens proposed and accepted,
    # and a histogram of accepted drafts per verify (index k: k drafts accepted, so k + 1 tokens).
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accept_histogram: list[int] = field(default_factory=list)
    spec_accept_lengths: list[int] = field(default_factory=list)  # tokens emitted by each verify, in order

    @property
    def mean_accept_length(self) -> float | None:
        """Tokens per verify step: accepted drafts + the bonus token (1.0 = no speed-up)."""
        return None if not self.spec_verify_steps else (self.spec_accepted_tokens + self.spec_verify_steps) / \
            self.spec_verify_steps

    @property
    def accept_rate(self) -> float | None:
        """Accepted / proposed draft tokens."""
        return None if not self.spec_draft_tokens else self.spec_accepted_tokens / self.spec_draft_tokens

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_verify_steps += 1
        self.spec_draft_tokens += num_drafts
        self.spec_accepted_tokens += num_accepted
        self.spec_accept_lengths.append(num_accepted + 1)
        h = self.spec_accept_histogram
        if len(h) <= num_accepted:
            h.extend([0] * (num_accepted + 1 - len(h)))
        h[num_accepted] += 1

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, over the time after the first (the steady decode rate)."""
        if self.first_token_time is None or self.finished_time is None or self.num_generated_tokens < 2:
            return None
        dt = self.finished_time - self.first_token_time
        return (self.num_generated_tokens - 1) / dt if dt > 0 else None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, chosen first


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's RequestOutput field)
    # Streaming: the text and token ids added since the previous output of this request.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
