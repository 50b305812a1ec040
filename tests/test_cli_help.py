"""Every flag of `tercel generate`, `tercel serve` and `tercel bench` says what it does in --help, and
`tercel --version` answers at once."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tercel import __version__
from tercel.cli import build_parser

REPO = Path(__file__).resolve().parent.parent


def _sub(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("path", [("generate",), ("serve",), ("bench", "offline"), ("bench", "serve")])
def test_every_option_has_help_text(path):
    parser = _sub(build_parser(), *path)
    bare = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = (action.help or "").strip()
        if not text or text == argparse.SUPPRESS or "(flag:" in text:
            bare.append("/".join(action.option_strings) or action.dest)
    assert not bare, f"`tercel {' '.join(path)}` options without readable help: {bare}"


def test_negated_switch_help_says_what_turning_it_off_does():
    help_text = _sub(build_parser(), "generate").format_help()
    assert "--no-tune-gemv" in help_text and "skip measuring cuBLAS" in " ".join(help_text.split())


@pytest.mark.parametrize("argv", [[sys.executable, "-m", "tercel", "--version"]])
def test_version_answers_at_once(argv):
    start = time.perf_counter()
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"tercel {__version__}"
    assert elapsed < 3.0, f"--version took {elapsed:.1f} s (it must not import torch)"
    probe = "import sys, tercel.cli; tercel.cli.build_parser(); print('torch' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert imported.stdout.strip() == "False", "parsing the command line imports torch"
