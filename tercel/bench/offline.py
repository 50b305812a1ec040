"""`tercel bench offline`: a sweep of algorithm x output length x concurrency through the public API.

Each point sends `concurrency` conversations at once to `LLM.chat` (text in, text out, as users run it) and
is run twice: the first pass carries just-in-time costs (Triton compiles, graph warm-up), the second is
the steady figure used for speed-ups. Plain decoding also runs the same prompts as token-id lists through
`LLM.generate` with the engine's detokenizer off (ids in, ids out, as HF generate), so the JSON shows what
the text path (chat template, incremental detokenization) costs."""
from __future__ import annotations

import dataclasses
import gc
import logging
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


@dataclass(slots=True)
class PassResult:
    wall_s: float
    output_tokens: int
    tok_s: float
    mean_accept_length: float | None = None
    accept_histogram: list[int] = field(default_factory=list)  # index k: verifies that accepted k drafts
    spec_stats: dict = field(default_factory=dict)  # the change of engine.spec.stats over this pass


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
    return PassResult(wall_s=round(wall, 4), output_tokens=tokens, tok_s=round(tokens / wall, 2),
                      mean_accept_length=round((accepted + steps) / steps, 3) if steps else None,
                      accept_histogram=hist, spec_stats=stats_delta(before, stats_snapshot(stats)))


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


def _engines(cfg: OfflineConfig, loaded, device: torch.device, errors: dict[str, str]) -> Iterator[tuple[str, object]]:
    """(algorithm, LLM) one at a time; each is dropped before the next takes its KV pool."""
    from ..llm import LLM

    engine_kw = {k: v for k, v in cfg.engine.items() if k not in ("dequantize_gguf",)}
    engine_kw["progress"] = False
    for algo in cfg.algorithms:
        try:
            llm = LLM(loaded=loaded, skip_tokenizer_init=loaded.tokenizer is None, **engine_kw,
                      **cfg.spec.engine_kwargs(algo))
        except Exception as e:  # noqa: BLE001 - one algorithm that cannot start must not lose the others
            errors[algo] = f"{type(e).__name__}: {e}"
            continue
        yield algo, llm
        del llm
        _free(device)


def run_offline(cfg: OfflineConfig, on_progress: Callable[[OfflineResult], None] | None = None) -> OfflineResult:
    """The sweep; on_progress gets the result so far after every point (speed-ups filled in)."""
    loaded, device = load_target(cfg)
    api_prompts, id_prompts, described = held_out_prompts(loaded, cfg.num_prompts)
    shape = target_shape(cfg.model)
    label = shape.label if shape else f"{loaded.path.name} ({loaded.config.architecture})"
    res = OfflineResult(model=label, device=str(device), dtype=str(next(loaded.model.parameters()).dtype),
                        prompts=described, weight_bytes=weight_bytes(loaded.model),
                        copy_bandwidth_bytes_per_s=copy_bandwidth(device))
    total = len(cfg.algorithms) * len(cfg.output_lens) * len(cfg.concurrency)
    bar = tqdm(total=total, desc="bench offline", unit="point", leave=False)
    for algo, llm in _engines(cfg, loaded, device, res.engine_errors):
        points = [(n, c) for n in cfg.output_lens for c in sorted(cfg.concurrency)]
        for n_out, c in points:
            bar.set_postfix_str(f"{algo} c={c} len={n_out}")
            try:
                point = measure_point(cfg, llm, algo, c, n_out, profile=cfg.profile == "all" or (
                    cfg.profile == "first" and c == min(cfg.concurrency)), prompts=(api_prompts, id_prompts))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at a large batch: keep the other algorithms
                res.point_errors.append({"algorithm": algo, "concurrency": c, "output_len": n_out,
                                         "error": f"{type(e).__name__}: {e}"[:500]})
                bar.update(len(points) - points.index((n_out, c)))
                break  # this engine's state is suspect; the next algorithm gets a fresh one
            res.points.append(point)
            if on_progress is not None:
                derive(res)
                on_progress(res)
            bar.update(1)
        llm = None  # the generator drops the engine only once no reference is left here
    bar.close()
    derive(res)
    if cfg.hf_peers:
        from .hf_peers import run_hf_peers

        res.hf_peers = run_hf_peers(cfg, loaded, id_prompts[0], device)
        for peer in res.hf_peers:
            ours = {p.algorithm: p.second.tok_s for p in res.points
                    if p.concurrency == 1 and p.output_len == peer.get("output_len")}
            peer["tercel_speedup"] = {a: round(t / peer["tok_s"], 2) for a, t in ours.items() if peer.get("tok_s")}
    return res


def measure_point(cfg: OfflineConfig, llm, algo: str, c: int, n_out: int, profile: bool,
                  prompts: tuple[list, list[list[int]]]) -> Point:
    """Two timed passes of `c` requests at once; plain decoding adds the token-id pass, speculative
    decoding (when `profile`) a profiled one."""
    api_prompts, id_prompts = prompts
    device = llm.engine.device
    chat = isinstance(api_prompts[0], list) and isinstance(api_prompts[0][0], dict)
    batch, params = _cycle(api_prompts, c), _params(cfg, c, n_out)
    run = (lambda: llm.chat(batch, params)) if chat else (lambda: llm.generate(batch, params))
    first = timed_pass(llm, run, device)
    point = Point(algo, c, n_out, first, timed_pass(llm, run, device))
    if algo == "NONE" and cfg.token_id_path and chat:  # without a tokenizer both paths are token ids
        # ids in, ids out, as HF generate: no per-step detokenization
        ids = _cycle(id_prompts, c)
        id_params = [replace(p, detokenize=False) for p in _params(cfg, c, n_out, True)]
        point.token_id = timed_pass(llm, lambda: llm.generate(ids, id_params), device)
        point.api_fraction_of_token_id = round(point.second.tok_s / point.token_id.tok_s, 3)
    if llm.engine.spec is not None and profile:
        point.step_breakdown_us = profiled_pass(llm.engine.spec, run)
    return point


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
    """Speed-up over plain decoding (second passes, same length and concurrency) and the weight roofline."""
    plain = {(p.output_len, p.concurrency): p.second.tok_s for p in res.points if p.algorithm == "NONE"}
    per_seq = res.copy_bandwidth_bytes_per_s / res.weight_bytes
    for p in res.points:
        base = plain.get((p.output_len, p.concurrency))
        p.speedup_over_plain = round(p.second.tok_s / base, 3) if base else None
        p.weight_roofline_tok_s = round(per_seq * p.concurrency, 1)
        p.roofline_fraction = round(p.second.tok_s / p.weight_roofline_tok_s, 4)


ROOFLINE_NOTE = ("weight_roofline_tok_s = concurrency * copy bandwidth / weight bytes: every weight read once per "
                 "step, KV reads ignored; a bound for plain decoding while it is memory-bound (small batches); "
                 "speculative decoding emits several tokens per read and can exceed it")
TOK_S_NOTE = "output tokens of the whole batch / wall time of the LLM.chat (or generate) call, prefill included"
