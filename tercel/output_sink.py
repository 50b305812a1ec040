"""Where generated tokens go: append with the stop checks, finish a request, build its step output.

Every path that produces tokens (the plain step, a decode window, the speculative step, the chained EAGLE
step) hands them to one OutputSink, so the stop rules, the detokenizer, the grammar and the streaming
outputs are written once. The engine owns the sink; the speculative worker gets it, never the engine's
internals.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .detokenizer import update_text
from .outputs import CompletionOutput, RequestOutput
from .request import Request
from .sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from .loader.tokenizer import Tokenizer
    from .scheduler import Scheduler

log = logging.getLogger(__name__)


class OutputSink:
    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], tokenizer: Tokenizer | None,
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.requests = requests  # the engine's live requests: a finished one leaves it here
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append_token(self, req: Request, token: int, logprob: dict[int, float] | None,
                     now: float | None = None) -> None:
        """Append one generated token, check the stop conditions; a finished request is freed. now: the
        time the token arrived (one clock read for a whole window's tokens)."""
        if now is None:
            now = time.perf_counter()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.output_token_ids.append(token)
        if req.grammar is not None and not req.grammar.accept(token):  # only a masked-out token: min_tokens
            log.warning("request %s: token %d breaks its grammar; it stops here", req.request_id, token)
            req.finish_reason = "stop"
        req.metrics.num_generated_tokens = len(req.output_token_ids)
        if logprob is not None and req.logprobs is not None:
            req.logprobs.append(logprob)
        self.check_stop(req, token)
        if req.finish_reason is not None:
            req.metrics.finished_time = now
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)

    def append_tokens(self, req: Request, tokens: list[int],
                      logprobs: list[dict[int, float] | None] | None = None, now: float | None = None) -> bool:
        """Append a run of tokens (a window's, or a verify's accepted drafts and bonus) until one stops the
        request; the rest are discarded. True when the request goes on."""
        if now is None:
            now = time.perf_counter()
        for i, tok in enumerate(tokens):
            self.append_token(req, tok, logprobs[i] if logprobs is not None else None, now)
            if req.finish_reason is not None:
                return False
        return True

    def check_stop(self, req: Request, token: int) -> None:
        p = req.params
        n = len(req.output_token_ids)
        if n >= p.min_tokens:
            if token in req.eos_token_ids:
                req.finish_reason = "stop"
            elif token in p.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", token
        if self.tokenizer is not None and p.detokenize and self.text_as_it_grows(req):
            hit = update_text(req, self.tokenizer)
            if hit is not None and req.finish_reason is None and n >= p.min_tokens:
                req.finish_reason, req.stop_reason = "stop", hit
        if req.finish_reason is None and req.grammar is not None and req.grammar.terminated:
            req.finish_reason = "stop"  # the grammar is complete and accepted its stop token
        if req.finish_reason is None and (n >= p.max_tokens or req.num_tokens >= self.max_model_len):
            req.finish_reason = "length"

    @staticmethod
    def text_as_it_grows(req: Request) -> bool:
        """Does req need its text at every token: stop strings are searched in it, or its outputs hand it out
        before the end? A FINAL_ONLY request without stop strings (LLM.generate / chat) has its text decoded once
        when it finishes: incremental detokenization costs two tokenizer decodes a token, a third of a millisecond
        of host time per step at 64 requests, where the host sets the pace on a GPU."""
        return bool(req.params.stop) or req.params.output_kind != RequestOutputKind.FINAL_ONLY

    def emit(self, outputs: list[RequestOutput], req: Request) -> None:
        """Add req's output for this step, when its output_kind wants one now (FINAL_ONLY: at the end)."""
        out = self.make_output(req)
        if out is not None:
            outputs.append(out)

    def postprocess(self, reqs: list[Request], tokens: list[int],
                    logprobs: list[dict[int, float] | None]) -> list[RequestOutput]:
        """Append each request's sampled token (with the stop checks); the outputs this step gives."""
        outputs: list[RequestOutput] = []
        for r, t, lp in zip(reqs, tokens, logprobs):
            self.append_token(r, t, lp)
            self.emit(outputs, r)
        return outputs

    def make_output(self, req: Request) -> RequestOutput | None:
        """This step's output for req, as its params' output_kind asks; None for a FINAL_ONLY request
        that is still running (no object, no copy of its token ids: offline generate at large batch)."""
        finished = req.finish_reason is not None
        kind = req.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if finished and self.tokenizer is not None and req.params.detokenize and not self.text_as_it_grows(req):
            req.output_text = self.tokenizer.decode(req.output_token_ids,
                                                    skip_special_tokens=req.params.skip_special_tokens)
        # Streaming holds back text that may still turn out to be part of a stop string.
        safe = len(req.output_text) if finished else req.output_text_safe_len
        delta_text = req.output_text[req.sent_text_len:safe] if safe > req.sent_text_len else ""
        req.sent_text_len = max(req.sent_text_len, safe)
        start = req.sent_token_len
        delta_ids = req.output_token_ids[start:]
        req.sent_token_len = len(req.output_token_ids)
        lps = req.logprobs
        if kind == RequestOutputKind.DELTA:
            text, token_ids, lps = delta_text, delta_ids, lps[start:] if lps is not None else None
        else:
            text, token_ids, lps = req.output_text, list(req.output_token_ids), list(lps) if lps is not None else None
        completion = CompletionOutput(index=0, text=text, token_ids=token_ids, finish_reason=req.finish_reason,
                                      stop_reason=req.stop_reason, logprobs=lps)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished, req.metrics,
                             num_cached_tokens=req.metrics.num_cached_tokens, delta_text=delta_text,
                             delta_token_ids=delta_ids)
