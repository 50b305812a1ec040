"""Kernels that fold a speculative step's bookkeeping into single launches equal the torch code they replace, in
Triton's CPU interpreter here and natively on a GPU by tests/test_gpu_graphs.py (kernel_checks.ALL): the chained
step's acceptance and next state (kernels/chain_accept.py), the sampler's stream keys (kernels/race.py) and its
filters (kernels/sample_filter.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
@pytest.mark.parametrize("check", ["check_chain_accept", "check_stream_keys", "check_sample_filter"])
def test_the_one_launch_kernel_equals_the_torch_ops(check):
    code = ("import sys, torch; sys.path.insert(0, 'tests'); import kernel_checks as k; "
            f"k.{check}('cpu', torch.float32); print('kernel ok')")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "kernel ok" in out.stdout
