"""Speculative decoding against plain decoding on one GPU, every configuration loaded at once and measured in
interleaved rounds (the host's speed drifts between minutes, so a ratio is taken within a round and the median
over rounds is reported). Through the public API on text: `LLM.chat` on the held-out chat + code prompts, one
conversation at a time at concurrency 1, a batch of conversations at 16 / 64 / 256.

Configurations: plain (greedy and T = 1 top-p 0.95 seeded), and each algorithm with the bundled drafts at a
fixed width (`speculative_adaptive="off"`) and adaptive (the default). `--shape llama8b` adds the
Llama-3.1-8B shape with random weights and a random one-layer EAGLE-3 head (every draft rejected): plain,
fixed-width chain and adaptive chain.

A configuration may carry developer switches (tercel/dev_overrides.py) for its own engine, set while it builds,
warms up and runs: `--configs plain,eagle3-chain,eagle3-chain@TERCEL_VERIFY_ATTN=rope` measures a kernel variant
beside the default in the same rounds. The small-M GEMMs are tuned once, on the shared weights, when the first
engine loads: run the process with TERCEL_SMALL_M=1 (or rowgrid: the batch-1 GEMVs per row, no tuning pass) and
give the engines that stay unfused @TERCEL_SMALL_M=0
(`--configs plain,eagle3-chain,eagle3-chain@TERCEL_SMALL_M=0`; TERCEL_SMALL_M_BUCKETS=8 tunes only the bucket a
bs-1 chain of 6 rows uses).

Usage: PYTHONPATH=. python benchmarks/spec_rounds.py --model $M [--rounds 5] [--tokens 256]
       [--concurrency 1,16,64] [--configs ...] [--shape llama8b] --out spec_rounds_smollm2_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, environment, split_config, switches  # noqa: E402

from tercel.speculative.config import DEFAULT_EAGLE3_TOKEN_MAP  # noqa: E402

E3 = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1)
TMAP = str(DEFAULT_EAGLE3_TOKEN_MAP)
TREE = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_num_draft_tokens=16)
CONFIGS = {  # name -> (engine keywords, temperature)
    "plain": ({}, 0.0),
    "eagle3-chain": (dict(E3, speculative_adaptive="off"), 0.0),
    "eagle3-chain-adaptive": (dict(E3), 0.0),
    "ngram": (dict(speculative_algorithm="NGRAM", speculative_adaptive="off"), 0.0),
    "ngram-adaptive": (dict(speculative_algorithm="NGRAM"), 0.0),
    "eagle3-tree16": (dict(TREE, speculative_adaptive="off"), 0.0),
    "eagle3-tree16-adaptive": (dict(TREE), 0.0),
    # the bundled hot-token map: the draft's lm_head reads 5244 rows instead of 49152 a draft step
    "eagle3-chain-tmap": (dict(E3, speculative_adaptive="off", speculative_token_map=TMAP), 0.0),
    "eagle3-tree16-tmap": (dict(TREE, speculative_adaptive="off", speculative_token_map=TMAP), 0.0),
    "dflash": (dict(speculative_algorithm="DFLASH", speculative_adaptive="off"), 0.0),
    "dflash-adaptive": (dict(speculative_algorithm="DFLASH"), 0.0),
    "ddtree16": (dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16, speculative_adaptive="off"), 0.0),
    "ddtree16-adaptive": (dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16), 0.0),
    "plain-t1": ({}, 1.0),
    "eagle3-chain-t1": (dict(E3, speculative_adaptive="off"), 1.0),
    "eagle3-chain-adaptive-t1": (dict(E3), 1.0),
    "ngram-adaptive-t1": (dict(speculative_algorithm="NGRAM"), 1.0),
    "eagle3-tree16-adaptive-t1": (dict(TREE), 1.0),
    "dflash-adaptive-t1": (dict(speculative_algorithm="DFLASH"), 1.0),
    "ddtree16-adaptive-t1": (dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16), 1.0),
}


def config(name: str) -> tuple[dict, float, dict]:
    """(engine keywords, temperature, developer switches) of a configuration name: one of CONFIGS, optionally
    with switches set for its engine, e.g. eagle3-chain@TERCEL_VERIFY_ATTN=rope beside eagle3-chain."""
    base, env = split_config(name)
    if base not in CONFIGS:
        raise SystemExit(f"--configs: unknown {base!r}; choose from {', '.join(CONFIGS)} (optionally @VAR=VALUE)")
    kw, temp = CONFIGS[base]
    return kw, temp, env


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _spec_counts(llm) -> tuple:
    s = llm.engine.spec_stats()
    if s is None:
        return 0, 0, 0, 0, 0.0, {}, 0, 0.0, 0, 0.0, 0.0, 0, 0, 0.0
    return (s.verify_steps, s.accepted_tokens, s.plain_window_steps, s.chain_reads, s.chain_wait_s,
            dict(s.width_histogram), s.worker_steps, s.worker_step_s, s.flushes, s.flush_s, s.flush_host_s,
            s.flush_rows, s.probes, s.probe_s)


class GcPauses:
    """Python's cyclic collector's pauses while a pass runs (gc.callbacks): a collection that lands inside a step
    stalls the host there (a flush's host time at 16 requests on an H200 read 4-23 ms, out of proportion to its
    rows)."""

    def __init__(self) -> None:
        self.seconds, self.count, self.full = 0.0, 0, 0
        self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began
            self.count += 1
            self.full += info.get("generation") == 2

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


class FlushProfile:
    """cProfile over the deferred draft_extends (AdaptiveSpec.flush) alone, every engine's, while the rounds run:
    on an H200 a flush's host part read 3.6-7.6 ms at one request whatever its rows (19-242), against ~60 launches.
    `top` lists the functions by their own time, per flush."""

    def __init__(self) -> None:
        self.prof = cProfile.Profile()
        self.flushes = 0
        self._orig = None

    def __enter__(self) -> "FlushProfile":
        from tercel.speculative.adaptive import AdaptiveSpec

        self._orig = orig = AdaptiveSpec.flush

        def flush(spec, reqs, drafter):
            self.prof.enable()
            try:
                rows = orig(spec, reqs, drafter)
            finally:
                self.prof.disable()
            self.flushes += rows > 0  # per flush that extended rows (most calls find none and return at once)
            return rows

        AdaptiveSpec.flush = flush
        return self

    def __exit__(self, *exc) -> None:
        from tercel.speculative.adaptive import AdaptiveSpec

        AdaptiveSpec.flush = self._orig

    def top(self, n: int = 25) -> list[dict]:
        if not self.flushes:
            return []
        stats = pstats.Stats(self.prof).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
        k = self.flushes
        return [dict(function=f"{Path(f).name}:{line}({name})", calls_per_flush=round(cc / k, 2),
                     own_us_per_flush=round(1e6 * tt / k, 1), cum_us_per_flush=round(1e6 * ct / k, 1))
                for (f, line, name), (cc, _, tt, ct, _) in rows]


def run_point(llm, convs, c: int, tokens: int, temperature: float) -> dict:
    """One pass: every conversation once, `c` at a time. tok/s over the whole wall time (prefill included)."""
    from tercel import SamplingParams

    params = [SamplingParams(max_tokens=tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
                             seed=i if temperature else None, ignore_eos=True) for i in range(c)]
    before = _spec_counts(llm)
    _sync()
    t0 = time.perf_counter()
    n, ttft, decode = 0, [], []
    with GcPauses() as pauses:
        for start in range(0, len(convs), c):
            batch = convs[start:start + c]
            outs = llm.chat(batch, params[:len(batch)])
            n += sum(len(o.outputs[0].token_ids) for o in outs)
            for o in outs:  # a request's time to its first token (prefill), then its steady decode pace
                m = o.metrics
                ttft.append(m.time_to_first_token or 0.0)
                if m.decode_tokens_per_s:
                    decode.append(1.0 / m.decode_tokens_per_s)
        _sync()
    wall = time.perf_counter() - t0
    after = _spec_counts(llm)
    steps, acc, plain_w, reads, wait = (a - b for a, b in zip(after[:5], before[:5]))
    widths = {w: n - before[5].get(w, 0) for w, n in after[5].items() if n != before[5].get(w, 0)}
    worker_steps, worker_s = after[6] - before[6], after[7] - before[7]
    flushes, flush_s = after[8] - before[8], after[9] - before[9]
    flush_host_s, flush_rows = after[10] - before[10], after[11] - before[11]
    probes, probe_s = after[12] - before[12], after[13] - before[13]
    ada = getattr(llm.engine.spec, "adaptive", None)
    # the host's wait at each chained read: near a step's device time when the device sets the pace, near 0
    # when the host does
    return dict(tok_s=n / wall, tokens=n, wall_s=wall, verify_steps=steps,
                accept_length=(acc + steps) / steps if steps else None, plain_window_steps=plain_w,
                steps_by_width=widths, wall_us_per_step=1e6 * wall / steps if steps else None,
                chain_wait_us_per_read=1e6 * wait / reads if reads else None,
                # the worker's steps (speculative, probes, a batch's first decode, prefill): their share of the pass
                worker_steps=worker_steps, worker_share=round(worker_s / wall, 4),
                # the deferred draft_extends before speculative steps (inside the worker steps): their share
                flushes=flushes, flush_share=round(flush_s / wall, 4),
                # per flush: its synced wall, the host's part of it (launches returned), the rows it extended
                flush_ms=round(1e3 * flush_s / flushes, 3) if flushes else None,
                flush_host_ms=round(1e3 * flush_host_s / flushes, 3) if flushes else None,
                flush_rows=flush_rows // flushes if flushes else None,
                # probes measured whole (window read before to window read after, less the plain steps' worth of
                # tokens gained): how many, and their mean cost
                probes=probes, probe_ms=round(1e3 * probe_s / probes, 3) if probes else None,
                # Python's cyclic collector inside the pass: its pauses' share, how many, how many of them full
                gc_share=round(pauses.seconds / wall, 4), gc_collections=pauses.count, gc_full=pauses.full,
                # per request: mean time to the first token (prefill, with the drafter's), mean µs per later token
                ttft_ms=round(1e3 * sum(ttft) / len(ttft), 3) if ttft else None,
                decode_us_per_token=round(1e6 * sum(decode) / len(decode), 1) if decode else None,
                cost_model=ada.costs.snapshot() if ada is not None else None,
                # what a fresh batch of each size is weighed at (AdaptiveSpec.floors) and a lone request's prior
                floors={str(b): round(a, 3) for b, a in ada.floors.items()} if ada is not None else None,
                prior_alpha=round(ada.recent.alpha, 3) if ada is not None else None)


def build(base, names: list[str], extra: dict, device: str) -> dict:
    from tercel import LLM
    from tercel.speculative import DEFAULT_DFLASH_DRAFT, DEFAULT_EAGLE3_DRAFT

    out = {}
    for name in names:
        kw, _, env = config(name)
        algo = kw.get("speculative_algorithm")
        if algo in ("EAGLE3", "DFLASH", "DDTREE"):  # the bundled drafts, named (the GGUF may not be the default's)
            kw = dict(kw, speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT if algo == "EAGLE3"
                                                           else DEFAULT_DFLASH_DRAFT))
        t = time.perf_counter()
        with switches(env):
            out[name] = LLM(loaded=base.engine.loaded, dtype=base.engine.dtype, device=device, progress=False,
                            max_model_len=base.engine.config.max_model_len, **extra, **kw)
        print(f"built {name} in {time.perf_counter() - t:.1f} s", flush=True)
    return out


def reference(name: str, names: list[str]) -> str | None:
    """The plain configuration a configuration is paired with (same temperature), if loaded."""
    ref = "plain-t1" if config(name)[1] else "plain"
    return ref if ref in names and ref != name else None


def rounds(llms: dict, convs_by_c: dict, rounds_n: int, tokens_by_c: dict, results: dict, write) -> None:
    """Each round, at each concurrency, every configuration runs between two runs of its plain reference (the
    host's speed drifts within seconds: the three are measured in the same few seconds) and its ratio is to their
    geometric mean; the run after one configuration is the run before the next of the same reference. A plain
    configuration that is some configuration's reference is measured by those runs."""
    names = list(llms)
    refs = {reference(n, names) for n in names} - {None}
    for r in range(rounds_n):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: no config always runs first
        for c, convs in convs_by_c.items():
            last: tuple[str, float] | None = None  # (reference, tok/s) of the run just made, if a plain run

            def run_ref(ref: str) -> float:
                base = run_point(llms[ref], convs, c, tokens_by_c[c], config(ref)[1])
                results.setdefault(ref, {}).setdefault(str(c), []).append(base)
                return base["tok_s"]

            for name in order:
                if name in refs:
                    continue
                _, temp, env = config(name)
                ref = reference(name, names)
                before = after = paired = None
                if ref is not None:
                    before = last[1] if last is not None and last[0] == ref else run_ref(ref)
                with switches(env):
                    point = run_point(llms[name], convs, c, tokens_by_c[c], temp)
                last = None
                if ref is not None:
                    after = run_ref(ref)
                    last = (ref, after)
                    paired = (before * after) ** 0.5
                point["paired_plain_tok_s"] = paired
                point["plain_before_after_tok_s"] = [before, after]
                results.setdefault(name, {}).setdefault(str(c), []).append(point)
                print(f"round {r} c={c} {name}: {point['tok_s']:.0f} tok/s"
                      + (f" ({point['tok_s'] / paired:.3f}x {ref} around it: {before:.0f}, {after:.0f})"
                         if paired else "")
                      + f" accept {point['accept_length']} steps by width {point['steps_by_width']}"
                      + (f" worker {point['worker_steps']} steps {100 * point['worker_share']:.0f}% of the pass"
                         if point["worker_steps"] else "")
                      + (f" ttft {point['ttft_ms']:.2f} ms, decode {point['decode_us_per_token']:.0f} us/token"
                         if point.get("decode_us_per_token") is not None else "")
                      + (f" wall {point['wall_us_per_step']:.0f} us/step, host waits "
                         f"{point['chain_wait_us_per_read']:.0f} us/read"
                         if point.get("chain_wait_us_per_read") is not None else ""), flush=True)
            write()


def summarize(results: dict) -> dict:
    """Per config and concurrency: median tok/s and the median of per-round ratios to plain at the same
    temperature (plain-t1 for T = 1 configs) and to plain greedy."""
    table = {}
    for name, by_c in results.items():
        temp = config(name)[1]
        ref = "plain-t1" if temp and "plain-t1" in results else "plain"
        for c, points in by_c.items():
            row = dict(tok_s=round(statistics.median(p["tok_s"] for p in points), 1))
            acc = [p["accept_length"] for p in points if p["accept_length"]]
            row["accept_length"] = round(statistics.median(acc), 3) if acc else None
            for key, base in (("vs_plain", ref), ("vs_plain_greedy", "plain")):
                if base == ref and points and all(p.get("paired_plain_tok_s") for p in points):
                    ratios = [p["tok_s"] / p["paired_plain_tok_s"] for p in points]  # its own plain runs around it
                else:
                    bp = results.get(base, {}).get(c, [])
                    if len(bp) == len(points):  # one run per round each: per-round ratios
                        ratios = [p["tok_s"] / q["tok_s"] for p, q in zip(points, bp)]
                    else:  # the reference ran beside several configurations per round: the ratio of medians
                        ratios = [statistics.median(p["tok_s"] for p in points)
                                  / statistics.median(q["tok_s"] for q in bp)] if bp and points else []
                row[key] = round(statistics.median(ratios), 3) if ratios else None
            table.setdefault(name, {})[c] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=256, help="tokens per request at concurrency > 1")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shape", default=None, help="llama8b: also the 8B shape, random weights + random head")
    ap.add_argument("--skip-smollm2", action="store_true", help="only the --shape part")
    ap.add_argument("--shape-rounds", type=int, default=5)
    ap.add_argument("--shape-configs", default=",".join(SHAPE_KINDS),
                    help="the --shape part's engines; NAME@VAR=VALUE adds developer switches (benchmarks/common.py)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-bytes", type=int, default=2 << 30, help="KV pool per engine")
    ap.add_argument("--flush-profile", action="store_true",
                    help="cProfile the deferred draft_extends (flushes) over the rounds: their host time's functions")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for n in args.configs.split(","):
        if n:
            config(n)  # an unknown name or switch stops here, before anything loads
    for n in args.shape_configs.split(",") if args.shape else ():
        if split_config(n)[0] not in SHAPE_KINDS:
            raise SystemExit(f"--shape-configs: {n!r} is not one of {', '.join(SHAPE_KINDS)} (+ @VAR=VALUE)")

    import torch

    from tercel import LLM
    from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    res = dict(benchmark="spec_rounds", environment=environment(), command=" ".join(["python"] + sys.argv),
               method=f"all configurations loaded in one process; {args.rounds} interleaved rounds (the order rotates "
                      "each round); in a round each configuration runs between two runs of its plain reference "
                      "(plain, or plain-t1 at T = 1), its ratio is to the geometric mean of the two, and the median "
                      "over rounds is reported",
               copy_bandwidth_bytes_per_s=copy_bandwidth(args.device), results={}, shape_results={})
    out = Path(args.out)

    def write() -> None:
        res["summary"] = summarize(res["results"])
        if res["shape_results"]:
            res["shape_summary"] = summarize(res["shape_results"])
        out.write_text(json.dumps(res, indent=1))

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.skip_smollm2:
        shape_bench(args, res, write)
        write()
        return
    base = LLM(args.model, dtype=dtype, device=args.device, max_model_len=2048, kv_cache_memory=args.kv_bytes,
               progress=False)
    texts = EVAL_CHAT_PROMPTS[:4] + EVAL_CODE_PROMPTS[:4]
    convs = [[{"role": "user", "content": t}] for t in texts]
    cs = [int(x) for x in args.concurrency.split(",")]
    convs_by_c = {c: (convs if c == 1 else [convs[i % len(convs)] for i in range(c)]) for c in cs}
    tokens_by_c = {c: args.tokens if c == 1 else args.batch_tokens for c in cs}
    names = [n for n in args.configs.split(",") if n]
    res["prompts"] = f"{len(texts)} held-out prompts (EVAL_CHAT_PROMPTS[:4] + EVAL_CODE_PROMPTS[:4]), chat template"
    # graphs captured at the measured batch sizes only (each engine captures every step kind per bucket)
    llms = build(base, names, dict(kv_cache_memory=args.kv_bytes, cuda_graph_bs=sorted(set(cs))), args.device)
    for name, llm in llms.items():  # warm-up at every concurrency: allocator, first shapes, and (adaptive) the
        _, temp, env = config(name)  # cost model's per-batch-size measurements, which a serving engine makes once
        with switches(env):  # in its life
            for c in cs:
                run_point(llm, convs_by_c[c][:c], c, 32, temp)
    if args.flush_profile:
        with FlushProfile() as fp:
            rounds(llms, convs_by_c, args.rounds, tokens_by_c, res["results"], write)
        res["flush_profile"] = dict(flushes=fp.flushes, top=fp.top())
    else:
        rounds(llms, convs_by_c, args.rounds, tokens_by_c, res["results"], write)
    write()
    print(json.dumps(res["summary"], indent=1), flush=True)
    del llms, base
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    if args.shape == "llama8b":
        shape_bench(args, res, write)
    write()


SHAPE_KINDS = ("plain", "eagle3-chain", "eagle3-chain-adaptive", "eagle3-tree16")  # the --shape part's engines


def shape_bench(args, res: dict, write) -> None:
    """Llama-3.1-8B shape, random weights, a random one-layer EAGLE-3 head (every draft rejected): a chain step and
    a tree-16 step against a plain step (#30 item 5), and adaptive against plain (#31)."""
    import tempfile

    import torch

    from tercel import LLM
    from tercel.bench.shapes import random_loaded
    from tercel.train.export import random_eagle3

    loaded = random_loaded("llama-3.1-8b", 2048, torch.bfloat16, "cuda")
    head = random_eagle3(Path(tempfile.mkdtemp()) / "e3", loaded.config, draft_vocab_size=32000)
    kw = dict(loaded=loaded, dtype=torch.bfloat16, device="cuda", progress=False, skip_tokenizer_init=True,
              kv_cache_memory=2 << 30, cuda_graph_bs=[1], max_model_len=2048)
    spec = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, speculative_draft_model_path=str(head))
    tree = dict(spec, speculative_eagle_topk=4, speculative_num_draft_tokens=16, speculative_adaptive="off")
    kinds = {"plain": {}, "eagle3-chain": dict(spec, speculative_adaptive="off"), "eagle3-chain-adaptive": spec,
             "eagle3-tree16": tree}
    envs = {}
    llms = {}
    for name in args.shape_configs.split(","):
        base, envs[name] = split_config(name)
        with switches(envs[name]):  # built, warmed and run under its switches (graphs keep what they chose)
            llms[name] = LLM(**kw, **kinds[base])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1000, 100000, (64,), generator=g).tolist() for _ in range(2)]
    from tercel import SamplingParams

    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    for name, llm in llms.items():
        with switches(envs[name]):
            llm.generate(prompts[:1], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for r in range(args.shape_rounds):
        for name, llm in llms.items():
            before = _spec_counts(llm)
            _sync()
            with switches(envs[name]):
                t0 = time.perf_counter()
                n = sum(len(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts)
                _sync()
                wall = time.perf_counter() - t0
            steps, acc, plain_w = (a - b for a, b in zip(_spec_counts(llm)[:3], before[:3]))
            point = dict(tok_s=n / wall, tokens=n, wall_s=wall, verify_steps=steps, plain_window_steps=plain_w,
                         accept_length=(acc + steps) / steps if steps else None)
            res["shape_results"].setdefault(name, {}).setdefault("1", []).append(point)
            print(f"8B round {r} {name}: {point['tok_s']:.1f} tok/s plain-window steps {plain_w}", flush=True)
        write()


if __name__ == "__main__":
    main()
