"""LLMEngine: add requests, step (schedule -> forward -> sample -> postprocess), abort.

One step serves a mixed batch: prefill chunks and decodes of many requests, packed flat.

Multi-step decode (num_scheduler_steps = N > 1, vLLM's idea): when every running request is decoding
and needs no host data per step (no penalties, logprobs or pending min_tokens), one step runs up to
N forwards back to back with no host sync between them. The token chosen at forward s stays on the
device and is the input of forward s+1; positions, KV slots, seq lens and block tables of all N
forwards are known up front (the scheduler reserves the slots) and go up in one upload. One sync at
the end brings the N x B tokens back; they are appended one by one with the usual stop checks, so
outputs equal single-step decoding, delivered in bursts. (A request that stops on EOS / a stop string
inside a window keeps its row until the window ends: the batch is then one row larger than a single
step's, which bf16 GEMMs on a GPU may round differently, like bucket padding.)

Overlap schedule (SGLang's idea; on by default on a GPU, `disable_overlap_schedule` turns it off): a
decode window (of N >= 1 forwards) is launched and left in flight; the next step launches the following
window, fed the in-flight window's last tokens on the device, before it waits for the in-flight tokens
and appends them. The host's bookkeeping (stop checks, detokenization, scheduling, staging) then runs
while the GPU computes, instead of between its forwards. It assumes no request stops inside the
in-flight window; one that does (EOS, stop string, abort) has the next window's work for it discarded.
Outputs are those of one step per sync, one step later.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import numbers
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .batching import RowSpan, TableRows, build_batch, decode_rows, step_batch
from .config import ConfigError, EngineConfig, ModelLoadConfig
from .cpu_threads import apply_threads
from .executor import DECODE, Executor, StepKey
from .forward_batch import ForwardBatch, ModelOutput
from .gpu_memory import release_if_last, track
from .kv import KVCacheSpec, PagedKVCache, num_kv_blocks
from .loader.model_loader import Checkpoint, DtypeChoice, LoadedModel, load_model, read_checkpoint, resolve_dtype
from .loader.tokenizer import Tokenizer
from .output_sink import OutputSink
from .outputs import RequestMetrics, RequestOutput
from .prefix_cache import PrefixCache
from .request import Request
from .sampling import Sampler, SamplingTensors, greedy_tokens, sample_rows, stream_keys
from .sampling_params import SamplingParams
from .scheduler import ScheduledRequest, Scheduler

if TYPE_CHECKING:
    from .graphs.compiled import CompiledSteps
    from .graphs.runner import CudaGraphRunner
    from .graphs.sampled_decode import SampledDecodeBatch, SampledDecodeOutput

log = logging.getLogger(__name__)

SPEC_GRAPH_MAX_BS = 64  # largest batch whose speculative steps are captured (larger ones run eagerly)
_GREEDY_STANDIN = SamplingParams(temperature=1.0)  # greedy rows of a mixed sampled window draw, unused


@dataclass(slots=True)
class DecodeWindow:
    """Device inputs of a multi-step decode window: num_steps forwards over the same requests."""

    first_ids: torch.Tensor  # [B]: each request's last token, the input of forward 0
    positions: torch.Tensor  # [num_steps, B]
    out_cache_loc: torch.Tensor  # [num_steps, B]
    seq_lens: torch.Tensor  # [num_steps, B]
    block_tables: torch.Tensor  # [B, width]: covers the whole window
    logits_indices: torch.Tensor  # [B]
    seq_lens_cpu: list[list[int]]  # [num_steps][B], host copy
    seeds: torch.Tensor | None = None  # [B]: each request's stream seed (sampled rows)
    draws: torch.Tensor | None = None  # [num_steps, B]: the draw index of each step's token (sampled rows)

    def batch(self, step: int, input_ids: torch.Tensor) -> ForwardBatch:
        lens = self.seq_lens_cpu[step]
        return ForwardBatch(input_ids=input_ids, positions=self.positions[step], out_cache_loc=self.out_cache_loc[step],
                            seq_lens=self.seq_lens[step], block_tables=self.block_tables,
                            logits_indices=self.logits_indices, query_lens=[1] * len(lens), seq_lens_cpu=lens)


@dataclass(slots=True)
class InflightWindow:
    """A launched decode window whose tokens are not read yet (overlap schedule)."""

    reqs: list[Request]
    num_steps: int
    tokens: torch.Tensor  # [num_steps, B] on the device: the last row feeds the next window
    host_tokens: torch.Tensor  # the same, copied to (pinned) host memory behind `ready`
    ready: torch.cuda.Event | None  # None on CPU (the forwards ran synchronously)
    spec_plain: bool = False  # plain steps granted by adaptive speculation
    hidden: torch.Tensor | None = None  # spec_plain: [num_steps, B, H] the drafter's hidden rows


def _step_major(rows: list[int], num_steps: int) -> list[int]:
    """Request-major rows (each request's num_steps in turn) reordered step by step."""
    return list(itertools.chain.from_iterable(zip(*(rows[i:i + num_steps] for i in range(0, len(rows), num_steps)))))


def engine_config(model: "str | Path | EngineConfig | None", config: EngineConfig | None,
                  settings: dict[str, object]) -> EngineConfig:
    """The engine's settings tree from LLMEngine's arguments: a tree (first argument or config=), or a
    model path and flat keyword settings (an unknown name raises, listing the close ones)."""
    if isinstance(model, EngineConfig):
        config, model = model, None
    if config is None:
        return EngineConfig.from_kwargs(model=model, **settings)
    if model is not None or settings:
        raise ConfigError(f"pass either an EngineConfig or a model and keyword settings, not both (got "
                          f"{'model, ' if model is not None else ''}{', '.join(settings)} with the config).")
    return copy.deepcopy(config)  # the engine fills in resolved values (max_model_len, AUTO speculation)


def default_batched_tokens(device: torch.device) -> int:
    """The per-step token budget (chunked prefill) for this device, when max_num_batched_tokens is unset.
    A step's time grows with its tokens, and every running request's next token waits for the step: on a
    CPU a 256-token step takes about as long as a decode step of a large batch; a GPU absorbs far more per
    step (sizes as vLLM and SGLang pick them by memory)."""
    if device.type != "cuda":
        return 256
    total = torch.cuda.get_device_properties(device).total_memory
    return 8192 if total >= 60 << 30 else 4096 if total >= 20 << 30 else 2048


def default_step_tokens(device: torch.device) -> int | None:
    """The cap on a step's decode plus prefill tokens while requests decode, when max_step_tokens is unset. On a
    CPU a step's time grows with its tokens from a few dozen up (about 3 ms each for SmolLM2 fp32 on 2 cores),
    so a cap of 128 keeps a decoding request's next token within a few tenths of a second beside a large
    fan-out; a GPU step of a few thousand tokens costs about what a decode step does, so none there."""
    return 128 if device.type != "cuda" else None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int  # free, or cached with no request holding them
    kv_blocks_cached: int = 0  # of the free ones: cached (a prefix hit reuses them; evicted under pressure)
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, found there

    @property
    def kv_blocks_used(self) -> int:
        """Blocks some request holds (0 when idle; cached blocks nobody holds count as free)."""
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        q = self.prefix_cache_queried_tokens
        return None if not q else self.prefix_cache_hit_tokens / q


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'.")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported; use auto, cpu or cuda[:N].")
    return torch.device(device)


def _is_default_model(path: Path) -> bool:
    """Is this the default model (whose bundled drafts apply)?"""
    from .loader.model_loader import default_model_path

    try:
        return Path(path).resolve() == default_model_path().resolve()
    except ConfigError:
        return False


class LLMEngine:
    def __init__(self, model: "str | Path | EngineConfig | None" = None, *, config: EngineConfig | None = None,
                 loaded: LoadedModel | None = None, tokenizer: Tokenizer | None = None,
                 checkpoint: Checkpoint | None = None, **settings) -> None:
        """LLMEngine(EngineConfig(...)), or LLMEngine(model, **settings) with the settings' flat names
        (dtype=, device=, max_model_len=, kv_cache_memory=, speculative_algorithm=, ...: see tercel.config).
        loaded: an already loaded model (its weights are shared); tokenizer: an already loaded tokenizer;
        checkpoint: the model already read by read_checkpoint (the command lines do, to check flags)."""
        config = engine_config(model, config, settings).validate()
        m, sched = config.model, config.scheduler
        apply_threads(config.kernel.threads)  # --threads, else the physical cores
        self.num_scheduler_steps = sched.num_scheduler_steps
        self.device = resolve_device(m.device)
        # overlap schedule: a GPU default (on CPU the forward runs on the host, so nothing overlaps);
        # disable_overlap_schedule=False forces it on anywhere (tests drive it on CPU)
        self.overlap_schedule = (self.device.type == "cuda" if sched.disable_overlap_schedule is None
                                 else not sched.disable_overlap_schedule)
        self._inflight: InflightWindow | None = None
        self._download_stream = None  # CUDA (set with the stager): the stream that brings window tokens to the host
        self._window_st: tuple[tuple[str, ...], SamplingTensors] | None = None  # _window_settings' last upload
        self._window_tables = TableRows()  # the decode windows' block tables, packed once per batch
        # dtype="auto" on the CPU reads the checkpoint's header to pick its path; tensor-parallel ranks load
        # dense shards (a GGUF's 4-bit matrices are not kept), so they resolve it as for a dense checkpoint
        ckpt = checkpoint if loaded is None and config.parallel.tp_size == 1 else None
        if ckpt is None and loaded is None and m.dtype == "auto" and self.device.type == "cpu" \
                and config.parallel.tp_size == 1:
            ckpt = read_checkpoint(m.model, m.load_cache)
        choice = self._dtype_choice(m, loaded, ckpt)
        self.dtype = choice.dtype
        self.dtype_note = choice.note  # dtype="auto": what it picked and why (logged once, here)
        if choice.note is not None:
            log.info("%s", choice.note)
        self.rng = torch.Generator().manual_seed(sched.seed)
        self._closed = False  # shutdown() ran: the engine holds nothing and takes no requests
        self.tp_group = None  # tensor parallelism (tercel.distributed): the ranks' group; None: one process
        self._draft_target = None
        if config.parallel.tp_size > 1:
            loaded = self._start_tensor_parallel(config, loaded, tokenizer)
        elif loaded is None:
            loaded = load_model(m.model, self.dtype, self.device, max_model_len=m.max_model_len,
                                load_tokenizer_too=not m.skip_tokenizer_init, progress=m.progress,
                                dequantize_gguf=m.dequantize_gguf, tokenizer=tokenizer, checkpoint=ckpt,
                                use_cache=m.load_cache)
        try:
            self._init_after_load(config, loaded)
        except BaseException:
            self.close()
            raise

    def _init_after_load(self, config: EngineConfig, loaded: LoadedModel) -> None:
        m, sched = config.model, config.scheduler
        self.loaded = loaded
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        if m.chat_template is not None and self.tokenizer is not None:  # a copy: the loaded model may be shared
            self.tokenizer = copy.copy(self.tokenizer)
            self.tokenizer.set_chat_template(m.chat_template)
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        m.max_model_len = m.max_model_len or loaded.model.max_positions
        self.config = config
        block_size = config.cache.block_size
        if self.device.type == "cuda" and self.tp_group is None and hasattr(loaded.model, "fold_norms"):
            from .kernels import triton_enabled

            if triton_enabled():  # before the KV pool takes what is left: the folded weights' copies (fold_norms)
                loaded.model.fold_norms()
        spec = KVCacheSpec.for_model(loaded.model.config, block_size, self.dtype)  # a TP rank's model: its KV heads
        num_blocks = num_kv_blocks(config, spec, self.device)
        if self.tp_group is not None:  # the same pool on every rank: the smallest any rank can hold
            num_blocks = self.tp_group.agree_start(num_blocks)
            if num_blocks <= 0:
                raise ConfigError("a tensor-parallel rank failed to load its shard (its error is printed above).")
        # the executor owns the model, the KV pool, the input upload and the graph runners (executor.py)
        self.executor = Executor(loaded.model, PagedKVCache(spec, num_blocks, self.device), self.device)
        if self.device.type == "cuda":
            track(self)  # the last CUDA engine to go gives torch's cuBLAS workspaces back (gpu_memory.py)
        usable_tokens = self.kv.allocator.num_usable * block_size
        if usable_tokens < self.config.max_model_len:
            raise ConfigError(
                f"the KV pool holds {usable_tokens} tokens, fewer than max_model_len={self.config.max_model_len}: "
                f"raise kv_cache_memory / num_kv_blocks or lower max_model_len."
            )
        sched.max_num_batched_tokens = sched.max_num_batched_tokens or default_batched_tokens(self.device)
        sched.max_step_tokens = sched.max_step_tokens or default_step_tokens(self.device)
        self.scheduler = Scheduler(self.kv.allocator, block_size, sched.max_num_seqs, sched.max_num_batched_tokens,
                                   max_step_tokens=sched.max_step_tokens,
                                   min_prefill_tokens=max(1, (sched.max_step_tokens or 0) // 4))
        self.sampler = Sampler(self.model.logits_exact_dtype)
        self.requests: dict[str, Request] = {}
        self.sink = OutputSink(self.scheduler, self.requests, self.tokenizer, self.config.max_model_len)
        self._ids = itertools.count()
        self._grammars = None  # structured output's GrammarBackend, built on the first constrained request
        self._lock = threading.RLock()  # add/abort may come from another thread (the server)
        # CPU: decode and verify steps run compiled code (tercel/graphs/compiled.py), compiled on first use;
        # the executor's forward tries it before the eager model
        if config.kernel.cpu_compile and self.device.type == "cpu" and self.tp_group is None:
            from .graphs.compiled import CompiledSteps
            from .loader.cache import cache_root

            self.executor.compiled = CompiledSteps(self.model, self.kv, sched.max_num_seqs,
                                                   str(cache_root() / "inductor"))
        # Speculative decoding (tercel.speculative): None keeps the plain decode path.
        from .speculative import build_spec_worker
        from .speculative.adaptive import check_adaptive

        default_model = _is_default_model(loaded.path)
        auto = (config.speculative.algorithm or "").upper() == "AUTO"
        # the CPU's fused decoder layers (models.cpu_fused) decided now, not at the first forward: where they serve
        # the target, plain decoding measured faster than every speculative width (a verify row costs half a
        # plain step there), so AUTO leaves speculation off as it does on a GPU
        cpu_eager = self.device.type == "cpu" and self.tp_group is None and not config.kernel.cpu_compile
        if cpu_eager and getattr(self.model, "cpu_fused", None) is False:
            from .models.cpu_fused import CpuFusedLayers

            self.model.cpu_fused = CpuFusedLayers.build(self.model)
        fused_cpu = cpu_eager and getattr(self.model, "cpu_fused", None) not in (None, False)
        sp = config.speculative = config.speculative.resolve_auto(default_model,
                                                                  self.device.type == "cpu" and not fused_cpu)
        if auto:  # say what AUTO chose: a server's log is where a user looks for it
            log.info("speculative decoding (AUTO): %s", "EAGLE3 with the bundled head" if sp.algorithm else
                     "off (plain decoding on the CPU's fused layers measured faster than speculating; name "
                     "--speculative-algorithm to speculate anyway)" if fused_cpu else
                     "off (AUTO speculates with the bundled head on the default model on the CPU; name "
                     "--speculative-algorithm and a draft to speculate here)")
        self.spec = build_spec_worker(
            self, sp.algorithm, sp.draft_model_path, sp.num_steps, sp.eagle_topk, sp.num_draft_tokens,
            default_model=default_model, ddtree_budget=sp.ddtree_budget, token_map=sp.token_map,
            adaptive=check_adaptive(sp.adaptive))
        if config.cache.enable_prefix_caching:  # after the drafter: its KV decides when a block is final
            drafter = self.spec.drafter if self.spec is not None else None
            self.scheduler.prefix_cache = PrefixCache(
                self.kv.allocator, block_size, lookahead=drafter.kv_lookahead if drafter is not None else 0,
                draft_kv=drafter is not None and drafter.has_kv)
        # GPU fast path (tercel.graphs): decode steps replay CUDA graphs captured now (the executor's runners)
        self.gemv_choices = None
        if self.device.type == "cuda":
            self._download_stream = torch.cuda.Stream(self.device)
            # batch-1 linears: cuBLAS or the Triton GEMV, whichever this GPU runs faster (measured once per model)
            self.gemv_choices = getattr(self.model, "gemv_choices", None)
            # (not under tensor parallelism: its forward runs the plain linears on every rank alike)
            if (config.kernel.tune_gemv and self.gemv_choices is None and self.tp_group is None
                    and self.dtype in (torch.bfloat16, torch.float16)):
                from .kernels import triton_enabled

                if triton_enabled():
                    from .models.gemv_tuning import tune_model

                    try:
                        self.gemv_choices = self.model.gemv_choices = tune_model(self.model)
                    except Exception as e:  # never fatal: tune_model sets nothing unless it finishes
                        log.warning("batch-1 GEMV tuning failed (%s); using cuBLAS for every linear", e)
                    self._tune_draft()
        # CPU tests drive the same runners with the breakable-debug backend (forwards re-run on static buffers)
        g = config.graph
        if self.tp_group is not None:
            if not g.disable_cuda_graph and self.device.type == "cuda":
                # a graph would capture the all-reduces, and every rank would have to capture and replay
                # it in step with rank 0: not built yet
                log.warning("tensor parallelism runs eagerly: no CUDA graphs are captured with tp_size > 1 (yet)")
        elif not g.disable_cuda_graph and (self.device.type == "cuda" or g.cuda_graph_backend == "breakable-debug"):
            self._init_graphs(g.cuda_graph_max_bs, g.cuda_graph_bs, g.cuda_graph_backend, sched.max_num_seqs)

    def _tune_draft(self) -> None:
        """An EAGLE chain's draft steps run one row at batch 1: its linears get the Triton GEMV where it measures
        faster, as the target's decode does (before the graphs are captured)."""
        draft = self.spec.drafter.one_row_model() if self.spec is not None else None
        if draft is None:
            return
        from .models.gemv_tuning import tune_draft

        try:
            tune_draft(draft)
        except Exception as e:  # never fatal: tune_draft sets nothing unless it finishes
            log.warning("draft GEMV tuning failed (%s); the draft keeps cuBLAS", e)

    def _init_graphs(self, max_bs: int | None, batch_sizes: list[int] | None, backend: str, max_num_seqs: int) -> None:
        from .graphs import GraphConfig
        from .graphs.steps import ModelStep

        graph_config = GraphConfig(max_bs=min(max_bs or 256, max_num_seqs),
                                   batch_sizes=tuple(batch_sizes) if batch_sizes else None, backend=backend)
        extra = self.spec.extra_slots if self.spec else 0
        max_blocks = -(-(self.config.max_model_len + extra) // self.kv.block_size) + 1
        runner = self.executor.register(DECODE, ModelStep(self.model, self.kv, max_blocks), graph_config)
        if self.device.type == "cuda" and backend == "full":  # sampled rows of decode windows: captured too
            from .graphs.sampler import SamplerGraphs

            self.executor.sampler = SamplerGraphs(self.model_config.vocab_size, self.device,
                                                  stream=self.executor.capture_stream,
                                                  exact=self.model.logits_exact_dtype)
        log.info("captured %d decode graphs (batch sizes %s) in %.1f s", len(runner.graphs), runner.buckets,
                 runner.stats.capture_seconds)
        if self.spec is not None:
            # speculative steps hold logits for every verified token: their buckets stop lower
            spec_max = min(graph_config.max_bs, SPEC_GRAPH_MAX_BS)
            sizes = tuple(b for b in graph_config.buckets() if b <= spec_max) or (spec_max,)
            spec_config = GraphConfig(max_bs=spec_max, backend=backend, batch_sizes=sizes)
            start = time.perf_counter()
            self.spec.init_graphs(spec_config, max_blocks, plain_config=graph_config)
            log.info("captured speculative graphs (batch sizes up to %d; plain steps up to %d) in %.1f s", spec_max,
                     graph_config.max_bs, time.perf_counter() - start)

    def upload(self, lists: list[list[int]]) -> list[torch.Tensor]:
        """Small integer lists to the device as int64 tensors: one pinned copy on a GPU (the executor's)."""
        return self.executor.upload(lists)

    @property
    def model(self) -> torch.nn.Module | None:
        """The target model (the executor's; None once shut down)."""
        ex = getattr(self, "executor", None)
        return None if ex is None else ex.model

    @property
    def kv(self) -> PagedKVCache | None:
        """The target's paged KV pool (the executor's; None once shut down)."""
        ex = getattr(self, "executor", None)
        return None if ex is None else ex.kv

    @property
    def compiled(self) -> CompiledSteps | None:
        """The compiled CPU steps (--cpu-compile; the executor's), else None."""
        ex = getattr(self, "executor", None)
        return None if ex is None else ex.compiled

    @property
    def graph_runner(self) -> CudaGraphRunner | None:
        """The decode graph runner (the executor's), None when decode runs eagerly."""
        ex = getattr(self, "executor", None)
        return None if ex is None else ex.runner(DECODE)

    @graph_runner.setter
    def graph_runner(self, runner: CudaGraphRunner | None) -> None:
        self.executor.use(DECODE, runner)

    # ---- tensor parallelism (tercel.distributed, docs/parallel.md) ------------------------------
    def _start_tensor_parallel(self, config: EngineConfig, loaded: LoadedModel | None,
                               tokenizer: Tokenizer | None) -> LoadedModel:
        """Check the split (before any weight loads), start the other ranks, load rank 0's shard. Every
        target forward rank 0 runs is then sent to the followers first (the model's tp.mirror)."""
        from functools import partial

        from .distributed import launch
        from .distributed.comm import send_forward
        from .distributed.follower import load_rank
        from .distributed.shard import check_splittable
        from .loader.model_loader import read_checkpoint

        if loaded is not None:
            raise ConfigError("tp_size > 1 loads each rank's shard itself: pass a model path, not loaded=.")
        info = launch.torchrun_rank()
        check_splittable(read_checkpoint(config.model.model).config, config.parallel.tp_size, self.device,
                         ranks_here=None if info is None else info.local_size)
        group = self.tp_group = launch.start(config, self.device)
        self._tp_finalizer = weakref.finalize(self, launch.shutdown, group)
        self.device = group.device
        try:
            loaded = load_rank(config, group, tokenizer_too=True, tokenizer=tokenizer)
        except BaseException:
            self.close()
            raise
        loaded.model.tp.mirror = partial(send_forward, group)
        return loaded

    @property
    def draft_target(self):
        """What a draft reads of the target (embed_tokens, lm_head_weight, compute_logits): the target
        itself, or under tensor parallelism rank 0's whole copies (drafts run on rank 0, replicated)."""
        if self.tp_group is None:
            return self.model
        if self._draft_target is None:
            from .distributed.layers import ReplicatedHead

            self._draft_target = ReplicatedHead.load(self.config.model.model, self.model_config, self.dtype,
                                                     self.device)
        return self._draft_target

    def shutdown(self) -> None:
        """Give back everything the engine holds: requests, the speculative worker (draft model, its graphs
        and buffers), the CUDA graphs, the pinned staging buffers, the KV pool and the model's weights (the
        engine's reference: weights passed in as `loaded=` stay with their owner), and stop the
        tensor-parallel ranks. On a GPU the freed blocks go back to the driver (empty_cache), so another
        engine in this process finds the memory free. Idempotent; the engine takes no requests afterwards.
        Deleting the engine (or its LLM) frees the same without a call: nothing outside it refers back to it."""
        if getattr(self, "_closed", False):
            return
        # also called from a failed __init__ (tensor-parallel start), with only part of the engine built
        with getattr(self, "_lock", None) or contextlib.nullcontext():
            self._closed = True
            inflight = getattr(self, "_inflight", None)
            if inflight is not None and inflight.ready is not None:
                inflight.ready.synchronize()  # the last window's kernels finish before their buffers go
            if getattr(self, "tp_group", None) is not None:
                self._tp_finalizer()
            for name in ("_inflight", "spec", "executor", "_download_stream", "_draft_target", "scheduler", "sink",
                         "sampler", "loaded", "gemv_choices"):
                setattr(self, name, None)
            self.requests = {}  # (the sink, gone above, held the old dict)
        device = getattr(self, "device", None)
        if device is not None and device.type == "cuda":
            import gc

            gc.collect()  # tensors held in reference cycles elsewhere (a caller's outputs do not hold any)
            torch.cuda.synchronize(device)
            release_if_last(self)
            torch.cuda.empty_cache()

    def close(self) -> None:
        """shutdown() under vLLM-style and file-like names alike."""
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was shut down (shutdown() / close() / the end of a `with` block); "
                               "create a new LLM or LLMEngine.")

    def _dtype_choice(self, m: ModelLoadConfig, loaded: LoadedModel | None, ckpt: Checkpoint | None) -> DtypeChoice:
        """m.dtype resolved; "auto" on the CPU reads the checkpoint's header (ckpt, not its weights) to see
        which path pays. A model loaded elsewhere keeps its dtype under "auto" (the engine shares its weights)."""
        if m.dtype == "auto" and loaded is not None:
            dtype = next((p.dtype for p in loaded.model.parameters() if p.is_floating_point()), None)
            if dtype is not None:
                return DtypeChoice(dtype)
        return resolve_dtype(m.dtype, self.device, ckpt, dequantize_gguf=m.dequantize_gguf)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        self._check_open()
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this engine has no tokenizer; pass token ids instead of text.")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                       for t in prompt):
            text, ids = None, [int(t) for t in prompt]
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}.")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token.")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len={self.config.max_model_len} leaves no room to "
                f"generate: shorten the prompt or raise max_model_len."
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self.rng))
        req = Request(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
            generator=torch.Generator().manual_seed(seed),
            metrics=RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(ids)),
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids, seed=seed,
        )
        if params.logprobs is not None:
            req.logprobs = []
        if params.structured_outputs is not None:
            req.grammar = self.grammar_backend().state(params.structured_outputs)
        with self._lock:
            if request_id in self.requests:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            self.requests[request_id] = req
            self.scheduler.add(req)
        return request_id

    def grammar_backend(self):
        """Structured output's compiler for this tokenizer (tercel.structured), built on first use."""
        if self._grammars is not None:
            return self._grammars
        with self._lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ConfigError("structured output needs a tokenizer; this engine has none.")
                from .structured.backend import GrammarBackend

                self._grammars = GrammarBackend(self.tokenizer.backend, self.model_config.vocab_size,
                                                sorted(self.eos_token_ids))
            return self._grammars

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. Returns False if it is unknown or already done."""
        with self._lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return False
            req.finish_reason = "abort"
            self.scheduler.finish(req)
            return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def spec_stats(self):
        """Engine-wide speculative decoding counters (tercel.speculative.worker.SpecStats), or None when off."""
        return None if self.spec is None else self.spec.stats

    def stats(self) -> EngineStats:
        a = self.kv.allocator
        pc = self.scheduler.prefix_cache
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), a.num_usable, a.num_free,
                           a.num_cached_free, pc.stats.queried_tokens if pc else 0, pc.stats.hit_tokens if pc else 0)

    # ---- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self._check_open()
        with self._lock:
            if self.spec is not None:
                self.spec.step_began()
            if self._inflight is not None:
                outputs = self._advance_inflight()
                if outputs or self._inflight is not None:
                    return outputs
                # nothing to report and nothing in flight (that window's requests stopped or were aborted, or
                # they want FINAL_ONLY outputs and the batch changed): schedule afresh now
            if self.spec is not None and self.spec.inflight:  # a chained speculative step (speculative/chain_loop.py)
                outputs = self.spec.advance()
                if outputs or self.spec.inflight:
                    return outputs
            num_steps = self._window_steps()
            if num_steps >= 1:
                window = self.scheduler.schedule_decode_window(num_steps)
                if window is not None:
                    return self._multi_step(window, num_steps)
            if self.spec is not None:  # the next window's gap to the last one holds this step's work
                self.spec.windows_interrupted()
            sched = self.scheduler.schedule(self.spec.extra_slots if self.spec is not None else 0)
            if not sched.scheduled:
                return []
            if self.spec is not None:
                return self.spec.step(sched.scheduled)
            batch, sampled = step_batch(sched.scheduled, self.kv.block_size, self.upload)
            out = self.run_model(batch)
            for s in sched.scheduled:
                s.request.num_computed_tokens += s.num_tokens
            reqs = [s.request for s in sampled]
            tokens, logprobs = self.sampler.sample(out.logits, reqs)
            return self.sink.postprocess(reqs, tokens, logprobs)

    # ---- multi-step decode -----------------------------------------------------------------
    def _window_steps(self, ahead: int = 0) -> int:
        """Forwards the next decode window may run without a host sync; 0: no window (a normal step runs).
        A window of one forward only under the overlap schedule. ahead: tokens of an in-flight window not
        appended yet. Never past a request's max_tokens or max_model_len, so every reserved KV slot of a
        live request is used."""
        n = self.num_scheduler_steps
        if n == 1 and not self.overlap_schedule:
            return 0
        if self.spec is not None:  # adaptive speculation may grant a stretch of plain steps
            n = min(n, self.spec.plain_window(self.scheduler.running))
            if n < 1:
                return 0
        # A request's next tokens can be chosen on the device, with no host data per step, unless it has
        # penalties (they count the tokens just sampled), logprobs (computed per step on the host), min_tokens
        # still to reach (stop ids masked by count) or a grammar (its mask follows each token on the host).
        # Sampling is fine: draw k's noise is a hash of (seed, k), the same whichever step kind makes the draw.
        # (Per request per step: Request.num_tokens inlined.)
        room = self.config.max_model_len - ahead
        for r in self.scheduler.running:
            p, done = r.params, len(r.output_token_ids)
            if done < p.min_tokens or p.logprobs is not None or r.grammar is not None or p.has_penalties:
                return 0
            n = min(n, p.max_tokens - done - ahead, room - len(r.prompt_token_ids) - done)
        return n if n > 1 or (n == 1 and self.overlap_schedule) else 0

    def _build_window(self, reqs: list[Request], num_steps: int, ahead: int = 0,
                      first_ids: torch.Tensor | None = None) -> DecodeWindow:
        """ahead, first_ids: the window after an in-flight one, whose last tokens (on the device) are the
        input of forward 0 and whose `ahead` positions are not counted in num_computed_tokens yet."""
        if num_steps == 1:  # the overlap schedule's windows
            rows = decode_rows(reqs, ahead, self.kv.block_size, self._window_tables, self.kv.table_cuts)
            positions, slots, seq_lens = rows.positions, rows.slots, rows.seq_lens
        else:  # the rows come request by request; the window reads them step by step
            rows = build_batch([RowSpan(r, r.num_computed_tokens + ahead, num_steps) for r in reqs],
                               self.kv.block_size)
            positions, slots = _step_major(rows.positions, num_steps), _step_major(rows.slots, num_steps)
            seq_lens = [p + 1 for p in positions]
        width = rows.cols
        lists = [positions, slots, seq_lens, rows.tables, list(range(len(reqs)))]
        sampled = any(not r.params.greedy for r in reqs)
        if sampled:  # draw r.draws + step of each stream, taken now (greedy rows draw too, unused)
            lists += [[r.seed for r in reqs], [r.draws + step for step in range(num_steps) for r in reqs]]
            for r in reqs:
                r.draws += num_steps
        if first_ids is None:
            lists.append([(r.output_token_ids or r.prompt_token_ids)[-1] for r in reqs])
        t = self.upload(lists)  # GPU: the whole window's inputs in one pinned upload
        b = len(reqs)
        seeds = draws = None
        if sampled:
            seeds, draws = t[5], t[6].view(num_steps, b)
            t = t[:5] + t[7:]
        return DecodeWindow(first_ids=t[5] if first_ids is None else first_ids,
                            positions=t[0].view(num_steps, b), out_cache_loc=t[1].view(num_steps, b),
                            seq_lens=t[2].view(num_steps, b), block_tables=t[3].view(b, width), logits_indices=t[4],
                            seq_lens_cpu=[seq_lens[i * b:(i + 1) * b] for i in range(num_steps)], seeds=seeds,
                            draws=draws)

    def _multi_step(self, scheduled: list[ScheduledRequest], num_steps: int) -> list[RequestOutput]:
        """A decode window: launched, then (overlap schedule) left in flight, or read back now."""
        window = self._launch_window([s.request for s in scheduled], num_steps)
        if self.overlap_schedule:
            self._inflight = window
            return []
        return self._collect_window(window)

    def _advance_inflight(self) -> list[RequestOutput]:
        """Overlap schedule: launch the window after the in-flight one (when the batch stays the same pure
        decode batch and the KV pool covers it), then read the in-flight tokens back and append them."""
        w, self._inflight = self._inflight, None
        nxt = None
        if self.scheduler.running == w.reqs:
            n = self._window_steps(ahead=w.num_steps)
            if n >= 1 and self.scheduler.schedule_decode_window(n, ahead=w.num_steps) is not None:
                nxt = self._launch_window(w.reqs, n, ahead=w.num_steps, first_ids=w.tokens[-1])
        outputs = self._collect_window(w)
        self._inflight = nxt
        return outputs

    def _launch_window(self, reqs: list[Request], num_steps: int, ahead: int = 0,
                       first_ids: torch.Tensor | None = None) -> InflightWindow:
        """num_steps decode forwards, each replaying the decode graph, each fed the tokens the previous one
        chose on the device (argmax; sampled requests: Sampler's exponential race, batched). Nothing here
        waits for the GPU; the tokens start on their way to the host behind an event."""
        window = self._build_window(reqs, num_steps, ahead, first_ids)
        st = mixed = None
        if window.seeds is not None:  # per-row settings on the device once per batch (greedy rows: T = 1)
            st = self._window_settings(reqs)
            if any(r.params.greedy for r in reqs):
                mixed = torch.tensor([not r.params.greedy for r in reqs], dtype=torch.long,
                                     pin_memory=self.device.type == "cuda")
                mixed = mixed.to(self.device, non_blocking=True)
        spec_plain = self.spec is not None
        keeps_hidden = False  # the drafter reads the target's hidden rows (EAGLE, DFlash): its own one-token step
        if spec_plain:
            self.spec.window_launched(reqs, num_steps)
            keeps_hidden = self.spec.plain_kind() != DECODE
        drawn = None  # sampled rows, with graphs: the kind that runs the forward and the draw in one replay
        if st is not None:
            base = self.spec.plain_kind() if spec_plain else DECODE
            drawn = self.executor.sampled(base, st.any_top_k or st.any_top_p, mixed is not None)
        if drawn is not None:
            from .graphs.sampled_decode import SampledDecodeBatch
            from .speculative.chain import ChainSampling
        ids = window.first_ids
        step_tokens: list[torch.Tensor] = []
        hidden: list[torch.Tensor] = []
        for step in range(num_steps):
            if drawn is not None:
                batch = window.batch(step, ids)
                if spec_plain:
                    self.spec.prepare_plain(batch)
                sp = ChainSampling(window.seeds, window.draws[step], mixed if mixed is not None else window.seeds,
                                   st.temperature, st.top_k, st.top_p, st.min_p)
                res = self.run_model(SampledDecodeBatch(batch, sp), drawn)
                ids = res.tokens.clone()  # copies: the next replay overwrites the graph's outputs
                step_tokens.append(ids)
                if spec_plain and res.hidden_states is not None:
                    hidden.append(res.hidden_states.clone())
                continue
            if keeps_hidden:  # the drafter's hidden rows too, kept for its deferred draft_extend
                out = self.spec.plain_forward(window.batch(step, ids))
                if out.hidden_states is not None:
                    hidden.append(out.hidden_states.clone())  # the next replay overwrites the graph's output
            else:
                out = self.run_model(window.batch(step, ids))
            # choose before the next replay overwrites the graph's logits; the same rules as Sampler.sample,
            # on the device with no host sync (greedy argmax; sampled rows: the race with this step's keys)
            if st is None:
                ids = greedy_tokens(out.logits)
            else:
                if self.executor.sampler is not None:
                    ids = self.executor.sampler.sample(out.logits, st, window.seeds, window.draws[step])
                else:
                    ids = sample_rows(out.logits, st, stream_keys(window.seeds, window.draws[step]),
                                      exact=self.model.logits_exact_dtype)
                if mixed is not None:  # greedy rows of a mixed batch: the argmax (their draw is unused)
                    ids = torch.where(mixed.bool(), ids, greedy_tokens(out.logits))
            step_tokens.append(ids)
        tokens = torch.stack(step_tokens)
        stacked = None if not hidden else hidden[0][None] if len(hidden) == 1 else torch.stack(hidden)
        if tokens.is_cuda:  # a sync-free copy: .tolist() here would also wait for any window launched after
            # on its own stream, so the next window's kernels need not queue behind the copy's latency
            down = self._download_stream
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            down.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(down):
                host.copy_(tokens, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            tokens.record_stream(down)
            return InflightWindow(reqs, num_steps, tokens, host, ready, spec_plain, stacked)
        return InflightWindow(reqs, num_steps, tokens, tokens, None, spec_plain, stacked)

    def _window_settings(self, reqs: list[Request]) -> SamplingTensors:
        """The sampled rows' settings on the device, uploaded once while the same requests decode on (the
        overlap schedule's windows of one step would otherwise upload them every token)."""
        key = tuple(r.request_id for r in reqs)
        if self._window_st is None or self._window_st[0] != key:
            st = SamplingTensors.of([r.params if not r.params.greedy else _GREEDY_STANDIN for r in reqs],
                                    self.model_config.vocab_size, self.device)
            self._window_st = (key, st)
        return self._window_st[1]

    def _collect_window(self, w: InflightWindow) -> list[RequestOutput]:
        """Wait for a window's tokens and append them with the usual stop checks. A request aborted while
        its window was in flight is skipped; one that stops inside it discards the rest of its tokens."""
        if w.ready is not None:
            w.ready.synchronize()
        tokens = w.host_tokens.tolist()  # the window's one device -> host sync
        outputs = []
        now = time.perf_counter()
        only = tokens[0] if w.num_steps == 1 else None  # the overlap schedule's windows: one token each
        for i, r in enumerate(w.reqs):
            if r.finish_reason is not None:  # aborted, or stopped inside the previous window
                continue
            r.num_computed_tokens += w.num_steps
            # one that stops inside the window discards the rest of its tokens; its blocks are freed
            if only is not None:
                self.sink.append_token(r, only[i], None, now)
            else:
                self.sink.append_tokens(r, [row[i] for row in tokens[:w.num_steps]], now=now)
            self.sink.emit(outputs, r)
        if w.spec_plain:
            self.spec.after_plain_window(w.reqs, w.hidden, w.num_steps, now)
        return outputs

    def run_model(self, batch: "ForwardBatch | SampledDecodeBatch", kind: StepKey = DECODE) -> \
            "ModelOutput | SampledDecodeOutput":
        """The target forward: a decode-graph replay when the executor's runner can serve the batch, else the
        executor's forward (the compiled CPU step when on, else eager). kind: a sampled decode variant (its
        batch carries the rows' sampling state; the output their tokens)."""
        return self.executor.run(kind, batch)

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """The target forward without a CUDA graph: the compiled CPU step when it serves the batch, else eager."""
        return self.executor.forward(batch)
