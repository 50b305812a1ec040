"""Automatic prefix caching: full KV blocks shared across requests by content.

Each full block of a sequence has a key chained over the whole prefix: key(b) = sha256(key(b - 1) +
tokens of block b), so equal keys mean equal tokens from position 0 to the block's end, hence equal
KV. A block is published (findable by its key) once it is full and its KV is written and final: its
positions lie below the request's num_computed_tokens and, with a draft that keeps KV of its own (EAGLE,
DFlash: their caches share the target pool's slots), below the draft's written length too. A new
request (or one readmitted after preemption) takes the longest run of published blocks that matches
its tokens, and its prefill starts after them. At most num_tokens - 1 tokens come from the cache: the
last one is always computed, for its logits, so no write ever lands in a shared block.

EAGLE's draft KV at position p is computed from the token at p + 1 (the draft pairs the target's hidden
state at p with the next token), so with EAGLE a block's key also covers the first token after it
(`lookahead` 1): a hit then guarantees the draft KV at the block's last slot saw the same next token.

Blocks are reference-counted by the allocator (tercel.kv.BlockAllocator); a cached block no request
holds stays findable until the pool needs a fresh block and evicts it (least recently freed first).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from .kv import BlockAllocator
from .request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Engine-wide: prompt tokens looked up at first admission and those found in the cache."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    num_queries: int = 0  # requests looked up

    @property
    def hit_rate(self) -> float | None:
        return None if not self.queried_tokens else self.hit_tokens / self.queried_tokens


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, lookahead: int = 0,
                 draft_kv: bool = False) -> None:
        """lookahead: tokens past a block that its draft KV depends on (EAGLE: 1); draft_kv: a draft keeps
        KV in the target's slots, so a block is published only once Request.draft_kv_len covers it."""
        self.allocator = allocator
        self.block_size = block_size
        self.lookahead = lookahead
        self.draft_kv = draft_kv
        self.stats = PrefixCacheStats()
        self._root = hashlib.sha256(f"tercel-prefix-cache/{block_size}/{lookahead}".encode()).digest()

    def _keys(self, req: Request, n: int) -> list[bytes]:
        """req's first n block keys (memoized on the request: its tokens only ever grow)."""
        keys = req.block_hashes
        bs = self.block_size
        while len(keys) < n:
            b = len(keys)
            h = hashlib.sha256(keys[-1] if keys else self._root)
            h.update(array("q", req.token_slice(b * bs, (b + 1) * bs + self.lookahead)).tobytes())
            keys.append(h.digest())
        return keys

    def match(self, req: Request) -> list[int]:
        """The cached blocks that hold req's longest cached prefix (not yet taken: see take)."""
        n = (req.num_tokens - 1) // self.block_size  # the last token is always computed
        if n <= 0:
            return []
        blocks = []
        a = self.allocator
        bs = self.block_size
        # keys are hashed one block at a time: a miss stops before hashing the rest of a long prompt
        for b in range(n):
            if b * bs + bs + self.lookahead > req.num_tokens:
                break
            block = a.lookup(self._keys(req, b + 1)[b])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def next_key(self, req: Request, num_hits: int) -> bytes | None:
        """The key of req's block after its num_hits cached ones, or None when that block may not come from
        the cache (it holds the last token, or its lookahead is not there yet)."""
        b, bs = num_hits, self.block_size
        if b >= (req.num_tokens - 1) // bs or b * bs + bs + self.lookahead > req.num_tokens:
            return None
        return self._keys(req, b + 1)[b]

    def prompt_keys_ahead(self, req: Request) -> list[bytes]:
        """The keys of req's full prompt blocks it has not computed yet: a request with the same prefix
        that waits until they are published computes none of them."""
        bs = self.block_size
        first = req.num_computed_tokens // bs
        n = (len(req.prompt_token_ids) - self.lookahead) // bs
        return self._keys(req, n)[first:n] if n > first else []

    def take(self, req: Request, blocks: list[int]) -> None:
        """Start req on the matched blocks: it holds them, and its computation starts after them."""
        for b in blocks:
            self.allocator.share(b)
        req.block_table = list(blocks)
        n = len(blocks) * self.block_size
        req.num_computed_tokens = n
        req.draft_kv_len = n
        req.num_published_blocks = len(blocks)
        if req.metrics.num_preemptions == 0:  # a readmission's hits are its own blocks coming back
            req.metrics.num_cached_tokens = n
            self.stats.num_queries += 1
            self.stats.queried_tokens += len(req.prompt_token_ids)
            self.stats.hit_tokens += n

    def publish(self, req: Request) -> None:
        """Publish req's blocks that are full, written and final since the last call."""
        written = min(req.num_computed_tokens, req.num_tokens - self.lookahead)
        if self.draft_kv:
            written = min(written, req.draft_kv_len)
        n = min(written // self.block_size, len(req.block_table))
        if n <= req.num_published_blocks:
            return
        keys = self._keys(req, n)
        for b in range(req.num_published_blocks, n):
            self.allocator.publish(req.block_table[b], keys[b])
        req.num_published_blocks = n
