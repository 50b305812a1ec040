"""The device sampler (tercel.sampling.sample_rows and the fused race kernel, kernels/race.py) draws exactly the
tokens of the reference path (filter_logits, draw_noise, race): checked in Triton's CPU interpreter here and natively
on a GPU by tests/test_gpu_graphs.py (kernel_checks.check_race)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tercel.sampling import SamplingTensors, draw_noise, filter_logits, race, sample_rows, stream_keys
from tercel.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _triton(), reason="needs triton (its CPU interpreter)")
def test_fused_race_equals_torch_race_in_interpreter():
    code = ("import sys, torch; sys.path.insert(0, 'tests'); import kernel_checks as k; "
            "k.check_race('cpu', torch.float32); k.check_race('cpu', torch.bfloat16); print('race ok')")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "race ok" in out.stdout


def test_rows_with_different_settings_sample_as_one_request_at_a_time():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=2.0, min_p=0.1),
              SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01),
              SamplingParams(temperature=1.0, top_k=1)]
    for seed in range(20):
        keys = stream_keys(torch.full((6,), seed), torch.arange(6))
        got = sample_rows(logits, SamplingTensors.of(params, 500, torch.device("cpu")), keys)
        for i, p in enumerate(params):
            want = race(filter_logits(logits[i:i + 1], p).softmax(-1), draw_noise(keys[i:i + 1], 500, logits.device))
            assert got[i] == want[0], (seed, i, p)
    assert (sample_rows(logits, SamplingTensors.of(params, 500, torch.device("cpu")), keys)[5]
            == logits[5].argmax()), "top_k=1 is the argmax"
