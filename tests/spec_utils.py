"""Helpers for speculative decoding tests: engines sharing a loaded target, and an oracle drafter."""
from __future__ import annotations

from tercel import LLM
from tercel.engine import LLMEngine
from tercel.request import Request
from tercel.spec.drafter import Drafter
from tercel.spec.tree import DraftTree


def spec_llm(base: LLM, **kw) -> LLM:
    """A second LLM on the same loaded weights (no reload), with its own engine settings."""
    llm = LLM.__new__(LLM)
    e = base.engine
    kw.setdefault("max_model_len", e.config.max_model_len)
    llm.engine = LLMEngine(loaded=e.loaded, dtype=e.dtype, device=e.device, **kw)
    return llm


class OracleTreeDrafter(Drafter):
    """Knows the plain greedy continuation of each prompt and hides it in a tree: at every depth the
    right token is the LAST of `width` siblings (the others are wrong), so accepted paths go through
    non-first children and verify must compact their KV. `depth` levels (num_draft_tokens - 1 =
    depth * width nodes)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], depth: int, width: int, vocab: int) -> None:
        self.cont, self.depth, self.width, self.vocab = continuations, depth, width, vocab

    def propose(self, reqs: list[Request]) -> list[DraftTree]:
        trees = []
        for r in reqs:
            truth = self.cont[tuple(r.prompt_token_ids)][len(r.output_token_ids):]
            tokens, parents = [r.output_token_ids[-1]], [-1]
            parent = 0
            for d in range(min(self.depth, len(truth))):
                for w in range(self.width):
                    wrong = (truth[d] + 1 + w) % self.vocab
                    tokens.append(truth[d] if w == self.width - 1 else wrong)
                    parents.append(parent)
                parent = len(tokens) - 1
            trees.append(DraftTree(tokens, parents))
        return trees
