"""Issue #25, acceptance 4: /openapi.json against one real server (tiny random model, API key).

The schema validates as OpenAPI 3 (openapi-spec-validator), documents a request body for each POST
and a response schema for every status of every route, sits behind the API key, real responses
match it, and a schemathesis run against it finds no server error and no response that breaks it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate
from server_harness import http_client, running_server, tiny_server_args

pytestmark = [pytest.mark.timeout(300)]

API_KEY = "openapi-key"
MAX_MODEL_LEN = 64  # keeps every generated completion short
ROUTES = {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
          ("/v1/models/{model_id}", "get"), ("/health", "get"), ("/metrics", "get"), ("/tokenize", "post"),
          ("/detokenize", "post")}


@pytest.fixture(scope="module")
def server():
    yield from running_server(*tiny_server_args("--max-model-len", str(MAX_MODEL_LEN), "--max-n", "2",
                                                "--max-request-fanout", "4"), api_key=API_KEY, with_reference=False)


@pytest.fixture(scope="module")
def http(server):
    with http_client(base_url=server.base_url, timeout=60.0, headers=server.headers()) as c:
        yield c


@pytest.fixture(scope="module")
def spec(http):
    r = http.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def test_openapi_json_and_docs_sit_behind_the_api_key(server, http):
    with http_client(base_url=server.base_url, timeout=10.0) as anonymous:
        for path in ("/openapi.json", "/docs"):
            r = anonymous.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert anonymous.get("/health").status_code == 200
    r = http.get("/docs")
    assert r.status_code == 200 and "/openapi.json" in r.text


def test_models_show_the_model_name_as_id_and_the_model_as_given_as_root(http):
    model = tiny_server_args()[0]  # the server was started with this directory
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == Path(model).name and card["root"] == model  # vLLM: root is the model argument
    assert http.get(f"/v1/models/{card['id']}").json() == card


def test_docs_page_is_self_contained_and_lists_every_route(http, spec):
    """/docs works offline: no script or stylesheet from elsewhere, and every route of /openapi.json is on it."""
    r = http.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<script" not in page and "http://" not in page and "https://" not in page, "an external asset"
    for path, item in spec["paths"].items():
        for method in item:
            assert f'id="{method}-{path}"' in page, (method, path)
    for name in spec["components"]["schemas"]:
        assert f'id="schema-{name}"' in page, name


def test_openapi_json_validates_and_documents_every_route(spec):
    validate(spec)  # raises on anything that is not valid OpenAPI 3
    assert spec["openapi"].startswith("3.")
    ops = {(path, method) for path, item in spec["paths"].items() for method in item}
    assert ops == ROUTES
    schemas = spec["components"]["schemas"]
    for path, method in ROUTES:
        op = spec["paths"][path][method]
        assert "200" in op["responses"], (path, method)
        for status, response in op["responses"].items():
            assert response.get("content"), (path, method, status)  # every status has a body schema
        if path not in ("/health",):
            assert op["security"] == [{"bearer": []}] and "401" in op["responses"], (path, method)
        if method == "post":
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in schemas
            for status in ("400", "413", "500") + (("429", "503") if path.startswith("/v1/") else ()):
                assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
                    "/ErrorResponse")
    assert set(schemas["CompletionRequest"]["required"]) == {"prompt"}
    assert set(schemas["ChatCompletionRequest"]["required"]) == {"messages"}
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1  # the tightened chat schema: no empty conversation ...
    assert set(schemas["ChatMessage"]["properties"]["role"]["enum"]) == {"system", "user", "assistant", "tool",
                                                                         "developer"}  # ... and no role ''
    for name in ("tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs",
                 "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        assert name in chat, name
    assert {"structured_outputs", "response_format"} <= set(schemas["CompletionRequest"]["properties"])
    stream = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    payload = stream["schema"]["properties"]["data"]["oneOf"][1]  # each event's data: a chunk, as JSON
    assert payload["contentSchema"]["anyOf"][0]["$ref"].endswith("/ChatCompletionStreamResponse")
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def _check(spec: dict, path: str, method: str, r) -> None:
    """r's JSON body must match the schema the spec gives for its status."""
    content = spec["paths"][path][method]["responses"][str(r.status_code)]["content"]
    schema = dict(content["application/json"]["schema"], components=spec["components"])
    OAS31Validator(schema).validate(r.json())


def test_real_responses_match_their_schemas(spec, http):
    user = [{"role": "user", "content": "hi"}]
    calls = [
        ("/v1/completions", {"prompt": "The capital", "max_tokens": 3, "logprobs": 2, "n": 2, "seed": 1}),
        ("/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "echo": True}),
        ("/v1/completions", {"prompt": "hi", "stop": ["e"], "max_tokens": 4, "temperature": 1.0}),
        ("/v1/chat/completions", {"messages": user, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": user, "max_tokens": 2, "n": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}),  # 400: over the context
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}),  # 400: over --max-request-fanout
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "", "content": "hi"}]}),
        ("/v1/chat/completions", {"messages": user, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objec"}}}}),
    ]
    statuses = []
    for path, body in calls:
        r = http.post(path, json=body)
        statuses.append(r.status_code)
        _check(spec, path, "post", r)
    assert statuses == [200] * 5 + [400] * 5
    for path, template in (("/v1/models", "/v1/models"), ("/v1/models/default", "/v1/models/{model_id}"),
                           ("/v1/models/nope", "/v1/models/{model_id}"), ("/health", "/health")):
        _check(spec, template, "get", http.get(path))
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "text/event-stream" in spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]


def _chat_200s(http) -> float:
    """Successful chat completions so far, from the server's request counter."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("tercel_requests_total{") and 'endpoint="/v1/chat/completions"' in line \
                and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(server, http, tmp_path: Path):
    before = _chat_200s(http)
    st = shutil.which("st", path=os.path.dirname(sys.executable)) or shutil.which("st")
    assert st, "schemathesis is not installed: pip install -e '.[test]'"
    cmd = [st, "run", server.base_url + "/openapi.json", "--header", f"Authorization: Bearer {API_KEY}",
           "--checks", "not_a_server_error,response_schema_conformance,status_code_conformance,"
                       "content_type_conformance",
           "--max-examples", "25", "--seed", "25", "--request-timeout", "30",
           "--phases", "examples,coverage,fuzzing"]
    env = dict(os.environ, NO_PROXY="127.0.0.1", no_proxy="127.0.0.1", SCHEMATHESIS_HOOKS="")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert "passed" in r.stdout and "Operations:       8 selected / 8 total" in r.stdout, r.stdout[-3000:]
    assert " ERROR " not in server.log_tail(100_000)
    chat_ok = _chat_200s(http) - before
    print(f"schemathesis: {chat_ok:.0f} successful chat completions")
    assert chat_ok >= 5, r.stdout[-3000:]  # the tightened schema lets the fuzzer reach real completions
