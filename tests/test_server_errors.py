"""Acceptance 3 (bad input) and 4 (auth) against one small real server: --api-key, a 256-token
context, a 16 KiB body limit, 2 running + 2 waiting requests at most.

Every bad request gets its status code and an OpenAI-style error body
{"error": {"message", "type", "param", "code"}}, and /health answers 200 after each.
"""
from __future__ import annotations

import json
import time

import openai
import pytest
from server_harness import http_client, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

API_KEY = "test-key-123"
MAX_MODEL_LEN = 256
LONG_TEXT = "hello " * 400  # > 256 tokens, < 16 KiB


@pytest.fixture(scope="module")
def server():
    yield from running_server("--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", "16KiB", "--max-num-seqs",
                              "2", "--max-queue-size", "2", "--max-n", "4", api_key=API_KEY, with_reference=False)


@pytest.fixture(scope="module")
def http(server):
    with http_client(base_url=server.base_url, timeout=60.0, headers=server.headers()) as c:
        yield c


def assert_error(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_healthy(server) -> None:
    with http_client(timeout=10.0) as c:  # no API key: /health stays open
        r = c.get(server.base_url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


C = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, path, body: dict or raw bytes, status, param, code)
BAD_REQUESTS = [
    ("invalid_json", C, b'{"prompt": "hi", ', 400, None, "invalid_json"),
    ("empty_body", C, b"", 400, None, "invalid_json"),
    ("body_not_object", C, b"[1, 2, 3]", 400, None, "invalid_body"),
    ("nan_number", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", None),
    ("missing_prompt", C, {"max_tokens": 2}, 400, "prompt", None),
    ("prompt_wrong_type", C, {"prompt": {"text": "hi"}}, 400, "prompt", None),
    ("prompt_mixed_list", C, {"prompt": [1, "a"]}, 400, "prompt", None),
    ("prompt_empty_string", C, {"prompt": ""}, 400, "prompt", None),
    ("prompt_empty_list", C, {"prompt": []}, 400, "prompt", None),
    ("prompt_too_long", C, {"prompt": LONG_TEXT}, 400, "prompt", "context_length_exceeded"),
    ("token_ids_too_long", C, {"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    ("token_id_outside_vocab", C, {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("token_id_negative", C, {"prompt": [1, -3]}, 400, "prompt", None),
    ("max_tokens_zero", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens_negative", C, {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens", None),
    ("max_tokens_beyond_context", C, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens",
     "context_length_exceeded"),
    ("max_tokens_string", C, {"prompt": "hi", "max_tokens": "16"}, 400, "max_tokens", None),
    ("max_tokens_float", C, {"prompt": "hi", "max_tokens": 16.5}, 400, "max_tokens", None),
    ("temperature_negative", C, {"prompt": "hi", "temperature": -0.1}, 400, "temperature", None),
    ("temperature_string", C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("top_p_zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("top_p_above_one", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("top_k_negative", C, {"prompt": "hi", "top_k": -7}, 400, "top_k", None),
    ("min_p_above_one", C, {"prompt": "hi", "min_p": 2}, 400, "min_p", None),
    ("presence_penalty_range", C, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("frequency_penalty_range", C, {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty", None),
    ("n_zero", C, {"prompt": "hi", "n": 0}, 400, "n", None),
    ("n_too_large", C, {"prompt": "hi", "n": 5}, 400, "n", None),
    ("n_bool", C, {"prompt": "hi", "n": True}, 400, "n", None),
    ("logprobs_too_many", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("logprobs_bool", C, {"prompt": "hi", "logprobs": True}, 400, "logprobs", None),
    ("stop_wrong_type", C, {"prompt": "hi", "stop": 5}, 400, "stop", None),
    ("stop_empty_string", C, {"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ("stop_too_many", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", None),
    ("seed_too_big", C, {"prompt": "hi", "seed": 2**70}, 400, "seed", None),
    ("stream_wrong_type", C, {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("unknown_model", C, {"model": "gpt-4", "prompt": "hi"}, 400, "model", "model_not_found"),
    ("logit_bias_unsupported", C, {"prompt": "hi", "logit_bias": {"50": -100}}, 400, "logit_bias", "unsupported"),
    ("echo_with_logprobs", C, {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo", "unsupported"),
    ("chat_invalid_json", CHAT, b'{"messages": [', 400, None, "invalid_json"),
    ("chat_missing_messages", CHAT, {"max_tokens": 2}, 400, "messages", None),
    ("chat_empty_messages", CHAT, {"messages": []}, 400, "messages", None),
    ("chat_messages_not_list", CHAT, {"messages": "hi"}, 400, "messages", None),
    ("chat_message_not_object", CHAT, {"messages": ["hi"]}, 400, "messages.0", None),
    ("chat_message_missing_role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role", None),
    ("chat_bad_role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
    ("chat_content_wrong_type", CHAT, {"messages": [{"role": "user", "content": 42}]}, 400, "messages.0.content",
     None),
    ("chat_image_part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}, 400, "messages.0.content",
     "unsupported"),
    ("chat_prompt_too_long", CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages",
     "context_length_exceeded"),
    ("chat_max_tokens_zero", CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens", None),
    ("chat_max_completion_tokens_beyond", CHAT, {"messages": USER, "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens", "context_length_exceeded"),
    ("chat_temperature_negative", CHAT, {"messages": USER, "temperature": -1}, 400, "temperature", None),
    ("chat_top_p_above_one", CHAT, {"messages": USER, "top_p": 1.01}, 400, "top_p", None),
    ("chat_n_too_large", CHAT, {"messages": USER, "n": 100}, 400, "n", None),
    ("chat_logprobs_int", CHAT, {"messages": USER, "logprobs": 3}, 400, "logprobs", None),
    ("chat_top_logprobs_without_logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("chat_top_logprobs_too_many", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", None),
    ("chat_unknown_model", CHAT, {"model": "nope", "messages": USER}, 400, "model", "model_not_found"),
    ("chat_empty_role", CHAT, {"messages": [{"role": "", "content": "hi"}]}, 400, "messages.0.role", None),
    ("chat_tool_without_type", CHAT, {"messages": USER, "tools": [{"function": {"name": "f"}}]}, 400,
     "tools.0.type", None),
    ("chat_tool_choice_unknown_function", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", None),
    ("chat_tool_choice_without_tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice",
     None),
    ("chat_bad_json_schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, 400, "response_format", None),
    ("guided_regex_bad", C, {"prompt": "hi", "guided_regex": "a("}, 400, "guided_regex", None),
    ("two_constraints", C, {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice",
     None),
    ("chat_stream_options_wrong_type", CHAT, {"messages": USER, "stream": True, "stream_options": "usage"}, 400,
     "stream_options", None),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(server, http, case):
    _, path, body, status, param, code = case
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert_error(r, status, param, code)
    assert_healthy(server)


def test_streaming_bad_request_is_an_http_error_not_a_stream(server, http):
    r = http.post(C, json={"prompt": LONG_TEXT, "stream": True})
    assert r.headers["content-type"].startswith("application/json")
    assert_error(r, 400, "prompt", "context_length_exceeded")
    assert_healthy(server)


def test_body_over_limit_is_413(server, http):
    body = json.dumps({"prompt": "x" * 20_000}).encode()  # > 16 KiB
    assert_error(http.post(C, content=body, headers={"Content-Type": "application/json"}), 413,
                 code="request_too_large")
    assert_healthy(server)

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(10):
            yield b" " * 4096
        yield b'{"prompt": "hi"}'

    assert_error(http.post(C, content=chunked(), headers={"Content-Type": "application/json"}), 413)
    assert_healthy(server)


def test_unknown_route_and_method(server, http):
    assert_error(http.get("/v1/nope"), 404)
    assert_error(http.get(C), 405)
    assert_healthy(server)


def test_unknown_fields_are_ignored(server, http):
    r = http.post(C, json={"prompt": "hi", "max_tokens": 1, "definitely_not_a_field": [1, 2], "user": "me"})
    assert r.status_code == 200, r.text
    assert_healthy(server)


def test_default_max_tokens_fill_the_context(server, http):
    """No max_tokens: chat gets the rest of the context, completions min(16, rest of the context)."""
    long_chat = [{"role": "user", "content": "hello " * 215}]
    r = http.post(CHAT, json={"messages": long_chat, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["completion_tokens"] == MAX_MODEL_LEN - u["prompt_tokens"] and u["completion_tokens"] > 0
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = http.post(C, json={"prompt": "hello " * 248, "temperature": 0, "ignore_eos": True})
    u = r.json()["usage"]
    assert u["completion_tokens"] == min(16, MAX_MODEL_LEN - u["prompt_tokens"]) < 16
    r = http.post(C, json={"prompt": "hello", "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16


def test_full_queue_is_429_with_retry_after(server, http):
    """2 running + 2 waiting fill the server; the next request gets 429 and Retry-After."""
    streams = []
    try:
        for _ in range(4):
            cm = http.stream("POST", C, json={"prompt": "Count:", "max_tokens": 240, "ignore_eos": True,
                                              "stream": True})
            r = cm.__enter__()
            streams.append(cm)
            assert r.status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = server.metrics()
            if m["tercel_num_requests_running"] == 2 and m["tercel_num_requests_waiting"] == 2:
                break
            time.sleep(0.05)
        assert (m["tercel_num_requests_running"], m["tercel_num_requests_waiting"]) == (2, 2), m
        r = http.post(C, json={"prompt": "hi", "max_tokens": 1})
        assert_error(r, 429, code="queue_full")
        assert r.headers["retry-after"] == "1"
        r = http.post(CHAT, json={"messages": USER, "max_tokens": 1, "stream": True})
        assert_error(r, 429, code="queue_full")
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)  # disconnect: the server aborts them
    server.wait_idle()
    assert_healthy(server)
    m = server.metrics()
    assert m['tercel_requests_total{endpoint="/v1/completions",status="429"}'] >= 1


# ---- acceptance 4: API key ----------------------------------------------------------------------

@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", C), ("POST", CHAT), ("GET", "/metrics")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {API_KEY}", API_KEY, "Bearer",
                                  f"Bearer {API_KEY}x", f"bearer {API_KEY[:-1]}"])
def test_missing_or_wrong_key_is_401(server, method, path, auth):
    headers = {"Authorization": auth} if auth is not None else {}
    body = {"messages": USER, "prompt": "hi", "max_tokens": 1}
    with http_client(timeout=30.0) as c:
        r = c.request(method, server.base_url + path, headers=headers, json=body if method == "POST" else None)
    err = assert_error(r, 401, code="invalid_api_key")
    assert API_KEY not in err["message"]
    assert r.headers.get("www-authenticate") == "Bearer"
    assert_healthy(server)


def test_health_is_open_and_key_works(server):
    assert_healthy(server)
    with http_client(timeout=30.0) as c:
        assert c.get(server.base_url + "/v1/models", headers=server.headers()).status_code == 200
        assert c.get(server.base_url + "/metrics", headers=server.headers()).status_code == 200


def test_openai_client_auth(server):
    good = server.openai()
    assert good.completions.create(model="default", prompt="hi", max_tokens=1).usage.completion_tokens == 1
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0,
                        http_client=http_client(timeout=30.0))
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt="hi", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError):
        good.completions.create(model="default", prompt="hi", max_tokens=0)
