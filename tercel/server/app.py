"""OpenAI-compatible routes on FastAPI.

POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events
ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics, GET /openapi.json, GET /docs.

Request bodies are read by hand (size limit, strict JSON validation), so every bad input becomes an
OpenAI-style error `{"error": {"message", "type", "param", "code"}}` with status 400 (413 for a
body over the size limit, 401 for a missing/wrong API key, 429 for a full queue, 503 while shutting
down) and never a stack trace; the trace goes to the server log with a generic 500.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import LLMEngine
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from ..structured import StructuredOutputError, StructuredOutputsParams
from .connections import BODY_TIMEOUT_KEY
from .docs_page import render_docs
from .engine_loop import ABORTED, AsyncEngine, EngineFailure, EngineRequest, QueueFullError, RequestGroup
from .metrics import ServerMetrics
from .openapi import build_openapi
from .protocol import (
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenizeRequest,
    _SamplingFields,
    error_body,
    validation_error_to_api,
)
from .structured_request import structured_params
from .tools import ToolPlan, ToolStream, pick_parser, render_messages

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json",
                       "/docs", "/tokenize", "/detokenize"})
GREEDY_EPS = 1e-5  # temperatures below this are greedy (avoids overflow in logits / T)
MIN_LOGPROB = -9999.0  # OpenAI's floor; JSON has no -inf
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_SEED = 2**63 - 1
DRAIN_BODY_LIMIT = 16 << 20  # read (and drop) up to this much of an oversized body before the 413


@dataclass(slots=True)
class ServerSettings:
    served_model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_queue_size: int = 1024  # waiting engine requests before 429
    max_body_bytes: int = 2 << 20
    max_n: int = 16
    max_batch_prompts: int = 64  # /v1/completions prompt lists
    max_request_fanout: int = 256  # engine requests (prompts x n) one HTTP request may start
    completions_default_max_tokens: int = 16  # OpenAI's default for /v1/completions
    shutdown_timeout_s: float = 5.0  # grace for running requests on SIGTERM
    tool_call_parser: str | None = None  # hermes, llama3_json, mistral, qwen; None: the chat template's family

    @property
    def model_names(self) -> frozenset[str]:
        return frozenset({self.served_model_name, "default"})


class _ClientGone(Exception):
    """The client went away (mid-body or while waiting): end the request quietly, as a 499."""


def _now() -> int:
    return int(time.time())


def _clamp_lp(x: float) -> float:
    return x if math.isfinite(x) and x > MIN_LOGPROB else MIN_LOGPROB


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_SSE_DONE = "data: [DONE]\n\n"
_SSE_ENGINE_ERROR = _sse(error_body("The engine failed while generating this request.", "server_error",
                                    code="engine_error"))


async def _group_items(group: RequestGroup, total: int) -> AsyncIterator[tuple[int, Any]]:
    """What a request group's queue delivers, in arrival order, until all `total` choices are done
    (finished or ABORTED) or the engine fails: (index, RequestOutput | ABORTED | EngineFailure); an
    EngineFailure is the last item."""
    done = 0
    while done < total:
        idx, item = await group.queue.get()
        if not isinstance(item, EngineFailure) and (item is ABORTED or item.finished):
            done += 1
        yield idx, item
        if isinstance(item, EngineFailure):
            return


def _join_delta(prev: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """The output so far of a request whose params ask for DELTA outputs: prev (joined earlier
    outputs, or None) followed by out's text, token ids and logprobs; out's finish state."""
    c = out.outputs[0]
    if prev is None:
        joined = CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                  None if c.logprobs is None else list(c.logprobs))
    else:
        joined = prev.outputs[0]
        joined.text += c.text
        joined.token_ids += c.token_ids
        if c.logprobs is not None:
            if joined.logprobs is None:
                joined.logprobs = []
            joined.logprobs.extend(c.logprobs)
        joined.finish_reason, joined.stop_reason = c.finish_reason, c.stop_reason
    return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, [joined], out.finished, out.metrics,
                         num_cached_tokens=out.num_cached_tokens)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (byte-level BPE token strings -> raw bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class _GroupStreamingResponse(StreamingResponse):
    """Aborts the group however the response ends: done, client gone (Starlette cancels the body
    iterator on http.disconnect), or never started."""

    def __init__(self, content: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._group.abort()


class OpenAIServer:
    def __init__(self, engine: LLMEngine, settings: ServerSettings) -> None:
        if engine.tokenizer is None:
            raise ValueError("the server needs a tokenizer; the engine was built without one.")
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.metrics = ServerMetrics()
        self.aengine = AsyncEngine(engine, self.metrics)
        self.created = _now()
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tercel-tok")
        self._tok_str: dict[int, str] = {}
        self._tok_bytes: dict[int, bytes] = {}
        self.tool_parser = pick_parser(settings.tool_call_parser, self.tokenizer.chat_template)

    # ---- helpers --------------------------------------------------------------------------------
    async def _in_tok_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, fn, *args)

    async def read_body(self, request: Request, model: type[BaseModel]) -> Any:
        limit = self.settings.max_body_bytes
        too_big = APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                           code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "Invalid Content-Length header.", code="invalid_body")
            if int(length) > limit:
                await self._drain_body(request)
                raise too_big
        chunks: list[bytes] = []
        total = 0
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    await self._drain_body(request, total)
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:  # hung up mid-body, a broken chunked body, or a body timeout
            raise _ClientGone from None
        try:
            return model.model_validate_json(b"".join(chunks))
        except ValidationError as e:
            raise validation_error_to_api(e) from None

    @staticmethod
    async def _drain_body(request: Request, seen: int = 0) -> None:
        """Read and drop the rest of an oversized body (bounded) so the client gets to read the 413."""
        try:
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > DRAIN_BODY_LIMIT:
                    break
        except Exception:  # the stream may be consumed or the client gone: nothing to drain
            pass

    def check_common(self, req: _SamplingFields) -> None:
        s = self.settings
        if req.model is not None and req.model not in s.model_names:
            raise APIError(400, f"The model '{req.model}' does not exist; this server serves "
                                f"'{s.served_model_name}' (alias 'default').", param="model", code="model_not_found")
        if self.aengine.draining or not self.aengine.healthy:
            raise APIError(503, "The server is shutting down." if self.aengine.draining else
                           "The engine is not running.", type="service_unavailable", code="unavailable")
        if not 1 <= req.n <= s.max_n:
            raise APIError(400, f"'n' must be between 1 and {s.max_n}, got {req.n}.", param="n",
                           code="invalid_value")
        if req.seed is not None and not -(2**63) <= req.seed <= MAX_SEED:
            raise APIError(400, "'seed' must fit in a signed 64-bit integer.", param="seed", code="invalid_value")
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"'stop' may hold at most {MAX_STOP_STRINGS} strings.", param="stop",
                           code="invalid_value")
        if any(not st for st in stops):
            raise APIError(400, "'stop' strings must not be empty.", param="stop", code="invalid_value")
        bad = [t for t in (req.stop_token_ids or []) if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"'stop_token_ids' {bad[:5]} are outside the vocabulary [0, {self.vocab_size}).",
                           param="stop_token_ids", code="invalid_value")
        if req.logit_bias:
            raise APIError(400, "'logit_bias' is not supported by this server.", param="logit_bias",
                           code="unsupported")

    def check_fanout(self, num_prompts: int, n: int) -> None:
        """One HTTP request may start at most max_request_fanout engine requests (prompts x n)."""
        cap = self.settings.max_request_fanout
        if num_prompts * n > cap:
            what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
            raise APIError(400, f"This request asks for {num_prompts * n} completions ({what}); this server "
                                f"allows at most {cap} per request (--max-request-fanout). Send fewer prompts or a "
                                f"smaller 'n', or split the request.", param="n", code="too_many_completions")

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"'{param}' is empty: give at least one token.", param=param, code="invalid_value")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"'{param}' has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size}).",
                           param=param, code="invalid_value")
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the "
                                f"prompt has {len(ids)} tokens (at least one token must remain for the "
                                f"completion). Shorten the prompt.", param=param, code="context_length_exceeded")

    def resolve_max_tokens(self, requested: int | None, param: str, prompt_len: int, default_cap: int | None) -> int:
        remaining = self.max_model_len - prompt_len
        if requested is None:
            return remaining if default_cap is None else min(remaining, default_cap)
        if requested < 1:
            raise APIError(400, f"'{param}' must be at least 1, got {requested}.", param=param, code="invalid_value")
        if requested > remaining:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                                f"for the completion). Reduce the prompt or '{param}'.", param=param,
                           code="context_length_exceeded")
        return requested

    async def compile_structured(self, so: StructuredOutputsParams | None, param: str | None) -> None:
        """Compile a request's constraint before it is queued (cached by the engine's grammar backend), so a
        bad schema, regex or grammar is a 400 naming it."""
        if so is None:
            return
        try:
            await self._in_tok_thread(lambda: self.engine.grammar_backend().compile(so))
        except StructuredOutputError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    def sampling_params(self, req: _SamplingFields, max_tokens: int, logprobs: int | None,
                        seed: int | None, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        # DELTA: each step's output carries only its new tokens (no per-step copy of the whole
        # completion); streams send them as they are, collect() joins them for a full response.
        kw: dict[str, Any] = dict(output_kind=RequestOutputKind.DELTA, max_tokens=max_tokens, logprobs=logprobs,
                                  seed=seed, stop=req.stop,
                                  stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                                  min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
                                  structured_outputs=structured)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        t = kw.get("temperature")
        if t is not None and 0.0 <= t < GREEDY_EPS:
            kw["temperature"] = 0.0
        if req.min_tokens > max_tokens:
            raise APIError(400, f"'min_tokens' ({req.min_tokens}) must not exceed the max tokens ({max_tokens}).",
                           param="min_tokens", code="invalid_value")
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            msg = str(e)
            m = re.match(r"SamplingParams\.(\w+)=", msg)
            param = m.group(1) if m else None
            raise APIError(400, msg.replace("SamplingParams.", "", 1) if m else msg, param=param,
                           code="invalid_value") from None

    async def submit(self, request: Request, requests: list[EngineRequest]) -> RequestGroup:
        if await request.is_disconnected():  # the client gave up while the request queued: skip the work
            raise _ClientGone
        try:
            return await self.aengine.submit(requests, max_waiting=self.settings.max_queue_size)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None

    async def collect(self, request: Request, group: RequestGroup,
                      total: int) -> tuple[list[RequestOutput | None], list[str]]:
        """Wait for every choice to finish, joining its DELTA outputs; abort them all if the client
        disconnects first."""

        async def consume() -> tuple[list[RequestOutput | None], list[str]]:
            last: list[RequestOutput | None] = [None] * total
            reasons: list[str] = [""] * total
            async for idx, item in _group_items(group, total):
                if isinstance(item, EngineFailure):
                    raise APIError(500, "The engine failed while generating this request.", type="server_error",
                                   code="engine_error")
                if item is ABORTED:
                    reasons[idx] = "abort"
                    continue
                last[idx] = _join_delta(last[idx], item)
                if item.finished:
                    reasons[idx] = item.outputs[0].finish_reason or "stop"
            return last, reasons

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer.done():
                return consumer.result()
            raise _ClientGone
        finally:
            consumer.cancel()
            watcher.cancel()
            group.abort()

    # ---- token strings for logprobs -------------------------------------------------------------
    def token_str(self, tid: int) -> str:
        s = self._tok_str.get(tid)
        if s is None:
            s = self._tok_str[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return s

    def token_bytes(self, tid: int) -> bytes:
        b = self._tok_bytes.get(tid)
        if b is None:
            s = self.token_str(tid)
            b = s.encode()
            if "\ufffd" in s:  # part of a multi-byte character: recover the raw bytes if we can
                raw = self.tokenizer.convert_ids_to_tokens([tid])[0]
                dec = _byte_decoder()
                if raw and all(ch in dec for ch in raw):
                    b = bytes(dec[ch] for ch in raw)
                elif m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", raw or ""):
                    b = bytes([int(m.group(1), 16)])
            self._tok_bytes[tid] = b
        return b

    def completion_logprobs(self, token_ids: list[int], lps: list[dict[int, float]],
                            offset: int) -> tuple[dict[str, Any], int]:
        """Legacy /v1/completions shape; top_logprobs holds the chosen token and the top-n (up to n+1)."""
        tokens, token_lps, top, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps):
            s = self.token_str(tid)
            tokens.append(s)
            token_lps.append(_clamp_lp(d.get(tid, MIN_LOGPROB)))
            top.append({self.token_str(k): _clamp_lp(v) for k, v in d.items()})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}, offset

    def chat_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], top_n: int) -> list[dict[str, Any]]:
        content = []
        for tid, d in zip(token_ids, lps):
            top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({
                "token": self.token_str(tid), "logprob": _clamp_lp(d.get(tid, MIN_LOGPROB)),
                "bytes": list(self.token_bytes(tid)),
                "top_logprobs": [{"token": self.token_str(k), "logprob": _clamp_lp(v),
                                  "bytes": list(self.token_bytes(k))} for k, v in top],
            })
        return content

    # ---- /v1/completions ------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self.read_body(request, CompletionRequest)
        self.check_common(req)
        if req.best_of is not None and req.best_of not in (1, req.n):
            raise APIError(400, "'best_of' other than 1 or n is not supported.", param="best_of", code="unsupported")
        if req.suffix:
            raise APIError(400, "'suffix' is not supported by this server.", param="suffix", code="unsupported")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"'logprobs' must be between 0 and {MAX_LOGPROBS}.", param="logprobs",
                           code="invalid_value")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "'echo' together with 'logprobs' is not supported.", param="echo",
                           code="unsupported")
        p = req.prompt
        if isinstance(p, list) and not p:
            raise APIError(400, "'prompt' is empty.", param="prompt", code="invalid_value")
        if isinstance(p, str) or isinstance(p[0], int):
            raw_prompts: list[str | list[int]] = [p]  # type: ignore[list-item]
        else:
            raw_prompts = list(p)  # type: ignore[arg-type]
        if len(raw_prompts) > self.settings.max_batch_prompts:
            raise APIError(400, f"At most {self.settings.max_batch_prompts} prompts per request.", param="prompt",
                           code="invalid_value")
        self.check_fanout(len(raw_prompts), req.n)
        structured, param = structured_params(req)
        await self.compile_structured(structured, param)

        def tokenize() -> list[list[int]]:
            return [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in raw_prompts]

        prompt_ids = await self._in_tok_thread(tokenize)
        rid = f"cmpl-{uuid.uuid4().hex}"
        engine_reqs: list[EngineRequest] = []
        for k, ids in enumerate(prompt_ids):
            self.check_prompt(ids, "prompt")
            max_tokens = self.resolve_max_tokens(req.max_tokens, "max_tokens", len(ids),
                                                 self.settings.completions_default_max_tokens)
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                params = self.sampling_params(req, max_tokens, req.logprobs, seed, structured)
                engine_reqs.append(EngineRequest(f"{rid}-{k * req.n + j}", ids, params))
        echo_texts: list[str] = []
        if req.echo:
            echo_texts = [x if isinstance(x, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
                          for x, ids in zip(raw_prompts, prompt_ids)]
        num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
        group = await self.submit(request, engine_reqs)
        total = len(engine_reqs)
        model = self.settings.served_model_name
        created = _now()

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _GroupStreamingResponse(
                self._stream_completion(group, total, req, rid, model, created, echo_texts, num_prompt_tokens,
                                        include_usage), group)

        last, reasons = await self.collect(request, group, total)
        choices = []
        completion_tokens = 0
        for i in range(total):
            out = last[i]
            text = out.outputs[0].text if out else ""
            token_ids = out.outputs[0].token_ids if out else []
            completion_tokens += len(token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs, _ = self.completion_logprobs(token_ids, (out.outputs[0].logprobs or []) if out else [], 0)
            if req.echo:
                text = echo_texts[i // req.n] + text
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reasons[i],
                            "stop_reason": out.outputs[0].stop_reason if out else None})
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(num_prompt_tokens, completion_tokens, _cached_tokens(last, req.n)),
        })

    async def _stream_completion(self, group: RequestGroup, total: int, req: CompletionRequest, rid: str,
                                 model: str, created: int, echo_texts: list[str], num_prompt_tokens: int,
                                 include_usage: bool) -> AsyncIterator[str]:
        def chunk(i: int, text: str, logprobs: Any = None, finish: str | None = None) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                                   "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                                "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        completion_tokens = [0] * total
        seen: list[RequestOutput | None] = [None] * total  # each completion's latest output (cached tokens)
        offsets = [0] * total
        try:
            if echo_texts:
                for i in range(total):
                    yield chunk(i, echo_texts[i // req.n])
            async for idx, item in _group_items(group, total):
                if isinstance(item, EngineFailure):
                    yield _SSE_ENGINE_ERROR
                    break
                if item is ABORTED:
                    yield chunk(idx, "", None, "abort")
                    continue
                out: RequestOutput = item
                c = out.outputs[0]
                seen[idx] = out
                completion_tokens[idx] += len(out.delta_token_ids)
                finish = c.finish_reason if out.finished else None
                logprobs = None
                if req.logprobs is not None and out.delta_token_ids:
                    logprobs, offsets[idx] = self.completion_logprobs(out.delta_token_ids, c.logprobs or [],
                                                                      offsets[idx])
                if out.delta_text or finish or logprobs:
                    yield chunk(idx, out.delta_text, logprobs, finish)
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(num_prompt_tokens, sum(completion_tokens),
                                                           _cached_tokens(seen, req.n))})
            yield _SSE_DONE
        finally:
            group.abort()

    # ---- /v1/chat/completions -------------------------------------------------------------------
    def chat_messages(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        if not req.messages:
            raise APIError(400, "'messages' is empty: give at least one message.", param="messages",
                           code="invalid_value")
        out: list[dict[str, Any]] = []
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise APIError(400, f"messages[{i}].role {m.role!r} is not one of {sorted(CHAT_ROLES)}.",
                               param=f"messages.{i}.role", code="invalid_value")
            if m.content is None:
                content = ""
            elif isinstance(m.content, str):
                content = m.content
            else:
                texts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                                            f"{part.type!r}.", param=f"messages.{i}.content", code="unsupported")
                    texts.append(part.text)
                content = "\n".join(texts)
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = await self.read_body(request, ChatCompletionRequest)
        self.check_common(req)
        plan = self.tool_plan(req)
        structured, param = structured_params(req)
        if plan is not None and plan.constraint() is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice {plan.choice!r} constrains the output itself; drop '{param}'.",
                               param=param, code="invalid_value")
            structured, param = plan.constraint(), "tools"
        await self.compile_structured(structured, param)
        top_n = req.top_logprobs
        if top_n is not None and not 0 <= top_n <= MAX_LOGPROBS:
            raise APIError(400, f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}.", param="top_logprobs",
                           code="invalid_value")
        if top_n and not req.logprobs:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true.", param="top_logprobs",
                           code="invalid_value")
        self.check_fanout(1, req.n)
        messages = self.chat_messages(req)

        def render() -> list[int]:
            rendered, tools = render_messages(messages, plan, self.tokenizer.supports_tools)
            return self.tokenizer.apply_chat_template(rendered, req.add_generation_prompt, tools=tools)

        try:
            ids = await self._in_tok_thread(render)
        except Exception as e:  # jinja2 TemplateError, ConfigError (no template), ...
            if type(e).__module__.startswith("jinja2") or isinstance(e, ValueError):
                raise APIError(400, f"The chat template rejected the messages: {e}", param="messages",
                               code="invalid_value") from None
            raise
        self.check_prompt(ids, "messages")
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = req.max_tokens, "max_tokens"
        max_tokens = self.resolve_max_tokens(requested, param, len(ids), None)
        logprobs = (top_n or 0) if req.logprobs else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        engine_reqs = [EngineRequest(f"{rid}-{j}", ids,
                                     self.sampling_params(req, max_tokens, logprobs,
                                                          None if req.seed is None else req.seed + j, structured))
                       for j in range(req.n)]
        group = await self.submit(request, engine_reqs)
        model = self.settings.served_model_name
        created = _now()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _GroupStreamingResponse(
                self._stream_chat(group, req.n, rid, model, created, logprobs, len(ids), include_usage, plan), group)

        last, reasons = await self.collect(request, group, req.n)
        choices = []
        completion_tokens = 0
        for i in range(req.n):
            out = last[i]
            c = out.outputs[0] if out else None
            completion_tokens += len(c.token_ids) if c else 0
            lp = None
            if logprobs is not None:
                lp = {"content": self.chat_logprobs(c.token_ids, c.logprobs or [], logprobs) if c else [],
                      "refusal": None}
            message: dict[str, Any] = {"role": "assistant", "content": c.text if c else ""}
            reason = reasons[i]
            if plan is not None and c is not None:
                parsed = plan.parse(c.text)
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": plan.openai_calls(parsed.calls)}
                if parsed.calls and reason == "stop":
                    reason = "tool_calls"
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason,
                            "stop_reason": c.stop_reason if c else None})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(len(ids), completion_tokens, _cached_tokens(last, req.n)),
        })

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        """The request's tools and choice; None without tools."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise APIError(400, "'tool_choice' needs 'tools'.", param="tool_choice", code="invalid_value")
            return None
        names = [t.function.name for t in req.tools]
        if len(set(names)) != len(names):
            raise APIError(400, f"'tools' has duplicate function names: {sorted(names)}.", param="tools",
                           code="invalid_value")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in 'tools' "
                                    f"({', '.join(names)}).", param="tool_choice", code="invalid_value")
            return ToolPlan(self.tool_parser, tools, "named", choice.function.name, req.parallel_tool_calls)
        return ToolPlan(self.tool_parser, tools, choice or "auto", None, req.parallel_tool_calls)

    async def _stream_chat(self, group: RequestGroup, n: int, rid: str, model: str, created: int,
                           logprobs: int | None, num_prompt_tokens: int, include_usage: bool,
                           plan: ToolPlan | None = None) -> AsyncIterator[str]:
        def chunk(i: int, delta: dict[str, Any], lp: Any = None, finish: str | None = None) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                   "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        completion_tokens = [0] * n
        seen: list[RequestOutput | None] = [None] * n  # each completion's latest output (cached tokens)
        tool_streams = [ToolStream(plan) for _ in range(n)] if plan is not None else None
        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for idx, item in _group_items(group, n):
                if isinstance(item, EngineFailure):
                    yield _SSE_ENGINE_ERROR
                    break
                if item is ABORTED:
                    yield chunk(idx, {}, None, "abort")
                    continue
                out: RequestOutput = item
                c = out.outputs[0]
                seen[idx] = out
                completion_tokens[idx] += len(out.delta_token_ids)
                finish = c.finish_reason if out.finished else None
                lp = None
                if logprobs is not None and out.delta_token_ids:
                    lp = {"content": self.chat_logprobs(out.delta_token_ids, c.logprobs or [], logprobs),
                          "refusal": None}
                if tool_streams is None:
                    if out.delta_text or finish or lp:
                        yield chunk(idx, {"content": out.delta_text} if out.delta_text else {}, lp, finish)
                    continue
                ts = tool_streams[idx]
                text, calls = ts.feed(out.delta_text)
                if finish:
                    more_text, more_calls = ts.finish()
                    text, calls = text + more_text, calls + more_calls
                    if finish == "stop" and (calls or ts.sent_calls):
                        finish = "tool_calls"
                delta: dict[str, Any] = {}
                if text:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = calls
                if delta or finish or lp:
                    yield chunk(idx, delta, lp, finish)
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(num_prompt_tokens, sum(completion_tokens),
                                                           _cached_tokens(seen, n))})
            yield _SSE_DONE
        finally:
            group.abort()

    # ---- /tokenize, /detokenize (vLLM) ----------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        req: TokenizeRequest = await self.read_body(request, TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give either 'prompt' or 'messages'.", param="prompt", code="invalid_value")

        def run() -> list[int]:
            if req.messages is not None:
                chat = ChatCompletionRequest.model_construct(messages=req.messages)
                return self.tokenizer.apply_chat_template(self.chat_messages(chat), req.add_generation_prompt)
            return self.tokenizer.encode_with_special(req.prompt, req.add_special_tokens)

        try:
            ids = await self._in_tok_thread(run)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"The chat template rejected the messages: {e}", param="messages",
                           code="invalid_value") from None
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        req: DetokenizeRequest = await self.read_body(request, DetokenizeRequest)
        self._check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"'tokens' {bad[:5]} are outside the vocabulary [0, {self.vocab_size}).",
                           param="tokens", code="invalid_value")
        text = await self._in_tok_thread(lambda: self.tokenizer.decode(req.tokens, skip_special_tokens=False))
        return JSONResponse({"prompt": text})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.model_names:
            raise APIError(400, f"The model '{model}' does not exist; this server serves "
                                f"'{self.settings.served_model_name}' (alias 'default').", param="model",
                           code="model_not_found")

    # ---- small endpoints ------------------------------------------------------------------------
    def _card(self) -> ModelCard:
        return ModelCard(id=self.settings.served_model_name, created=self.created, root=self.settings.model_path,
                         max_model_len=self.max_model_len)

    async def models(self, request: Request) -> Response:
        return JSONResponse(ModelList(data=[self._card()]).model_dump())

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if name not in self.settings.model_names:
            raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return JSONResponse(self._card().model_dump())

    async def health(self, request: Request) -> Response:
        if self.aengine.healthy and not self.aengine.draining:
            return JSONResponse({"status": "ok"})
        status = "draining" if self.aengine.draining else "engine not running"
        return JSONResponse({"status": status}, status_code=503)

    async def metrics_endpoint(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


def _usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """cached: prompt tokens served from the prefix cache (each prompt counted once, as prompt_tokens is)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _cached_tokens(outs: list[RequestOutput | None], n: int) -> int:
    """Per prompt, the cached tokens of its first completion (outs: n completions per prompt, in order)."""
    return sum(o.num_cached_tokens for o in outs[::n] if o is not None)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so receive() only wakes for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _guard(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Errors as OpenAI JSON; anything unexpected is logged and answered with a generic 500."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as e:
            return _error_response(e)
        except _ClientGone:
            if request.scope.get(BODY_TIMEOUT_KEY):  # the connection layer answered 408: count what was answered
                return Response(status_code=408)
            log.debug("client closed the connection during %s %s", request.method, request.url.path)
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return JSONResponse(error_body("Internal server error.", "server_error", code="internal_error"),
                                status_code=500)

    return wrapper


class _AuthAndMetricsMiddleware:
    """Pure ASGI (keeps streaming and disconnect detection intact): API-key check, request counting."""

    def __init__(self, app, server: OpenAIServer) -> None:
        self.app = app
        self.server = server
        key = server.settings.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = 500

        async def send_wrapper(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.expected is not None and path not in OPEN_PATHS:
                got = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
                if not hmac.compare_digest(got, self.expected):
                    e = APIError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                    await _error_response(e)(scope, receive, send_wrapper)
                    return
            await self.app(scope, receive, send_wrapper)
        finally:
            endpoint = path if path in ENDPOINTS else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
            self.server.metrics.requests.labels(endpoint, str(status)).inc()


def build_app(engine: LLMEngine, settings: ServerSettings, owns_engine: bool = False) -> FastAPI:
    """The FastAPI app serving `engine`; owns_engine (tercel serve): the app's shutdown also gives back the
    engine's memory (LLMEngine.shutdown), else the caller keeps the engine for further use."""
    server = OpenAIServer(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.aengine.start()
        try:
            yield
        finally:
            await server.aengine.shutdown(release_engine=owns_engine)
            server._tok_pool.shutdown(wait=False, cancel_futures=True)

    # /openapi.json and /docs sit behind the API key like every route but /health.
    app = FastAPI(title="Tercel", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = server
    app.add_api_route("/v1/completions", _guard(server.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", _guard(server.chat_completions), methods=["POST"])
    app.add_api_route("/tokenize", _guard(server.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", _guard(server.detokenize), methods=["POST"])
    app.add_api_route("/v1/models", _guard(server.models), methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", _guard(server.model), methods=["GET"])
    app.add_api_route("/health", _guard(server.health), methods=["GET"])
    app.add_api_route("/metrics", _guard(server.metrics_endpoint), methods=["GET"])
    app.openapi = build_openapi(app, OPEN_PATHS, settings.api_key is not None)  # type: ignore[method-assign]

    async def docs(request: Request) -> Response:  # self-contained: no CDN, so it works offline
        return HTMLResponse(render_docs(app.openapi()))

    app.add_api_route("/docs", _guard(docs), methods=["GET"], include_in_schema=False)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", code=str(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body("Invalid request.", code="invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("Internal server error.", "server_error", code="internal_error"),
                            status_code=500)

    app.add_middleware(_AuthAndMetricsMiddleware, server=server)
    return app
