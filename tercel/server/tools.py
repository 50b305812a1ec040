"""Tool calling for /v1/chat/completions: the prompt, the constraint, and the calls in the answer.

- Prompt: a chat template that renders `tools` itself gets them (and the history's tool calls and results as
  structured messages); one that does not (SmolLM2's) gets them as vLLM / HF fall back: a system-prompt
  section listing the function signatures and the call format of the chosen parser, with earlier calls
  written back into the assistant turns in that format and tool results wrapped in <tool_response>.
- tool_choice: "auto" parses the output with the parser (text outside the calls stays content); "none" sends
  no tools; "required" and a named function constrain the output through structured output (vLLM's way):
  a named function's output is its arguments object (the function's JSON schema); "required" is a JSON array
  of {"name", "parameters"} objects, one schema branch per function (one item when parallel_tool_calls is
  false).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ..structured import StructuredOutputsParams
from .tool_parsers import PARSERS, ParsedOutput, ParsedToolCall, ToolParser, _json_values, parser_for_template

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def pick_parser(name: str | None, template: str | None) -> ToolParser:
    """--tool-call-parser NAME, or the one the chat template implies."""
    if name is None:
        return parser_for_template(template)
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is unknown; choose one of {sorted(PARSERS)}.")
    return PARSERS[name]()


@dataclass(slots=True)
class ToolPlan:
    """One chat request's tools, choice and parser."""
    parser: ToolParser
    tools: list[dict[str, Any]]  # OpenAI {"type": "function", "function": {...}}
    choice: str  # "auto", "required", "named" or "none"
    named: str | None = None
    parallel: bool = True

    def function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def constraint(self) -> StructuredOutputsParams | None:
        if self.choice == "named":
            return StructuredOutputsParams(json=self.function(self.named).get("parameters") or ANY_OBJECT)
        if self.choice == "required":
            branches = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                          "parameters": t["function"].get("parameters") or ANY_OBJECT},
                         "required": ["name", "parameters"]} for t in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def parse(self, text: str) -> ParsedOutput:
        """The finished output's content and calls."""
        if self.choice == "named":
            return ParsedOutput(None, [ParsedToolCall(self.named, _compact(text))])
        if self.choice == "required":
            values = _json_values(text)
            items = values[0] if values and isinstance(values[0], list) else []
            return ParsedOutput(None, [ParsedToolCall(i["name"], json.dumps(i.get("parameters", {}),
                                                                             ensure_ascii=False))
                                       for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)])
        if self.choice == "none":
            return ParsedOutput(text, [])
        out = self.parser.parse(text, self.tools)
        if not self.parallel and len(out.calls) > 1:
            out.calls = out.calls[:1]
        return out

    @staticmethod
    def openai_calls(calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
        return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls]


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None,
                    template_supports_tools: bool) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The messages and `tools` argument for the chat template."""
    if plan is None or plan.choice == "none":
        return [_plain(m, plan.parser if plan else None) for m in messages], None
    if template_supports_tools:
        return [_structured(m) for m in messages], plan.tools
    rendered = [_plain(m, plan.parser) for m in messages]
    section = fallback_system_prompt(plan)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{section}".lstrip()}
    else:
        rendered.insert(0, {"role": "system", "content": section})
    return rendered, None


def fallback_system_prompt(plan: ToolPlan) -> str:
    """Function signatures and the call format, for chat templates that do not render tools."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
    example = plan.parser.render_call("function_name", '{"argument": "value"}')
    return ("You can call functions (tools) to answer. Their signatures, one JSON object per line:\n"
            f"<tools>\n{sigs}\n</tools>\n"
            f"To call a function, answer with the call in exactly this format (arguments as a JSON object that "
            f"follows the function's parameters schema):\n{example}\n"
            "Write one such call per function you need. When no function helps, answer normally.")


def _plain(m: dict[str, Any], parser: ToolParser | None) -> dict[str, Any]:
    """A message for a template that knows only role and content."""
    calls = m.get("tool_calls") or []
    if m["role"] == "assistant" and calls and parser is not None:
        written = "\n".join(parser.render_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
        return {"role": "assistant", "content": f"{m.get('content') or ''}\n{written}".strip()}
    if m["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    return {k: v for k, v in m.items() if k in ("role", "content", "name")}


def _structured(m: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that renders tools: tool_calls with their arguments as objects (as HF
    templates expect), tool results with their call id."""
    out = {k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id")}
    calls = m.get("tool_calls")
    if calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _as_object(c["function"]["arguments"])}} for c in calls]
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass(slots=True)
class ToolStream:
    """Streaming an auto-choice answer: text before the calls goes out as content deltas; once a call marker
    appears the rest is held and, at the end, parsed and sent as tool-call deltas (the id, type and name
    first, then the arguments), as OpenAI streams them. Required / named choices stream the arguments as
    they come (named) or the calls at the end (required)."""
    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of text already streamed as content (auto) or arguments (named)
    started: bool = False  # named: the call's header delta went out

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) to send for this piece of output."""
        self.text += delta
        if self.plan.choice == "named":
            return "", self._named_delta()
        if self.plan.choice in ("required",):
            return "", []
        start = self.plan.parser.call_start(self.text) if self.plan.choice == "auto" else None
        upto = len(self.text) if start is None else start
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest at the end: remaining content and the calls' deltas."""
        if self.plan.choice == "named":
            return "", self._named_delta()
        parsed = self.plan.parse(self.text)
        if not parsed.calls and self.plan.choice == "required":  # cut short before a call closed
            return "", []
        if not parsed.calls:
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            return rest, []
        deltas = []
        for i, c in enumerate(self.plan.openai_calls(parsed.calls)):
            deltas.append({"index": i, "id": c["id"], "type": "function",
                           "function": {"name": c["function"]["name"], "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": c["function"]["arguments"]}})
        return "", deltas

    def _named_delta(self) -> list[dict[str, Any]]:
        out = []
        if not self.started:
            self.started = True
            out.append({"index": 0, "id": new_call_id(), "type": "function",
                        "function": {"name": self.plan.named, "arguments": ""}})
        if len(self.text) > self.sent:
            out.append({"index": 0, "function": {"arguments": self.text[self.sent:]}})
            self.sent = len(self.text)
        return out

    @property
    def sent_calls(self) -> bool:
        """A tool-call delta went out already (a named call streams its arguments as they come)."""
        return self.started
