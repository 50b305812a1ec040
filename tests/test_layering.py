"""The package's layering, its environment variables and its command lines' shared flags, read from the source.

Imports are read with `ast` from every module under tercel/: at module level, inside functions, and under
`if TYPE_CHECKING:` alike (a lazy import still ties the two modules together), relative ones resolved.
An import of a submodule (`from pkg import sub`, `import pkg.sub`) is an edge to the submodule; the
package's __init__, which Python runs first, is not counted (every submodule would otherwise form a cycle
with an __init__ that re-exports it).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tercel"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package __init__)."""
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported tercel module: first line}."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods and "." in t:  # `import tercel.x.y` of a name inside a module
                    t = t.rpartition(".")[0]
                if t in mods and t != name:
                    edges.setdefault(t, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_cycle_finder_reports_a_cycle():
    graph = {"a": {"b": 3}, "b": {"c": 7}, "c": {"a": 1}, "d": {"a": 2}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_the_graph_reads_lazy_relative_and_type_checking_imports(tmp_path):
    graph = import_graph()
    # a function-level import (engine.py imports the speculative worker builder inside __init__)
    assert "tercel.speculative" in graph["tercel.engine"]
    # relative imports resolve to the module: kv imports tercel.config
    assert "tercel.config" in graph["tercel.kv"]
    # TYPE_CHECKING imports count (speculative/host.py names its types under TYPE_CHECKING)
    assert "tercel.kv" in graph["tercel.speculative.host"]


def test_no_import_cycles():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {_describe(graph, cycle)}"


@pytest.mark.parametrize("lower, higher", [
    ("tercel.kernels", "tercel.models"),  # kernels know no model
    ("tercel.models", "tercel.loader"),  # models load no files; the loader builds models
    ("tercel.distributed", "tercel.engine"),  # the engine drives distributed, not the reverse
    ("tercel.speculative", "tercel.engine"),  # the engine passes itself in (speculative.host.SpecEngine)
])
def test_a_lower_layer_imports_nothing_from_a_higher_one(lower, higher):
    graph = import_graph()
    bad = [f"{m}:{line} imports {t}" for m, edges in graph.items() if m == lower or m.startswith(lower + ".")
           for t, line in edges.items() if t == higher or t.startswith(higher + ".")]
    assert not bad, "\n".join(bad)


def test_cli_and_bench_cli_do_not_import_each_other():
    graph = import_graph()
    assert "tercel.cli" not in graph["tercel.bench.cli"]


# ---- environment variables ---------------------------------------------------------------------------------
ENV_READS = re.compile(r"\b(TERCEL_[A-Z0-9_]+)\b")


def test_every_tercel_variable_is_documented_in_dev_overrides():
    from tercel.dev_overrides import OVERRIDES

    named: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name == "dev_overrides.py" and path.parent == ROOT:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for name in ENV_READS.findall(line):
                named.setdefault(name, []).append(f"{path.relative_to(ROOT.parent)}:{i}")
    assert named, "the scan found no TERCEL_ name at all: the pattern is broken"
    missing = {n: where for n, where in named.items() if n not in OVERRIDES}
    assert not missing, f"TERCEL_* names not in tercel.dev_overrides.OVERRIDES: {missing}"
    for name, entry in OVERRIDES.items():
        assert len(entry.meaning) > 20, f"{name}: document what it does"
        assert entry.kind in ("developer", "environment")


def _env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of os.environ.get("TERCEL_..."), os.environ["TERCEL_..."], os.getenv("TERCEL_...")."""
    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = ast.unparse(node.func)
            if f in ("os.environ.get", "os.getenv", "environ.get", "getenv", "os.environ.setdefault"):
                key = node.args[0].value
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            if isinstance(node.slice, ast.Constant):
                key = node.slice.value
        if isinstance(key, str) and key.startswith("TERCEL_"):
            out.append((node.lineno, key))
    return out


def test_only_dev_overrides_reads_tercel_variables():
    bad = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "dev_overrides.py":
            continue
        bad += [f"{path.relative_to(ROOT.parent)}:{line} reads {name}"
                for line, name in _env_reads(ast.parse(path.read_text()))]
    assert not bad, "read TERCEL_* variables through tercel.dev_overrides.env:\n" + "\n".join(bad)


def test_env_reads_documented_names_only(monkeypatch):
    from tercel.dev_overrides import env

    monkeypatch.setenv("TERCEL_DECODE_MAX_SPLITS", "8")
    assert env("TERCEL_DECODE_MAX_SPLITS") == "8"
    monkeypatch.delenv("TERCEL_DECODE_MAX_SPLITS")
    assert env("TERCEL_DECODE_MAX_SPLITS") == "16"  # the documented default
    with pytest.raises(KeyError, match="TERCEL_NOT_A_SWITCH.*OVERRIDES"):
        env("TERCEL_NOT_A_SWITCH")


# ---- one definition of the speculative and sampling flags ----------------------------------------------------
def _help_flags(argv: list[str]) -> dict[str, str]:
    """--flag -> its help line(s), from the parser `tercel ARGV --help` prints."""
    import argparse

    from tercel.cli import build_parser

    parser = build_parser()
    for word in argv:  # walk down to the sub-command's parser
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return {s: a.help or "" for a in parser._actions for s in a.option_strings}


def _speculative(flags: dict[str, str]) -> dict[str, str]:
    return {f: h for f, h in flags.items() if f.startswith("--speculative-")}


def _sampling(flags: dict[str, str]) -> dict[str, str]:
    from tercel.sampling_options import sampling_options

    names = {"--" + n.replace("_", "-") for n, _, _ in sampling_options()}
    names |= {"--no-" + n[2:] for n in names}
    return {f: h.split(" (here the default is")[0] for f, h in flags.items() if f in names}


def test_bench_offline_has_generates_speculative_and_sampling_flags():
    from tercel.bench.cli import SWEPT_SAMPLING, SWEPT_SPECULATIVE

    gen, bench = _help_flags(["generate"]), _help_flags(["bench", "offline"])
    swept = {"--" + k.replace("_", "-") for k in SWEPT_SPECULATIVE + SWEPT_SAMPLING}
    want_spec = {f: h for f, h in _speculative(gen).items() if f not in swept}
    assert len(want_spec) >= 6 and _speculative(bench) == want_spec  # same flags, same help text
    want_sampling = {f: h for f, h in _sampling(gen).items() if f not in swept}
    assert {"--temperature", "--top-p", "--top-k", "--min-p", "--request-seed", "--ignore-eos"} <= set(want_sampling)
    assert _sampling(bench) == want_sampling
    # the swept ones are what the sweep sets per point: --algorithms, --eagle-draft / --dflash-draft, --output-len
    assert {"--algorithms", "--eagle-draft", "--dflash-draft", "--output-len"} <= set(bench)


def test_one_temperature_default_for_the_command_lines():
    from tercel.bench.cli import add_bench_parser  # noqa: F401 (the parsers below are built from it)
    from tercel.cli import build_parser
    from tercel.sampling_options import CLI_TEMPERATURE
    from tercel.sampling_params import SamplingParams

    assert SamplingParams().temperature == 1.0  # the Python API samples, as vLLM's does
    parser = build_parser()
    assert parser.parse_args(["generate"]).temperature == CLI_TEMPERATURE == 0.0
    assert parser.parse_args(["bench", "offline"]).temperature == CLI_TEMPERATURE
    assert parser.parse_args(["bench", "serve"]).temperature == CLI_TEMPERATURE
