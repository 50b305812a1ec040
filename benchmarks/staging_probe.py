"""Host-side staging cost of a speculative step's graph inputs: grouped (_foreach_copy_ per dtype group, big
tensors by DMA) vs one copy_ per tensor, for the step kinds a greedy EAGLE-3 chain replays on the SmolLM2 shape
(hidden 576, fc_in 3 x 576, W = 6 tokens per request, block tables for max_model_len 4096): the chained step
(spec/chain.py: everything in one graph), and the separate draft loop, target verify and draft_extend graphs.
Host µs per stage() call (median), and the GPU µs until the copies land. No model is needed: the buffers are
those of the step kinds' BufferSpecs, filled from live tensors of the right shapes.

PYTHONPATH=. python benchmarks/staging_probe.py --out benchmarks/results/staging_probe_h200.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from tercel.graphs.buffers import BufferSpec, Pad, Per, StaticBuffers  # noqa: E402

HIDDEN, FC_IN, W, MAX_BLOCKS = 576, 3 * 576, 6, 4096 // 16 + 2


def kinds() -> dict[str, tuple[int, list[BufferSpec]]]:
    """(tokens per request, buffer specs) of each step kind, as spec/chain.py, spec/eagle_steps.py and
    graphs/steps.py declare them."""
    long, bf16 = torch.long, torch.bfloat16
    tables = BufferSpec("block_tables", Per.REQUEST, long, Pad.ZERO, shape=(MAX_BLOCKS,))
    return {
        "chain": (1, [BufferSpec("roots", Per.REQUEST, long, Pad.ZERO),
                      BufferSpec("first", Per.REQUEST, long, Pad.ZERO),
                      BufferSpec("hidden", Per.REQUEST, bf16, Pad.ZERO, shape=(HIDDEN,)),
                      BufferSpec("base", Per.REQUEST, long, Pad.ZERO), tables,
                      BufferSpec("live", Per.REQUEST, long, Pad.ZERO)]),
        "draft": (1, [BufferSpec("roots", Per.REQUEST, long, Pad.HEAD_ONLY),
                      BufferSpec("first", Per.REQUEST, long, Pad.HEAD_ONLY),
                      BufferSpec("hidden", Per.REQUEST, bf16, Pad.ZERO, shape=(HIDDEN,)),
                      BufferSpec("base", Per.REQUEST, long, Pad.ZERO), tables]),
        "verify": (W, [BufferSpec("input_ids", Per.TOKEN, long, Pad.HEAD_ONLY),
                       BufferSpec("positions", Per.TOKEN, long, Pad.ZERO),
                       BufferSpec("out_cache_loc", Per.TOKEN, long, Pad.ZERO),
                       BufferSpec("seq_lens", Per.REQUEST, long, Pad.SENTINEL, sentinel=W), tables]),
        "draft_extend": (W, [BufferSpec("ids", Per.TOKEN, long, Pad.HEAD_ONLY),
                             BufferSpec("hidden", Per.TOKEN, bf16, Pad.ZERO, shape=(FC_IN,)),
                             BufferSpec("positions", Per.TOKEN, long, Pad.ZERO),
                             BufferSpec("out_cache_loc", Per.TOKEN, long, Pad.ZERO),
                             BufferSpec("seq_lens", Per.REQUEST, long, Pad.SENTINEL, sentinel=W), tables,
                             BufferSpec("last", Per.REQUEST, long, Pad.ZERO)]),
    }


def live_inputs(specs: list[BufferSpec], t: int, n: int, cols: int, device: str) -> dict[str, torch.Tensor]:
    out = {}
    for s in specs:
        rows = n * (t if s.per is Per.TOKEN else 1)
        shape = (rows, cols) if s.name == "block_tables" else (rows, *s.shape)
        out[s.name] = torch.ones(shape, dtype=s.dtype, device=device)
    return out


def probe(device: str, batch_sizes: list[int], reps: int) -> list[dict]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for name, (t, specs) in kinds().items():
        bufs = StaticBuffers(specs, 64, t, device)
        for n in batch_sizes:
            bucket = n
            live = live_inputs(specs, t, n, cols=40, device=device)  # a 640-token context
            row = {"step": name, "batch_size": n, "tensors": len(specs)}
            for grouped in (True, False):
                for _ in range(5):
                    bufs.stage(live, n, bucket, use_foreach=grouped)
                sync()
                host = []
                start = torch.cuda.Event(enable_timing=True) if device == "cuda" else None
                end = torch.cuda.Event(enable_timing=True) if device == "cuda" else None
                if start is not None:
                    start.record()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    bufs.stage(live, n, bucket, use_foreach=grouped)
                    host.append((time.perf_counter() - t0) * 1e6)
                if end is not None:
                    end.record()
                    end.synchronize()
                key = "grouped" if grouped else "per_tensor"
                row[f"{key}_host_us"] = round(statistics.median(host), 1)
                if start is not None:
                    row[f"{key}_gpu_us"] = round(start.elapsed_time(end) * 1e3 / reps, 1)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    from common import environment

    env = environment()
    env["command"] = "PYTHONPATH=. python " + " ".join(sys.argv)
    rows = probe(args.device, [int(b) for b in args.batch_sizes.split(",")], args.reps)
    note = ("a chained EAGLE step (spec/chain.py) stages only when a chain starts; its later steps stage nothing. "
            "The unchained path stages draft + verify + draft_extend every step.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": env, "note": note, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
