"""nn.Linear with a per-weight kernel choice, `gemv`:

  None              F.linear (cuBLAS / the CPU BLAS), the default everywhere;
  GemvConfig        batch-1 calls through the Triton GEMV, set by tercel.models.gemv_tuning where it
                    measured the GEMV faster for this shape on this GPU (biased layers and autograd
                    still take F.linear);
  CpuPackedLinear   a bf16 CPU weight prepacked once (oneDNN) or a GGUF 4-bit weight kept 4-bit
                    (models.cpu_linear), used for every call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import use_triton
from .cpu_linear import CpuPackedLinear, pack_dense, wants_cpu_packing


def linear(x: torch.Tensor, weight: torch.Tensor, gemv_config=None, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the tuned GEMV when one is set, there is no bias and x is a
    single row. (The model calls this on its Linear modules' tensors instead of calling the modules:
    the module-call overhead shows on a CPU decode step.) out_dtype: the result widened to it, e.g.
    fp32 logits; the GEMV stores them so directly, without a copy kernel."""
    if isinstance(gemv_config, CpuPackedLinear):
        y = gemv_config(x, bias)
    elif bias is not None:
        y = F.linear(x, weight, bias)
    elif gemv_config is not None and x.dim() == 2 and x.shape[0] == 1 and use_triton(x, weight):
        from ..kernels.gemv import gemv

        return gemv(x if x.is_contiguous() else x.contiguous(), weight, gemv_config, out_dtype=out_dtype)
    else:
        y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


class Linear(nn.Linear):
    gemv = None  # GemvConfig (set by the GPU tuner) or CpuPackedLinear (set at CPU load): see above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.gemv, self.bias)


def prepack_for_cpu(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """bf16 on CPU: every Linear of a loaded, frozen `module` gets a oneDNN-prepacked copy of its
    weight (models.cpu_linear.pack_dense: F.linear where this CPU cannot pack bf16); otherwise nothing changes."""
    if not wants_cpu_packing(device, dtype):
        return
    for m in module.modules():
        if isinstance(m, Linear) and m.weight.numel():
            m.gemv = pack_dense(m.weight)
