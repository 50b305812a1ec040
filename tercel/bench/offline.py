"""`tercel bench offline`: a sweep of algorithm x output length x concurrency through the public API.

Each point sends `concurrency` conversations at once to `LLM.chat` (text in, text out, as users run it) and
is run twice: the first pass carries just-in-time costs (Triton compiles, graph warm-up), the second is
the steady figure used for speed-ups. Plain decoding also runs the same prompts as token-id lists through
`LLM.generate` with the engine's detokenizer off (ids in, ids out, as HF generate), so the JSON shows what
the text path (chat template, incremental detokenization) costs.

With `rounds` > 1 every engine is built up front and the timed passes run in interleaved rounds, each
algorithm right after a plain pass of its own (`run_rounds`): the host's speed drifts between minutes, so a
speed-up is taken within a round and the median over rounds is reported."""
from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from ..sampling_options import CLI_TEMPERATURE
from . import DEFAULT_CONCURRENCY
from .environment import copy_bandwidth, weight_bytes
from .shapes import target_shape

log = logging.getLogger(__name__)

SHAPE_MAX_MODEL_LEN = 4096  # random-weight shapes: their configs allow 128k, which sizes a huge RoPE table
SHAPE_PROMPT_LEN = 32


@dataclass(slots=True, frozen=True)
class SpecOptions:
    """Speculative settings shared by every algorithm of a sweep (None: the engine's default)."""
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    ddtree_budget: int | None = None
    token_map: str | None = None
    eagle_draft: str | None = None  # EAGLE / EAGLE3 draft directory
    dflash_draft: str | None = None  # DFLASH / DDTREE draft directory
    adaptive: bool = True  # adaptive speculation (the engine's default); False: the full width every step

    def engine_kwargs(self, algorithm: str) -> dict:
        if algorithm == "NONE":
            return {}
        eagle = algorithm in ("EAGLE", "EAGLE3")
        return dict(speculative_algorithm=algorithm,
                    speculative_draft_model_path=self.eagle_draft if eagle else
                    self.dflash_draft if algorithm in ("DFLASH", "DDTREE") else None,
                    speculative_num_steps=self.num_steps, speculative_eagle_topk=self.eagle_topk if eagle else None,
                    speculative_num_draft_tokens=self.num_draft_tokens,
                    speculative_ddtree_budget=self.ddtree_budget if algorithm == "DDTREE" else None,
                    speculative_token_map=self.token_map if eagle else None, speculative_adaptive=self.adaptive)


@dataclass(slots=True, frozen=True)
class OfflineConfig:
    model: str | None  # None: the default SmolLM2; a path; or a shape name (tercel.bench.shapes)
    algorithms: tuple[str, ...] = ("NONE", "NGRAM", "EAGLE3", "DFLASH", "DDTREE")
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    output_lens: tuple[int, ...] = (128,)
    num_prompts: int = 20
    # SamplingParams keywords of every request (tercel.cli_args.sampling_values), but max_tokens: --output-len;
    # a sampled run seeds request i with seed + i (0 + i without one), so it repeats exactly whatever the batch
    sampling: dict = field(default_factory=lambda: {"temperature": CLI_TEMPERATURE, "ignore_eos": True}, hash=False)
    engine: dict = field(default_factory=dict, hash=False)  # LLMEngine keywords (tercel.cli.engine_kwargs)
    spec: SpecOptions = SpecOptions()
    token_id_path: bool = True
    profile: str = "first"  # off | first (each algorithm's smallest concurrency) | all
    hf_peers: bool = False
    hf_prompt_lookup: int = 10
    rounds: int = 1  # > 1: interleaved rounds with paired plain passes (run_rounds); needs NONE among algorithms


@dataclass(slots=True)
class PassResult:
    wall_s: float
    output_tokens: int
    tok_s: float
    mean_accept_length: float | None = None
    accept_histogram: list[int] = field(default_factory=list)  # index k: verifies that accepted k drafts
    spec_stats: dict = field(default_factory=dict)  # the change of engine.spec.stats over this pass
    cost_model: dict = field(default_factory=dict)  # adaptive: the policy's step costs after the pass (CostModel)


@dataclass(slots=True)
class Point:
    algorithm: str
    concurrency: int
    output_len: int
    first: PassResult
    second: PassResult
    # plain only: the same prompts as token ids through LLM.generate, the engine's detokenizer off
    token_id: PassResult | None = None
    api_fraction_of_token_id: float | None = None
    speedup_over_plain: float | None = None
    weight_roofline_tok_s: float | None = None
    roofline_fraction: float | None = None
    step_breakdown_us: dict | None = None  # SpecWorker.profile summary, from a separate profiled pass


@dataclass(slots=True)
class RoundsPoint(Point):
    """A point measured in interleaved rounds (`rounds` > 1): `first` is the warm-up pass, `second` the round
    with the median tok/s, and the speed-up the median over rounds of tok/s / the plain pass just before."""
    rounds: list[PassResult] = field(default_factory=list)
    # the plain pass run just before this algorithm's in the same round (plain itself: its own tok/s, so 1.0)
    paired_plain_tok_s: list[float | None] = field(default_factory=list)
    round_speedups: list[float | None] = field(default_factory=list)  # rounds[i].tok_s / paired_plain_tok_s[i]

    def add_round(self, run: PassResult, plain_tok_s: float | None) -> None:
        self.rounds.append(run)
        self.paired_plain_tok_s.append(plain_tok_s)
        self.round_speedups.append(round(run.tok_s / plain_tok_s, 4) if plain_tok_s else None)
        self.second = median_pass(self.rounds)

    def median_speedup(self) -> float | None:
        ratios = [r for r in self.round_speedups if r is not None]
        return round(statistics.median(ratios), 3) if ratios else None


def median_pass(passes: Sequence[PassResult]) -> PassResult:
    """The pass with the median tok/s (the lower middle one of an even count: a pass that was measured)."""
    return sorted(passes, key=lambda r: r.tok_s)[(len(passes) - 1) // 2]


def rounds_method(n: int) -> str:
    return (f"every algorithm's engine built up front on the same weights; a warm-up pass of every point "
            f"(`first`); then {n} interleaved rounds: in each, at every output length and concurrency, each "
            f"speculative algorithm (their order rotating by one each round) runs right after a plain pass of its "
            f"own; its per-round speed-up is its tok/s over that plain pass's, and speedup_over_plain is the median "
            f"over rounds; `second` is the round with the median tok/s; plain's round is the median of that "
            f"round's plain passes (speed-up 1.0)")


@dataclass(slots=True)
class OfflineResult:
    model: str
    device: str
    dtype: str
    prompts: str
    weight_bytes: int
    copy_bandwidth_bytes_per_s: float
    points: list[Point] = field(default_factory=list)
    engine_errors: dict[str, str] = field(default_factory=dict)  # algorithm -> why its engine did not start
    point_errors: list[dict] = field(default_factory=list)  # a point that failed ends its algorithm's sweep
    hf_peers: list[dict] = field(default_factory=list)


# ---- engine stats, read generically: other fields (e.g. adaptive widths) are recorded as they appear ----
def stats_snapshot(stats: object | None) -> dict:
    if stats is None:
        return {}
    raw = ({f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)} if dataclasses.is_dataclass(stats)
           else dict(vars(stats)))
    return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
            for k, v in raw.items() if isinstance(v, (int, float, list, dict)) and not isinstance(v, bool)}


def _minus(after, before):
    if isinstance(after, (int, float)) and isinstance(before, (int, float)):
        return after - before
    if isinstance(after, list):
        before = before if isinstance(before, list) else []
        return [_minus(a, before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        return {k: _minus(v, before.get(k, 0)) for k, v in after.items()}
    return after


def stats_delta(before: dict, after: dict) -> dict:
    """Counters, histograms (lists) and keyed counts (dicts) as changed between two snapshots."""
    return {k: _minus(v, before.get(k)) for k, v in after.items()}


# ---- one pass ---------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_pass(llm, run: Callable[[], list], device: torch.device) -> PassResult:
    stats = getattr(llm.engine.spec, "stats", None)
    before = stats_snapshot(stats)
    _sync(device)
    t = time.perf_counter()
    outs = run()
    _sync(device)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = sum(o.metrics.spec_verify_steps for o in outs)
    accepted = sum(o.metrics.spec_accepted_tokens for o in outs)
    hist: list[int] = []
    for o in outs:
        h = o.metrics.spec_accept_histogram
        hist = [(hist[k] if k < len(hist) else 0) + (h[k] if k < len(h) else 0) for k in range(max(len(hist), len(h)))]
    adaptive = getattr(llm.engine.spec, "adaptive", None)
    return PassResult(wall_s=round(wall, 4), output_tokens=tokens, tok_s=round(tokens / wall, 2),
                      mean_accept_length=round((accepted + steps) / steps, 3) if steps else None,
                      accept_histogram=hist, spec_stats=stats_delta(before, stats_snapshot(stats)),
                      cost_model=adaptive.costs.snapshot() if adaptive is not None else {})


# ---- the sweep --------------------------------------------------------------------------------------------
def load_target(cfg: OfflineConfig):
    """The model, loaded once for every algorithm's engine."""
    from ..cpu_threads import apply_threads
    from ..engine import resolve_device
    from ..loader.model_loader import load_model, read_checkpoint, resolve_dtype
    from .shapes import random_loaded

    apply_threads(cfg.engine.get("threads"))  # the load's packing too, not only the engines' steps
    device = resolve_device(cfg.engine.get("device", "auto"))
    dtype, dequantize = cfg.engine.get("dtype", "auto"), cfg.engine.get("dequantize_gguf", False)
    shape = target_shape(cfg.model)
    if shape is not None:
        return random_loaded(shape, cfg.engine.get("max_model_len") or SHAPE_MAX_MODEL_LEN,
                             resolve_dtype(dtype, device).dtype, device), device
    ckpt = read_checkpoint(cfg.model)  # dtype="auto" on the CPU depends on what the checkpoint stores
    choice = resolve_dtype(dtype, device, ckpt, dequantize_gguf=dequantize)
    if choice.note is not None:
        log.info("%s", choice.note)
    return load_model(cfg.model, choice.dtype, device, max_model_len=cfg.engine.get("max_model_len"), progress=False,
                      dequantize_gguf=dequantize, checkpoint=ckpt), device


def held_out_prompts(loaded, n: int) -> tuple[list, list[list[int]], str]:
    """(conversations or token-id prompts for the API path, token-id prompts, a description)."""
    from ..train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    tok = loaded.tokenizer
    if tok is None or not tok.has_chat_template:  # random-weight shapes: no tokenizer, so token ids both ways
        g = torch.Generator().manual_seed(1)
        high = min(loaded.config.vocab_size, 100000)
        ids = [torch.randint(min(1000, high // 2), high, (SHAPE_PROMPT_LEN,), generator=g).tolist() for _ in range(n)]
        return ids, ids, f"{n} seeded random prompts of {SHAPE_PROMPT_LEN} token ids (the model has no tokenizer)"
    texts = (EVAL_CHAT_PROMPTS + EVAL_CODE_PROMPTS)[:n]
    convs = [[{"role": "user", "content": t}] for t in texts]
    return convs, [tok.apply_chat_template(c) for c in convs], (
        f"{len(texts)} held-out prompts (tercel.train.data EVAL_CHAT_PROMPTS + EVAL_CODE_PROMPTS) in the chat "
        f"template, cycled to fill each batch")


def _cycle(items: Sequence, n: int) -> list:
    return [items[i % len(items)] for i in range(n)]


def _params(cfg: OfflineConfig, n: int, output_len: int, ignore_eos: bool | None = None) -> list:
    """ignore_eos: overrides the sweep's setting (the token-id pass runs every request to its length)."""
    from ..sampling_params import SamplingParams

    kw = dict(cfg.sampling)
    if ignore_eos is not None:
        kw["ignore_eos"] = ignore_eos
    sampled = kw.get("temperature", CLI_TEMPERATURE) > 0
    base = kw.pop("seed", None) or 0
    return [SamplingParams(max_tokens=output_len, seed=base + i if sampled else None, **kw) for i in range(n)]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def shared_kv_budget(cfg: OfflineConfig, device: torch.device, engines: int) -> dict:
    """Engine keywords that let `engines` engines live at once on a GPU: each KV pool sized from free memory
    would take 85% of what the previous ones left, and the third would not start. Without a pool size of the
    user's, each takes an equal share of half of gpu_memory_utilization x free memory: the other half is for
    what each engine adds after its pool (drafts, graph pools: 12 GiB for four SmolLM2 engines on the H200)."""
    if device.type != "cuda" or engines < 2 or {"kv_cache_memory", "num_kv_blocks"} & {
            k for k, v in cfg.engine.items() if v is not None}:
        return {}
    free, _ = torch.cuda.mem_get_info(device)
    return {"kv_cache_memory": int(free * (cfg.engine.get("gpu_memory_utilization") or 0.85) / (2 * engines))}


def _build_engine(cfg: OfflineConfig, loaded, algo: str, errors: dict[str, str], extra: dict | None = None):
    """The algorithm's LLM on the shared weights, or None (the reason in `errors`)."""
    from ..llm import LLM

    engine_kw = {k: v for k, v in cfg.engine.items() if k not in ("dequantize_gguf",)} | (extra or {})
    engine_kw["progress"] = False
    try:
        return LLM(loaded=loaded, skip_tokenizer_init=loaded.tokenizer is None, **engine_kw,
                   **cfg.spec.engine_kwargs(algo))
    except Exception as e:  # noqa: BLE001 - one algorithm that cannot start must not lose the others
        errors[algo] = f"{type(e).__name__}: {e}"
        return None


def _engines(cfg: OfflineConfig, loaded, device: torch.device, errors: dict[str, str]) -> Iterator[tuple[str, object]]:
    """(algorithm, LLM) one at a time; each is dropped before the next takes its KV pool."""
    for algo in cfg.algorithms:
        llm = _build_engine(cfg, loaded, algo, errors)
        if llm is None:
            continue
        yield algo, llm
        del llm
        _free(device)


def run_offline(cfg: OfflineConfig, on_progress: Callable[[OfflineResult], None] | None = None) -> OfflineResult:
    """The sweep; on_progress gets the result so far after every point (with `rounds` > 1: after every round),
    speed-ups filled in."""
    loaded, device = load_target(cfg)
    api_prompts, id_prompts, described = held_out_prompts(loaded, cfg.num_prompts)
    shape = target_shape(cfg.model)
    label = shape.label if shape else f"{loaded.path.name} ({loaded.config.architecture})"
    res = OfflineResult(model=label, device=str(device), dtype=str(next(loaded.model.parameters()).dtype),
                        prompts=described, weight_bytes=weight_bytes(loaded.model),
                        copy_bandwidth_bytes_per_s=copy_bandwidth(device))
    if cfg.rounds > 1:
        run_rounds(cfg, loaded, device, (api_prompts, id_prompts), res, on_progress)
    else:
        _run_sequential(cfg, loaded, device, (api_prompts, id_prompts), res, on_progress)
    derive(res)
    if cfg.hf_peers:
        from .hf_peers import run_hf_peers

        res.hf_peers = run_hf_peers(cfg, loaded, id_prompts[0], device)
        for peer in res.hf_peers:
            ours = {p.algorithm: p.second.tok_s for p in res.points
                    if p.concurrency == 1 and p.output_len == peer.get("output_len")}
            peer["tercel_speedup"] = {a: round(t / peer["tok_s"], 2) for a, t in ours.items() if peer.get("tok_s")}
    return res


def _profiled(cfg: OfflineConfig, c: int) -> bool:
    return cfg.profile == "all" or (cfg.profile == "first" and c == min(cfg.concurrency))


def _grid(cfg: OfflineConfig) -> list[tuple[int, int]]:
    """(output length, concurrency) of every point, in sweep order."""
    return [(n, c) for n in cfg.output_lens for c in sorted(cfg.concurrency)]


def _point_error(res: OfflineResult, algo: str, c: int, n_out: int, e: Exception) -> None:
    res.point_errors.append({"algorithm": algo, "concurrency": c, "output_len": n_out,
                             "error": f"{type(e).__name__}: {e}"[:500]})


def _run_sequential(cfg: OfflineConfig, loaded, device: torch.device, prompts: tuple[list, list[list[int]]],
                    res: OfflineResult, on_progress: Callable[[OfflineResult], None] | None) -> None:
    """One engine at a time, each point's two passes back to back (`rounds` = 1)."""
    total = len(cfg.algorithms) * len(cfg.output_lens) * len(cfg.concurrency)
    bar = tqdm(total=total, desc="bench offline", unit="point", leave=False)
    for algo, llm in _engines(cfg, loaded, device, res.engine_errors):
        points = _grid(cfg)
        for n_out, c in points:
            bar.set_postfix_str(f"{algo} c={c} len={n_out}")
            try:
                point = measure_point(cfg, llm, algo, c, n_out, profile=_profiled(cfg, c), prompts=prompts)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at a large batch: keep the other algorithms
                _point_error(res, algo, c, n_out, e)
                bar.update(len(points) - points.index((n_out, c)))
                break  # this engine's state is suspect; the next algorithm gets a fresh one
            res.points.append(point)
            if on_progress is not None:
                derive(res)
                on_progress(res)
            bar.update(1)
        llm = None  # the generator drops the engine only once no reference is left here
    bar.close()


def _is_chat(api_prompts: list) -> bool:
    return isinstance(api_prompts[0], list) and isinstance(api_prompts[0][0], dict)


def point_runner(cfg: OfflineConfig, llm, c: int, n_out: int, api_prompts: list) -> Callable[[], list]:
    """One pass of the point: `c` requests at once through LLM.chat (or generate, for token-id prompts)."""
    batch, params = _cycle(api_prompts, c), _params(cfg, c, n_out)
    return (lambda: llm.chat(batch, params)) if _is_chat(api_prompts) else (lambda: llm.generate(batch, params))


def side_passes(cfg: OfflineConfig, llm, point: Point, run: Callable[[], list], prompts: tuple[list, list[list[int]]],
                profile: bool) -> None:
    """Plain decoding's token-id pass and (when `profile`) speculative decoding's profiled pass; once per point."""
    api_prompts, id_prompts = prompts
    c, n_out = point.concurrency, point.output_len
    if point.algorithm == "NONE" and cfg.token_id_path and _is_chat(api_prompts):  # no tokenizer: both are ids
        # ids in, ids out, as HF generate: no per-step detokenization
        ids = _cycle(id_prompts, c)
        id_params = [replace(p, detokenize=False) for p in _params(cfg, c, n_out, True)]
        point.token_id = timed_pass(llm, lambda: llm.generate(ids, id_params), llm.engine.device)
    if llm.engine.spec is not None and profile:
        point.step_breakdown_us = profiled_pass(llm.engine.spec, run)


def measure_point(cfg: OfflineConfig, llm, algo: str, c: int, n_out: int, profile: bool,
                  prompts: tuple[list, list[list[int]]]) -> Point:
    """Two timed passes of `c` requests at once; plain decoding adds the token-id pass, speculative
    decoding (when `profile`) a profiled one."""
    device = llm.engine.device
    run = point_runner(cfg, llm, c, n_out, prompts[0])
    first = timed_pass(llm, run, device)
    point = Point(algo, c, n_out, first, timed_pass(llm, run, device))
    side_passes(cfg, llm, point, run, prompts, profile)
    return point


# ---- interleaved rounds (rounds > 1) ------------------------------------------------------------------------
@dataclass(slots=True)
class _Live:
    """An algorithm in the rounds: its engine, and per (output length, concurrency) its point (a dict that
    outlives this entry: a dropped algorithm keeps the rounds it measured) and its pass."""
    llm: object
    points: dict[tuple[int, int], RoundsPoint]
    runs: dict[tuple[int, int], Callable[[], list]] = field(default_factory=dict)

    def timed(self, key: tuple[int, int]) -> PassResult:
        return timed_pass(self.llm, self.runs[key], self.llm.engine.device)


def run_rounds(cfg: OfflineConfig, loaded, device: torch.device, prompts: tuple[list, list[list[int]]],
               res: OfflineResult, on_progress: Callable[[OfflineResult], None] | None) -> None:
    """Every engine alive at once (they share `loaded`), a warm-up pass of every point, then `cfg.rounds`
    interleaved rounds of paired passes (`play_round`). An algorithm whose pass fails leaves the rounds (its
    engine's state is suspect) and keeps the points with the rounds it measured."""
    live: dict[str, _Live] = {}
    points: dict[str, dict[tuple[int, int], RoundsPoint]] = {}
    share = shared_kv_budget(cfg, device, len(cfg.algorithms))
    for algo in cfg.algorithms:
        llm = _build_engine(cfg, loaded, algo, res.engine_errors, share)
        if llm is not None:
            live[algo] = _Live(llm, points.setdefault(algo, {}))
    bar = tqdm(total=len(live) * len(_grid(cfg)) * (1 + cfg.rounds), desc="bench offline", unit="pass",
               leave=False)
    for algo, entry in list(live.items()):
        for n_out, c in _grid(cfg):
            bar.set_postfix_str(f"warm-up {algo} c={c} len={n_out}")
            try:
                warm_up(cfg, algo, entry, n_out, c, prompts)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at a large batch: keep the other algorithms
                _point_error(res, algo, c, n_out, e)
                _drop(live, algo, device)
                break
            bar.update(1)
        entry = None  # no reference to a dropped engine left here
    for r in range(cfg.rounds):
        play_round(r, cfg, live, res, device, bar)
        # in sweep order; a point enters once it has a round (until then its `second` is only the warm-up)
        res.points = [p for algo in cfg.algorithms for p in points.get(algo, {}).values() if p.rounds]
        if on_progress is not None:
            derive(res)
            on_progress(res)
    bar.close()
    live.clear()
    _free(device)


def warm_up(cfg: OfflineConfig, algo: str, entry: _Live, n_out: int, c: int,
            prompts: tuple[list, list[list[int]]]) -> None:
    """The point's first pass (compile / capture costs) and its side passes; `second` is set by the rounds."""
    key = (n_out, c)
    entry.runs[key] = point_runner(cfg, entry.llm, c, n_out, prompts[0])
    first = entry.timed(key)
    point = RoundsPoint(algo, c, n_out, first, first)
    side_passes(cfg, entry.llm, point, entry.runs[key], prompts, _profiled(cfg, c))
    entry.points[key] = point


def _drop(live: dict[str, _Live], algo: str, device: torch.device) -> None:
    del live[algo]
    _free(device)


def play_round(r: int, cfg: OfflineConfig, live: dict[str, _Live], res: OfflineResult, device: torch.device,
               bar) -> None:
    """At every point, each speculative algorithm right after a plain pass of its own; the algorithms' order
    rotates by one each round so none always runs first."""
    spec = [a for a in cfg.algorithms if a != "NONE"]
    order = spec[r % len(spec):] + spec[:r % len(spec)] if spec else []
    for n_out, c in _grid(cfg):
        key = (n_out, c)
        plain_runs: list[PassResult] = []

        def attempt(algo: str) -> PassResult | None:
            if algo not in live or key not in live[algo].points:
                return None
            bar.set_postfix_str(f"round {r + 1} {algo} c={c} len={n_out}")
            try:
                return live[algo].timed(key)
            except Exception as e:  # noqa: BLE001 - the others keep going
                _point_error(res, algo, c, n_out, e)
                _drop(live, algo, device)
                return None

        for algo in order:
            if algo not in live:
                continue
            base = attempt("NONE")
            if base is not None:
                plain_runs.append(base)
            own = attempt(algo)
            if own is not None:
                live[algo].points[key].add_round(own, base.tok_s if base is not None else None)
            bar.update(1)
        if not plain_runs:  # no speculative algorithm left to pair with: plain's own pass
            base = attempt("NONE")
            plain_runs += [base] if base is not None else []
        if plain_runs and "NONE" in live:
            mid = median_pass(plain_runs)
            live["NONE"].points[key].add_round(mid, mid.tok_s)
            bar.update(1)


def profiled_pass(spec, run: Callable[[], object]) -> dict:
    """Per-phase step times from a pass of its own: profiling syncs once per step, so it is not timed."""
    spec.profile.enabled = True
    try:
        run()
    finally:
        spec.profile.enabled = False
    summary = spec.profile.summary()
    spec.profile = type(spec.profile)(spec.profile.device)
    return summary


def derive(res: OfflineResult) -> None:
    """Speed-up over plain decoding (second passes, same length and concurrency; in rounds the median of the
    per-round paired ratios), the text path's share of the token-id speed and the weight roofline."""
    plain = {(p.output_len, p.concurrency): p.second.tok_s for p in res.points if p.algorithm == "NONE"}
    per_seq = res.copy_bandwidth_bytes_per_s / res.weight_bytes
    for p in res.points:
        if isinstance(p, RoundsPoint):
            p.speedup_over_plain = p.median_speedup()
        else:
            base = plain.get((p.output_len, p.concurrency))
            p.speedup_over_plain = round(p.second.tok_s / base, 3) if base else None
        if p.token_id is not None:
            p.api_fraction_of_token_id = round(p.second.tok_s / p.token_id.tok_s, 3)
        p.weight_roofline_tok_s = round(per_seq * p.concurrency, 1)
        p.roofline_fraction = round(p.second.tok_s / p.weight_roofline_tok_s, 4)


ROOFLINE_NOTE = ("weight_roofline_tok_s = concurrency * copy bandwidth / weight bytes: every weight read once per "
                 "step, KV reads ignored; a bound for plain decoding while it is memory-bound (small batches); "
                 "speculative decoding emits several tokens per read and can exceed it")
TOK_S_NOTE = "output tokens of the whole batch / wall time of the LLM.chat (or generate) call, prefill included"
