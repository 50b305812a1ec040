"""Structured output: grammars (JSON schema, regex, EBNF / Lark, choices) that constrain a request's tokens.

params.py says what a request asks for (vLLM's `StructuredOutputsParams`); backend.py compiles it with
xgrammar and keeps a per-request matcher; mask.py turns matcher states into token bitmasks and applies
them to the logits on their device before any token is chosen (plain steps and every speculative verify
row, along the draft path).
"""
from .params import StructuredOutputError, StructuredOutputsParams

__all__ = ["StructuredOutputError", "StructuredOutputsParams"]
