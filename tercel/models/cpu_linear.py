"""bf16 linears on the CPU through prepacked weights (oneDNN), and 4-bit GGUF weights kept 4-bit.

F.linear on a bf16 CPU tensor re-lays the weight out for oneDNN on every call, so a bf16 decode
step is slower than fp32 on the same CPU. Packing each weight once at load time removes that:
  - PackedDense: the weight reordered for oneDNN (torch.ops.mkldnn); any linear. oneDNN takes bf16
    weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere (e.g. AVX2-only) a
    dense weight stays an UnpackedDense: plain F.linear, correct but without the packing's speed.
  - PackedInt4:  a GGUF Q4_0 / Q4_1 weight kept at 4 bits (torch's int4 CPU matmul, groups of 32):
    a quarter of the bf16 bytes, and a decode step is bound by the bytes of weight it reads.
Both take bf16 activations and return bf16. GGUF stores w = d * q + m per block of 32 (Q4_0:
m = -8 d) with d, m in fp16; the int4 kernel computes w = (q - 8) * scale + zero, so scale = d and
zero = m + 8 d. That is exact in fp32; the kernel wants scale/zero in the activation dtype, and
rounding them to bf16 errs by the same relative amount (2^-9) as rounding the dense weights to bf16.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Q4_GROUP = 32  # GGUF Q4_0 / Q4_1 block length along the input dimension


@dataclass(slots=True)
class Q4Blocks:
    """A 4-bit GGUF weight [N, K] as w = scale * q + min per group of Q4_GROUP inputs."""
    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K // Q4_GROUP]
    min: torch.Tensor  # float32 [N, K // Q4_GROUP]

    def dequantize(self) -> torch.Tensor:
        g = lambda t: t.repeat_interleave(Q4_GROUP, dim=1)  # noqa: E731
        return g(self.scale) * self.q.float() + g(self.min)

    def rows(self, index: torch.Tensor) -> "Q4Blocks":
        return Q4Blocks(self.q[index], self.scale[index], self.min[index])

    @staticmethod
    def cat(parts: list["Q4Blocks"]) -> "Q4Blocks":
        """Stack along the output dimension (fused q/k/v or gate/up projections)."""
        return Q4Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.min for p in parts]))


@dataclass(frozen=True, slots=True)
class Q8Blocks:
    """A GGUF Q8_0 weight [N, K] as w = scale * q per group of Q4_GROUP inputs (the tied embedding of most GGUFs,
    taken as the head)."""
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // Q4_GROUP]

    def dequantize(self) -> torch.Tensor:
        return self.scale.repeat_interleave(Q4_GROUP, dim=1) * self.q.float()


class CpuPackedLinear:
    """A weight prepared for one CPU kernel; called as packed(x, bias) in place of F.linear."""
    out_features: int
    nbytes: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """What restores it (from_tensors): the load cache keeps a prepared model in these."""
        raise NotImplementedError(f"{type(self).__name__} cannot be saved")

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "CpuPackedLinear":
        raise NotImplementedError(f"{cls.__name__} cannot be restored")


class PackedDense(CpuPackedLinear):
    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().to(torch.bfloat16).contiguous()
        self.out_features = w.shape[0]
        self.nbytes = w.numel() * w.element_size()
        # the saved form: the bf16 weight (the module's own parameter when it is bf16 already, so no copy);
        # the oneDNN layout itself is opaque and is made again on load
        self.source = w
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, 1)  # laid out for a batch-1 (decode) call

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self.weight, bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.source}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "PackedDense":
        return cls(tensors["weight"])


class UnpackedDense(CpuPackedLinear):
    """The bf16 weight as it is, through F.linear: where this CPU's oneDNN cannot reorder bf16 weights."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().to(torch.bfloat16)  # no copy when it already is bf16
        self.out_features = self.weight.shape[0]
        self.nbytes = self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "UnpackedDense":
        return cls(tensors["weight"])


@functools.lru_cache(maxsize=1)
def dense_packing_available() -> bool:
    """Whether oneDNN packs and multiplies bf16 weights on this CPU: asked once, on a 16 x 16 weight
    (torch raises 'bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq')."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=torch.bfloat16), w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def pack_dense(weight: torch.Tensor) -> CpuPackedLinear:
    """PackedDense where this CPU's oneDNN takes bf16 weights, else UnpackedDense."""
    return PackedDense(weight) if dense_packing_available() else UnpackedDense(weight)


class PackedInt4(CpuPackedLinear):
    @staticmethod
    def supports(n: int, k: int) -> bool:
        """The kernel's layout: rows in multiples of 16, inputs in whole groups."""
        return n % 16 == 0 and k % Q4_GROUP == 0

    def __init__(self, blocks: Q4Blocks) -> None:
        n, k = blocks.q.shape
        if not self.supports(n, k):
            raise ValueError(f"the int4 CPU matmul needs a [N, K] weight with N a multiple of 16 and K of "
                             f"{Q4_GROUP}; got [{n}, {k}] (pack it with PackedDense instead).")
        self.out_features = n
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 1)
        zero = blocks.min + 8 * blocks.scale  # exact in fp32: see the module docstring
        # [K // group, N, 2] as the kernel wants it
        self.scales_and_zeros = torch.stack([blocks.scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.nbytes = self.packed.numel() + self.scales_and_zeros.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, Q4_GROUP, self.scales_and_zeros)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "PackedInt4":
        """The packed weight as tensors() gave it, without packing again."""
        self = cls.__new__(cls)
        self.packed, self.scales_and_zeros = tensors["packed"], tensors["scales_and_zeros"]
        self.out_features = self.scales_and_zeros.shape[1]
        self.nbytes = self.packed.numel() + self.scales_and_zeros.numel() * 2
        return self


def cpu_packing_available() -> bool:
    """oneDNN and the int4 CPU matmul ship with torch's CPU builds; a build without them keeps F.linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass(frozen=True, slots=True)
class CpuBf16Support:
    """What makes bf16 pay on this CPU: asked once per process (cpu_bf16_support), read by dtype="auto"."""
    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    int4_matmul: bool  # torch's int4 CPU matmul has a vectorised kernel here (AVX2 / AVX-512)
    dense_packing: bool  # oneDNN packs and multiplies bf16 weights (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)
    native_bf16: bool  # bf16 dot products in hardware (avx512_bf16 / amx_bf16 / avx_ne_convert)

    def describe(self) -> str:
        native = ", native bf16" if self.native_bf16 else ""
        return f"{self.capability}{native}"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty elsewhere (then torch's capability decides)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_bf16_support() -> CpuBf16Support:
    """Cheap (a 16 x 16 probe and /proc/cpuinfo), cached: the hardware does not change under a process."""
    capability = torch.backends.cpu.get_cpu_capability()
    available = cpu_packing_available()
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "avx_ne_convert"})
    return CpuBf16Support(capability=capability, int4_matmul=available and capability.startswith("AVX"),
                          dense_packing=available and dense_packing_available(), native_bf16=native)


def wants_cpu_packing(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing pays for bf16 on CPU (fp32 keeps the exact reference path, GPUs their own kernels)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_packing_available()
