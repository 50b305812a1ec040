"""nn.Linear that can route batch-1 calls (decode at one request) through the Triton GEMV.

`gemv` is None (cuBLAS, the default everywhere) until tercel.kernels.gemv_tune measured the GEMV
faster for this weight's shape on this GPU; CPU tensors, biased layers and autograd always take
F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import use_triton


def linear(x: torch.Tensor, weight: torch.Tensor, gemv_config=None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the tuned GEMV when one is set, there is no bias and x is a
    single row. (The model calls this on its Linear modules' tensors instead of calling the modules:
    the module-call overhead shows on a CPU decode step.)"""
    if bias is not None:
        return F.linear(x, weight, bias)
    if gemv_config is not None and x.dim() == 2 and x.shape[0] == 1 and use_triton(x, weight):
        from ..kernels.gemv import gemv

        return gemv(x if x.is_contiguous() else x.contiguous(), weight, gemv_config)
    return F.linear(x, weight)


class Linear(nn.Linear):
    gemv = None  # tercel.kernels.gemv.GemvConfig, set by the tuner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.gemv, self.bias)
