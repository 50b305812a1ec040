"""Optional GPU kernels (Triton). Importing this package never fails: without triton (or CUDA)
`TRITON_AVAILABLE` is False and callers keep their PyTorch path.

`use_triton(t, *params)` is the one switch the model and attention code consult; TERCEL_DISABLE_TRITON=1
turns every kernel off (debugging: compare against the PyTorch path on the same GPU).
Developer switches for side-by-side measurements (benchmarks/decode_variants.py), documented and read in
tercel.dev_overrides:
  TERCEL_FUSED_DECODE=0   batch-1 decode and small-M forwards (verify, drafts, small batches) on the unfused
                          kernels (norms, SwiGLU, residual adds, RoPE + store as their own launches)
  TERCEL_DECODE_ATTN      decode attention: rope (default: RoPE + K/V store in the split kernel, merge
                          kernel after), one (the merge in the same launch, by the last split), split (the
                          separate rope_store kernel before)
  TERCEL_VERIFY_ATTN      verify rows (causal blocks as decode rows): split (default: rope_store, then the
                          split kernel), rope (RoPE + K/V store in the split kernel, no rope_store launch; not
                          yet measured on a GPU, so opt-in)
  TERCEL_L2_PREFETCH=1    decode attention pulls the o_proj weight into L2 while it runs (measured slower
                          on the H200: off by default)
  TERCEL_DECODE_MAX_SPLITS  most split-KV programs per (request, KV head) in decode attention (default 16)
  TERCEL_SMALL_M=1        tune and use the fused small-M GEMMs for 2..32-row forwards (off by default);
                          rowgrid: no tuning pass, each role's batch-1 GEMV once per row
  TERCEL_SMALL_M_BUCKETS  the row buckets it tunes or fills (e.g. 8; default 2,4,8,16,32)
  TERCEL_FOLD_NORMS       the unfused forwards' RMSNorm weights folded into copies of qkv / gate_up (auto: while
                          the copies take <= 1 GiB; 1; 0)
  TERCEL_PDL              programmatic dependent launch for the decode GEMVs and attention: late (default: the
                          next kernel may launch once every program has finished its main loop), early (alias 1:
                          once every program has passed its wait; measured slower on the H200), 0 (off),
                          late_norm (late, and the RMSNorm kernel takes part too: not yet measured), late_all
                          (late_norm, and the split / merge attention, RoPE + store and SwiGLU kernels too)
"""
from __future__ import annotations

import functools
import os

import torch

from ..dev_overrides import env

try:  # triton is present on GPU machines, usually absent on CPU-only ones
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except Exception:  # pragma: no cover - depends on the machine
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU development: kernels run in the interpreter


def triton_enabled() -> bool:
    return TRITON_AVAILABLE and env("TERCEL_DISABLE_TRITON") != "1"


def use_triton(t: torch.Tensor, *params: torch.Tensor) -> bool:
    """True when a kernel should run on this tensor: on CUDA, or anywhere under TRITON_INTERPRET=1.
    Never while autograd records through t or params (draft training): the kernels have no backward,
    and running them would silently cut the gradient."""
    # device test first: on CPU it answers without reading the environment (called per layer per op)
    if not (t.is_cuda or _INTERPRET):
        return False
    if torch.is_grad_enabled() and (t.requires_grad or any(p.requires_grad for p in params)):
        return False
    return triton_enabled()


def fused_decode_enabled() -> bool:
    """Decode and small-M forwards (up to SMALL_M_ROWS rows) fold RMSNorm, SwiGLU and the residual adds
    into the GEMVs (models/llama.py)."""
    return env("TERCEL_FUSED_DECODE") != "0"


SMALL_M_MODES = ("0", "1", "rowgrid")


def small_m_mode() -> str:
    """TERCEL_SMALL_M: 0 (forwards of 2..SMALL_M_ROWS rows on cuBLAS and the unfused kernels), 1 (tune the fused
    small-M GEMMs per row bucket at load and use the kept ones), rowgrid (no tuning pass: every role runs its
    tuned batch-1 GEMV once per row, kernels.gemm_small's rowgrid)."""
    mode = env("TERCEL_SMALL_M")
    if mode not in SMALL_M_MODES:
        raise ValueError(f"TERCEL_SMALL_M={mode!r}: use one of {', '.join(SMALL_M_MODES)}.")
    return mode


def small_m_enabled() -> bool:
    """Forwards of 2..SMALL_M_ROWS rows (verify, small batches) on the fused small-M kernels (TERCEL_SMALL_M 1 or
    rowgrid). Off by default: benchmarks/results/verify_probe_h200.json measured the tuned choices slower per
    verify step than the unfused kernels on the H200."""
    return small_m_mode() != "0"


TOPK_ROWS_MAX_K = 16  # the widest top-k of kernels.topk_rows (wider: torch.topk)
FOLD_NORMS_MODES = ("auto", "0", "1")
FOLD_NORMS_AUTO_BYTES = 1 << 30  # auto folds while the weight copies take at most this much (models to ~1B)


def fold_norms_mode() -> str:
    """TERCEL_FOLD_NORMS: auto, 1 or 0 (dev_overrides); LlamaForCausalLM.fold_norms and its forwards read it."""
    mode = env("TERCEL_FOLD_NORMS")
    if mode not in FOLD_NORMS_MODES:
        raise ValueError(f"TERCEL_FOLD_NORMS={mode!r}: use one of {', '.join(FOLD_NORMS_MODES)}.")
    return mode


SMALL_M_ROWS = 32  # the most rows of a fused small-M forward (kernels.gemm_small): 16 drafts x 2 requests
ROW_BUCKETS = tuple(1 << i for i in range(1, SMALL_M_ROWS.bit_length()))  # 2, 4, .., 32: gemm_small's BLOCK_M


def small_m_buckets() -> tuple[int, ...]:
    """The row buckets the small-M tuner measures (TERCEL_SMALL_M_BUCKETS, e.g. "8" for a bs-1 chain of 6 rows;
    default every bucket 2..SMALL_M_ROWS): a measurement that needs one bucket skips the others' tuning time."""
    every = ROW_BUCKETS
    value = env("TERCEL_SMALL_M_BUCKETS")
    if not value:
        return every
    try:
        wanted = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        wanted = ()
    if not wanted or any(b not in every for b in wanted):
        raise ValueError(f"TERCEL_SMALL_M_BUCKETS={value!r}: a comma list of row buckets among "
                         f"{', '.join(map(str, every))}.")
    return wanted


def row_bucket(m: int) -> int:
    """The padded row count that serves m rows (1 < m <= SMALL_M_ROWS): one compiled kernel and one tuned
    config per bucket, so the choice depends on the shape only."""
    if not 1 < m <= SMALL_M_ROWS:
        raise ValueError(f"small-M GEMM: {m} rows; it serves 2..{SMALL_M_ROWS}.")
    return 1 << (m - 1).bit_length()


DECODE_ATTN_MODES = ("rope", "one", "split")


def decode_attention_mode() -> str:
    mode = env("TERCEL_DECODE_ATTN")
    if mode not in DECODE_ATTN_MODES:
        raise ValueError(f"TERCEL_DECODE_ATTN={mode!r}: use one of {', '.join(DECODE_ATTN_MODES)}.")
    return mode


VERIFY_ATTN_MODES = ("split", "rope")


def verify_attention_mode() -> str:
    """How a causal verify block's rows attend: split (rope_store, then the split-KV kernel) or rope (one launch:
    each row stores its own K/V, the block's earlier keys read from qk / v; TERCEL_DECODE_ATTN's merge choice)."""
    mode = env("TERCEL_VERIFY_ATTN")
    if mode not in VERIFY_ATTN_MODES:
        raise ValueError(f"TERCEL_VERIFY_ATTN={mode!r}: use one of {', '.join(VERIFY_ATTN_MODES)}.")
    return mode


def l2_prefetch_enabled() -> bool:
    return env("TERCEL_L2_PREFETCH") == "1"


def decode_max_splits() -> int:
    return max(1, int(env("TERCEL_DECODE_MAX_SPLITS")))


@functools.lru_cache(maxsize=None)
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9  # griddepcontrol: Hopper and later


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


PDL_LATE_NORM = 3
PDL_LATE_ALL = 4
PDL_MODES = {"0": 0, "early": 1, "1": 1, "late": 2, "late_norm": PDL_LATE_NORM, "late_all": PDL_LATE_ALL}


def pdl_small(t: torch.Tensor, norm: bool = False) -> bool:
    """Whether a small kernel (no weights to stream before its wait) launches with PDL: its launch gap then
    overlaps the previous kernel's tail. The RMSNorm from late_norm on, the others with late_all."""
    mode = pdl_mode(t)
    return mode == PDL_LATE_ALL or (norm and mode == PDL_LATE_NORM)


def pdl_mode(t: torch.Tensor) -> int:
    """Programmatic dependent launch of the decode kernels: a kernel's blocks start while the previous
    kernel drains and stream their weights, then wait (griddepcontrol.wait) before touching its output.
    0: off; 1 (early): a kernel lets the next one launch right after its own wait; 2 (late): only after its
    main loop, so the next kernel's blocks take the SMs as this one's leave (early ones sit on slots, and
    land unevenly); 3 (late_norm): late, and the RMSNorm kernel (kernels.fused) launches so too, between
    the o_proj and gate_up GEMVs that the tuner leaves unfused; 4 (late_all): late_norm, and the split-KV attention,
    merge, RoPE + store and SwiGLU kernels launch so too (the unfused verify layers' launches).
    Not under the interpreter, nor before Hopper."""
    if _INTERPRET or not t.is_cuda:
        return 0
    mode = env("TERCEL_PDL")  # late: 4.09 against 4.14 ms per 8B step off (8e60d47)
    if mode not in PDL_MODES:
        raise ValueError(f"TERCEL_PDL={mode!r}: use one of 0, early, late, late_norm, late_all.")
    level = PDL_MODES[mode]
    return level if level and _has_pdl(_device_index(t)) else 0
