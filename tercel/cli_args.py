"""Command-line flags generated from the engine's settings tree (tercel.config), shared by `tercel
generate` and `tercel serve`: one flag per setting, with its help text, parser and check, so a new
setting is written once. Values are checked while parsing, before anything loads, and a bad one is a
one-line error naming the flag: `tercel generate: error: --max-model-len 0: must be a positive integer`.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from .config import ConfigError, EngineConfig, Setting, settings
from .options import Option, cli_spelling, parse_float, parse_int, parse_int_list, parse_size
from .sampling_options import params_kwargs, sampling_options

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
    return flag_name(("no_" if s.option.negate else "") + s.kwarg)


def _value_parser(s: Setting) -> Callable[[str], Any]:
    return _checked_parser(s.kwarg, s.option)


def _checked_parser(name: str, o: Option) -> Callable[[str], Any]:
    """Text -> value, checked: argparse reports a failure as `--flag TEXT: problem`."""
    parse, check = o.parse, o.check
    assert parse is not None

    def convert(text: str) -> Any:
        value = parse(text)
        problem = check(value, cli_spelling) if check is not None else None
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{text}: {problem.removeprefix('but ')}")
        return value

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def add_engine_options(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                       exclude: tuple[str, ...] = ()) -> None:
    """One flag per command-line setting of the tree, grouped by section; `defaults` overrides a
    setting's default for this command (by keyword name); `exclude`: sections, or single settings by keyword
    name, that the command sets its own way."""
    defaults = defaults or {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in settings(EngineConfig):
        if not s.option.cli or s.section in exclude or s.kwarg in exclude:
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
                           default=default, help=o.off_help if o.negate else o.help)
            continue
        metavar = o.metavar or ("{" + ",".join(o.choices) + "}" if o.choices else _METAVARS.get(o.parse))
        g.add_argument(flag(s), dest=s.kwarg, type=_value_parser(s), default=default, metavar=metavar, help=o.help)


def add_sampling_options(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                         exclude: tuple[str, ...] = ()) -> None:
    """The sampling flags (tercel.sampling_options), one group; `defaults` overrides a flag's default for this
    command, `exclude` leaves flags out that the command sets its own way (e.g. a sweep over output lengths)."""
    defaults = defaults or {}
    g = parser.add_argument_group("sampling: each request's SamplingParams")
    for name, o, default in sampling_options():
        if name in exclude:
            continue
        dest, text, help_ = name, "--" + name.replace("_", "-"), o.help
        if name in defaults:
            default = defaults[name]
            help_ += f" (here the default is {'on' if default is True else 'off' if default is False else default})"
        if o.parse is None:  # a switch: --NAME / --no-NAME
            g.add_argument(text, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        g.add_argument(text, dest=dest, type=_checked_parser(name, o), default=default,
                       metavar=_METAVARS.get(o.parse), help=help_)


def sampling_values(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags' values the command has, by SamplingParams keyword."""
    return params_kwargs({name: getattr(args, name) for name, _, _ in sampling_options() if hasattr(args, name)})


def sampling_params(args: argparse.Namespace, **fixed: Any):
    """The request's SamplingParams from the flags (plus what the command fixes itself), or a one-line
    ConfigError naming the flag (before anything loads)."""
    from .sampling_params import SamplingParams

    values = {**sampling_values(args), **fixed}
    try:
        return SamplingParams(**values)
    except ValueError as e:
        m = re.fullmatch(r"SamplingParams\.(\w+)=.*? is invalid: (.*?)\.?", str(e))
        if m is None or m.group(1) not in values:
            raise
        name = "request_seed" if m.group(1) == "seed" else m.group(1)
        raise ConfigError(f"--{name.replace('_', '-')} {values[m.group(1)]}: {m.group(2)}") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings the flags give, by keyword name (speculative ones not resolved)."""
    flags = {s.kwarg for s in settings(EngineConfig) if s.option.cli}  # not model, progress, ... (the caller's)
    return {k: v for k, v in engine_config_from_args(args).to_kwargs().items()
            if k in flags and not k.startswith("speculative_")}


def engine_config_from_args(args: argparse.Namespace, **settings_: Any) -> EngineConfig:
    """The tree from parsed flags (plus settings the command fixes itself, e.g. model, progress),
    validated with the flags' spelling in its errors."""
    kw = {s.kwarg: getattr(args, s.kwarg) for s in settings(EngineConfig) if s.option.cli and hasattr(args, s.kwarg)}
    return EngineConfig.from_kwargs(**kw, **settings_).validate(cli_spelling)


def cli_message(message: str) -> str:
    """An engine error as a command line reads it: `speculative_algorithm=EAGLE` -> `--speculative-algorithm EAGLE`."""
    names = "|".join(sorted((s.kwarg for s in settings(EngineConfig) if s.option.cli), key=len, reverse=True))
    return re.sub(rf"\b({names})\b(=)?", lambda m: flag_name(m.group(1)) + (" " if m.group(2) else ""), message)


def flag_name(kwarg: str) -> str:
    return "--" + kwarg.replace("_", "-")


def check_speculative(config: EngineConfig, default_model: bool) -> None:
    """The speculative flags and the draft / token-map paths they name, before any weight loads: a
    ConfigError naming the flag and the fix. AUTO takes the bundled draft (or none), or the EAGLE3 draft named."""
    from .speculative.config import SpecConfig

    sp = config.speculative
    if (sp.algorithm or "").upper() == "AUTO":  # the bundled EAGLE3 draft or none; a draft named is an EAGLE3 one
        algorithm = "EAGLE3"
        draft = Path(sp.draft_model_path).expanduser() if sp.draft_model_path is not None else None
    else:
        try:
            cfg = SpecConfig.resolve(sp.algorithm, sp.draft_model_path, sp.num_steps, sp.eagle_topk,
                                     sp.num_draft_tokens, default_model, sp.ddtree_budget, sp.token_map)
        except ConfigError as e:
            raise ConfigError(cli_message(str(e).rstrip("."))) from None
        if cfg is None:
            if sp.draft_model_path is not None:
                raise ConfigError(f"--speculative-draft-model-path {sp.draft_model_path} is set but speculative "
                                  f"decoding is off; pass --speculative-algorithm EAGLE3 (or EAGLE, DFLASH, DDTREE) "
                                  f"with it, or drop it")
            return
        algorithm, draft = cfg.algorithm, cfg.draft_model_path
    if sp.draft_model_path is not None:
        kind = "a DFlash" if algorithm in ("DFLASH", "DDTREE") else f"an {algorithm}"
        if draft is None or not draft.is_dir() or not (draft / "config.json").is_file():
            what = "no such directory" if draft is None or not draft.exists() else \
                "not a directory" if not draft.is_dir() else "no config.json there"
            raise ConfigError(f"--speculative-draft-model-path {sp.draft_model_path}: {what}; give {kind} draft "
                              f"directory (config.json + model.safetensors, e.g. from `tercel train-draft`)"
                              + (", or drop the flag for the default model's bundled draft" if default_model else ""))
        if not any(draft.glob("*.safetensors")):
            raise ConfigError(f"--speculative-draft-model-path {sp.draft_model_path}: no .safetensors weights there; "
                              f"give {kind} draft directory (config.json + model.safetensors)")
    if sp.token_map is not None and not Path(sp.token_map).expanduser().is_file():
        raise ConfigError(f"--speculative-token-map {sp.token_map}: no such file; give a .pt or .json list of "
                          f"token ids, or drop the flag")


def start_checks(config: EngineConfig):
    """Every check that needs no weights, in seconds, with a start line first: the model path, the speculative
    flags and draft paths, the checkpoint's config (read once, from the load cache after the first start,
    and passed on to the engine). Returns the Checkpoint."""
    from .loader import cache
    from .loader.paths import default_model_path, resolve_model_path

    path = resolve_model_path(config.model.model)
    try:
        default_model = path.resolve() == default_model_path().resolve()
    except ConfigError:
        default_model = False
    check_speculative(config, default_model)
    first = (path.is_file() and config.model.load_cache
             and not (cache.entry_dir(path) / "metadata.json").is_file())
    note = (f" (first start with this file: preparing it, kept under {cache.cache_root()} so later starts skip "
            f"that)" if first else "")
    logging.getLogger("tercel.cli").info("loading %s%s", path.name, note)
    from .loader.model_loader import read_checkpoint  # torch: after the start line

    return read_checkpoint(path, config.model.load_cache)


def fail(args: argparse.Namespace, message: str) -> int:
    """Report a command-line mistake found after parsing the way argparse reports one: exit code 2."""
    prog = getattr(args, "prog", None) or "tercel"
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def config_error(args: argparse.Namespace, e: ConfigError) -> int:
    return fail(args, str(e))
