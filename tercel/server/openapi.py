"""/openapi.json: the request and response schemas of every route.

The handlers read their bodies by hand (size limit, strict JSON, OpenAI-style errors), so FastAPI
cannot infer these schemas; they come from the pydantic models in protocol.py, one table below.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import protocol as p

REF = "#/components/schemas/{model}"
_ERRORS = {400: "Invalid request", 401: "Missing or incorrect API key", 404: "Unknown model",
           413: "Request body over --max-body-bytes", 429: "Queue full (see Retry-After)",
           500: "Internal or engine error", 503: "Shutting down or engine not running"}
_GENERATE_ERRORS = (400, 401, 413, 429, 500, 503)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _generate_ok(full: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    return {"description": f"`stream: false`: one JSON object. `stream: true`: server-sent events, each "
                           f"`data: <{chunk.__name__}>`, ending with `data: [DONE]`.",
            "content": {**_json(full), "text/event-stream": {"schema": _sse_event(chunk)}}}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1 describes an event stream by its events): its `data`
    is a chunk as JSON (an error object if the engine fails mid-stream), or `[DONE]` at the end."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref(p.ErrorResponse)]}}
    return {"type": "object", "required": ["data"],
            "description": f"A server-sent event: `data: <{chunk.__name__}>`; the last one is `data: [DONE]`.",
            "properties": {"data": {"oneOf": [{"const": "[DONE]"}, payload]}, "event": {"type": "string"},
                           "id": {"type": "string"}, "retry": {"type": "integer"}}}


# (path, method) -> (request model or None, {status: response}, extra operation fields)
_ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | None, dict[int, dict[str, Any]], dict[str, Any]]] = {
    ("/v1/completions", "post"): (
        p.CompletionRequest, {200: _generate_ok(p.CompletionResponse, p.CompletionStreamResponse)},
        {"summary": "Text completion (OpenAI /v1/completions)"}),
    ("/v1/chat/completions", "post"): (
        p.ChatCompletionRequest, {200: _generate_ok(p.ChatCompletionResponse, p.ChatCompletionStreamResponse)},
        {"summary": "Chat completion (OpenAI /v1/chat/completions)"}),
    ("/tokenize", "post"): (p.TokenizeRequest,
                            {200: {"description": "The token ids", "content": _json(p.TokenizeResponse)}},
                            {"summary": "Tokenize a prompt or chat messages (vLLM /tokenize)"}),
    ("/detokenize", "post"): (p.DetokenizeRequest,
                              {200: {"description": "The text", "content": _json(p.DetokenizeResponse)}},
                              {"summary": "Token ids to text (vLLM /detokenize)"}),
    ("/v1/models", "get"): (None, {200: {"description": "The served model", "content": _json(p.ModelList)}},
                            {"summary": "List models"}),
    ("/v1/models/{model_id}", "get"): (
        None, {200: {"description": "The model", "content": _json(p.ModelCard)}},
        {"summary": "Describe a model",
         "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]}),
    ("/health", "get"): (
        None, {200: {"description": "Ready", "content": _json(p.HealthResponse)},
               503: {"description": "Draining or engine not running", "content": _json(p.HealthResponse)}},
        {"summary": "Readiness (open without the API key)"}),
    ("/metrics", "get"): (
        None, {200: {"description": "Prometheus text format",
                     "content": {"text/plain": {"schema": {"type": "string"}}}}},
        {"summary": "Prometheus metrics"}),
}
_ERRORS_OF = {("/v1/completions", "post"): _GENERATE_ERRORS, ("/v1/chat/completions", "post"): _GENERATE_ERRORS,
              ("/v1/models", "get"): (401,), ("/v1/models/{model_id}", "get"): (401, 404), ("/health", "get"): (),
              ("/metrics", "get"): (401,), ("/tokenize", "post"): (400, 401, 413, 500),
              ("/detokenize", "post"): (400, 401, 413, 500)}
_STREAM_MODELS = (p.CompletionStreamResponse, p.ChatCompletionStreamResponse)


def _component_schemas() -> dict[str, Any]:
    requests = [(m, "validation") for m in (p.CompletionRequest, p.ChatCompletionRequest, p.TokenizeRequest,
                                             p.DetokenizeRequest)]
    responses = [(m, "serialization") for m in (p.ErrorResponse, p.CompletionResponse, p.ChatCompletionResponse,
                                                 p.ModelList, p.ModelCard, p.HealthResponse, p.TokenizeResponse,
                                                 p.DetokenizeResponse, *_STREAM_MODELS)]
    _, top = models_json_schema(requests + responses, ref_template=REF)  # type: ignore[arg-type]
    return top["$defs"]


def build_openapi(app: FastAPI, open_paths: frozenset[str], api_key_set: bool) -> Callable[[], dict[str, Any]]:
    """A replacement for app.openapi: FastAPI's paths with the schemas above filled in (cached)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if cache:
            return cache
        schema = get_openapi(title="Tercel", version=app.version, routes=app.routes,
                             description="OpenAI-compatible inference server (speculative decoding).")
        components = schema.setdefault("components", {})
        components["schemas"] = _component_schemas()
        if api_key_set:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                         "description": "the server's --api-key"}}
        for (path, method), (body, ok, extra) in _ROUTES.items():
            op = schema["paths"][path][method]
            op.update(extra)
            responses: dict[str, Any] = {str(status): r for status, r in ok.items()}
            for status in _ERRORS_OF[(path, method)]:
                if status == 401 and not api_key_set:
                    continue
                responses[str(status)] = {"description": _ERRORS[status], "content": _json(p.ErrorResponse)}
            op["responses"] = responses
            if body is not None:
                op["requestBody"] = {"required": True, "content": _json(body)}
            if api_key_set and path not in open_paths:
                op["security"] = [{"bearer": []}]
        cache.update(schema)
        return cache

    return openapi
