"""Speculative decoding: drafters (n-gram, EAGLE / EAGLE-3), draft trees, lossless verification and
the one spec step they share (worker.py). SGLang's argument names and semantics:

  speculative_algorithm        NGRAM | EAGLE | EAGLE3 (None / "NONE": off)
  speculative_draft_model_path the EAGLE / EAGLE-3 draft directory (EAGLE3 on the default model: the
                               bundled SmolLM2 head, tercel/drafts/smollm2-eagle3)
  speculative_num_steps        draft depth (default 5)
  speculative_eagle_topk       branches per step (default 1: a chain)
  speculative_num_draft_tokens tree nodes verified per step, root included (chain: num_steps + 1)
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

ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3")
DEFAULT_DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"
DEFAULT_EAGLE3_DRAFT = DEFAULT_DRAFTS_DIR / "smollm2-eagle3"
DEFAULT_NUM_STEPS = 5


@dataclass(slots=True, frozen=True)
class SpecConfig:
    algorithm: str
    draft_model_path: Path | None
    num_steps: int
    topk: int
    num_draft_tokens: int

    @classmethod
    def resolve(cls, algorithm: str | None, draft_path: str | Path | None, num_steps: int | None,
                topk: int | None, num_draft_tokens: int | None, default_model: bool) -> "SpecConfig | None":
        if algorithm is None or str(algorithm).upper() in ("", "NONE"):
            return None
        algo = str(algorithm).upper()
        if algo not in ALGORITHMS:
            raise ConfigError(f"speculative_algorithm={algorithm!r} is not supported; use one of {ALGORITHMS} "
                              f"or NONE.")
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
        return cls(algo, path, steps, k, n)


def build_spec_worker(engine: "LLMEngine", algorithm: str | None, draft_path: str | Path | None,
                      num_steps: int | None, topk: int | None, num_draft_tokens: int | None,
                      default_model: bool = False) -> SpecWorker | None:
    cfg = SpecConfig.resolve(algorithm, draft_path, num_steps, topk, num_draft_tokens, default_model)
    if cfg is None:
        return None
    if cfg.algorithm == "NGRAM":
        from .ngram import NgramDrafter

        drafter = NgramDrafter(cfg.num_draft_tokens)
    else:
        from .eagle import EagleDrafter

        drafter = EagleDrafter.load(engine, cfg)
    engine.spec_config = cfg
    return SpecWorker(engine, drafter, cfg.num_draft_tokens)


__all__ = ["SpecConfig", "SpecStats", "SpecWorker", "build_spec_worker", "ALGORITHMS"]
