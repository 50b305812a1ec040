"""Tool-call parsers on each family's real output strings (the formats their chat templates teach):
Hermes / Qwen2.5 <tool_call> blocks, Qwen3-Coder's XML parameters, Llama 3.1's JSON with <|python_tag|>,
Mistral's [TOOL_CALLS] list (v3) and name[ARGS] form (v11); content outside the calls is kept; streaming
holds back a marker while it is still being written; tool plans build the constraints of required / named
choices, and the fallback rendering writes history calls and results in the parser's format."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tercel.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    QwenParser,
    parser_for_template,
)
from tercel.server.tools import ToolPlan, ToolStream, pick_parser, render_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]


def _calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.calls]


def test_hermes_blocks_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
    out = HermesParser().parse(text, TOOLS)
    assert out.content == "Let me check."
    assert _calls(out) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]
    assert HermesParser().parse("Just text, no call.", TOOLS).calls == []
    broken = HermesParser().parse("<tool_call>\n{not json</tool_call>", TOOLS)
    assert broken.calls == [] and broken.content == "<tool_call>\n{not json</tool_call>"


def test_qwen25_json_and_qwen3_coder_xml():
    q25 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beijing"}}\n</tool_call>'
    assert _calls(QwenParser().parse(q25, TOOLS)) == [("get_weather", {"city": "Beijing"})]
    coder = ("I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    out = QwenParser().parse(coder, TOOLS)
    assert out.content == "I'll look it up."
    assert _calls(out) == [("get_weather", {"city": "San Francisco", "days": 3})]  # typed by the schema


def test_llama3_json():
    p = Llama3JsonParser()
    assert _calls(p.parse('{"name": "get_weather", "parameters": {"city": "Rome"}}', TOOLS)) == [
        ("get_weather", {"city": "Rome"})]
    two = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", ' \
          '"parameters": {"tz": "CET"}}'
    assert [n for n, _ in _calls(p.parse(two, TOOLS))] == ["get_weather", "get_time"]
    plain = p.parse("Rome is sunny today.", TOOLS)
    assert plain.calls == [] and plain.content == "Rome is sunny today."


def test_mistral_v3_and_v11():
    p = MistralParser()
    v3 = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "get_time", ' \
         '"arguments": {"tz": "CET"}}]'
    assert _calls(p.parse(v3, TOOLS)) == [("get_weather", {"city": "Lyon"}), ("get_time", {"tz": "CET"})]
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    assert _calls(p.parse(v11, TOOLS)) == [("get_weather", {"city": "Nice"}), ("get_time", {"tz": "UTC"})]
    assert p.parse("No tools needed.", TOOLS).calls == []


def test_parser_from_template_and_flag():
    assert isinstance(parser_for_template("{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(parser_for_template("<|python_tag|>{{ x }}"), Llama3JsonParser)
    assert isinstance(parser_for_template("<|im_start|>{{ m }}"), HermesParser)
    assert isinstance(pick_parser("qwen", None), QwenParser)
    with pytest.raises(ValueError, match="hermes"):
        pick_parser("nope", None)


def test_call_start_holds_back_a_partial_marker():
    p = HermesParser()
    assert p.call_start("Sure. <tool") == len("Sure. ")
    assert p.call_start("Sure. <tool_call>{") == len("Sure. ")
    assert p.call_start("Sure.") is None
    assert Llama3JsonParser().call_start('  {"na') == 2 and Llama3JsonParser().call_start("Hi") is None


def test_stream_auto_sends_content_then_call_deltas():
    s = ToolStream(ToolPlan(HermesParser(), TOOLS, "auto"))
    pieces = ["Checking", " now. <tool", '_call>\n{"name": "get_weather", ',
              '"arguments": {"city": "Oslo"}}\n</tool_call>']
    content = "".join(s.feed(x)[0] for x in pieces)
    rest, deltas = s.finish()
    assert content + rest == "Checking now. "
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith("call_")
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Oslo"}


def test_required_and_named_constraints_validate_their_outputs():
    required = ToolPlan(HermesParser(), TOOLS, "required", parallel=False).constraint().json
    jsonschema.validate([{"name": "get_time", "parameters": {"tz": "UTC"}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "x"}}], required)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate([{"name": "get_time", "parameters": {"tz": "a"}}] * 2, required)
    named = ToolPlan(HermesParser(), TOOLS, "named", "get_weather")
    assert named.constraint().json == WEATHER["function"]["parameters"]
    assert _calls(named.parse('{"city": "Oslo"}')) == [("get_weather", {"city": "Oslo"})]
    req = ToolPlan(HermesParser(), TOOLS, "required")
    assert _calls(req.parse('[{"name": "get_time", "parameters": {"tz": "UTC"}}]')) == [("get_time", {"tz": "UTC"})]


def test_fallback_rendering_writes_history_in_the_parser_format():
    plan = ToolPlan(HermesParser(), TOOLS, "auto")
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"}]
    msgs, tools = render_messages(history, plan, template_supports_tools=False)
    assert tools is None and msgs[0]["content"].startswith("Be brief.") and '"get_time"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert msgs[3] == {"role": "tool", "content": '<tool_response>\n{"temp": 3}\n</tool_response>'}
    msgs, tools = render_messages(history, plan, template_supports_tools=True)
    assert tools == TOOLS and msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert msgs[3]["tool_call_id"] == "call_1"


def test_stream_named_sends_arguments_as_they_come():
    s = ToolStream(ToolPlan(HermesParser(), TOOLS, "named", "get_weather"))
    assert not s.sent_calls
    first = s.feed('{"city": ')[1]
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""} and s.sent_calls
    rest = s.feed('"Oslo"}')[1] + s.finish()[1]
    args = "".join(d["function"]["arguments"] for d in first[1:] + rest)
    assert json.loads(args) == {"city": "Oslo"}
    assert s.finish() == ("", [])  # nothing twice
