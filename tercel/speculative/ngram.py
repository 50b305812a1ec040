"""N-gram (prompt lookup) drafting: no weights. Match the last n tokens of prompt + output against
earlier text (n from max_n down to min_n, most recent occurrence first) and propose the tokens that
followed that occurrence. Drafts are deterministic: verify treats them as q = one-hot."""
from __future__ import annotations

from ..request import Request
from .drafter import Drafter
from .tree import DraftTree


def ngram_lookup(tokens: list[int], max_drafts: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The up-to-max_drafts tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` (length max_n down to min_n) that occurs earlier."""
    length = len(tokens)
    if max_drafts <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]
        first = pattern[0]
        # scan start positions from the most recent one backwards; the match must end before the suffix
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == pattern:
                follow = tokens[start + n:start + n + max_drafts]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    def __init__(self, num_draft_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram window min_n={min_n}, max_n={max_n}: need 1 <= min_n <= max_n.")
        self.max_drafts = num_draft_tokens - 1
        self.min_n, self.max_n = min_n, max_n

    def propose(self, reqs: list[Request]) -> list[DraftTree]:
        trees = []
        for r in reqs:
            seq = r.prompt_token_ids + r.output_token_ids
            trees.append(DraftTree.chain(seq[-1], ngram_lookup(seq, self.max_drafts, self.min_n, self.max_n)))
        return trees
