"""Optional GPU kernels (Triton). Importing this package never fails: without triton (or CUDA)
`TRITON_AVAILABLE` is False and callers keep their PyTorch path.

`use_triton(t)` is the one switch the model and attention code consult; TERCEL_DISABLE_TRITON=1
turns every kernel off (debugging: compare against the PyTorch path on the same GPU).
"""
from __future__ import annotations

import os

import torch

try:  # triton is present on GPU machines, usually absent on CPU-only ones
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except Exception:  # pragma: no cover - depends on the machine
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU development: kernels run in the interpreter


def triton_enabled() -> bool:
    return TRITON_AVAILABLE and os.environ.get("TERCEL_DISABLE_TRITON", "0") != "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when a kernel should run on this tensor: on CUDA, or anywhere under TRITON_INTERPRET=1."""
    # device test first: on CPU it answers without reading the environment (called per layer per op)
    return (t.is_cuda or _INTERPRET) and triton_enabled()
