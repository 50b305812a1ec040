"""A small GPU case for compute-sanitizer (memcheck): every Triton kernel, eager prefill and decode
forwards, graph capture + padded replays of a tiny model, and its fused batch-1 decode.
Run: compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu_sanitize_case.py"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from graph_utils import FakeRequests, kv_pool, tiny_model  # noqa: E402
from kernel_checks import run_all  # noqa: E402
from test_gpu_fused_decode import _fuse_all, compare_fused_unfused  # noqa: E402

from tercel.graphs import CudaGraphRunner, GraphConfig  # noqa: E402
from tercel.graphs.steps import ModelStep  # noqa: E402


@torch.inference_mode()
def main() -> None:
    run_all("cuda", torch.bfloat16)
    model, cfg = tiny_model("cuda", torch.bfloat16)
    kv = kv_pool(cfg, "cuda", torch.bfloat16, num_blocks=64, block_size=16)
    reqs = FakeRequests(6, kv, cfg.vocab_size)
    model(reqs.batch([0, 1], tokens_per_request=5), kv)  # extend path
    for backend in ("full", "breakable"):
        runner = CudaGraphRunner(ModelStep(model, kv, 16), GraphConfig(max_bs=4, backend=backend), "cuda")
        runner.capture_all()
        for rows in ([0, 1, 2, 3], [4], [1, 2, 5]):  # padded: 1 -> 1, 3 -> 3 (buckets 1..4), shrink and grow
            out = runner.run(reqs.batch(rows))
            reqs.advance(rows, out.logits.argmax(-1).tolist())
    compare_fused_unfused("cuda", torch.bfloat16, steps=2)  # the fused batch-1 decode, eager
    _fuse_all(model)
    runner = CudaGraphRunner(ModelStep(model, kv, 16), GraphConfig(max_bs=2), "cuda")
    runner.capture_all()
    for rows in ([3], [0, 5], [2]):  # fused bucket 1, then 2 (unfused layers, one-launch attention)
        out = runner.run(reqs.batch(rows))
        reqs.advance(rows, out.logits.argmax(-1).tolist())
    torch.cuda.synchronize()
    print("sanitize case done: kernels, eager forwards, full and breakable replays, fused decode")


if __name__ == "__main__":
    main()
