"""The sampling flags of the command lines (`tercel generate`, `tercel bench offline`, `tercel bench serve`),
defined once: each field becomes a flag (tercel.cli_args.add_sampling_options) and a SamplingParams field.

The Python API's SamplingParams samples by default (temperature 1.0, as vLLM's does); the command lines
decode greedily unless told otherwise (CLI_TEMPERATURE), and that default is written here only.
No torch import: `--help` reads this module."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .options import Option, any_int, boolean, option, parse_float, parse_int


def _at_least_one(v: object, spell: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else "must be an integer >= 1"


CLI_TEMPERATURE = 0.0  # the command lines decode greedily by default (SamplingParams: 1.0)


@dataclass(slots=True)
class SamplingOptions:
    """sampling: each request's SamplingParams"""

    max_tokens: int = option(128, "most new tokens (default 128)", parse=parse_int, check=_at_least_one)
    temperature: float = option(CLI_TEMPERATURE, "0 = greedy (default 0)", parse=parse_float)
    top_p: float = option(1.0, "nucleus sampling: smallest token set with this probability mass, in (0, 1] "
                               "(default 1: off)", parse=parse_float)
    top_k: int = option(0, "sample among the k most likely tokens (default 0: off)", parse=parse_int)
    min_p: float = option(0.0, "drop tokens below this fraction of the top token's probability, in [0, 1] "
                               "(default 0: off)", parse=parse_float)
    request_seed: int | None = option(None, "seed of each request's sampling (default: the engine's generator)",
                                      parse=parse_int, check=lambda v, s: None if v is None else any_int(v, s))
    ignore_eos: bool = option(False, "keep generating past end-of-sequence (--no-ignore-eos: stop there)",
                              check=boolean)


def sampling_options() -> list[tuple[str, Option, Any]]:
    """(name, option, default) of every sampling flag, in declaration order."""
    return [(f.name, f.metadata["option"], f.default) for f in fields(SamplingOptions)]


def params_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keywords from flag values by name (request_seed is SamplingParams.seed)."""
    return {("seed" if k == "request_seed" else k): v for k, v in values.items()}
