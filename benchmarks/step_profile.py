"""A step profile per algorithm (issue #30 item 4): kernels per step and device µs per step, by kernel and by phase.

SmolLM2 bf16 with the bundled drafts, batch 1, greedy (the `-t1` configurations: T = 1, top-p 0.95, seeded), one
chat prompt. For each configuration:
- kernels: one generate of --tokens under torch.profiler (CUDA activity: graph replays' kernels are listed one
  by one) minus a generate of 1 token (prefill and start-up), divided by the steps between them (decode steps
  for plain, verify steps for speculation): kernels per step, device µs per step, the heaviest kernels.
- phases: the same generate with the worker's StepProfile on (CUDA events at draft / verify / accept / emit /
  extend), on an engine with the chained step off (TERCEL_SPEC_CHAIN=0), so each phase has its own boundary;
  the chained step's kernels are the first part's.

A configuration may name developer switches for its engine (tercel/dev_overrides.py), set while it builds and
runs: `--configs eagle3-chain,eagle3-chain@TERCEL_VERIFY_ATTN=rope` profiles a kernel variant beside the default.
The engines share the weights set up when the first loads: for the small-M kernels run the process with
TERCEL_SMALL_M=rowgrid (or 1) and give the unfused engines @TERCEL_SMALL_M=0.

Usage: PYTHONPATH=. python benchmarks/step_profile.py --model $M [--tokens 128] [--configs plain,eagle3-chain,...]
       --out benchmarks/results/step_profile_smollm2_h200_<commit>.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, split_config, switches  # noqa: E402

CONFIGS = {  # name -> engine keywords (fixed width: the profile is of one step shape)
    "plain": {},
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1),
    "eagle3-tree16": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_num_draft_tokens=16),
    "dflash": dict(speculative_algorithm="DFLASH"),
    "ddtree16": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16),
    "ngram": dict(speculative_algorithm="NGRAM"),
    # adaptive on: with @TERCEL_ADAPTIVE_PIN=plain every decode step is a plain window step that keeps the drafter's
    # hidden rows (a step here is a token), the plain stretches' own cost beside plain's
    "eagle3-adaptive": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, speculative_adaptive="on"),
    "dflash-adaptive": dict(speculative_algorithm="DFLASH", speculative_adaptive="on"),
    # sampled (T = 1, top-p 0.95, seeded): the sampler's launches beside the step's
    "plain-t1": {},
    "eagle3-chain-t1": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1),
}
SAMPLED = dict(temperature=1.0, top_p=0.95, seed=7)


def _params(name: str, tokens: int):
    from tercel import SamplingParams

    sampling = SAMPLED if split_config(name)[0].endswith("-t1") else dict(temperature=0)
    return SamplingParams(max_tokens=tokens, ignore_eos=True, **sampling)
_NOT_KERNELS = ("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")
GAP_US = 4.0  # a longer idle gap between two kernels is the host's, a shorter one launch latency
_SHORT_GAPS, _LONG_GAPS = "(idle: short gaps)", "(idle: long gaps)"


def _engine(base, name: str, device: str, chained: bool):
    from tercel import LLM
    from tercel.engine import LLMEngine
    from tercel.speculative import DEFAULT_DFLASH_DRAFT, DEFAULT_EAGLE3_DRAFT

    saved = os.environ.get("TERCEL_SPEC_CHAIN")
    if not chained:
        os.environ["TERCEL_SPEC_CHAIN"] = "0"  # read while the engine builds
    try:
        llm = LLM.__new__(LLM)
        kw = CONFIGS[split_config(name)[0]]
        algo = kw.get("speculative_algorithm")
        drafts = {"EAGLE3": DEFAULT_EAGLE3_DRAFT, "DFLASH": DEFAULT_DFLASH_DRAFT, "DDTREE": DEFAULT_DFLASH_DRAFT}
        draft = str(drafts[algo]) if algo in drafts else None  # the bundled drafts, whatever GGUF path --model names
        kw = dict(dict(speculative_adaptive="off"), **kw)
        llm.engine = LLMEngine(loaded=base.engine.loaded, device=device, dtype=base.engine.dtype,
                               kv_cache_memory=1 << 30, speculative_draft_model_path=draft, **kw)
    finally:
        if saved is None:
            os.environ.pop("TERCEL_SPEC_CHAIN", None)
        else:
            os.environ["TERCEL_SPEC_CHAIN"] = saved
    return llm


def _steps(llm, out) -> int:
    """Verify steps for speculation, else (plain, or speculation pinned to plain windows) decode steps."""
    m = out[0].metrics
    return m.spec_verify_steps if m.spec_verify_steps else len(out[0].outputs[0].token_ids) - 1


def _kernels(llm, prompt: str, params) -> tuple[dict, int]:
    """{kernel name: [count, device µs]} of one generate, and its steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        out = llm.generate([prompt], params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.name.startswith(_NOT_KERNELS):
            continue
        table[e.name][0] += 1
        table[e.name][1] += e.time_range.elapsed_us()
        spans.append((e.time_range.start, e.time_range.end))
    table.update(_gaps(spans))
    return table, _steps(llm, out)


def _gaps(spans: list[tuple[float, float]]) -> dict[str, list[float]]:
    """The GPU's idle time between kernels, split at GAP_US: short gaps are launch latency inside a graph (one
    kernel's end to the next one's start), long ones the device waiting for the host. Rows of the kernel table
    under reserved names (count, µs), so the per-step difference below treats them like kernels."""
    short, long_ = [0, 0.0], [0, 0.0]
    end = None
    for s, e in sorted(spans):
        if end is not None and s > end:
            bucket = short if s - end <= GAP_US else long_
            bucket[0] += 1
            bucket[1] += s - end
        end = e if end is None else max(end, e)
    return {_SHORT_GAPS: short, _LONG_GAPS: long_}


def profile_kernels(llm, prompt: str, tokens: int, name: str = "plain") -> dict:
    full, steps = _kernels(llm, prompt, _params(name, tokens))
    head, steps0 = _kernels(llm, prompt, _params(name, 1))
    n = max(1, steps - steps0)
    per = {k: (c - head.get(k, (0, 0.0))[0], us - head.get(k, (0, 0.0))[1]) for k, (c, us) in full.items()}
    gaps = {k: per.pop(k) for k in (_SHORT_GAPS, _LONG_GAPS)}
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:20]
    return {"steps": n, "kernels_per_step": round(sum(c for c, _ in per.values()) / n, 1),
            "device_us_per_step": round(sum(us for _, us in per.values()) / n, 1),
            # idle between kernels per step: launch latency (gaps <= GAP_US) and waits for the host (longer)
            "short_gap_us_per_step": round(gaps[_SHORT_GAPS][1] / n, 1),
            "long_gap_us_per_step": round(gaps[_LONG_GAPS][1] / n, 1),
            "long_gaps_per_step": round(gaps[_LONG_GAPS][0] / n, 2),
            "top_kernels": [{"name": k[:120], "per_step": round(c / n, 2), "us_per_step": round(us / n, 1)}
                            for k, (c, us) in top]}


def profile_phases(llm, prompt: str, tokens: int, name: str = "plain") -> dict | None:
    spec = llm.engine.spec
    if spec is None:
        return None
    spec.profile.enabled = True
    llm.generate([prompt], _params(name, tokens))
    spec.profile.enabled = False
    return spec.profile.summary()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import logging

    # the GEMV tuner's per-role timings (fused against unfused, per row bucket) land in the log: with
    # TERCEL_SMALL_M=1 they say why a small-M GEMM was kept or not
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tercel.models.gemv_tuning").setLevel(logging.INFO)
    from tercel import LLM
    from tercel.train.data import EVAL_CHAT_PROMPTS

    names = args.configs.split(",")
    bad = [n for n in names if split_config(n)[0] not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; choose from {list(CONFIGS)} (optionally @VAR=VALUE: a "
                         "developer switch for that engine, e.g. eagle3-chain@TERCEL_VERIFY_ATTN=rope)")
    base = LLM(args.model, device=args.device, dtype="auto", progress=False, kv_cache_memory=1 << 30)
    prompt = base.tokenizer.apply_chat_template([{"role": "user", "content": EVAL_CHAT_PROMPTS[0]}])
    res: dict = {"benchmark": "step profile per algorithm: kernels and device µs per step (torch.profiler), "
                              "device µs per phase (StepProfile, unchained steps)",
                 "environment": environment(), "device": args.device, "dtype": str(base.engine.dtype),
                 "tokens": args.tokens, "prompt": "EVAL_CHAT_PROMPTS[0], chat template, batch 1, greedy, fixed "
                                                  "width (adaptive off)", "results": {}}
    for name in names:
        entry: dict = {}
        for chained in (True, False):
            if not chained and (name.startswith("plain") or "adaptive" in name):
                continue
            with switches(split_config(name)[1]):  # the engine's build, captures and runs see its switches
                llm = _engine(base, name, args.device, chained)
                for _ in range(2):
                    llm.generate([prompt], _params(name, args.tokens))  # captures, JIT, clocks
                if chained:
                    entry["kernels"] = profile_kernels(llm, prompt, args.tokens, name)
                    spec = llm.engine.spec
                    if spec is not None:
                        s = llm.engine.spec_stats()
                        entry["accept_length"] = round((s.accepted_tokens + s.verify_steps)
                                                       / max(1, s.verify_steps), 3)
                else:
                    entry["phases_unchained"] = profile_phases(llm, prompt, args.tokens, name)
                llm.engine.shutdown()
        res["results"][name] = entry
        k = entry["kernels"]
        print(f"{name:14s} {k['kernels_per_step']:7.1f} kernels/step {k['device_us_per_step']:8.1f} µs/step  idle "
              f"{k['short_gap_us_per_step']:.0f} short + {k['long_gap_us_per_step']:.0f} long "
              f"({k['long_gaps_per_step']} gaps)  phases "
              f"{entry.get('phases_unchained', {}) and entry['phases_unchained']['gpu_us']}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
