"""Helpers for graph-runner tests: a tiny random Llama, a paged KV pool, and decode/verify batches
built the way the engine builds them (CPU or GPU)."""
from __future__ import annotations

import torch

from tercel.config import ModelConfig
from tercel.forward_batch import ForwardBatch
from tercel.kv import KVCacheSpec, PagedKVCache
from tercel.loader.model_loader import build_model

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=False)


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    cfg = ModelConfig.from_hf_dict({**TINY, **overrides})
    model = build_model(cfg, 512, dtype, torch.device(device))
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model, cfg


def kv_pool(cfg: ModelConfig, device: str, dtype: torch.dtype, num_blocks: int = 64, block_size: int = 4,
            seed: int = 1) -> PagedKVCache:
    kv = PagedKVCache(KVCacheSpec.for_model(cfg, block_size, dtype), num_blocks, torch.device(device))
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


class FakeRequests:
    """Requests with contiguous random histories already in the cache; each decode step appends one token."""

    def __init__(self, n: int, kv: PagedKVCache, vocab: int, seed: int = 2, min_len: int = 3,
                 max_len: int = 30) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.kv = kv
        self.lens = torch.randint(min_len, max_len, (n,), generator=g).tolist()
        self.tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        free = list(range(kv.num_blocks - 1, 0, -1))
        perm = torch.randperm(len(free), generator=g).tolist()
        free = [free[i] for i in perm]
        self.tables: list[list[int]] = []
        per = (kv.num_blocks - 1) // n
        for i in range(n):
            self.tables.append(free[i * per:(i + 1) * per])

    def slot(self, i: int, pos: int) -> int:
        bs = self.kv.block_size
        return self.tables[i][pos // bs] * bs + pos % bs

    def batch(self, rows: list[int], tokens_per_request: int = 1, masks: list | None = None) -> ForwardBatch:
        """A decode (t=1) or verify (t>1) batch for these requests: t new tokens after each history."""
        dev = self.kv.k.device
        t = tokens_per_request
        ids, pos, slots, lens = [], [], [], []
        g = torch.Generator(device="cpu").manual_seed(sum(rows) + 7 * t)
        for i in rows:
            base = self.lens[i]
            ids += [self.tokens[i]] + torch.randint(0, 200, (t - 1,), generator=g).tolist()
            pos += list(range(base, base + t))
            slots += [self.slot(i, p) for p in range(base, base + t)]
            lens.append(base + t)
        need = max(-(-(l) // self.kv.block_size) for l in lens)
        tables = [self.tables[i][:need] for i in rows]
        return ForwardBatch(
            input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(pos, device=dev),
            out_cache_loc=torch.tensor(slots, device=dev), seq_lens=torch.tensor(lens, device=dev),
            block_tables=torch.tensor(tables, device=dev), logits_indices=torch.arange(len(ids), device=dev),
            query_lens=[t] * len(rows), seq_lens_cpu=lens, custom_masks=masks)

    def advance(self, rows: list[int], new_tokens: list[int]) -> None:
        for i, tok in zip(rows, new_tokens):
            self.lens[i] += 1
            self.tokens[i] = tok
