"""Incremental detokenization with stop strings.

The whole output is decoded each step (simple and exact for any tokenizer); the text a stream
may hand out stops before an incomplete UTF-8 character or a possible start of a stop string.
"""
from __future__ import annotations

from .loader.tokenizer import Tokenizer
from .request import Request


def update_text(req: Request, tokenizer: Tokenizer) -> str | None:
    """Refresh req.output_text; return the stop string that ended the text, if any (text cut before it)."""
    prev_len = len(req.output_text)
    text = tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
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
