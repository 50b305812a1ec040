"""A sampled row's filtered distribution in one launch (Triton): temperature, top-k, top-p and min-p; with the
race folded in, the row's draw itself.

tercel.sampling.sample_rows works in the sorted domain: the logits sorted once, then per row x / T, top-k (keep
values >= the k-th), the softmax, top-p (drop a position once the mass before it reaches top_p; the first always
stays), the softmax again over what is kept, min-p (zero a probability below min_p times the largest). In torch
that is ~15 launches after the sort; here one program per row walks the row in wide chunks, up to three times
(the normaliser; the running mass that decides top-p, and the second normaliser, stopping where top-p cuts; the
probabilities, only zeros stored past the cut), so a batch-1 sampled token costs the sort, this launch and the
race. One program per row keeps the launch count down; its walk is latency-bound, hence the wide chunks and the
early stop. Unsorted rows (no top-k or top-p) take the same kernel with the row's maximum found in its first
pass (the softmax's max shift).

Each probability is exp(x - max) / sum, as torch's softmax computes it; the sums run in another order than torch's
reductions, so a probability may differ from torch's in its last bit (the race or the top-p boundary could then
differ at a tie that close). Graph and eager steps, plain and speculative rows all sample through this kernel on
a GPU, so they stay token for token equal; CPU runs keep torch's ops.

`sample_sorted` draws the token itself, in two launches over a grid of (row, slice) programs and the race's
pick, with no walk along the row: the first makes each slice's share of the softmax's sum (over what top-k
keeps); the second reads the row's shares, so each slice knows the mass before it (top-p: a slice wholly past
the cut draws nothing, the one it falls in finds it with a cumsum of its own), and races its kept positions
(the noise of the token the sort put there). The race needs no second normaliser: p / E and exp(x - max) / E
share their argmax, and min-p's floor (min_p times the largest probability) is min_p in exp(x - max) units.
No [N, V] probabilities are written or read back. The winner is the race's (the first position at a tie;
positions past the cut score 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .race import _GOLDEN, _MIX1, _MIX2, _noise, _race_pick_kernel

BLOCK = 8192  # a few wide chunks per row: one program walks it, so each chunk's load latency counts
RACE_BLOCK = 2048  # sample_sorted's slices: each program reads one, and a row's slices fill the GPU


@triton.jit
def _sample_filter_kernel(X, T, TOP_K, TOP_P, MIN_P, OUT, stride_x, n_cols, SORTED: tl.constexpr,
                          ANY_TOP_K: tl.constexpr, ANY_TOP_P: tl.constexpr, ANY_MIN_P: tl.constexpr,
                          BLOCK: tl.constexpr):
    """OUT: the probabilities [N, V] (float32), one program per row."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    offs = tl.arange(0, BLOCK)
    t = tl.load(T + row)
    # the shift: the first value of a sorted row, else the row's maximum
    if SORTED:
        m = tl.math.div_rn(tl.load(x_row).to(tl.float32), t)
    else:
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        for c in range(0, n_cols, BLOCK):
            x = tl.load(x_row + c + offs, mask=c + offs < n_cols, other=float("-inf")).to(tl.float32)
            mx = tl.maximum(mx, tl.math.div_rn(x, t))
        m = tl.max(mx, 0)
    kth = float("-inf")
    if ANY_TOP_K:  # sorted: the k-th value; ties with it stay
        k = tl.load(TOP_K + row)
        kth = tl.math.div_rn(tl.load(x_row + k - 1).to(tl.float32), t)
    # pass 1: the softmax's sum over what top-k keeps (sorted: a prefix, counted)
    acc = tl.zeros([BLOCK], tl.float32)
    kept = tl.zeros([BLOCK], tl.int32)
    for c in range(0, n_cols, BLOCK):
        inside = c + offs < n_cols
        x = tl.math.div_rn(tl.load(x_row + c + offs, mask=inside, other=float("-inf")).to(tl.float32), t)
        keep = inside & (x >= kth)
        acc += tl.where(keep, tl.exp(x - m), 0.0)
        kept += keep.to(tl.int32)
    s1 = tl.sum(acc, 0)
    # pass 2 (top-p): the mass before each position decides; the kept ones' sum is the second normaliser. Rows
    # are sorted, so once the mass before a chunk reaches top_p everything from there on drops: the walk stops
    # (at top_p 0.95 the kept prefix is usually a chunk or two of the vocabulary)
    s2 = s1
    kept_n = n_cols
    if ANY_TOP_P:
        top_p = tl.load(TOP_P + row)
        if top_p < 1.0:
            carry = s1 * 0.0  # an fp32 scalar from the start: the compiler keeps a loop-carried type fixed
            acc2 = tl.zeros([BLOCK], tl.float32)
            first_drop = tl.full([BLOCK], n_cols, tl.int32)
            c = 0
            while (c < n_cols) & (carry < top_p):
                inside = c + offs < n_cols
                x = tl.math.div_rn(tl.load(x_row + c + offs, mask=inside, other=float("-inf")).to(tl.float32), t)
                keep = inside & (x >= kth)
                p = tl.where(keep, tl.exp(x - m) / s1, 0.0)
                before = carry + tl.cumsum(p, 0) - p
                drop = before >= top_p
                first_drop = tl.minimum(first_drop, tl.where(drop & inside, c + offs, n_cols))
                acc2 += tl.where(keep & (c + offs < tl.min(first_drop, 0)), tl.exp(x - m), 0.0)
                carry = carry + tl.sum(p, 0)
                c += BLOCK
            kept_n = tl.minimum(tl.min(first_drop, 0), c)  # stopped early: from c on every position drops
            s2 = tl.sum(acc2, 0)
    floor = 0.0
    if ANY_MIN_P:  # zero below min_p times the largest probability (exp(0) / s2)
        floor = tl.load(MIN_P + row) * (1.0 / s2)
    # pass 3: the probabilities; past the top-p prefix only zeros are stored (nothing to read or compute)
    out_row = OUT + row * n_cols
    for c in range(0, n_cols, BLOCK):
        inside = c + offs < n_cols
        if c < kept_n:
            x = tl.math.div_rn(tl.load(x_row + c + offs, mask=inside, other=float("-inf")).to(tl.float32), t)
            keep = inside & (x >= kth) & (c + offs < kept_n)
            p = tl.where(keep, tl.exp(x - m) / s2, 0.0)
            if ANY_MIN_P:
                p = tl.where(p < floor, 0.0, p)
            tl.store(out_row + c + offs, p, mask=inside)
        else:
            tl.store(out_row + c + offs, tl.zeros([BLOCK], tl.float32), mask=inside)


@triton.jit
def _sorted_row_head(X, T, TOP_K, row, stride_x, ANY_TOP_K: tl.constexpr):
    """A sorted row's pointer, temperature, shift (its first value / T) and top-k's value (-inf when off)."""
    x_row = X + row * stride_x
    t = tl.load(T + row)
    m = tl.math.div_rn(tl.load(x_row).to(tl.float32), t)
    kth = float("-inf")
    if ANY_TOP_K:  # the k-th value; ties with it stay
        kth = tl.math.div_rn(tl.load(x_row + tl.load(TOP_K + row) - 1).to(tl.float32), t)
    return x_row, t, m, kth


@triton.jit
def _sorted_shares_kernel(X, T, TOP_K, SHARE, stride_x, n_cols, num_slices, ANY_TOP_K: tl.constexpr,
                          BLOCK: tl.constexpr):
    """SHARE[row, s]: slice s's sum of exp(x / T - shift) over what top-k keeps."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    x_row, t, m, kth = _sorted_row_head(X, T, TOP_K, row, stride_x, ANY_TOP_K)
    offs = s * BLOCK + tl.arange(0, BLOCK)
    x = tl.math.div_rn(tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32), t)
    tl.store(SHARE + row * num_slices + s, tl.sum(tl.where(x >= kth, tl.exp(x - m), 0.0), 0))


@triton.jit
def _sorted_race_kernel(X, T, TOP_K, TOP_P, MIN_P, SHARE, IDS, KEYS, PV, PI, stride_x, stride_ids, n_cols, num_slices,
                        GOLDEN, M1, M2, ANY_TOP_K: tl.constexpr, ANY_TOP_P: tl.constexpr, ANY_MIN_P: tl.constexpr,
                        BLOCK: tl.constexpr, SLICES_PAD: tl.constexpr):
    """Slice s's best e / E over its kept positions and where (PV, PI [N, slices]: race.py's _race_pick_kernel
    picks the row's draw), e = exp(x / T - shift), E the noise of token IDS[row, j] under the row's key."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    x_row, t, m, kth = _sorted_row_head(X, T, TOP_K, row, stride_x, ANY_TOP_K)
    j = tl.arange(0, SLICES_PAD)
    shares = tl.load(SHARE + row * num_slices + j, mask=j < num_slices, other=0.0)
    total = tl.sum(shares, 0)
    offs = s * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_cols
    live = True  # top-p: the mass before this slice has not reached the cut
    if ANY_TOP_P:
        top_p = tl.load(TOP_P + row)
        cut = tl.where(top_p < 1.0, top_p, float("inf"))  # 1: off
        before_slice = tl.sum(tl.where(j < s, shares, 0.0), 0) / total
        live = before_slice < cut
    score = tl.where(inside, 0.0, float("-inf"))
    if live:
        x = tl.math.div_rn(tl.load(x_row + offs, mask=inside, other=float("-inf")).to(tl.float32), t)
        e = tl.where(inside & (x >= kth), tl.exp(x - m), 0.0)
        keep = e > 0.0
        if ANY_TOP_P:  # drop a position once the mass before it reaches top_p (the first always stays)
            p = e / total
            keep = keep & (before_slice + tl.cumsum(p, 0) - p < cut)
        if ANY_MIN_P:  # below min_p times the largest probability (e = 1 at the top)
            keep = keep & (e >= tl.load(MIN_P + row))
        drawn = tl.math.div_rn(e, _noise(IDS, KEYS, row, offs, keep, stride_ids, GOLDEN, M1, M2, True))
        score = tl.where(keep, drawn, score)
    score = tl.where(score == score, score, float("-inf"))  # NaN (a padding row's 0 / 0) never wins
    tl.store(PV + row * num_slices + s, tl.max(score, 0))
    tl.store(PI + row * num_slices + s, tl.minimum(s * BLOCK + tl.argmax(score, 0, tie_break_left=True), n_cols - 1))


def filtered_probs(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, sorted_rows: bool, any_top_k: bool, any_top_p: bool,
                   any_min_p: bool) -> torch.Tensor:
    """x [N, V] logits (any float dtype, last dim contiguous; sorted_rows: each row in descending order, needed
    for top-k / top-p); per-row temperature, top_k (the kept count), top_p, min_p [N] -> float32 probabilities
    [N, V] of the filtered distribution (0 where filtered out)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"filtered_probs needs a [N, V] tensor with a contiguous last dim, got {tuple(x.shape)}.")
    if (any_top_k or any_top_p) and not sorted_rows:
        raise ValueError("filtered_probs: top-k and top-p need rows sorted in descending order.")
    n, v = x.shape
    out = torch.empty((n, v), dtype=torch.float32, device=x.device)
    if n:
        _sample_filter_kernel[(n,)](x, temperature, top_k, top_p, min_p, out, x.stride(0), v, SORTED=sorted_rows,
                                    ANY_TOP_K=any_top_k, ANY_TOP_P=any_top_p, ANY_MIN_P=any_min_p, BLOCK=BLOCK,
                                    num_warps=16)
    return out


def sample_sorted(x: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, any_top_k: bool, any_top_p: bool,
                  any_min_p: bool) -> torch.Tensor:
    """x [N, V] logits, each row sorted in descending order (any float dtype, last dim contiguous); ids [N, V]:
    the token at each sorted position (last dim contiguous); keys [N] int64 stream keys; the per-row settings as
    filtered_probs takes them -> int64 [N]: each row's draw, race_rows(filtered_probs(x, ...), keys, ids) in one
    launch."""
    if x.dim() != 2 or x.stride(-1) != 1 or ids.shape != x.shape or ids.stride(-1) != 1:
        raise ValueError(f"sample_sorted needs [N, V] logits and ids with contiguous last dims, got "
                         f"{tuple(x.shape)} and {tuple(ids.shape)}.")
    n, v = x.shape
    out = torch.empty(n, dtype=torch.long, device=x.device)
    if n:
        num_slices = triton.cdiv(v, RACE_BLOCK)
        share = torch.empty((n, num_slices), dtype=torch.float32, device=x.device)
        pv = torch.empty((n, num_slices), dtype=torch.float32, device=x.device)
        pi = torch.empty((n, num_slices), dtype=torch.int32, device=x.device)
        pad = max(2, triton.next_power_of_2(num_slices))
        _sorted_shares_kernel[(n, num_slices)](x, temperature, top_k, share, x.stride(0), v, num_slices,
                                               ANY_TOP_K=any_top_k, BLOCK=RACE_BLOCK, num_warps=4)
        _sorted_race_kernel[(n, num_slices)](x, temperature, top_k, top_p, min_p, share, ids,
                                             keys.to(torch.int64).contiguous(), pv, pi, x.stride(0), ids.stride(0), v,
                                             num_slices, _GOLDEN, _MIX1, _MIX2, ANY_TOP_K=any_top_k,
                                             ANY_TOP_P=any_top_p, ANY_MIN_P=any_min_p, BLOCK=RACE_BLOCK,
                                             SLICES_PAD=pad, num_warps=4)
        _race_pick_kernel[(n,)](pv, pi, ids, out, ids.stride(0), num_slices, HAS_IDS=True, SLICES_PAD=pad,
                                num_warps=1)
    return out
