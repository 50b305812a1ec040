"""GPU decode speed on one GPU: Tercel (CUDA graphs + Triton kernels) against HF transformers in the
same run, plus a Llama-3.1-8B-shaped model with random weights for bandwidth at scale.

Correctness first (graph replay and eager give the same greedy tokens; agreement with HF reported),
then timings: warm-up, CUDA-synchronised wall clock, medians. Prints a short table last and writes
one JSON per model (commit, GPU, torch, the exact command).

  smollm2: SmolLM2-135M-Instruct bf16, bs=1, 256 new tokens: Tercel vs HF eager and HF static cache +
           CompileConfig(fullgraph=True, mode="reduce-overhead")
  llama8b: hidden 4096, 32 layers, 32 q / 8 kv heads, FFN 14336, vocab 128256, random weights (seeded
           normal, std 0.02, generated on the GPU and fed through load_weights), bf16, bs=1
  both:    bs=1 also with multi-step decode (--num-scheduler-steps N greedy forwards per host sync,
           default 8; "bs1" is N=1, "bs1_multistep" is N, tokens checked equal); each with the overlap
           schedule (the GPU default: the next step is launched before the last one's tokens are read) and
           without it ("*_no_overlap");
           throughput for bs 1, 8, 32, 128, 256 (N=1, with and without the overlap schedule); host
           microseconds to stage one replay's inputs with grouped foreach copies vs one copy_ per tensor

Roofline: a bs=1 decode step reads every weight once (the embedding table only where tied, as the
lm_head), so roofline tok/s = measured copy bandwidth / weight bytes.

Usage: PYTHONPATH=. python benchmarks/gpu_decode.py --models smollm2,llama8b --smol PATH.gguf --out-dir DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402

from tercel.bench.environment import copy_bandwidth, weight_bytes  # noqa: E402,F401
from tercel.bench.shapes import random_loaded  # noqa: E402

BATCHES = (1, 8, 32, 128, 256)


def gpu_copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of CUDA-event timings."""
    return copy_bandwidth("cuda", nbytes, reps)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def generate(engine, prompts, n):
    from tercel import RequestOutputKind, SamplingParams

    # final outputs only, as LLM.generate asks for them (no per-step output objects)
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [engine.add_request(x, p) for x in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]


def graph_step_ms(runner, bucket: int, reps: int = 200) -> float:
    """GPU time of one replay of this bucket's graph (no host work): the engine's floor per step."""
    g = runner.graphs[bucket].graph
    for _ in range(10):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def staging_us(engine, sizes=BATCHES, iters=300) -> list[dict]:
    """Host time of runner.stage_inputs (copy live inputs into static buffers + pad) per replay,
    grouped foreach vs per-tensor copy_; synthetic decode batches of each size."""
    from tercel.forward_batch import ForwardBatch

    runner = engine.graph_runner
    rows = []
    for n in sizes:
        bucket = runner.bucket_for(n)
        if bucket is None:
            continue
        captured = runner.graphs[bucket]
        width = 24
        dev = engine.device
        batch = ForwardBatch(
            input_ids=torch.randint(0, 100, (n,), device=dev), positions=torch.randint(0, 300, (n,), device=dev),
            out_cache_loc=torch.randint(16, 1000, (n,), device=dev), seq_lens=torch.randint(1, 300, (n,), device=dev),
            block_tables=torch.randint(1, 60, (n, width), device=dev), logits_indices=torch.arange(n, device=dev),
            query_lens=[1] * n, seq_lens_cpu=[100] * n)
        row = {"batch_size": n, "bucket": bucket}
        for label, foreach in (("grouped_foreach", True), ("per_tensor", False)):
            runner.config.use_foreach = foreach
            plan = None
            for _ in range(20):
                runner.stage_inputs(batch, captured, bucket)
            torch.cuda.synchronize()
            ts = []
            for _ in range(iters):
                t = time.perf_counter()
                runner.stage_inputs(batch, captured, bucket)
                ts.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            from tercel.graphs.buffers import plan_copies

            dsts, srcs = runner.buffers.copy_pairs(runner.step.live_inputs(batch), n, bucket)
            plan = plan_copies(dsts, srcs, runner.config.big_copy_bytes)
            launches = (plan.num_launches if foreach
                        else sum(len(d) for d, _ in plan.groups.values()) + len(plan.singles))
            row[f"{label}_us"] = round(statistics.median(ts) * 1e6, 1)
            row[f"{label}_copy_launches"] = launches
        runner.config.use_foreach = True
        rows.append(row)
    return rows


def throughput(engine, make_prompts, n_new: int, sizes) -> list[dict]:
    rows = []
    for bs in sizes:
        prompts = make_prompts(bs)
        generate(engine, prompts[: min(bs, 4)], 4)  # warm-up
        ts = timed(lambda: generate(engine, prompts, n_new), 2)
        t = min(ts)
        rows.append({"batch_size": bs, "new_tokens": n_new, "tok_s": round(bs * n_new / t, 1),
                     "step_ms": round(t / n_new * 1e3, 3), "times_s": [round(x, 3) for x in ts],
                     "replays": engine.graph_runner.stats.replays if engine.graph_runner else 0})
    return rows


def bench_engine(engine, eager_engine, make_prompts, name: str, args, bw: float) -> dict:
    res: dict = {"model": name, "output": "token ids (no detokenization), like HF generate; "
                 "bs1_with_detokenize adds the engine's per-step incremental detokenization"}
    tokenizer = engine.tokenizer
    engine.tokenizer = eager_engine.tokenizer = None
    wb = weight_bytes(engine.model)
    res["weight_bytes"] = wb
    res["roofline_tok_s"] = round(bw / wb, 1)
    prompt = make_prompts(1)
    # correctness: graph replay == eager, greedy, bs=1, full length
    got = generate(engine, prompt, args.new_tokens)[0].outputs[0].token_ids
    want = generate(eager_engine, prompt, args.new_tokens)[0].outputs[0].token_ids
    res["graph_equals_eager_tokens"] = got == want
    res["graph_eager_common_prefix"] = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
    res["tokens"] = got[:32]
    # bs=1 latency: token ids out (like HF generate), then with incremental detokenization as served
    def bs1(n_runs):
        # untimed warm-up runs: the first timed runs on a fresh machine were up to 1.7x slower than the
        # rest (gpu_decode_smollm2_9ac6945_first_on_machine.json and the run at e625b6e)
        for _ in range(args.warmup):
            generate(engine, prompt, args.new_tokens)
        runs = []
        for _ in range(n_runs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = generate(engine, prompt, args.new_tokens)[0]
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t, out.metrics.decode_tokens_per_s))
        wall = statistics.median(r[0] for r in runs)
        return {"new_tokens": args.new_tokens, "tok_s": round(args.new_tokens / wall, 1),
                "decode_tok_s": round(statistics.median(r[1] for r in runs), 1),
                "times_s": [round(r[0], 4) for r in runs]}
    engine.num_scheduler_steps = 1
    res["bs1"] = bs1(args.repeats)
    res["bs1"]["num_scheduler_steps"] = 1
    res["bs1"]["overlap_schedule"] = engine.overlap_schedule
    engine.overlap_schedule = False
    res["bs1_no_overlap"] = bs1(args.repeats)
    res["bs1_no_overlap"]["roofline_fraction"] = round(res["bs1_no_overlap"]["decode_tok_s"] / res["roofline_tok_s"], 3)
    engine.overlap_schedule = True
    if tokenizer is not None:
        engine.tokenizer = tokenizer
        res["bs1_with_detokenize"] = bs1(1)
        engine.tokenizer = None
    if args.num_scheduler_steps > 1:  # the same rows with N greedy forwards per host sync
        engine.num_scheduler_steps = args.num_scheduler_steps
        multi = generate(engine, prompt, args.new_tokens)[0].outputs[0].token_ids
        res["bs1_multistep"] = bs1(args.repeats)
        res["bs1_multistep"]["num_scheduler_steps"] = args.num_scheduler_steps
        res["bs1_multistep"]["tokens_equal_single_step"] = multi == got
        res["bs1_multistep"]["roofline_fraction"] = round(
            res["bs1_multistep"]["decode_tok_s"] / res["roofline_tok_s"], 3)
        engine.overlap_schedule = False
        res["bs1_multistep_no_overlap"] = bs1(args.repeats)
        res["bs1_multistep_no_overlap"]["roofline_fraction"] = round(
            res["bs1_multistep_no_overlap"]["decode_tok_s"] / res["roofline_tok_s"], 3)
        engine.overlap_schedule = True
        if tokenizer is not None:
            engine.tokenizer = tokenizer
            res["bs1_multistep_with_detokenize"] = bs1(1)
            engine.tokenizer = None
        engine.num_scheduler_steps = 1
        print(f"[{name}] bs=1 multi-step: {res['bs1_multistep']}", flush=True)
    res["bs1"]["roofline_fraction"] = round(res["bs1"]["decode_tok_s"] / res["roofline_tok_s"], 3)
    res["bs1"]["graph_step_gpu_ms"] = round(graph_step_ms(engine.graph_runner, 1), 4)
    res["bs1"]["graph_only_roofline_fraction"] = round(
        (1e3 / res["bs1"]["graph_step_gpu_ms"]) / res["roofline_tok_s"], 3)
    t = timed(lambda: generate(eager_engine, prompt, 64), 1)[0]
    res["bs1_no_graph_tok_s"] = round(64 / t, 1)
    print(f"[{name}] bs=1: {res['bs1']}", flush=True)
    try:
        sizes = [int(b) for b in args.batches.split(",") if b]
        res["throughput"] = throughput(engine, make_prompts, args.tput_tokens, sizes)
        print(f"[{name}] throughput: {res['throughput']}", flush=True)
        engine.overlap_schedule = False
        res["throughput_no_overlap"] = throughput(engine, make_prompts, args.tput_tokens, sizes)
        engine.overlap_schedule = True
        print(f"[{name}] throughput without the overlap schedule: {res['throughput_no_overlap']}", flush=True)
    except Exception as e:  # keep what was measured
        res["throughput_error"] = repr(e)
        traceback.print_exc()
    try:
        res["replay_staging_us"] = staging_us(engine)
    except Exception as e:
        res["replay_staging_error"] = repr(e)
        traceback.print_exc()
    res["runner"] = {"buckets": engine.graph_runner.buckets, "captures": engine.graph_runner.stats.captures,
                     "capture_s": round(engine.graph_runner.stats.capture_seconds, 2),
                     "fallbacks": dict(engine.graph_runner.stats.fallbacks)}
    return res


def hf_peers(path: str, prompt_ids: list[int], n: int, repeats: int, ours: list[int]) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig

    transformers.logging.set_verbosity_error()
    d, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt_ids], device="cuda")
    res: dict = {"transformers": transformers.__version__}
    eager_cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        out = hf.generate(ids, generation_config=eager_cfg)[0, len(prompt_ids):].tolist()
        res["tokens_common_prefix_with_tercel"] = next((i for i, (a, b) in enumerate(zip(out, ours)) if a != b),
                                                       min(len(out), len(ours)))
        ts = timed(lambda: hf.generate(ids, generation_config=eager_cfg), max(1, repeats - 1))
        res["eager"] = {"tok_s": round(n / statistics.median(ts), 1), "times_s": [round(t, 3) for t in ts],
                        "config": "generate, DynamicCache, eager"}
        print(f"[hf] eager {res['eager']}", flush=True)
        try:
            comp_cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2,
                                        cache_implementation="static",
                                        compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
            t0 = time.perf_counter()
            for _ in range(3):  # compile + cudagraph recording
                hf.generate(ids, generation_config=comp_cfg)
            warm = time.perf_counter() - t0
            ts = timed(lambda: hf.generate(ids, generation_config=comp_cfg), repeats)
            res["compiled"] = {"tok_s": round(n / statistics.median(ts), 1), "times_s": [round(t, 3) for t in ts],
                               "warmup_s": round(warm, 1),
                               "config": "static cache + CompileConfig(fullgraph=True, mode='reduce-overhead')"}
            print(f"[hf] compiled {res['compiled']}", flush=True)
        except Exception as e:
            res["compiled_error"] = repr(e)
            traceback.print_exc()
    hf = None  # free the peer before returning
    torch.cuda.empty_cache()
    return res


def llama8b_loaded(max_model_len: int):
    return random_loaded("llama-3.1-8b", max_model_len, torch.bfloat16, torch.device("cuda"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,llama8b")
    ap.add_argument("--smol", default=os.environ.get("TERCEL_SMOL_GGUF"))
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--tput-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before each bs=1 measurement")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--num-scheduler-steps", type=int, default=8,
                    help="N for the bs=1 multi-step rows (1: skip them)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="throughput batch sizes")
    args = ap.parse_args()
    from tercel.engine import LLMEngine

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    env["commit"] = os.environ.get("TERCEL_COMMIT", env["commit"])  # the device copy has no .git
    env["command"] = "PYTHONPATH=. python " + " ".join(sys.argv)
    env["triton"] = __import__("triton").__version__
    env["switches"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TERCEL_") and "DIR" not in k}
    bw = gpu_copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    summary = []
    common = dict(dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=256, progress=False)
    for name in args.models.split(","):
        t0 = time.perf_counter()
        result = {"benchmark": f"gpu_decode_{name}", "env": env, "copy_bandwidth_TBps": round(bw / 1e12, 3)}
        try:
            if name == "smollm2":
                engine = LLMEngine(args.smol, kv_cache_memory=8 << 30, **common)
                eager = LLMEngine(loaded=engine.loaded, kv_cache_memory=4 << 30, disable_cuda_graph=True, **common)
                tok = engine.tokenizer
                topics = ["the ocean", "prime numbers", "autumn leaves", "hash tables", "cooking", "the sky"]

                def make_prompts(bs, tok=tok, topics=topics):
                    return [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {topics[i % 6]}."}])
                            for i in range(bs)]
                label = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16)"
            else:
                loaded = llama8b_loaded(2048)
                engine = LLMEngine(loaded=loaded, kv_cache_memory=24 << 30, skip_tokenizer_init=True, **common)
                eager = LLMEngine(loaded=loaded, kv_cache_memory=4 << 30, disable_cuda_graph=True,
                                  skip_tokenizer_init=True, **common)
                g = torch.Generator().manual_seed(1)

                def make_prompts(bs, g=g):
                    return [torch.randint(1000, 100000, (32,), generator=g).tolist() for _ in range(bs)]
                label = "Llama-3.1-8B shape, random weights (seeded normal std 0.02)"
            result["model"] = label
            result["init_s"] = round(time.perf_counter() - t0, 1)
            result.update(bench_engine(engine, eager, make_prompts, label, args, bw))
            # per batch-1 linear shape: cuBLAS or the Triton GEMV, as measured at engine start
            result["gemv_choices"] = [dataclasses.asdict(c) for c in engine.gemv_choices or []]
            result["model"] = label
            if name == "smollm2" and not args.skip_hf:
                try:
                    result["hf"] = hf_peers(args.smol, make_prompts(1)[0], args.new_tokens, args.repeats,
                                            result["tokens"])
                    if "compiled" in result["hf"]:
                        result["speedup_vs_hf_compiled"] = round(
                            result["bs1"]["tok_s"] / result["hf"]["compiled"]["tok_s"], 2)
                    result["speedup_vs_hf_eager"] = round(result["bs1"]["tok_s"] / result["hf"]["eager"]["tok_s"], 2)
                except Exception as e:
                    result["hf_error"] = repr(e)
                    traceback.print_exc()
            del engine, eager
            torch.cuda.empty_cache()
        except Exception as e:
            result["error"] = repr(e)
            traceback.print_exc()
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        path = out_dir / f"gpu_decode_{name}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        summary.append(result)
    print("\nmodel      bs=1 tok/s  decode tok/s  roofline  graph-only  HF eager  HF compiled  vs HF-c"
          "  multi-step tok/s (N)")
    for r in summary:
        b = r.get("bs1", {})
        hf = r.get("hf", {})
        m = r.get("bs1_multistep", {})
        print(f"{r['benchmark'][11:]:<10} {b.get('tok_s', '-'):>10} {b.get('decode_tok_s', '-'):>13} "
              f"{b.get('roofline_fraction', '-'):>9} {b.get('graph_only_roofline_fraction', '-'):>11} "
              f"{hf.get('eager', {}).get('tok_s', '-'):>9} {hf.get('compiled', {}).get('tok_s', '-'):>12} "
              f"{r.get('speedup_vs_hf_compiled', '-'):>8}  {m.get('tok_s', '-')} ({m.get('num_scheduler_steps', '-')})")
    for r in summary:
        for row in r.get("throughput", []):
            print(f"{r['benchmark'][11:]:<10} bs={row['batch_size']:<4} {row['tok_s']:>10} tok/s")
        for row in r.get("replay_staging_us", []):
            print(f"{r['benchmark'][11:]:<10} stage bs={row['batch_size']:<4} grouped {row['grouped_foreach_us']} us "
                  f"({row['grouped_foreach_copy_launches']} launches) vs per-tensor {row['per_tensor_us']} us "
                  f"({row['per_tensor_copy_launches']})")


if __name__ == "__main__":
    main()
