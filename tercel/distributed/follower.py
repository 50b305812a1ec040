"""Ranks > 0: load this rank's shard, make the same KV pool as rank 0, then run every forward rank 0
sends (comm.recv) until it says shut down. No scheduler, sampler or draft runs here."""
from __future__ import annotations

import os
import threading
import time

import torch

from ..config import EngineConfig
from ..kv import KVCacheSpec, PagedKVCache, num_kv_blocks
from ..loader.model_loader import LoadedModel, load_model, parse_dtype
from .comm import recv
from .layers import TensorParallel
from .parallel_state import TPGroup
from .shard import TPShard


def exit_with_parent() -> None:
    """A spawned rank ends when its parent (rank 0's process) is gone, however rank 0 ended: no orphans
    blocked in a collective."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="tercel-tp-parent-watch", daemon=True).start()


def load_rank(config: EngineConfig, group: TPGroup, tokenizer_too: bool, tokenizer=None) -> LoadedModel:
    """This rank's shard of the model, its TensorParallel attached (every rank, rank 0 included)."""
    from ..loader.model_loader import read_checkpoint

    m = config.model
    cfg = read_checkpoint(m.model).config
    shard = TPShard.of(cfg, group.rank, group.size)
    loaded = load_model(m.model, parse_dtype(m.dtype, group.device), group.device, max_model_len=m.max_model_len,
                        load_tokenizer_too=tokenizer_too and not m.skip_tokenizer_init,
                        progress=m.progress and group.is_driver, dequantize_gguf=m.dequantize_gguf,
                        tokenizer=tokenizer, shard=shard)
    loaded.model.tp = TensorParallel(group, shard)
    return loaded


def serve(group: TPGroup, config: EngineConfig) -> None:
    torch.set_grad_enabled(False)
    try:
        loaded = load_rank(config, group, tokenizer_too=False)
        spec = KVCacheSpec.for_model(loaded.model.config, config.cache.block_size,
                                     parse_dtype(config.model.dtype, group.device))
        blocks = num_kv_blocks(config, spec, group.device)
    except BaseException:
        group.agree_start(-1)  # rank 0 raises instead of waiting for this rank
        raise
    # every rank sizes its pool from its own memory, then all take the smallest count, so a block id
    # means the same block everywhere
    blocks = group.agree_start(blocks)
    if blocks <= 0:  # rank 0 (or another rank) failed to start
        return
    kv = PagedKVCache(spec, blocks, group.device)
    model = loaded.model
    with torch.inference_mode():
        while (batch := recv(group)) is not None:
            model(batch, kv)
