"""PNG figures for `tercel bench` (matplotlib, imported only here and only when a figure is drawn)."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(result, path: Path) -> Path | None:
    """Speed-up over plain decoding vs concurrency, one line per algorithm (and output length)."""
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    many_lens = len({p.output_len for p in result.points}) > 1
    for p in result.points:
        if p.speedup_over_plain is not None:
            key = p.algorithm + (f" ({p.output_len} tok)" if many_lens else "")
            lines[key].append((p.concurrency, p.speedup_over_plain))
    if not lines:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in lines.items():
        pts.sort()
        ax.plot([c for c, _ in pts], [s for _, s in pts], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in one batch)")
    ax.set_ylabel("tok/s / plain tok/s (second pass)")
    ax.set_title(f"Speed-up over plain decoding\n{result.model} on {result.device}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def plot_accept_histogram(result, path: Path) -> Path | None:
    """Share of verify steps that emitted k tokens (accepted drafts + 1), summed over a sweep's points."""
    hists: dict[str, list[int]] = {}
    for p in result.points:
        for h in (p.first.accept_histogram, p.second.accept_histogram):
            acc = hists.setdefault(p.algorithm, [])
            acc.extend([0] * (len(h) - len(acc)))
            for k, v in enumerate(h):
                acc[k] += v
    hists = {a: h for a, h in hists.items() if sum(h)}
    if not hists:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(hists)
    for i, (algo, h) in enumerate(hists.items()):
        total = sum(h)
        ax.bar([k + 1 + (i - (len(hists) - 1) / 2) * width for k in range(len(h))], [v / total for v in h],
               width=width, label=f"{algo} (mean {sum((k + 1) * v for k, v in enumerate(h)) / total:.2f})")
    ax.set_xticks(range(1, max(len(h) for h in hists.values()) + 1))
    ax.set_xlabel("tokens emitted per verify step (accept length)")
    ax.set_ylabel("share of verify steps")
    ax.set_title(f"Accept length\n{result.model} on {result.device}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, plt, path)


def plot_serve_latency(results: Sequence, label: str, path: Path) -> Path | None:
    """TTFT, ITL and end-to-end latency (p50 with p90..p99 whiskers) vs request rate."""
    rows = [r for r in results if r.completed]
    if not rows:
        return None
    plt = _pyplot()
    finite = [r.request_rate for r in rows if not math.isinf(r.request_rate)]
    inf_x = (max(finite) * 2 if finite else 1.0)  # 'inf' drawn one step right of the largest finite rate
    xs = [inf_x if math.isinf(r.request_rate) else r.request_rate for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, key, name in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "inter-token latency", "end to end")):
        p50 = [getattr(r, key).get("p50") for r in rows]
        p90 = [getattr(r, key).get("p90") for r in rows]
        p99 = [getattr(r, key).get("p99") for r in rows]
        ax.plot(xs, p50, marker="o", label="p50")
        ax.plot(xs, p90, marker=".", ls="--", label="p90")
        ax.plot(xs, p99, marker=".", ls=":", label="p99")
        ax.set_xscale("log")
        ax.minorticks_off()  # the log axis's minor labels (2x10^1, ...) overprint the rates
        ax.set_xticks(xs, [("inf" if math.isinf(r.request_rate) else f"{r.request_rate:g}") for r in rows])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(label, fontsize=10)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
