"""GPU: a request's token draws are the same on the GPU as on the CPU (the counter-based noise is
integer arithmetic, exact on both), so seeded sampling does not depend on the device. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from tercel import SamplingParams
from tercel.outputs import RequestMetrics
from tercel.request import Request
from tercel.sampling import draw_keys, draw_noise, sample_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _reqs(params: SamplingParams, seeds: list[int]) -> list[Request]:
    return [Request("r", None, [1], params, torch.Generator(), RequestMetrics(0.0), seed=s) for s in seeds]


def test_noise_and_draws_equal_on_cpu_and_gpu():
    seeds = [0, 1, 2**61 + 5, 12345]
    keys = draw_keys(_reqs(SamplingParams(temperature=1.0), seeds))
    cpu = draw_noise(keys, 49152, torch.device("cpu"))
    gpu = draw_noise(keys, 49152, torch.device("cuda")).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-6, atol=0)
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)) * 4
    p = SamplingParams(temperature=0.8, top_p=0.9)
    cpu_reqs, gpu_reqs = _reqs(p, seeds), _reqs(p, seeds)
    for _ in range(3):  # successive draws of the same streams
        assert sample_batch(logits, cpu_reqs).tolist() == sample_batch(logits.cuda(), gpu_reqs).cpu().tolist()
