"""Tool-call parsers: a model family's tool-call text -> OpenAI `tool_calls`, and the reverse for prompts.

Each family writes calls its own way (the formats below are the ones their chat templates teach):
  hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (one block per call)
  llama3_json  {"name": "f", "parameters": {...}}, optionally after <|python_tag|>; calls joined by "; "
  mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   or (v11+) [TOOL_CALLS]f[ARGS]{...}
  qwen         hermes' blocks (Qwen2.5 / Qwen3), or Qwen3-Coder's XML inside them:
               <tool_call>\\n<function=f>\\n<parameter=x>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
A parser splits a finished output into its plain content and its calls; while streaming, `call_start`
says where the calls begin, so the text before them streams as content and the rest waits for the end.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(slots=True)
class ParsedOutput:
    content: str | None  # the text outside the calls (None when there is none)
    calls: list[ParsedToolCall]


def _args_text(args: Any) -> str:
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


def _call_from_obj(obj: Any) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], _args_text(args))


def _json_values(text: str) -> list[Any]:
    """Every top-level JSON value in text, in order (separators and junk between them skipped)."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while i < len(text):
        j = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
        if j < 0:
            break
        try:
            value, end = dec.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        out.append(value)
        i = end
    return out


def _content(*parts: str) -> str | None:
    text = "".join(parts).strip()
    return text or None


class ToolParser:
    name = ""
    starts: tuple[str, ...] = ()  # markers that open the calls
    at_start_only = False  # llama3_json: a call is the whole output, so it can only begin at its start
    needs_special_tokens = False  # its markers are special tokens, kept in the text only with skip off

    def parse(self, text: str, tools: list[dict]) -> ParsedOutput:
        raise NotImplementedError

    def render_call(self, name: str, arguments: str) -> str:
        """One call in this family's format (assistant turns of the history, templates without tools)."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where the calls begin in a (partial) output, or None while none has; a text ending in a marker's
        first characters returns that position too (they are held back, not streamed as content)."""
        body = text.lstrip() if self.at_start_only else text
        lead = len(text) - len(body)
        if self.at_start_only:
            ok = any(body.startswith(m) or (body and m.startswith(body)) for m in self.starts)
            return lead if ok else None
        found = [i for i in (text.find(m) for m in self.starts) if i >= 0]
        if found:
            return min(found)
        for m in self.starts:  # a marker still being written
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    return len(text) - k
        return None


class HermesParser(ToolParser):
    name = "hermes"
    starts = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str, tools: list[dict]) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(_content(text), [])
        calls = [c for body in self._block.findall(text[start:]) for c in self._parse_block(body.strip(), tools)]
        if not calls:  # not a well-formed call: the text is content
            return ParsedOutput(_content(text), [])
        tail = text[start:].rsplit("</tool_call>", 1)
        return ParsedOutput(_content(text[:start], tail[1] if len(tail) == 2 else ""), calls)

    def _parse_block(self, body: str, tools: list[dict]) -> list[ParsedToolCall]:
        return [c for c in (_call_from_obj(v) for v in _json_values(body)[:1]) if c is not None]

    def render_call(self, name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


class QwenParser(HermesParser):
    name = "qwen"
    _function = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)

    def _parse_block(self, body: str, tools: list[dict]) -> list[ParsedToolCall]:
        if not body.startswith("<function="):
            return super()._parse_block(body, tools)
        calls = []
        for name, inner in self._function.findall(body):
            name = name.strip()
            props = _tool_properties(tools, name)
            args = {k.strip(): _typed_value(v, props.get(k.strip(), {})) for k, v in self._parameter.findall(inner)}
            calls.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    starts = ("<|python_tag|>", "{")
    at_start_only = True
    needs_special_tokens = True

    def parse(self, text: str, tools: list[dict]) -> ParsedOutput:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return ParsedOutput(_content(text), [])
        calls = [c for c in (_call_from_obj(v) for v in _json_values(body)) if c is not None]
        return ParsedOutput(None, calls) if calls else ParsedOutput(_content(text), [])

    def render_call(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'


class MistralParser(ToolParser):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    needs_special_tokens = True

    def parse(self, text: str, tools: list[dict]) -> ParsedOutput:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return ParsedOutput(_content(text), [])
        body = text[start + len("[TOOL_CALLS]"):]
        calls: list[ParsedToolCall] = []
        if "[ARGS]" in body:  # v11+: name[ARGS]{json}, repeated after further [TOOL_CALLS]
            for part in body.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args)
                if name.strip() and values:
                    calls.append(ParsedToolCall(name.strip(), _args_text(values[0])))
        else:
            values = _json_values(body)
            items = values[0] if values and isinstance(values[0], list) else values
            calls = [c for c in (_call_from_obj(v) for v in items) if c is not None]
        return ParsedOutput(_content(text[:start]), calls) if calls else ParsedOutput(_content(text), [])

    def render_call(self, name: str, arguments: str) -> str:
        return f'[TOOL_CALLS][{{"name": {json.dumps(name)}, "arguments": {arguments}}}]'


def _tool_properties(tools: list[dict], name: str) -> dict[str, Any]:
    for t in tools:
        f = t.get("function", {})
        if f.get("name") == name:
            return (f.get("parameters") or {}).get("properties", {}) or {}
    return {}


def _typed_value(raw: str, schema: dict[str, Any]) -> Any:
    """An XML parameter's text as the JSON value its schema asks for (strings stay strings)."""
    text = raw.strip("\n")
    if schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, QwenParser)}


def parser_for_template(template: str | None) -> ToolParser:
    """The parser a chat template's own tool format implies (hermes for ChatML and unknown templates)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<|python_tag|>" in t or "ipython" in t:
        return Llama3JsonParser()
    if "<function=" in t:
        return QwenParser()
    return HermesParser()
