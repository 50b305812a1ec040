"""Terminal tables and JSON files for `tercel bench` results."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100), numpy's default method; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned table: numbers right-aligned, text left-aligned."""
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) for i in range(len(headers))]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def to_json(obj: object) -> object:
    """Dataclasses to dicts; infinities (request rate inf) as the string 'inf' so the file stays strict JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(payload), indent=2, allow_nan=False) + "\n")
    return path


def offline_table(result) -> str:
    rows = []
    for p in result.points:
        rows.append([p.algorithm, p.output_len, p.concurrency, p.first.tok_s, p.second.tok_s, p.speedup_over_plain,
                     p.second.mean_accept_length, p.roofline_fraction,
                     p.token_id.tok_s if p.token_id else None, p.api_fraction_of_token_id])
    text = table(["algorithm", "len", "conc", "tok/s 1st", "tok/s 2nd", "vs plain", "accept len", "roofline",
                  "token-id tok/s", "api/token-id"], rows)
    if result.engine_errors:
        text += "\n" + "\n".join(f"{a}: engine did not start: {e}" for a, e in result.engine_errors.items())
    for err in result.point_errors:
        text += f"\n{err['algorithm']} at concurrency {err['concurrency']}, {err['output_len']} tokens: {err['error']}"
    if result.hf_peers:
        peer_rows = [[r["config"], r.get("output_len"), r.get("tok_s"), r.get("error", "")[:60] or None,
                      " ".join(f"{a} {s}x" for a, s in r.get("tercel_speedup", {}).items()) or None]
                     for r in result.hf_peers]
        text += "\n\nHF transformers peers (concurrency 1)\n" + table(
            ["peer", "len", "tok/s", "error", "Tercel speed-up (2nd pass)"], peer_rows)
    return text


def serve_table(results: Sequence) -> str:
    rows = [[_rate(r.request_rate), r.completed, r.errors, r.request_throughput, r.output_tok_s,
             r.ttft_ms.get("p50"), r.ttft_ms.get("p90"), r.ttft_ms.get("p99"), r.itl_ms.get("p50"),
             r.itl_ms.get("p99"), r.tpot_ms.get("p50"), r.e2e_ms.get("p50"), r.e2e_ms.get("p99")]
            for r in results]
    return table(["rate/s", "done", "errors", "req/s", "out tok/s", "TTFT p50", "p90", "p99", "ITL p50", "p99",
                  "TPOT p50", "E2E p50", "p99"], rows) + "\n(latencies in ms)"


def _rate(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:g}"
