"""The kernel budget of a step outside the layers (issue #30), counted on the CPU: benchmarks/step_launches.py runs
a tiny random Llama with a random EAGLE-3 head under TRITON_INTERPRET=1 (the GPU's code paths) and counts every
launch outside the target's and the draft's layer stacks and the attention metadata (LaunchCounter). At SmolLM2's
size every GPU launch costs ~2-3 µs, so a bookkeeping op added to a step shows up here before it costs the H200.
Budgets sit a little above the counts measured at the commit that set them
(benchmarks/results/step_launches_cpu_*.json)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tercel.kernels.launch_count import LaunchCounter

ROOT = Path(__file__).resolve().parent.parent
# launches per step outside the layers; before the fused bookkeeping (20e611d): 112.8 / 460.9 / 38.0 / 4.0; the
# sampled chain 134 before its draft picks raced the logits unfiltered, 76 before they hashed their keys in the race
# (the chained EAGLE tree step, topk 4 x 16 nodes: 212 before its layout and acceptance kernels, 132 after, 61 with
# the draft loop's expansion, the re-ranking and the positions as kernels; DFLASH and DDTREE-16 count their draft's
# layers too: 65 and 71 with the dense-key merge as one kernel, ~30 launches a layer before)
BUDGETS = {"eagle3-chain": 47, "eagle3-chain-t1": 70, "plain-t1": 7, "plain": 4, "eagle3-tree16": 66, "dflash": 56,
           "ddtree16": 62}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
def test_each_step_stays_within_its_launch_budget(tmp_path):
    out = tmp_path / "launches.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    # --num-sms 1: the draft steps' paged-prefix attention in 2 splits per (row, KV head), not an H100's 8-16 of a
    # few keys each: the same launches and tokens (benchmarks/step_launches.py --help), half the interpreter's time
    run = subprocess.run([sys.executable, "benchmarks/step_launches.py", "--configs", ",".join(BUDGETS),
                          "--tokens", "8", "--outside-only", "--num-sms", "1", "--out", str(out)], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    over = {name: (results[name]["outside"], budget, results[name]["ops"]) for name, budget in BUDGETS.items()
            if results[name]["outside"] > budget}
    assert not over, over
    assert results["eagle3-chain"]["ops"].get("triton:_chain_accept_kernel") == 1.0, results["eagle3-chain"]["ops"]
    # the GPU's bookkeeping kernels, run here in the interpreter, leave greedy speculation lossless
    for name in ("eagle3-chain", "eagle3-tree16", "dflash", "ddtree16"):
        assert results[name]["outputs"] == results["plain"]["outputs"], name
    assert results["eagle3-chain-t1"]["outputs"] == results["plain-t1"]["outputs"]  # seeded: plain sampling's tokens
    tree = results["eagle3-tree16"]["ops"]
    assert tree.get("triton:_tree_layout_kernel") == tree.get("triton:_tree_accept_kernel") == 1.0, tree
    assert tree.get("triton:_tree_select_kernel") == 1.0 and tree.get("triton:_tree_expand_kernel") == 5.0, tree


def test_the_counter_counts_compute_and_triton_launches_not_views_or_allocations():
    x = torch.randn(4, 8)
    with LaunchCounter() as c:
        y = x.t().reshape(-1)  # a view, then a copy (the transpose is not contiguous)
        torch.empty(3)
        z = (x + 1).sum()
        with c.paused():
            x * 2
        float(z)  # a host read
    assert c.ops["add.Tensor"] == 1 and c.ops["sum.default"] == 1 and c.launches == 3, c.ops
    assert c.syncs == 1 and y.shape == (32,)
    with LaunchCounter(paused=True) as c:
        x + 1
        with c.counting():
            x - 1
    assert dict(c.ops) == {"sub.Tensor": 1}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
def test_the_counter_counts_a_triton_launch_once_and_nothing_inside_it():
    code = ("import torch; from tercel.kernels.launch_count import LaunchCounter; "
            "from tercel.kernels.argmax import argmax_rows\n"
            "x = torch.randn(3, 5000)\n"
            "with LaunchCounter() as c:\n    argmax_rows(x)\n"
            "print(sorted(c.ops.items()))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[('triton:_argmax_pick_kernel', 1), ('triton:_argmax_slices_kernel', 1)]", out.stdout
