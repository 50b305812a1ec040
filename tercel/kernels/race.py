"""The exponential race argmax_v p_v / E_v (a draw from p) with the noise made inside the kernel (Triton).

E_v is the counter-based Exp(1) noise of tercel.sampling.draw_noise: splitmix64 started at the row's key,
output v + 1, turned into a 53-bit uniform u and E = -log(u) in double, rounded to float. torch builds that
noise with ~15 elementwise int64 launches over [B, V] before the division and the argmax; here one launch
per (row, slice) hashes, divides and reduces, and a second picks each row's winning slice. Ties go to the
first index, as torch.argmax.

With `ids` (sorted-domain sampling: the row's candidates in another order), position j draws token
ids[j]'s noise and the winner's id is returned.

The stream keys themselves (tercel.sampling.stream_keys: splitmix64 of the seed, plus the draw index times the
golden gamma, mixed again) are ~25 int64 elementwise launches in torch; `stream_keys_2d` makes them in one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


@triton.jit
def _mix64(x, M1, M2):
    x = (x ^ (x >> 30)) * M1
    x = (x ^ (x >> 27)) * M2
    return x ^ (x >> 31)


@triton.jit
def _stream_keys_kernel(SEEDS, INDEX, OUT, n, cols, ss0, ss1, si0, si1, GOLDEN, M1, M2, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    r = offs // cols
    c = offs % cols
    seed = tl.load(SEEDS + r * ss0 + c * ss1, mask=inside, other=0).to(tl.uint64)
    index = tl.load(INDEX + r * si0 + c * si1, mask=inside, other=0).to(tl.uint64)
    key = _mix64(_mix64(seed, M1, M2) + index * GOLDEN, M1, M2)
    tl.store(OUT + offs, key.to(tl.int64), mask=inside)


def stream_keys_2d(seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tercel.sampling.stream_keys for int64 seeds and index of at most 2 dims that broadcast together (strides,
    zero ones included, read as they are): a contiguous int64 tensor of the broadcast shape, one launch."""
    shape = torch.broadcast_shapes(seeds.shape, index.shape)
    if len(shape) > 2:
        raise ValueError(f"stream_keys_2d: shapes {tuple(seeds.shape)} and {tuple(index.shape)} broadcast to "
                         f"{tuple(shape)}; at most 2 dims.")
    s2, i2 = seeds.expand(shape), index.expand(shape)  # views: a broadcast dim has stride 0
    while s2.dim() < 2:
        s2, i2 = s2.unsqueeze(0), i2.unsqueeze(0)
    out = torch.empty(shape, dtype=torch.int64, device=seeds.device)
    n = out.numel()
    if n:
        block = 128
        _stream_keys_kernel[(triton.cdiv(n, block),)](s2, i2, out, n, s2.shape[1], s2.stride(0), s2.stride(1),
                                                      i2.stride(0), i2.stride(1), _GOLDEN, _MIX1, _MIX2, BLOCK=block,
                                                      num_warps=4)
    return out


@triton.jit
def _noise(IDS, KEYS, row, offs, inside, stride_ids, GOLDEN, M1, M2, HAS_IDS: tl.constexpr):
    """draw_noise of the row's key at columns offs (of token ids[row, offs] with HAS_IDS), as float32."""
    return _noise_of_key(IDS, tl.load(KEYS + row).to(tl.uint64), row, offs, inside, stride_ids, GOLDEN, M1, M2,
                         HAS_IDS)


@triton.jit
def _noise_of_key(IDS, key, row, offs, inside, stride_ids, GOLDEN, M1, M2, HAS_IDS: tl.constexpr):
    if HAS_IDS:
        tok = tl.load(IDS + row * stride_ids + offs, mask=inside, other=0).to(tl.uint64)
    else:
        tok = offs.to(tl.uint64)
    bits = _mix64(key + (tok + 1) * GOLDEN, M1, M2)
    u = ((bits >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2 ** -53
    return (-tl.log(u)).to(tl.float32)


@triton.jit
def _race_slices_kernel(P, IDS, KEYS, PV, PI, stride_p, stride_ids, n_cols, num_slices, GOLDEN, M1, M2,
                        HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = s * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_cols
    p = tl.load(P + row * stride_p + offs, mask=inside, other=0.0).to(tl.float32)
    score = tl.math.div_rn(p, _noise(IDS, KEYS, row, offs, inside, stride_ids, GOLDEN, M1, M2, HAS_IDS))
    # NaN (a padding row's 0 / 0) scores -inf: argmax over NaN is undefined and could name a column past n_cols
    score = tl.where(inside & (score == score), score, float("-inf"))
    m = tl.max(score, 0)
    i = tl.argmax(score, 0, tie_break_left=True)
    tl.store(PV + row * num_slices + s, m)
    tl.store(PI + row * num_slices + s, tl.minimum(s * BLOCK + i, n_cols - 1))


@triton.jit
def _race_logits_slices_kernel(X, IDS, KEYS, DRAWS, T, SAMPLED, PV, PI, stride_x, stride_ids, n_cols, num_slices,
                               ahead, GOLDEN, M1, M2, HAS_IDS: tl.constexpr, SEEDED: tl.constexpr,
                               BLOCK: tl.constexpr):
    """The race on logits: argmax x / T - log E (the same winner as argmax softmax(x / T) / E, without the
    softmax); a row with SAMPLED 0 takes the plain argmax. SEEDED: KEYS holds the rows' seeds and the key is
    stream_keys(seed, DRAWS[row] + ahead), hashed here."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = s * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if tl.load(SAMPLED + row) != 0:
        if SEEDED:
            index = (tl.load(DRAWS + row) + ahead).to(tl.uint64)
            key = _mix64(_mix64(tl.load(KEYS + row).to(tl.uint64), M1, M2) + index * GOLDEN, M1, M2)
        else:
            key = tl.load(KEYS + row).to(tl.uint64)
        e = _noise_of_key(IDS, key, row, offs, inside, stride_ids, GOLDEN, M1, M2, HAS_IDS)
        x = tl.math.div_rn(x, tl.load(T + row)) - tl.log(e)
    x = tl.where(inside & (x == x), x, float("-inf"))
    tl.store(PV + row * num_slices + s, tl.max(x, 0))
    tl.store(PI + row * num_slices + s, tl.minimum(s * BLOCK + tl.argmax(x, 0, tie_break_left=True), n_cols - 1))


def race_logits_rows(logits: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor, sampled: torch.Tensor,
                     ids: torch.Tensor | None = None, draws: torch.Tensor | None = None,
                     ahead: int = 0) -> torch.Tensor:
    """logits [N, V] (last dim contiguous), keys [N] int64, temperature [N] float32, sampled [N] (0: argmax)
    -> int64 [N]: argmax_v logits / T - log draw_noise(keys)[v] for sampled rows (the noise of token ids[n, v]
    when ids is given; the returned id too), argmax_v logits for the others. draws [N] int64: keys are the rows'
    seeds instead, and row n races with stream_keys(keys[n], draws[n] + ahead), hashed in the same launch."""
    t, flag = temperature.float().contiguous(), sampled.contiguous()
    seeded = draws is not None
    draws_t = draws.to(torch.int64).contiguous() if seeded else flag

    def slices(grid, ids_t, keys_, pv, pi, stride_ids, v, num_slices, has_ids):
        _race_logits_slices_kernel[grid](logits, ids_t, keys_, draws_t, t, flag, pv, pi, logits.stride(0), stride_ids,
                                         v, num_slices, ahead, _GOLDEN, _MIX1, _MIX2, HAS_IDS=has_ids, SEEDED=seeded,
                                         BLOCK=BLOCK, num_warps=8)

    return _race_two_pass("race_logits_rows", logits, keys, ids, slices)


@triton.jit
def _race_pick_kernel(PV, PI, IDS, OUT, stride_ids, num_slices, HAS_IDS: tl.constexpr, SLICES_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SLICES_PAD)
    v = tl.load(PV + row * num_slices + s, mask=s < num_slices, other=float("-inf"))
    j = tl.minimum(tl.argmax(v, 0, tie_break_left=True), num_slices - 1)  # never a padding slice
    col = tl.load(PI + row * num_slices + j).to(tl.int64)
    if HAS_IDS:
        col = tl.load(IDS + row * stride_ids + col).to(tl.int64)
    tl.store(OUT + row, col)


def race_rows(probs: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """probs [N, V] (any float dtype, last dim contiguous), keys [N] int64 stream keys, ids [N, V] int64 or None
    -> int64 [N]: argmax_v probs / draw_noise(keys)[v] (the noise of token ids[n, v] when ids is given)."""
    def slices(grid, ids_t, keys_, pv, pi, stride_ids, v, num_slices, has_ids):
        _race_slices_kernel[grid](probs, ids_t, keys_, pv, pi, probs.stride(0), stride_ids, v, num_slices,
                                  _GOLDEN, _MIX1, _MIX2, HAS_IDS=has_ids, BLOCK=BLOCK, num_warps=8)

    return _race_two_pass("race_rows", probs, keys, ids, slices)


def _race_two_pass(name: str, x: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None, slices) -> torch.Tensor:
    """Each (row, slice)'s best by `slices` (a launch over grid (N, slices)), then each row's winning slice."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} needs a [N, V] tensor with a contiguous last dim, got {tuple(x.shape)}.")
    n, v = x.shape
    out = torch.empty(n, dtype=torch.long, device=x.device)
    if n == 0:
        return out
    num_slices = triton.cdiv(v, BLOCK)
    pv = torch.empty((n, num_slices), dtype=torch.float32, device=x.device)
    pi = torch.empty((n, num_slices), dtype=torch.int32, device=x.device)
    keys = keys.to(torch.int64).contiguous()
    has_ids = ids is not None
    ids_t = ids if has_ids else keys
    stride_ids = ids.stride(0) if has_ids else 0
    slices((n, num_slices), ids_t, keys, pv, pi, stride_ids, v, num_slices, has_ids)
    _race_pick_kernel[(n,)](pv, pi, ids_t, out, stride_ids, num_slices, HAS_IDS=has_ids,
                            SLICES_PAD=max(2, triton.next_power_of_2(num_slices)), num_warps=1)
    return out
