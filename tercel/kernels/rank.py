"""The descending rank that the tree kernels (ddtree_beams.py, tree_draft.py) give their candidates, as a stable
descending sort orders them: a higher score first, at equal scores the lower index."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rank_tile(s, i, sj, j, vj):
    """For each candidate (score s, index i) the number of valid candidates among (sj, j, vj) placed before it."""
    beats = ((sj[None, :] > s[:, None]) | ((sj[None, :] == s[:, None]) & (j[None, :] < i[:, None]))) & vj[None, :]
    return tl.sum(beats.to(tl.int32), 1)
