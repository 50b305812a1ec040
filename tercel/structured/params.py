"""What a request's output must match (vLLM's `StructuredOutputsParams` field names)."""
from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (a bad schema, regex or grammar): the server answers 400."""


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one of json (a JSON schema, as a dict or its text), regex, choice (a list of strings),
    grammar (EBNF in xgrammar's / llama.cpp's GBNF dialect, or Lark) or json_object (any JSON object).
    disable_any_whitespace: JSON without free whitespace between tokens (compact output)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise StructuredOutputError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar or json_object; got "
                f"{', '.join(given) if given else 'none'}.")
        if isinstance(self.json, str):
            try:
                self.json = jsonlib.loads(self.json)
            except ValueError as e:
                raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {e}.") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise StructuredOutputError(
                f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}.")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputError(
                f"structured_outputs.choice={self.choice!r} must be a non-empty list of non-empty strings.")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise StructuredOutputError(f"structured_outputs.{name}={v!r} must be a non-empty string.")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, compact): equal keys compile to the same grammar."""
        kind = self.kind
        spec = {"json": lambda: jsonlib.dumps(self.json, sort_keys=True), "choice": lambda: jsonlib.dumps(self.choice),
                "regex": lambda: self.regex, "grammar": lambda: self.grammar, "json_object": lambda: ""}[kind]()
        return kind, spec, self.disable_any_whitespace
