"""What a configuration field knows about itself: help text, how to parse it from a command line, how
to check it. The engine's settings tree (tercel.config) declares each option once with `option()`;
the Python API validates with the checks and both command lines build their flags from the same
metadata (tercel.cli_args). No torch import here: `--help` stays fast.
"""
from __future__ import annotations

import argparse
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A checkpoint or engine setting Tercel cannot serve; the message names the value and the fix."""


# How a setting is written where an error is reported: `device='cpu'` in Python, `--device cpu` on a CLI.
Spelling = Callable[[str, object], str]
Check = Callable[[Any, Spelling], "str | None"]  # the problem with a value ("must be ..."), or None


def python_spelling(name: str, value: object) -> str:
    return f"{name}={value!r}"


def cli_spelling(name: str, value: object) -> str:
    return f"--{name.replace('_', '-')} {value}"


@dataclass(frozen=True, slots=True)
class Option:
    help: str
    parse: Callable[[str], Any] | None = None  # command-line text -> value; None: a switch (no value)
    check: Check | None = None
    choices: tuple[str, ...] | None = None  # shown in --help; the check enforces them
    cli: bool = True  # False: Python API only (e.g. a progress bar, a tokenizer object)
    negate: bool = False  # a switch whose flag turns a True default off: --no-NAME
    metavar: str | None = None
    off_help: str | None = None  # a negated switch: its --no-NAME flag's help (what turning it off does)
    both_flags: bool = False  # a switch with both spellings: --NAME and --no-NAME


def option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, check: Check | None = None,
           choices: tuple[str, ...] | None = None, cli: bool = True, negate: bool = False,
           metavar: str | None = None, off_help: str | None = None, both_flags: bool = False) -> Any:
    """A dataclass field carrying its Option (see dataclasses.field's metadata)."""
    if negate and cli and off_help is None and not both_flags:
        raise TypeError("a negated switch needs off_help: its --no-NAME flag's help")
    meta = Option(help, parse, check, choices, cli, negate, metavar, off_help, both_flags)
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"option": meta})
    return field(default=default, metadata={"option": meta})


# ---- checks: each returns the problem, phrased to follow the spelled value ---------------------

def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def positive_int(optional: bool = False) -> Check:
    def check(v: object, spell: Spelling) -> str | None:
        if (v is None and optional) or (_is_int(v) and v >= 1):
            return None
        return "must be a positive integer"
    return check


def int_in(lo: int, hi: int, optional: bool = False) -> Check:
    def check(v: object, spell: Spelling) -> str | None:
        if (v is None and optional) or (_is_int(v) and lo <= v <= hi):
            return None
        return f"must be an integer in {lo}..{hi}"
    return check


def any_int(v: object, spell: Spelling) -> str | None:
    return None if _is_int(v) else "must be an integer"


def fraction(v: object, spell: Spelling) -> str | None:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and 0.0 < v <= 1.0
    return None if ok else "must be a number in (0, 1]"


def boolean(v: object, spell: Spelling) -> str | None:
    return None if isinstance(v, bool) else "must be True or False"


def on_off(v: object, spell: Spelling) -> str | None:
    ok = isinstance(v, bool) or (isinstance(v, str) and v.lower() in ("on", "off"))
    return None if ok else "must be on|off (True or False); off verifies num_draft_tokens on every step"


def one_of(*names: str, optional: bool = False, upper: bool = False) -> Check:
    def check(v: object, spell: Spelling) -> str | None:
        if v is None and optional:
            return None
        if isinstance(v, str) and (v.upper() if upper else v) in names:
            return None
        return f"is not supported; use one of {', '.join(names)}"
    return check


def int_list(v: object, spell: Spelling) -> str | None:
    ok = v is None or (isinstance(v, (list, tuple)) and v and all(_is_int(x) and x >= 1 for x in v))
    return None if ok else "must be a non-empty list of positive integers"


def path_like(v: object, spell: Spelling) -> str | None:
    return None if v is None or isinstance(v, str) or hasattr(v, "__fspath__") else "must be a path"


# ---- command-line parsers ---------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
               "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '1GiB', '512M', '2g' (k/M/G = 1000^n, Ki/Mi/Gi = 1024^n)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1073741824, 512MiB, 2GiB)")
    value = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return int(value)


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def parse_int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,2,4)") from None
