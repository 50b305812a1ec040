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

`sample_sorted` runs the exponential race (kernels/race.py) in the same launch instead of storing the
probabilities: a grid of (row, slice) programs, each makes the row's sums (passes 1 and 2) and then races its
slice, drawing noise only for kept positions (of the token the sort put there); slices past top-k's or top-p's cut
draw nothing. No [N, V] probabilities are written or read back, and the race's slice launch goes; its pick
launch stays. The winner is the race's (the first position at a tie; positions past the cut score 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .race import _GOLDEN, _MIX1, _MIX2, _noise, _race_pick_kernel

BLOCK = 8192  # a few wide chunks per row: one program walks it, so each chunk's load latency counts


@triton.jit
def _sample_filter_kernel(X, T, TOP_K, TOP_P, MIN_P, OUT, IDS, KEYS, PV, PI, stride_x, stride_ids, n_cols, num_slices,
                          GOLDEN, M1, M2, SORTED: tl.constexpr, ANY_TOP_K: tl.constexpr, ANY_TOP_P: tl.constexpr,
                          ANY_MIN_P: tl.constexpr, RACE: tl.constexpr, BLOCK: tl.constexpr):
    """OUT: the probabilities [N, V] (float32); or with RACE, over a grid (N, slices of BLOCK), each slice's best
    p / E and its position (PV, PI [N, slices]: race.py's _race_pick_kernel picks the row's draw), E the noise of
    token IDS[row, j] under the row's key KEYS[row]. Each program of a row makes the row's sums itself."""
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
    if RACE:  # pass 3: this program's slice of the race (race.py's slices); past the cut p = 0, nothing to draw
        if SORTED:
            kept_n = tl.minimum(kept_n, tl.sum(kept, 0))
        s = tl.program_id(1)
        c = s * BLOCK
        score = tl.where(c + offs < n_cols, 0.0, float("-inf"))
        if c < kept_n:
            inside = c + offs < kept_n
            x = tl.math.div_rn(tl.load(x_row + c + offs, mask=inside, other=float("-inf")).to(tl.float32), t)
            p = tl.where(inside & (x >= kth), tl.exp(x - m) / s2, 0.0)
            if ANY_MIN_P:
                p = tl.where(p < floor, 0.0, p)
            drawn = tl.math.div_rn(p, _noise(IDS, KEYS, row, c + offs, inside, stride_ids, GOLDEN, M1, M2, True))
            score = tl.where(inside, drawn, score)
        score = tl.where(score == score, score, float("-inf"))  # NaN (a padding row's 0 / 0) never wins
        tl.store(PV + row * num_slices + s, tl.max(score, 0))
        tl.store(PI + row * num_slices + s, tl.minimum(c + tl.argmax(score, 0, tie_break_left=True), n_cols - 1))
    else:  # pass 3: the probabilities; past the top-p prefix only zeros are stored (nothing to read or compute)
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
        _sample_filter_kernel[(n,)](x, temperature, top_k, top_p, min_p, out, out, top_k, out, out, x.stride(0), 0, v,
                                    1, _GOLDEN, _MIX1, _MIX2, SORTED=sorted_rows, ANY_TOP_K=any_top_k,
                                    ANY_TOP_P=any_top_p, ANY_MIN_P=any_min_p, RACE=False, BLOCK=BLOCK, num_warps=16)
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
        num_slices = triton.cdiv(v, BLOCK)
        pv = torch.empty((n, num_slices), dtype=torch.float32, device=x.device)
        pi = torch.empty((n, num_slices), dtype=torch.int32, device=x.device)
        _sample_filter_kernel[(n, num_slices)](x, temperature, top_k, top_p, min_p, out, ids,
                                               keys.to(torch.int64).contiguous(), pv, pi, x.stride(0), ids.stride(0),
                                               v, num_slices, _GOLDEN, _MIX1, _MIX2, SORTED=True, ANY_TOP_K=any_top_k,
                                               ANY_TOP_P=any_top_p, ANY_MIN_P=any_min_p, RACE=True, BLOCK=BLOCK,
                                               num_warps=16)
        _race_pick_kernel[(n,)](pv, pi, ids, out, ids.stride(0), num_slices, HAS_IDS=True,
                                SLICES_PAD=max(2, triton.next_power_of_2(num_slices)), num_warps=1)
    return out
