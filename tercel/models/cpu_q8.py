"""GGUF 4-bit weights against int8-quantised activations on the CPU: a hand-written Q4 x Q8 kernel.

torch's int4 CPU matmul (PackedInt4) dequantises every weight block to bf16/fp32 and multiplies in floating
point, compute-bound at batch 1. llama.cpp instead quantises the activations per block of 32 to int8 (one
fp32 scale, and the block's sum for the Q4_1 min term) and runs integer dot products (AVX2 maddubs/madd, or
VNNI dpbusd). PackedQ4Q8 does the same through cpu_q8_kernel.cpp, built with the host compiler at first use
(-O3 -march=native) and kept under the load cache's folder, so a later start only loads it.

Quantising the activations changes results slightly (as in llama.cpp), so only bf16 (dtype "auto" on the
CPU) takes this path; fp32 stays exact. Each output row depends on its own input row only, so the result
of a row does not depend on how many rows share the call (decode and verify agree).
TERCEL_CPU_Q8=0 keeps torch's int4 kernel (side-by-side measurements).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..dev_overrides import cache_dir, env
from .cpu_linear import Q4_GROUP, CpuPackedLinear, Q4Blocks, Q8Blocks, cpu_flags

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_q8_kernel.cpp")
# built into the same library beside _SOURCE: the shared core and the fused decoder layer (models.cpu_fused)
_COMPANIONS = ("cpu_q8_kernel.h", "cpu_layer_kernel.cpp")
# -fopenmp: at::parallel_for is a header template, serial unless the extension itself is built with OpenMP (it
# then shares torch's libgomp, so --threads holds)
_CFLAGS = ("-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
_NEEDED_FLAGS = frozenset({"avx2", "fma", "f16c"})  # the kernel's instructions (VNNI only where -march=native has it)


class Q8KernelUnavailable(RuntimeError):
    """The Q4 x Q8 kernel cannot run here (CPU, compiler, build); callers keep torch's int4 kernel."""


@dataclass(frozen=True, slots=True)
class Q8Build:
    """Where and how the kernel is built: the folder's name changes with anything the binary depends on."""
    source: Path
    root: Path
    cflags: tuple[str, ...]

    def files(self) -> list[Path]:
        return [self.source, *(self.source.with_name(name) for name in _COMPANIONS)]

    def key(self) -> str:
        flags = " ".join(sorted(cpu_flags()))
        texts = [f.read_text() for f in self.files()]
        text = "|".join([*texts, torch.__version__, " ".join(self.cflags), flags])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def directory(self) -> Path:
        return self.root / "kernels" / f"cpu_q8-{self.key()}"


def enabled() -> bool:
    return env("TERCEL_CPU_Q8") != "0"


def _build(build: Q8Build) -> None:
    """Compile (or load the cached build of) the kernel; registers torch.ops.tercel_cpu_q8."""
    missing = _NEEDED_FLAGS - cpu_flags()
    if missing:
        raise Q8KernelUnavailable(f"the Q4 x Q8 CPU kernel needs {sorted(_NEEDED_FLAGS)}; this CPU lacks "
                                  f"{sorted(missing)} (set TERCEL_CPU_Q8=0 to silence this).")
    gone = [f for f in build.files() if not f.is_file()]
    if gone:
        raise Q8KernelUnavailable(f"the Q4 x Q8 CPU kernel's source {gone[0]} is missing (an install without "
                                  f"package data?): reinstall tercel, or set TERCEL_CPU_Q8=0.")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise Q8KernelUnavailable("the Q4 x Q8 CPU kernel is compiled at first use and no C++ compiler was found "
                                  "(CXX or c++ on PATH): install g++ or clang++, or set TERCEL_CPU_Q8=0.")
    try:
        _compile(build)
    except Exception as e:  # a compiler error, a missing ninja, an unwritable cache folder
        serial = replace(build, cflags=tuple(f for f in build.cflags if f != "-fopenmp"))
        if serial != build:  # a compiler without OpenMP (clang without libomp): the kernel on one thread
            try:
                _compile(serial)
            except Exception:  # noqa: BLE001 (the first error is the one to report)
                pass
            else:
                log.warning("the Q4 x Q8 CPU kernel was built without OpenMP (the compiler refused -fopenmp): its "
                            "matmuls run on one thread whatever --threads says; install the compiler's OpenMP "
                            "runtime (libgomp / libomp) to use them all")
                return
        raise Q8KernelUnavailable(f"could not build the Q4 x Q8 CPU kernel in {build.directory()} "
                                  f"({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}); "
                                  f"set TERCEL_CPU_Q8=0 to use torch's int4 kernel without trying.") from e


def _compile(build: Q8Build) -> None:
    from torch.utils import cpp_extension

    where = build.directory()
    where.mkdir(parents=True, exist_ok=True)
    sources = [str(f) for f in build.files() if f.suffix == ".cpp"]
    openmp = ["-fopenmp"] if "-fopenmp" in build.cflags else []
    cpp_extension.load(name=f"tercel_cpu_q8_{build.key()}", sources=sources, extra_cflags=list(build.cflags),
                       extra_ldflags=openmp, build_directory=str(where), is_python_module=False, verbose=False)


@functools.cache
def kernel_error() -> str | None:
    """None when torch.ops.tercel_cpu_q8.q4q8_linear is ready (built once per process, cached on disk across
    processes), else why not. Asked once: a failed build is not retried on every linear."""
    try:
        _build(Q8Build(source=_SOURCE, root=cache_dir(), cflags=_CFLAGS))
    except Q8KernelUnavailable as e:
        return str(e)

    # the output's shape for tracing (--cpu-compile): Inductor leaves the call itself to the C++ kernel
    @torch.library.register_fake("tercel_cpu_q8::q4q8_linear")
    def _(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tercel_cpu_q8::q8_linear")
    def _(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n, dtype=torch.float32)

    return None


def q8_available() -> bool:
    """The switch is on and the kernel built; the first failure is logged once, on one line."""
    if not enabled():
        return False
    error = kernel_error()
    if error is not None:
        _log_fallback(error)
    return error is None


@functools.cache
def _log_fallback(error: str) -> None:
    log.warning("Q4 x Q8 CPU kernel unavailable, keeping torch's int4 kernel: %s", error)


def _require() -> None:
    error = kernel_error()
    if error is not None:
        raise Q8KernelUnavailable(error)


def q4q8_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int) -> torch.Tensor:
    """y[M, N] = x[M, K] @ W^T, x bf16/fp32 (2-D), W as PackedQ4Q8 lays it out; y in x's dtype."""
    _require()
    return torch.ops.tercel_cpu_q8.q4q8_linear(x, qs, d, m, n)


ROW_GROUP = 8  # weight rows per 256-bit vector in the kernel's layout
LAYOUT = 4  # bumped when PackedQ4Q8's or PackedQ8's tensors change layout: the load cache's file name carries it


def _grouped(t: torch.Tensor, n_pad: int) -> torch.Tensor:
    """[N, ...] -> [N + n_pad, ...] with zero rows (a zero scale and min: the padded outputs are 0, never read)."""
    return torch.cat([t, t.new_zeros(n_pad, *t.shape[1:])]) if n_pad else t


def _by_group(t: torch.Tensor, pad: int, g: int, nb: int) -> torch.Tensor:
    """Per-block values [N, nb] -> fp16 [N / 8, nb, 8]: the 8 rows of a group side by side (one vector)."""
    return _grouped(t, pad).view(g, ROW_GROUP, nb).transpose(1, 2).to(torch.float16).contiguous()


class _RowGroupLinear(CpuPackedLinear):
    """A weight in the kernel's 8-row-group layout (qs, d, m) and the op that multiplies by it."""
    op_name: str  # torch.ops.tercel_cpu_q8.<op_name>(x, qs, d, m, n)
    has_min: bool  # m is the weight's own (Q4_1 / Q4_0); else zeros for the op's signature, not saved

    def _set(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, n: int) -> None:
        self.qs, self.d = qs, d
        self.m = m if m is not None else torch.zeros_like(d)
        self.out_features = n
        self.nbytes = qs.numel() + d.numel() * d.element_size() * (2 if self.has_min else 1)

    def tensors(self) -> dict[str, torch.Tensor]:
        saved = {"qs": self.qs, "d": self.d, "n": torch.tensor(self.out_features)}
        return saved | ({"m": self.m} if self.has_min else {})

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "_RowGroupLinear":
        _require()
        self = cls.__new__(cls)
        self._set(tensors["qs"], tensors["d"], tensors.get("m") if cls.has_min else None, int(tensors["n"]))
        return self

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # the op itself (built when this was made, see _require): nothing else for torch.compile to trace
        op = getattr(torch.ops.tercel_cpu_q8, self.op_name)
        y = op(x.reshape(-1, x.shape[-1]), self.qs, self.d, self.m, self.out_features)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)


class PackedQ4Q8(_RowGroupLinear):
    """A Q4_0 / Q4_1 weight [N, K] for the Q4 x Q8 kernel: 8 rows interleaved per 4 inputs (cpu_q8_kernel.cpp
    says how), scales and mins in fp16 (exact: GGUF stores them so)."""
    op_name = "q4q8_linear"
    has_min = True

    @staticmethod
    def supports(n: int, k: int) -> bool:
        return n > 0 and k > 0 and k % Q4_GROUP == 0

    def __init__(self, blocks: Q4Blocks) -> None:
        n, k = blocks.q.shape
        if not self.supports(n, k):
            raise ValueError(f"the Q4 x Q8 CPU kernel needs a [N, K] weight with K a multiple of {Q4_GROUP}; "
                             f"got [{n}, {k}] (pack it with PackedInt4 or PackedDense instead).")
        _require()
        pad = -n % ROW_GROUP
        g, nb = (n + pad) // ROW_GROUP, k // Q4_GROUP
        q = _grouped(blocks.q, pad).view(g, ROW_GROUP, nb, 2, 4, 4)  # group, row, block, half, chunk, byte
        packed = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # low nibble: inputs 0..15 of a block, high: 16..31
        self._set(packed.permute(0, 2, 3, 1, 4).contiguous(),  # group, block, chunk, row, byte
                  _by_group(blocks.scale, pad, g, nb), _by_group(blocks.min, pad, g, nb), n)


class PackedQ8(_RowGroupLinear):
    """A GGUF Q8_0 weight [N, K] for the kernel's 8-bit variant (q8_linear): 8 rows interleaved per 2 inputs, one
    int8 per input, fp16 scales, against activations quantised to int16 per block of 32 (finer than the layers'
    Q8: it serves as the head, whose logits feed sampling). Half the bytes of the dense bf16 copy; fp32 results."""
    op_name = "q8_linear"
    has_min = False

    def __init__(self, blocks: Q8Blocks) -> None:
        n, k = blocks.q.shape
        if not PackedQ4Q8.supports(n, k):
            raise ValueError(f"the Q8_0 CPU kernel needs a [N, K] weight with K a multiple of {Q4_GROUP}; "
                             f"got [{n}, {k}].")
        _require()
        pad = -n % ROW_GROUP
        g, nb = (n + pad) // ROW_GROUP, k // Q4_GROUP
        q = _grouped(blocks.q, pad).view(g, ROW_GROUP, nb, 16, 2)  # group, row, block, chunk, byte
        self._set(q.permute(0, 2, 3, 1, 4).contiguous(), _by_group(blocks.scale, pad, g, nb), None, n)
