"""Kernel launches per step, counted on the CPU: the kernel budget of issue #30 outside the layers.

At SmolLM2's size a GPU kernel costs ~2-3 µs whatever it does, so a step's launch count is its cost. The H200's
profile (benchmarks/step_profile.py) counts kernels there; this script counts them anywhere, with
tercel.kernels.launch_count.LaunchCounter (every ATen op that computes, every Triton launch), under
TRITON_INTERPRET=1 so the CPU takes the GPU's code paths (use_triton). A tiny random Llama ("llama-tiny" shape,
random weights) with a random one-layer EAGLE-3 head and DFlash draft; batch 1 (or --batch); graphs on the
breakable-debug backend (the captured step bodies run eagerly over their static buffers, as the CPU tests drive them).

Per configuration, one generate of --tokens minus one of 1 token (prefill, start-up), divided by the steps
between them (decode steps for plain, verify steps for speculation):
  per_step   every launch of the step, host-side uploads included
  outside    the launches outside the target's and the EAGLE draft's layer stacks and the attention metadata: the
             sampler, the draft loop's and the acceptance's bookkeeping, the heads, the state update. These are
             the same kernels on a GPU (the layers themselves differ: torch's CPU ops here, the fused GEMVs and
             attention kernels there; step_profile.py counts those on the H200). DFLASH's and DDTREE's draft layers
             are counted in (the DFlash draft runs its layers through its own block and context paths).
A config's `ops` lists its outside launches by op.

Usage: TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/step_launches.py [--configs plain,eagle3-chain,...]
       [--tokens 24] [--out benchmarks/results/step_launches_cpu.json]
(tests/test_launch_budget.py runs it and holds each configuration to its budget.)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from common import environment  # noqa: E402
from dflash_utils import write_random_dflash  # noqa: E402

GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, top_p=0.95, seed=7)
EAGLE3 = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, speculative_num_steps=5,
              speculative_num_draft_tokens=6, speculative_adaptive="off")
TREE16 = dict(EAGLE3, speculative_eagle_topk=4, speculative_num_draft_tokens=16)
DFLASH = dict(speculative_algorithm="DFLASH", speculative_adaptive="off")
DDTREE16 = dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16, speculative_adaptive="off")
CONFIGS = {  # name -> (engine keywords, sampling keywords)
    "plain": ({}, GREEDY),
    "plain-t1": ({}, SAMPLED),
    "eagle3-chain": (EAGLE3, GREEDY),
    "eagle3-chain-t1": (EAGLE3, SAMPLED),
    "eagle3-tree16": (TREE16, GREEDY),
    "eagle3-tree16-t1": (TREE16, SAMPLED),
    "dflash": (DFLASH, GREEDY),
    "ddtree16": (DDTREE16, GREEDY),
}


@dataclass(frozen=True)
class Drafts:
    eagle3: Path  # a random one-layer EAGLE-3 head
    dflash: Path  # a random one-layer DFlash draft (block 16)


def _engine(loaded, drafts: Drafts, kw: dict, batch: int):
    import torch

    from tercel.engine import LLMEngine

    algorithm = kw.get("speculative_algorithm")
    if algorithm is not None:
        kw = {**kw, "speculative_draft_model_path": str(drafts.eagle3 if algorithm == "EAGLE3" else drafts.dflash)}
    # graphs for the batch measured only: each captured bucket runs its step body in the interpreter
    return LLMEngine(loaded=loaded, device="cpu", dtype=torch.float32, cuda_graph_backend="breakable-debug",
                     cuda_graph_max_bs=batch, kv_cache_memory=1 << 26, max_model_len=512, **kw)


def _run(engine, prompts: list[list[int]], params, outputs: list | None = None) -> int:
    """Generate to the end; the steps taken (verify steps when speculating, else decode steps). outputs: gets
    each prompt's generated token ids."""
    before = engine.spec_stats().verify_steps if engine.spec is not None else 0
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    if outputs is not None:
        outputs.extend(list(outs[i].outputs[0].token_ids) for i in ids)
    if engine.spec is not None:
        return engine.spec_stats().verify_steps - before
    return max(len(o.outputs[0].token_ids) for o in outs.values()) - 1


@dataclass
class _Current:
    """The counter the pause hooks act on (None between counting runs)."""
    counter: object = None

    def pause(self, *_) -> None:
        if self.counter is not None:
            self.counter.pause()

    def resume(self, *_) -> None:
        if self.counter is not None:
            self.counter.resume()


def _pause_inside(current: _Current, engine) -> None:
    """The current counter stops inside the layer stacks (see the module's docstring)."""
    modules = [engine.loaded.model]
    drafter = getattr(engine.spec, "drafter", None)
    if getattr(drafter, "model", None) is not None:
        modules.append(drafter.model)
    for m in modules:
        m.register_forward_pre_hook(current.pause)
        m.register_forward_hook(current.resume)


def _pause_in_metadata(current: _Current) -> None:
    """The current counter stops in the attention metadata and the breakable-debug backend's copies (once per
    process: class attributes)."""
    # the attention metadata (every backend instance: the target's and the draft's), and the breakable-debug
    # backend's copy of a step's outputs into the captured ones (a full CUDA graph writes them in place)
    from tercel.attention.torch_ref import TorchAttentionBackend
    from tercel.attention.triton_backend import TritonAttentionBackend
    from tercel.graphs import breakable

    def pausing(original):
        def wrapped(*a, **k):
            current.pause()
            try:
                return original(*a, **k)
            finally:
                current.resume()
        return wrapped

    for cls in (TorchAttentionBackend, TritonAttentionBackend):
        for name in ("capture_metadata", "prepare"):
            setattr(cls, name, pausing(getattr(cls, name)))
    breakable.copy_into = pausing(breakable.copy_into)


def count(name: str, loaded, drafts: Drafts, tokens: int, batch: int, current: _Current,
          kinds: tuple[str, ...] = ("per_step", "outside")) -> dict:
    from tercel import SamplingParams
    from tercel.kernels.launch_count import LaunchCounter

    engine_kw, sampling_kw = CONFIGS[name]
    engine = _engine(loaded, drafts, dict(engine_kw), batch)
    prompts = [list(range(5 + i, 37 + i)) for i in range(batch)]

    def params(n: int):
        return SamplingParams(max_tokens=n, ignore_eos=True, **sampling_kw)

    outputs: list = []
    _run(engine, prompts, params(tokens), outputs)  # captures, first uses
    result: dict = {"outputs": outputs}  # the generated tokens (greedy speculation must give plain's)
    _pause_inside(current, engine)
    for what in kinds:
        runs = []
        for n in (1, tokens):
            counter = LaunchCounter()
            current.counter = counter if what == "outside" else None
            with counter:
                steps = _run(engine, prompts, params(n))
            runs.append((counter, steps))
        (c1, s1), (cn, sn) = runs
        n_steps = max(1, sn - s1)
        result[what] = round((cn.launches - c1.launches) / n_steps, 1)
        if what == "outside":
            ops = {k: round((v - c1.ops.get(k, 0)) / n_steps, 1) for k, v in cn.ops.items()}
            result["ops"] = dict(sorted(((k, v) for k, v in ops.items() if v), key=lambda kv: -kv[1]))
            result["steps"] = n_steps
    if engine.spec is not None:
        s = engine.spec_stats()
        result["accept_length"] = round((s.accepted_tokens + s.verify_steps) / max(1, s.verify_steps), 2)
    engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--outside-only", action="store_true", help="count only the launches outside the layers")
    ap.add_argument("--num-sms", type=int, default=None,
                    help="the SM count the draft steps' split-KV attention over the paged prefix plans its splits for "
                         "(attention/paged_merge.py; default: 132, an H100's). The launches are the same for any "
                         "count (one split kernel, one merge); the interpreter's time is not: it runs every program "
                         "in Python, and 132 SMs give 8-16 splits per (row, KV head) of a few keys each")
    ap.add_argument("--out", default=None, help="a JSON file (default: print the JSON)")
    args = ap.parse_args()
    import os

    import torch

    from tercel.bench.shapes import random_loaded
    from tercel.train.export import random_eagle3

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("step_launches.py: run it with TRITON_INTERPRET=1, so the CPU takes the GPU's code paths.")
    if args.num_sms is not None:
        from tercel.attention import paged_merge

        paged_merge._num_sms = lambda device: args.num_sms
    names = args.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; choose from {list(CONFIGS)}")
    loaded = random_loaded("llama-tiny", 512, torch.float32, "cpu")
    root = Path(tempfile.mkdtemp())
    drafts = Drafts(random_eagle3(root / "e3", loaded.config, draft_vocab_size=256, intermediate_size=128,
                                  aux_layer_ids=(0, 1)),
                    write_random_dflash(root / "df", vocab=512, hidden=64, num_target_layers=2, block_size=16,
                                        mask_token_id=511, target_layer_ids=[0, 1]))
    current = _Current()  # the pause hooks act on it during the "outside" runs
    _pause_in_metadata(current)
    res = {"benchmark": "kernel launches per step, counted on the CPU under TRITON_INTERPRET=1 (LaunchCounter)",
           "environment": environment(),
           "model": "llama-tiny shape, random weights; a random one-layer EAGLE-3 head and DFlash draft (block 16)",
           "batch": args.batch, "tokens": args.tokens, "num_sms": args.num_sms, "results": {}}
    for name in names:
        kinds = ("outside",) if args.outside_only else ("per_step", "outside")
        r = res["results"][name] = count(name, loaded, drafts, args.tokens, args.batch, current, kinds)
        print(f"{name:18s} per step {r.get('per_step', float('nan')):7.1f}  outside the layers {r['outside']:7.1f}",
              file=sys.stderr)
    text = json.dumps(res, indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
