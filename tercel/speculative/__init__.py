"""Speculative decoding: drafters (n-gram, EAGLE / EAGLE-3), draft trees, lossless verification and
the one spec step they share (worker.py). SGLang's argument names and semantics:

  speculative_algorithm        NGRAM | EAGLE | EAGLE3 (None / "NONE": off)
  speculative_draft_model_path the EAGLE / EAGLE-3 draft directory (EAGLE3 on the default model: the
                               bundled SmolLM2 head, tercel/drafts/smollm2-eagle3)
  speculative_num_steps        draft depth (default 5)
  speculative_eagle_topk       branches per step (default 1: a chain)
  speculative_num_draft_tokens tree nodes verified per step, root included (chain: num_steps + 1);
                               DFLASH / DDTREE: the block size (default: the checkpoint's)
  speculative_ddtree_budget    DDTREE: draft nodes in the tree (2..64; default 16)
  speculative_adaptive         True (default): each step verifies the width that maximises expected tokens/s,
                               down to a plain decode step (adaptive.py); False: num_draft_tokens every step

DFLASH | DDTREE take a DFlash draft directory (z-lab format) as speculative_draft_model_path.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .config import (
    ALGORITHMS,
    DEFAULT_DDTREE_BUDGET,
    DEFAULT_DFLASH_DRAFT,
    DEFAULT_DRAFTS_DIR,
    DEFAULT_EAGLE3_DRAFT,
    DEFAULT_EAGLE3_TOKEN_MAP,
    DEFAULT_NUM_STEPS,
    SpecConfig,
    SpeculativeConfig,
)

if TYPE_CHECKING:
    from .host import SpecEngine
    from .worker import SpecWorker


def build_spec_worker(engine: "SpecEngine", algorithm: str | None, draft_path: str | Path | None,
                      num_steps: int | None, topk: int | None, num_draft_tokens: int | None,
                      default_model: bool = False, ddtree_budget: int | None = None,
                      token_map: str | Path | None = None, adaptive: bool = True) -> "SpecWorker | None":
    from .worker import SpecWorker

    cfg = SpecConfig.resolve(algorithm, draft_path, num_steps, topk, num_draft_tokens, default_model, ddtree_budget,
                             token_map)
    if cfg is None:
        return None
    if cfg.algorithm in ("DFLASH", "DDTREE"):
        from .dflash import DFlashDrafter

        dflash = DFlashDrafter.load(engine, cfg.draft_model_path, cfg.num_draft_tokens or None, cfg.ddtree_budget)
        engine.spec_config = cfg
        return SpecWorker(engine, dflash, dflash.num_draft_tokens, adaptive)
    if cfg.algorithm == "NGRAM":
        from .ngram import NgramDrafter

        drafter = NgramDrafter(cfg.num_draft_tokens)
    else:
        from .eagle import EagleDrafter

        drafter = EagleDrafter.load(engine, cfg)
    engine.spec_config = cfg
    return SpecWorker(engine, drafter, cfg.num_draft_tokens, adaptive)


__all__ = ["ALGORITHMS", "DEFAULT_DDTREE_BUDGET", "DEFAULT_DFLASH_DRAFT", "DEFAULT_DRAFTS_DIR", "DEFAULT_EAGLE3_DRAFT",
           "DEFAULT_EAGLE3_TOKEN_MAP", "DEFAULT_NUM_STEPS", "SpecConfig", "SpeculativeConfig", "build_spec_worker"]
