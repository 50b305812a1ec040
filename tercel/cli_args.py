"""Command-line flags generated from the engine's settings tree (tercel.config), shared by `tercel
generate` and `tercel serve`: one flag per setting, with its help text, parser and check, so a new
setting is written once. Values are checked while parsing, before anything loads, and a bad one is a
one-line error naming the flag: `tercel generate: error: --max-model-len 0: must be a positive integer`.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .config import ConfigError, EngineConfig, Setting, settings
from .options import cli_spelling, parse_float, parse_int, parse_int_list, parse_size

_METAVARS: dict[Any, str] = {parse_int: "N", parse_float: "X", parse_int_list: "N[,N...]", parse_size: "SIZE"}


class CliParser(argparse.ArgumentParser):
    """argparse with one-line errors for bad values (the flag, the value, the fix) and the usage shown
    only when the command line's shape is wrong (unknown flag, missing argument)."""

    def error(self, message: str) -> NoReturn:
        m = re.fullmatch(r"argument (-[\w-]+)(?:/[\w-]+)*: (.*)", message, flags=re.S)
        if m is None:
            self.print_usage(sys.stderr)
        else:
            message = f"{m.group(1)} {m.group(2)}"
        self.exit(2, f"{self.prog}: error: {message}\n")


def flag(s: Setting) -> str:
    return "--" + ("no-" if s.option.negate else "") + s.kwarg.replace("_", "-")


def _value_parser(s: Setting) -> Callable[[str], Any]:
    """Text -> value, checked: argparse reports a failure as `--flag TEXT: problem`."""
    parse, check = s.option.parse, s.option.check
    assert parse is not None

    def convert(text: str) -> Any:
        value = parse(text)
        problem = check(value, cli_spelling) if check is not None else None
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{text}: {problem.removeprefix('but ')}")
        return value

    convert.__name__ = s.kwarg  # argparse names the type in some messages
    return convert


def add_engine_options(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                       exclude: tuple[str, ...] = ()) -> None:
    """One flag per command-line setting of the tree, grouped by section; `defaults` overrides a
    setting's default for this command (by keyword name); `exclude`: sections the command sets its own way."""
    defaults = defaults or {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in settings(EngineConfig):
        if not s.option.cli or s.section in exclude:
            continue
        if s.section not in groups:
            section_doc = type(getattr(EngineConfig(), s.section)).__doc__ or s.section
            groups[s.section] = parser.add_argument_group(section_doc.strip().splitlines()[0])
        g = groups[s.section]
        default = defaults.get(s.kwarg, s.default)
        o = s.option
        if o.parse is None and o.both_flags:  # --NAME and --no-NAME
            g.add_argument("--" + s.kwarg.replace("_", "-"), dest=s.kwarg, action=argparse.BooleanOptionalAction,
                           default=default, help=o.help)
            continue
        if o.parse is None:  # a switch
            g.add_argument(flag(s), dest=s.kwarg, action="store_false" if o.negate else "store_true",
                           default=default, help=o.help)
            continue
        metavar = o.metavar or ("{" + ",".join(o.choices) + "}" if o.choices else _METAVARS.get(o.parse))
        g.add_argument(flag(s), dest=s.kwarg, type=_value_parser(s), default=default, metavar=metavar, help=o.help)


def engine_config_from_args(args: argparse.Namespace, **settings_: Any) -> EngineConfig:
    """The tree from parsed flags (plus settings the command fixes itself, e.g. model, progress),
    validated with the flags' spelling in its errors."""
    kw = {s.kwarg: getattr(args, s.kwarg) for s in settings(EngineConfig) if s.option.cli and hasattr(args, s.kwarg)}
    return EngineConfig.from_kwargs(**kw, **settings_).validate(cli_spelling)


def fail(args: argparse.Namespace, message: str) -> int:
    """Report a command-line mistake found after parsing the way argparse reports one: exit code 2."""
    prog = getattr(args, "prog", None) or "tercel"
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def config_error(args: argparse.Namespace, e: ConfigError) -> int:
    return fail(args, str(e))
