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

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError
from .worker import SpecStats, SpecWorker

if TYPE_CHECKING:
    from ..engine import LLMEngine

log = logging.getLogger(__name__)

ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "DFLASH", "DDTREE")
DEFAULT_DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"
DEFAULT_EAGLE3_DRAFT = DEFAULT_DRAFTS_DIR / "smollm2-eagle3"
DEFAULT_DFLASH_DRAFT = DEFAULT_DRAFTS_DIR / "smollm2-dflash"
# the bundled head's hot tokens (python -m tercel.train.token_map --size 8192 --prompts 448: 5244 ids,
# a ninth of the vocabulary's head rows per draft step); `tercel generate` uses it on the CPU
DEFAULT_EAGLE3_TOKEN_MAP = DEFAULT_EAGLE3_DRAFT / "token_map.json"
DEFAULT_NUM_STEPS = 5
DEFAULT_DDTREE_BUDGET = 16


@dataclass(slots=True, frozen=True)
class SpecConfig:
    algorithm: str
    draft_model_path: Path | None
    num_steps: int
    topk: int
    num_draft_tokens: int
    ddtree_budget: int | None = None  # DDTREE only
    token_map: Path | None = None  # EAGLE / EAGLE3 only: the hot target ids the draft may propose

    @classmethod
    def resolve(cls, algorithm: str | None, draft_path: str | Path | None, num_steps: int | None,
                topk: int | None, num_draft_tokens: int | None, default_model: bool,
                ddtree_budget: int | None = None, token_map: str | Path | None = None) -> "SpecConfig | None":
        if algorithm is None or str(algorithm).upper() in ("", "NONE"):
            if token_map is not None:
                raise ConfigError(f"speculative_token_map={str(token_map)!r} is set but speculative decoding is "
                                  f"off; pass speculative_algorithm EAGLE or EAGLE3 with it.")
            return None
        algo = str(algorithm).upper()
        if algo not in ALGORITHMS:
            raise ConfigError(f"speculative_algorithm={algorithm!r} is not supported; use one of {ALGORITHMS} "
                              f"or NONE.")
        if token_map is not None and algo not in ("EAGLE", "EAGLE3"):
            raise ConfigError(f"speculative_token_map applies to EAGLE / EAGLE3 drafts, not "
                              f"speculative_algorithm={algo}; drop it.")
        for name, v in (("speculative_num_steps", num_steps), ("speculative_eagle_topk", topk),
                        ("speculative_num_draft_tokens", num_draft_tokens)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name}={v!r} must be a positive integer.")
        steps = num_steps or DEFAULT_NUM_STEPS
        k = topk or 1
        if algo == "NGRAM":
            n = num_draft_tokens or steps + 1
            return cls(algo, None, steps, 1, n)
        path = Path(draft_path).expanduser() if draft_path is not None else None
        if algo in ("DFLASH", "DDTREE"):
            if path is None and default_model:
                path = DEFAULT_DFLASH_DRAFT
            if path is None:
                raise ConfigError(f"speculative_algorithm={algo} needs speculative_draft_model_path (a DFlash draft "
                                  f"directory); only the default model has a bundled one.")
            if num_draft_tokens is not None and num_draft_tokens < 2:
                raise ConfigError(f"speculative_num_draft_tokens={num_draft_tokens} (the DFlash block size) must be >= 2.")
            budget = None
            if algo == "DDTREE":
                budget = DEFAULT_DDTREE_BUDGET if ddtree_budget is None else ddtree_budget
                if not isinstance(budget, int) or not 2 <= budget <= 64:
                    raise ConfigError(f"speculative_ddtree_budget={ddtree_budget!r} must be an integer in 2..64.")
            # 0: the block size comes from the checkpoint at load time
            return cls(algo, path, steps, 1, num_draft_tokens or 0, budget)
        if path is None:
            if algo == "EAGLE3" and default_model:
                path = DEFAULT_EAGLE3_DRAFT
            else:
                raise ConfigError(f"speculative_algorithm={algo} needs speculative_draft_model_path (a draft "
                                  f"directory with config.json + model.safetensors); only the default model has "
                                  f"a bundled EAGLE3 draft.")
        if k == 1:
            if num_draft_tokens is not None and num_draft_tokens != steps + 1:
                log.warning("speculative_eagle_topk=1 (a chain): speculative_num_draft_tokens=%d is set to "
                            "num_steps + 1 = %d.", num_draft_tokens, steps + 1)
            n = steps + 1
        else:
            most = 1 + k + (steps - 1) * k * k  # root + every candidate the draft loop produces
            n = num_draft_tokens or min(most, 2 * k * steps)
            if not 2 <= n <= most:
                raise ConfigError(f"speculative_num_draft_tokens={n} is out of range for topk={k}, num_steps={steps}: "
                                  f"use 2..{most}.")
        return cls(algo, path, steps, k, n, token_map=Path(token_map).expanduser() if token_map is not None else None)


def build_spec_worker(engine: "LLMEngine", algorithm: str | None, draft_path: str | Path | None,
                      num_steps: int | None, topk: int | None, num_draft_tokens: int | None,
                      default_model: bool = False, ddtree_budget: int | None = None,
                      token_map: str | Path | None = None, adaptive: bool = True) -> SpecWorker | None:
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


__all__ = ["SpecConfig", "SpecStats", "SpecWorker", "build_spec_worker", "ALGORITHMS"]
