"""Verify cost with and without the fused small-M path: graph-replay GPU time of a target step of t tokens
per request (t = 1 decode, t > 1 verify with a tree mask) through ModelStep + CudaGraphRunner, with
TERCEL_FUSED_DECODE on and off, on random-weight models of the SmolLM2-135M and Llama-3.1-8B shapes
(seeded normal std 0.02, norms 1, built in-process through the checkpoint loader's load_weights; labelled
"random weights"). Before timing, a correctness check: fused vs unfused logits of the same verify batch
(relative error, greedy argmax agreement) and graph replay == eager. The acceptance ratio of #21 is
verify(t) / decode(t = 1), both fused, at the same batch size. Roofline: (weights streamed + KV read)
/ 4.27 TB/s.

GPU:  PYTHONPATH=. python benchmarks/verify_probe.py --out benchmarks/results/verify_probe.json
CPU (checks the script, no timing worth reading):
      PYTHONPATH=. python benchmarks/verify_probe.py --device cpu --dry-run --out /tmp/verify_probe.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TERCEL_SMALL_M", "1")  # the probe compares the fused small-M path (opt-in) with unfused
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

COPY_BW = 4.27e12  # H200 device-to-device copy, bytes/s (shared/GPU.md)
CONTEXT = 400  # tokens already in the cache of every request
SHAPES = {
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False, rope_theta=10000.0),
}
LABELS = {"smol": "SmolLM2-135M shape, random weights", "8b": "Llama-3.1-8B shape, random weights",
          "tiny": "tiny shape (CPU dry run), random weights"}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON path")
    ap.add_argument("--shapes", default=None, help="comma list of smol, 8b, tiny (default smol,8b; dry run tiny)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes and few repetitions: checks the script")
    ap.add_argument("--tokens", default="1,2,4,8,16", help="tokens per request t")
    ap.add_argument("--reps", type=int, default=50, help="graph replays per timing round (5 rounds, median)")
    args = ap.parse_args()
    if args.shapes is None:
        args.shapes = "tiny" if args.dry_run else "smol,8b"
    if args.device == "cpu":  # the kernels run in Triton's interpreter; must be set before triton loads
        os.environ["TRITON_INTERPRET"] = "1"
    return args


@contextlib.contextmanager
def fused_switch(on: bool):
    """TERCEL_FUSED_DECODE for the duration (read at forward time, so also at graph capture)."""
    old = os.environ.get("TERCEL_FUSED_DECODE")
    os.environ["TERCEL_FUSED_DECODE"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TERCEL_FUSED_DECODE", None)
        else:
            os.environ["TERCEL_FUSED_DECODE"] = old


def build(shape: str, device: str, dtype):
    """A random-weight model of `shape` through the loader's load_weights (HF tensor names)."""
    import torch

    from tercel.config import ModelConfig
    from tercel.loader.model_loader import build_model

    raw = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
           "bos_token_id": 1, "eos_token_id": 2, **SHAPES[shape]}
    cfg = ModelConfig.from_hf_dict(raw, source=LABELS[shape])
    model = build_model(cfg, 2048, dtype, torch.device(device))
    gen = torch.Generator(device=device).manual_seed(0)
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def tensors():
        yield "model.embed_tokens.weight", (cfg.vocab_size, h)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (h,)
            yield p + "post_attention_layernorm.weight", (h,)
            for name, shp in (("q_proj", (q, h)), ("k_proj", (kvd, h)), ("v_proj", (kvd, h)), ("o_proj", (h, q))):
                yield p + f"self_attn.{name}.weight", shp
            for name, shp in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
                yield p + f"mlp.{name}.weight", shp
        yield "model.norm.weight", (h,)
        if not cfg.tie_word_embeddings:
            yield "lm_head.weight", (cfg.vocab_size, h)

    def materialise():
        for name, shp in tensors():
            if "norm" in name:
                yield name, torch.ones(shp, dtype=dtype, device=device)
            else:
                yield name, torch.empty(shp, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)

    model.load_weights(materialise(), source=LABELS[shape])
    return model, cfg


def force_configs(model) -> None:
    """CPU dry run: the tuner needs CUDA graphs, so every role gets a fixed small config."""
    from tercel.attention.triton_backend import TritonAttentionBackend
    from tercel.kernels.gemm_small import ROW_BUCKETS
    from tercel.kernels.gemv import GemvConfig

    cfg = model.config
    model.attn_backend = TritonAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, None, num_sms=8)
    one, dot = GemvConfig(block_n=8, block_k=32), GemvConfig(block_n=16, block_k=32, dot=True)
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv_fused = a.o_fused = m.gate_up_fused = m.down_fused = one
        for table in (a.qkv_fused_rows, a.o_fused_rows, m.gate_up_fused_rows, m.down_fused_rows):
            table.update(dict.fromkeys(ROW_BUCKETS, dot))
    model.lm_head_fused = one
    model.lm_head_fused_rows.update(dict.fromkeys(ROW_BUCKETS, dot))


def tree_mask(t: int, device: str):
    """A binary tree of t nodes: node j's parent is (j - 1) // 2."""
    import torch

    m = torch.zeros(t, t, dtype=torch.bool)
    for j in range(t):
        k = j
        while True:
            m[j, k] = True
            if k == 0:
                break
            k = (k - 1) // 2
    return m.to(device)


def make_batch(reqs, bs: int, t: int, device: str):
    # causal on the CPU: the interpreter of some Triton versions cannot load the attention's bool mask
    masks = [tree_mask(t, device)] * bs if t > 1 and device == "cuda" else None
    return reqs.batch(list(range(bs)), t, masks)


def check(model, kv, reqs, bs: int, t: int, device: str) -> dict:
    """Fused vs unfused logits of one verify batch (eager): relative error, greedy argmax agreement."""
    batch = make_batch(reqs, bs, t, device)
    with fused_switch(False):
        want = model(batch, kv).logits.clone()
    with fused_switch(True):
        got = model(batch, kv).logits.clone()
    rel = float((got.double() - want.double()).norm() / want.double().norm())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    return {"rel_err": float(f"{rel:.3g}"), "argmax_agree": round(agree, 4), "rows": int(want.shape[0])}


def median_replay_us(graph, reps: int, rounds: int = 5) -> float:
    import torch

    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / reps * 1000)
    return statistics.median(times)


def step_time(model, kv, reqs, bs: int, t: int, fused: bool, device: str, reps: int) -> dict:
    """GPU time of one captured step (us); fused: also whether replay == eager, bit for bit. CPU: eager
    wall time of one forward (the dry run checks the code path only)."""
    import torch

    batch = make_batch(reqs, bs, t, device)
    with fused_switch(fused):
        if device != "cuda":
            start = time.perf_counter()
            model(batch, kv)
            return {"us": round((time.perf_counter() - start) * 1e6, 1), "graph_equals_eager": None}
        from tercel.graphs import CudaGraphRunner, GraphConfig
        from tercel.graphs.steps import ModelStep

        step = ModelStep(model, kv, max_blocks_per_request=64, tokens_per_request=t, custom_mask=t > 1)
        runner = CudaGraphRunner(step, GraphConfig(batch_sizes=(bs,), backend="full"), kv.k.device)
        runner.capture_all()
        replayed = runner.run(batch).logits.clone()
        same = bool(torch.equal(replayed, model(batch, kv).logits)) if fused else None
        us = median_replay_us(runner.graphs[bs].graph, reps)
        del runner, step
    return {"us": round(us, 1), "graph_equals_eager": same}


def streamed_bytes(model, cfg, bs: int, t: int) -> int:
    """Weights read once per step (the embedding table only as the tied head) + the KV cache read."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n or cfg.tie_word_embeddings)
    kv_elem = model.embed_tokens.weight.element_size()
    kv = bs * (CONTEXT + t) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_elem
    return weights + kv


def probe_shape(shape: str, args) -> dict:
    import torch
    from graph_utils import FakeRequests

    from tercel.kv import KVCacheSpec, PagedKVCache

    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    t0 = time.perf_counter()
    model, cfg = build(shape, dev, dtype)
    res: dict = {"label": LABELS[shape], "dtype": str(dtype), "context": CONTEXT}
    print(f"[{shape}] built in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    if dev == "cuda":
        from tercel.models.gemv_tuning import tune_model

        choices = tune_model(model)
        res["tuning_s"] = round(time.perf_counter() - t0, 1)
        res["small_m_choices"] = [{"role": c.role, "rows": c.rows, "shape": list(c.shape), "unfused_us": c.cublas_us,
                                   "fused_us": c.gemv_us, "config": repr(c.config) if c.config else None}
                                  for c in choices if c.role != "plain"]
        kept = sum(c.config is not None for c in choices if c.rows > 1)
        print(f"[{shape}] tuned in {res['tuning_s']} s; small-M roles kept: {kept} of "
              f"{sum(c.rows > 1 for c in choices)}", flush=True)
    else:
        force_configs(model)
    batches = (1, 8) if shape == "smol" else (1,)
    tokens = [int(x) for x in args.tokens.split(",")]
    if args.dry_run:
        batches, tokens = (1, 2), [1, 4]
    per_request = -(-(CONTEXT + max(tokens)) // 16) + 1
    kv = PagedKVCache(KVCacheSpec.for_model(cfg, 16, dtype), max(batches) * per_request + 1, torch.device(dev))
    with torch.inference_mode():
        reqs = FakeRequests(max(batches), kv, cfg.vocab_size, min_len=CONTEXT, max_len=CONTEXT + 1)
        res["check"] = {}
        for bs in batches:
            for t in tokens:
                if t > 1 and (dev == "cuda" or bs == 1):
                    c = res["check"][f"bs{bs}_t{t}"] = check(model, kv, reqs, bs, t, dev)
                    print(f"[{shape}] check bs {bs} t {t}: {c}", flush=True)
        res["steps"] = {}
        for bs in batches:
            for t in tokens:
                row = {}
                for fused in (True, False):
                    row["fused" if fused else "unfused"] = step_time(model, kv, reqs, bs, t, fused, dev, args.reps)
                nbytes = streamed_bytes(model, cfg, bs, t)
                row["roofline_us"] = round(nbytes / COPY_BW * 1e6, 1)
                res["steps"][f"bs{bs}_t{t}"] = row
                print(f"[{shape}] bs {bs} t {t}: fused {row['fused']['us']} us, unfused {row['unfused']['us']} us, "
                      f"graph==eager {row['fused']['graph_equals_eager']}", flush=True)
    for bs in batches:
        base = res["steps"].get(f"bs{bs}_t1", {}).get("fused", {}).get("us")
        for t in tokens:
            row = res["steps"][f"bs{bs}_t{t}"]
            if base:
                row["fused_vs_decode"] = round(row["fused"]["us"] / base, 3)
                row["unfused_vs_decode"] = round(row["unfused"]["us"] / base, 3)
            row["roofline_fraction"] = round(row["roofline_us"] / row["fused"]["us"], 3)
    del model, kv
    if dev == "cuda":
        torch.cuda.empty_cache()
    return res


def table(results: dict) -> str:
    lines = [f"{'shape':6} {'bs':>3} {'t':>3} {'fused us':>9} {'unfused us':>10} {'fused/dec':>9} "
             f"{'unfused/dec':>11} {'roofline':>8} {'graph==eager':>12}"]
    for shape, res in results["shapes"].items():
        for key, row in res["steps"].items():
            bs, t = key[2:].split("_t")
            lines.append(f"{shape:6} {bs:>3} {t:>3} {row['fused']['us']:>9} {row['unfused']['us']:>10} "
                         f"{row.get('fused_vs_decode', '-'):>9} {row.get('unfused_vs_decode', '-'):>11} "
                         f"{row['roofline_fraction']:>8} {str(row['fused']['graph_equals_eager']):>12}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        import kernel_checks  # noqa: F401  (patches the interpreter for NumPy 2)
    from common import environment

    env = environment()
    env["commit"] = os.environ.get("TERCEL_COMMIT", env["commit"])  # a device copy may have no .git
    env["command"] = "PYTHONPATH=. python " + " ".join(sys.argv)
    env["switches"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TERCEL_")}
    if args.device == "cuda":
        env["triton"] = __import__("triton").__version__
    results = {"environment": env, "dry_run": args.dry_run, "device": args.device, "shapes": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for shape in args.shapes.split(","):
        results["shapes"][shape] = probe_shape(shape, args)
        out.write_text(json.dumps(results, indent=1) + "\n")  # after each shape: a timeout keeps what ran
        print(f"[{shape}] done at {time.perf_counter() - start:.0f} s", flush=True)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    print(table(results))


if __name__ == "__main__":
    main()
