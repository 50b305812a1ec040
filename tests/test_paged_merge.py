"""Draft attention over the paged prefix (tercel/attention/paged_merge.py): on a GPU the EAGLE tree loop and
DFlash's block read each request's prefix through the split-KV decode kernel and merge its partials with the
dense keys beside it (earlier leaves, the block's own rows) by log-sum-exp, where the CPU gathers every prefix
slot the block table can hold and runs SDPA. Both must give the same rows: checked in Triton's CPU interpreter
here (fp32: the interpreter multiplies bf16 dot operands wrongly) and natively in bf16 and fp32 by
tests/test_gpu_graphs.py (kernel_checks.ALL)."""
from __future__ import annotations

import importlib.util

import pytest
from kernel_checks import run_in_interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
@pytest.mark.parametrize("check", ["check_tree_draft_attention", "check_dflash_paged_attention",
                                   "check_paged_dense_merge"])
def test_paged_prefix_attention_equals_the_gathered_one(check):
    """A padding request with no prefix and (DFlash) a block cut short included; split counts 2 and more."""
    run_in_interpreter(check)
