"""Kernels that fold a speculative step's bookkeeping into single launches equal the torch code they replace, in
Triton's CPU interpreter here and natively on a GPU by tests/test_gpu_graphs.py (kernel_checks.ALL): the chained
step's acceptance and next state (kernels/chain_accept.py), the chained tree step's layout and acceptance
(kernels/tree_accept.py) and DDTREE's beams (kernels/ddtree_beams.py), the sampler's stream keys and the draft
picks' race on logits (kernels/race.py) and its filters (kernels/sample_filter.py), the tree drafts' top k of a
softmax (kernels/topk_rows.py); an EAGLE draft layer's RoPE and K/V store inside the attention backend's kernels;
a verify block's rows in the one-launch decode attention (RoPE, K/V store and attention in one kernel);
the draft head's product over int8 rows (kernels/gemv_q8.py); an EAGLE-3 draft MLP on the fused GEMVs."""
from __future__ import annotations

import importlib.util

import pytest
from kernel_checks import run_in_interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
@pytest.mark.parametrize("check", ["check_chain_accept", "check_stream_keys", "check_sample_filter",
                                   "check_tree_accept", "check_ddtree_beams", "check_race_logits",
                                   "check_topk_rows", "check_draft_rope_attention", "check_rows_rope",
                                   "check_gemv_q8", "check_draft_mlp_fused", "check_draft_input_and_add",
                                   "check_tree_draft", "check_chain_positions", "check_norm_rope"])
def test_the_one_launch_kernel_equals_the_torch_ops(check):
    run_in_interpreter(check)
