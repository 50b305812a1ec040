"""Speculative decoding's settings: the `speculative` section of the engine's settings tree (the
`speculative_*` keyword arguments and flags) and SpecConfig, the resolved choice the worker is built from.
No torch import: `--help` reads this module."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..options import ConfigError, int_in, on_off, one_of, option, parse_int, path_like, positive_int

log = logging.getLogger(__name__)

SPECULATIVE_ALGORITHMS = ("AUTO", "NONE", "NGRAM", "EAGLE", "EAGLE3", "DFLASH", "DDTREE")
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
                raise ConfigError(f"speculative_num_draft_tokens={num_draft_tokens} (the DFlash block size) "
                                  "must be >= 2.")
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


@dataclass(slots=True)
class SpeculativeConfig:
    """speculative decoding (SGLang's flags)"""

    algorithm: str | None = option(
        None, "AUTO: EAGLE3 with the bundled draft and its token map on the default model on the CPU, else off "
              "(generate's default); NONE: plain decoding (serve's default); or NGRAM, EAGLE, EAGLE3, DFLASH, DDTREE",
        parse=str.upper, check=one_of(*SPECULATIVE_ALGORITHMS, optional=True, upper=True),
        choices=SPECULATIVE_ALGORITHMS)
    draft_model_path: Any = option(None, "EAGLE / EAGLE-3 / DFlash draft directory (DFLASH/DDTREE on the default "
                                         "model: the bundled one)", parse=str, check=path_like, metavar="DIR")
    num_steps: int | None = option(None, "draft depth (default 5)", parse=parse_int, check=positive_int(optional=True))
    eagle_topk: int | None = option(None, "branches per draft step (1: chain)", parse=parse_int,
                                    check=positive_int(optional=True))
    num_draft_tokens: int | None = option(None, "tree nodes verified per step, root included (chain: num_steps + 1); "
                                                "DFLASH/DDTREE: the block size (default: the checkpoint's)",
                                          parse=parse_int, check=positive_int(optional=True))
    ddtree_budget: int | None = option(None, "DDTREE: draft nodes in the verified tree, 2..64 (default 16)",
                                       parse=parse_int, check=int_in(2, 64, optional=True))
    token_map: Any = option(None, "EAGLE/EAGLE3: a .pt or .json list of target token ids the draft may propose (hot "
                                  "tokens); each draft step's head then covers only them", parse=str, check=path_like,
                     metavar="FILE")
    adaptive: Any = option(True, "on (default): each step verifies the number of draft tokens that maximises expected "
                                 "tokens/s (measured step costs, running acceptance), down to plain decoding; off: "
                                 "num-draft-tokens every step", parse=str.lower, check=on_off, choices=("on", "off"))

    def resolve_auto(self, default_model: bool, on_cpu: bool) -> "SpeculativeConfig":
        """AUTO: EAGLE3 with the bundled head and its token map on the default model on the CPU; else off.
        On a GPU it stays off until a speculative step measures faster than plain decoding there
        (docs/speculative_graphs.md has the figures)."""
        if self.algorithm is None or self.algorithm.upper() != "AUTO":
            return self
        if not (default_model and on_cpu):
            return replace(self, algorithm=None)
        token_map = self.token_map
        if self.draft_model_path is None and token_map is None:
            token_map = str(DEFAULT_EAGLE3_TOKEN_MAP)  # the bundled head's hot tokens: faster CPU draft steps
        return replace(self, algorithm="EAGLE3", token_map=token_map)
