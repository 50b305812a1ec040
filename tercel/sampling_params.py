"""Per-request sampling parameters, validated on construction (vLLM's field names)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from .structured.params import StructuredOutputsParams


class RequestOutputKind(enum.IntEnum):
    """What the engine's step() returns for a request (vLLM's names): CUMULATIVE, every step, the text
    and token ids so far (plus the step's delta fields); DELTA, every step, only what this step added;
    FINAL_ONLY, one output when it finishes (offline generate: no per-step output objects or copies)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: chosen token only; n: plus top-n
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no per-step text (as vLLM's)
    min_tokens: int = 0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # a grammar the output must match (tercel.structured): JSON schema, regex, choice, EBNF / Lark, any JSON object
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = [
            (is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0.0,
             "temperature", "a finite number >= 0 (0 means greedy)"),
            (self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63),
             "seed", "None or an integer in [0, 2**63)"),
            (0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]"),
            (is_int(self.top_k) and self.top_k >= 0, "top_k", "0/-1 (off) or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "> 0 (1 means off)"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "logprobs", "None or an integer in [0, 20]"),
            (is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings"),
            (self.detokenize or not self.stop, "stop",
             "empty when detokenize=False (stop strings are matched on the text; use stop_token_ids)"),
            (all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "non-negative token ids"),
            (isinstance(self.output_kind, RequestOutputKind), "output_kind",
             "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "None, a StructuredOutputsParams or a dict of its fields"),
        ]
        for ok, name, want in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: must be {want}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
