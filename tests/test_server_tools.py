"""Structured output and tool calling through the server, driven by the official openai client on SmolLM2.

response_format json_schema (strict) and json_object round trips; structured_outputs / guided_* extras
in /v1/completions; a bad schema is a 400 naming it; tools with tool_choice auto (a conversation that
has called the tool before), required and a named function give tool_calls whose arguments parse and
validate against the function's schema, stream as tool-call deltas, and the tool result sent back yields
a final answer; /tokenize and /detokenize as vLLM serves them."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_harness import http_client, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _call(city: str, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]}


# an agent conversation that has used the tool before (what a 135M model needs to call it on its own)
HISTORY = [{"role": "user", "content": "What is the weather in Paris?"}, _call("Paris", 1),
           {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call_1"},
           {"role": "assistant", "content": "It is 18 degrees in Paris."},
           {"role": "user", "content": "What is the weather in Berlin?"}, _call("Berlin", 2),
           {"role": "tool", "content": '{"temp": 12}', "tool_call_id": "call_2"},
           {"role": "assistant", "content": "It is 12 degrees in Berlin."}]
ASK = [{"role": "user", "content": "What is the weather in Tokyo?"}]


@pytest.fixture(scope="module")
def server():
    yield from running_server("--max-model-len", "2048", with_reference=False)


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _args_ok(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_PARAMS)
    return args


def test_response_format_json_schema_and_json_object(client):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe a person as JSON."}], temperature=0,
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                                "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give me a JSON object."}], temperature=1.0, seed=3,
        max_tokens=80, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a JSON object's prefix
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_completions_structured_extras(client):
    r = client.completions.create(model="default", prompt="Is the sky blue? Answer:", max_tokens=5, temperature=1.0,
                                  seed=1, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model="default", prompt="A phone number:", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert len(r.choices[0].text) == 8 and r.choices[0].text[3] == "-"
    r = client.completions.create(model="default", prompt="A person:", max_tokens=40, temperature=0,
                                  extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_bad_constraints_are_400s_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError, match="objec"):
        client.chat.completions.create(model="default", messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}})
    with pytest.raises(openai.BadRequestError, match="regex cannot be compiled") as e:
        client.completions.create(model="default", prompt="x", max_tokens=4, extra_body={"guided_regex": "a("})
    assert e.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError, match="one structured-output"):
        client.completions.create(model="default", prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        client.chat.completions.create(model="default", messages=ASK, max_tokens=4, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_tool_choice_auto_calls_the_tool_and_takes_the_result(client):
    r = client.chat.completions.create(model="default", messages=HISTORY + ASK, tools=TOOLS, tool_choice="auto",
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert _args_ok(call)["city"] == "Tokyo"
    # the tool result goes back; the final answer is text
    follow = HISTORY + ASK + [choice.message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 25}'}]
    r = client.chat.completions.create(model="default", messages=follow, tools=TOOLS, temperature=0, max_tokens=30)
    final = r.choices[0]
    assert final.finish_reason in ("stop", "length") and not final.message.tool_calls and final.message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_required_and_named_choices_are_constrained(client, choice):
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, temperature=1.0, seed=7, max_tokens=60)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    _args_ok(calls[0])


@pytest.mark.parametrize("choice,messages", [("auto", HISTORY + ASK), ("required", ASK),
                                             ({"type": "function", "function": {"name": "get_weather"}}, ASK)],
                         ids=["auto", "required", "named"])
def test_tool_calls_stream_as_deltas(client, choice, messages):
    stream = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=False, temperature=0, max_tokens=60, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = c["id"] or d.id
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    c = calls[0]
    assert c["id"].startswith("call_") and c["name"] == "get_weather"
    jsonschema.validate(json.loads(c["arguments"]), WEATHER_PARAMS)


def test_tokenize_and_detokenize(server):
    with http_client(base_url=server.base_url, timeout=60.0) as http:
        r = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
        body = r.json()
        assert r.status_code == 200 and body["count"] == len(body["tokens"]) == 2
        assert body["max_model_len"] == 2048 and body["token_strs"][0] == "hello"
        assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "hello world"}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["count"] > 5  # rendered by the chat template
        assert http.post("/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
        assert http.post("/tokenize", json={}).status_code == 400
