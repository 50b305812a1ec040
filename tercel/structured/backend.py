"""Compiling constraints with xgrammar, and the per-request matcher that follows a request's tokens.

xgrammar (imported lazily: only requests with a constraint need it) compiles a JSON schema, regex or
grammar once per tokenizer into a token-level automaton; a GrammarMatcher per request accepts the tokens
the request emits, fills the bitmask of tokens allowed next (a few microseconds) and rolls back, which
speculative verification uses to walk draft paths.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .params import StructuredOutputError, StructuredOutputsParams

COMPILED_CACHE_SIZE = 256  # distinct constraints kept compiled (a server sees the same schemas again and again)


@dataclass(slots=True)
class GrammarState:
    """One request's position in its grammar. The matcher has accepted every token the request emitted."""
    matcher: Any  # xgrammar.GrammarMatcher

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Allowed next tokens into bitmask[row] (int32, bit t of word t // 32 = token t allowed). A terminated
        matcher allows everything: its request stops at the token it just accepted."""
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    """xgrammar for one tokenizer: compiles constraints (cached) and makes matchers. Thread-safe: the
    server compiles in its handlers (a bad constraint answers 400 before the request reaches the engine)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for params; StructuredOutputError names what is wrong with it."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > COMPILED_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        c, kind = self.compiler, params.kind
        compact = params.disable_any_whitespace
        try:
            if kind == "json":
                return c.compile_json_schema(json.dumps(params.json), any_whitespace=not compact)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=not compact, strict_mode=False)
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in params.choice)
                return c.compile_grammar(f"root ::= {alts}")
            if "::=" in params.grammar:  # EBNF (GBNF); otherwise Lark, as vLLM tells them apart
                return c.compile_grammar(params.grammar)
            return c.compile_lark(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise StructuredOutputError(f"structured output {kind} cannot be compiled: {_clean(e)}") from None

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(self.compile(params)))


def _clean(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    msg = str(e).strip()
    if msg.startswith("[") and ": " in msg:
        msg = msg.split(": ", 1)[1] if ".cc:" in msg.split(": ", 1)[0] else msg
    return msg.split("\n")[0]
