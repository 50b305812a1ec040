"""Incremental detokenization with stop strings.

Each step decodes only a short window of tokens (vLLM's prefix_offset / read_offset scheme), so the
cost per token does not grow with the output. Text up to `read_offset` is committed; the window
[prefix_offset, read_offset) is decoded again as context so that tokenizers whose pieces render
differently at the start of a decode (e.g. SentencePiece's leading space) give the same text as one
decode of the whole output. The window only advances when its new text does not end in "\\ufffd"
(an incomplete UTF-8 character whose remaining bytes come with later tokens).

req.output_text always equals tokenizer.decode(req.output_token_ids) (cut before a stop string); the
text a stream may hand out stops before an incomplete UTF-8 character or a possible start of a stop
string.
"""
from __future__ import annotations

from .loader.tokenizer import Tokenizer
from .request import Request

FALLBACK_CONTEXT = 4  # tokens kept as decode context after a full re-decode


def _decode_new_text(req: Request, tokenizer: Tokenizer) -> str:
    """The whole output's text, decoding only the tokens since the last commit (plus their context)."""
    ids, skip = req.output_token_ids, req.params.skip_special_tokens
    prefix, read = req.detok_prefix_offset, req.detok_read_offset
    prefix_text = tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
    window_text = tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
    if not window_text.startswith(prefix_text):  # the context decoded differently: trust a full decode
        text = tokenizer.decode(ids, skip_special_tokens=skip)
        if not text.endswith("\ufffd"):
            req.detok_prefix_offset, req.detok_read_offset = max(0, len(ids) - FALLBACK_CONTEXT), len(ids)
            req.detok_committed_len = len(text)
        return text
    tail = window_text[len(prefix_text):]
    text = req.output_text[:req.detok_committed_len] + tail
    if tail and not tail.endswith("\ufffd"):
        req.detok_prefix_offset, req.detok_read_offset = read, len(ids)
        req.detok_committed_len = len(text)
    return text


def update_text(req: Request, tokenizer: Tokenizer) -> str | None:
    """Refresh req.output_text; return the stop string that ended the text, if any (text cut before it)."""
    prev_len = len(req.output_text)
    text = _decode_new_text(req, tokenizer)
    stops = req.params.stop
    if stops:
        longest = max(len(s) for s in stops)
        search_from = max(0, min(prev_len, len(text)) - longest + 1)
        hits = [(idx, s) for s in stops if (idx := text.find(s, search_from)) != -1]
        if hits:
            idx, s = min(hits)
            req.output_text = text[:idx]
            req.output_text_safe_len = idx
            return s
    req.output_text = text
    safe = len(text)
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, safe), 0, -1):
            if text[safe - k:safe] == s[:k]:
                hold = max(hold, k)
                break
    safe -= hold
    req.output_text_safe_len = max(0, safe)
    return None
