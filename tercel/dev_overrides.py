"""Every `TERCEL_*` environment variable Tercel reads, in one table, and the one function that reads them.

The engine's behaviour is configured by the settings tree (tercel.config: keyword arguments and the
command lines' flags). The variables below are not settings: they are developer switches for
side-by-side measurements and debugging of the GPU kernels, machine plumbing (a commit hash, a results
directory) and a secret that should not sit on a command line. A name missing from OVERRIDES cannot be
read (`env` raises), and tests/test_layering.py checks that no other module reads a `TERCEL_*` variable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EnvOverride:
    default: str | None  # the value when unset (None: no value)
    meaning: str
    kind: str = "developer"  # developer: measurement / debugging switch; environment: machine or secret


OVERRIDES: dict[str, EnvOverride] = {
    "TERCEL_DISABLE_TRITON": EnvOverride(
        "0", "1: every Triton kernel off, the PyTorch path everywhere (compare against it on the same GPU)"),
    "TERCEL_FUSED_DECODE": EnvOverride(
        "1", "0: batch-1 decode and small-M forwards (verify, drafts, small batches) on the unfused kernels "
             "(norms, SwiGLU, residual adds, RoPE + store as their own launches)"),
    "TERCEL_SMALL_M": EnvOverride(
        "0", "1: tune and use the fused small-M GEMMs for 2..32-row forwards (measured slower per verify step on "
             "the H200, so off); rowgrid: no tuning pass, each role runs its tuned batch-1 GEMV once per row (norm, "
             "SwiGLU and residual folded, PDL; not yet measured on a GPU); read again when a forward runs or is "
             "captured, so an engine built with 0 after the weights were set up with 1 or rowgrid keeps its verify "
             "unfused (side-by-side runs in one process)"),
    "TERCEL_FOLD_NORMS": EnvOverride(
        "auto", "the unfused GPU forwards (verify rows, small batches past one row, prefill) with each layer's "
                "two RMSNorm weights folded into copies of the qkv and gate_up weights (1/rms applied in the RoPE + "
                "store and SwiGLU kernels, the residual adds in the o / down GEMMs: 2 launches a layer fewer): auto "
                "(when the copies take at most 1 GiB), 1 (whatever they take), 0 (off; read again when a forward runs "
                "or is captured, so an engine built with 0 beside folded weights stays unfolded)"),
    "TERCEL_SMALL_M_BUCKETS": EnvOverride(
        "", "with TERCEL_SMALL_M=1 or rowgrid: the row buckets the small-M tuner measures or fills, a comma list of "
            "2, 4, 8, 16, 32 (default every one; a bs-1 chain of 6 rows needs 8): the others stay unfused"),
    "TERCEL_DRAFT_HEAD": EnvOverride(
        "native", "int8: an EAGLE draft's head product reads int8 rows with a per-row scale (kernels/gemv_q8.py; "
                  "half the bytes, SmolLM2's head then fits the GPU's L2; the target verifies, so only the "
                  "proposals can change); native: the head in the draft's dtype"),
    "TERCEL_DRAFT_FUSED_MLP": EnvOverride(
        "0", "1: the EAGLE-3 draft's MLP on the fused GEMVs where tune_draft measures them faster (norm, SwiGLU and "
             "the residual add folded: 3 launches a draft step for 5); not yet measured on a GPU, so off"),
    "TERCEL_DRAFT_PAGED_PREFIX": EnvOverride(
        "1", "0: the EAGLE tree draft loop and DFlash's block gather every prefix slot the block table can hold and "
             "run SDPA over them (the CPU's path), instead of the split-KV decode kernel over each request's own "
             "prefix merged with the dense keys (tercel/attention/paged_merge.py)"),
    "TERCEL_DECODE_ATTN": EnvOverride(
        "rope", "decode attention variant: rope (RoPE + K/V store in the split kernel, merge kernel after), one "
                "(the merge in the same launch, by the last split), split (a separate rope_store kernel before)"),
    "TERCEL_VERIFY_ATTN": EnvOverride(
        "split", "verify rows (a causal block of t queries per request as decode rows): split (rope_store, then the "
                 "split-KV kernel), rope (RoPE and the K/V store in the split kernel, the block's earlier keys read "
                 "from qk / v: one launch fewer per layer; opt-in until measured on a GPU)"),
    "TERCEL_L2_PREFETCH": EnvOverride(
        "0", "1: decode attention pulls the o_proj weight into L2 while it runs (measured slower on the H200)"),
    "TERCEL_DECODE_MAX_SPLITS": EnvOverride(
        "16", "most split-KV programs per (request, KV head) in decode attention"),
    "TERCEL_PDL": EnvOverride(
        "late", "programmatic dependent launch of the decode GEMVs and attention: late (the next kernel may "
                "launch once every program has finished its main loop), early or 1 (once every program has "
                "passed its wait), 0 (off), late_norm (late, and the RMSNorm kernel takes part too), late_all "
                "(late_norm, and the split / merge attention, RoPE + store and SwiGLU kernels too: the unfused "
                "verify layers' launches; not yet measured on a GPU)"),
    "TERCEL_SPEC_CHAIN": EnvOverride(
        "1", "0: greedy EAGLE chains run as separate draft / verify / extend graphs instead of one chained "
             "graph step (side-by-side measurements)"),
    "TERCEL_ADAPTIVE_BATCH_ALPHA": EnvOverride(
        "pooled", "adaptive speculation with no request queued: pooled (every request at the batch's lowest alpha once "
                  "each request's is shrunk toward the batch's pooled one by the share of their spread that noise "
                  "explains; a new batch's unverified requests at the floor its size showed), min (the lowest raw "
                  "alpha), mean (each at its own, as when requests queue); side-by-side runs of the rules"),
    "TERCEL_ADAPTIVE_PIN": EnvOverride(
        "", "plain: adaptive speculation runs every decode step plain (as the engine's decode windows, hidden rows "
            "kept for the deferred draft_extend, no probes): the plain stretches' own cost beside the plain engine"),
    "TERCEL_ADAPTIVE_PROBE_SHARE": EnvOverride(
        "0.03", "adaptive speculation: the largest share of a plain stretch that a probe (its step and the deferred "
                "draft_extend it forces) may cost, a number in (0, 1) (side-by-side runs of the probe spacing)"),
    "TERCEL_ADAPTIVE_PROBE_MAX": EnvOverride(
        "2048", "adaptive speculation: the most plain steps between probes at a batch size, an integer >= 1 "
               "(side-by-side runs of the probe spacing)"),
    "TERCEL_FLUSH_PAD": EnvOverride(
        "1", "0: an eager EAGLE draft_extend (a prefill's, adaptive speculation's deferred flush) runs at its exact "
             "rows and prefix instead of shapes rounded up to few buckets (speculative/eagle.py extend_shape), on a "
             "GPU; side-by-side runs of the flush's host time"),
    "TERCEL_ADAPTIVE_FRESH_PROBE": EnvOverride(
        "1", "0: adaptive speculation weighs a just-prefilled lone request at the prior like any other, instead of "
             "running its first decode at the full width (side-by-side runs)"),
    "TERCEL_CPU_FUSED": EnvOverride(
        "1", "0: CPU decode / verify steps run the eager layer loop instead of one C++ call per decoder layer "
             "(tercel/models/cpu_fused.py; by default a model on the Q4 x Q8 kernel takes them); fp32: an fp32 "
             "model takes them too, with exact fp32 matmuls (the check that the fused layer is the eager one)"),
    "TERCEL_CPU_Q8": EnvOverride(
        "1", "0: GGUF 4-bit linears on the CPU (bf16) keep torch's int4 kernel instead of the Q4 x Q8 integer "
             "kernel (models.cpu_q8; compiled at first use), for side-by-side measurements"),
    "TERCEL_TP_INIT_TIMEOUT": EnvOverride(
        "300", "seconds tensor-parallel ranks wait for each other in torch.distributed's store and "
               "process-group start (slow shared file systems)"),
    "TERCEL_API_KEY": EnvOverride(
        None, "the bearer key `tercel serve` requires and `tercel bench serve` sends when --api-key is not "
              "given (keeps the secret off the command line)", kind="environment"),
    "TERCEL_RESULTS_DIR": EnvOverride(
        None, "where `tercel bench` writes its JSON and PNGs when --out-dir is not given", kind="environment"),
    "TERCEL_CACHE_DIR": EnvOverride(
        None, "where the load cache lives (default $XDG_CACHE_HOME/tercel or ~/.cache/tercel; --no-load-cache "
              "turns it off)", kind="environment"),
    "TERCEL_COMMIT": EnvOverride(
        None, "the commit `tercel bench` records in its results when the checkout has no .git (a copied tree)",
        kind="environment"),
}


def env(name: str) -> str | None:
    """The variable's value, else its default. Read at each call, so a test or benchmark may set it late."""
    entry = OVERRIDES.get(name)
    if entry is None:
        raise KeyError(f"{name} is not a documented Tercel environment variable; add it to "
                       f"tercel.dev_overrides.OVERRIDES with its meaning, or make it a setting (tercel.config).")
    return os.environ.get(name, entry.default)


def cache_dir() -> Path:
    """Tercel's cache folder: $TERCEL_CACHE_DIR, else $XDG_CACHE_HOME/tercel, else ~/.cache/tercel (the load
    cache and the CPU kernels built at first use live there)."""
    where = env("TERCEL_CACHE_DIR")
    if where:
        return Path(where).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "tercel"
