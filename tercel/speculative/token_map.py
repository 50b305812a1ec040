"""Hot-token maps (SGLang's --speculative-token-map, the FR-Spec idea): the draft proposes only the
listed target token ids, so each draft step's head product covers those rows instead of the whole
vocabulary. Verification is unchanged, so output stays exactly the target's; only tokens outside
the map can no longer be drafted.

A map file is a 1-D list of target token ids: a `.pt` tensor or list (torch.save; loaded with
weights_only, never unpickled) or a `.json` list of integers."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..options import ConfigError


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The map's distinct token ids, sorted, as a long tensor; a clear error for anything else."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"speculative_token_map={str(path)!r} is not a file; pass a .pt or .json list of token ids.")
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"speculative_token_map={str(path)!r} is not valid JSON ({e}); expected a list of "
                              f"token ids.") from e
        if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise ConfigError(f"speculative_token_map={str(path)!r} must hold a JSON list of integer token ids.")
        ids = torch.tensor(raw, dtype=torch.long)
    elif path.suffix == ".pt":
        try:
            raw = torch.load(str(path), weights_only=True, map_location="cpu")
        except Exception as e:  # torch raises several kinds for a bad or unsafe file
            raise ConfigError(f"speculative_token_map={str(path)!r} could not be read as a tensor file ({e}).") from e
        ids = torch.as_tensor(raw) if isinstance(raw, (list, tuple, torch.Tensor)) else None
        if ids is None or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ConfigError(f"speculative_token_map={str(path)!r} must hold an integer tensor or list of token "
                              f"ids, not {type(raw).__name__}{'' if ids is None else ' of ' + str(ids.dtype)}.")
        ids = ids.long()
    else:
        raise ConfigError(f"speculative_token_map={str(path)!r}: unknown suffix {path.suffix!r}; use .pt or .json.")
    if ids.dim() != 1 or ids.numel() == 0:
        raise ConfigError(f"speculative_token_map={str(path)!r} must be a non-empty 1-D list of token ids, "
                          f"got shape {tuple(ids.shape)}.")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ConfigError(f"speculative_token_map={str(path)!r} holds token id {int(bad[0])}, outside the target "
                          f"vocabulary [0, {vocab_size}); the map was made for another tokenizer.")
    return torch.unique(ids)  # sorted
