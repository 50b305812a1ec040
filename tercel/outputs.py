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
    # Streaming: the text and token ids added since the previous output of this request.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
