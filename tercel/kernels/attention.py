"""Paged attention kernels (Triton) over Tercel's KV layout: per layer k/v [slots, Hkv, D],
slot = block_table[request, pos // page] * page + pos % page.

decode_attention   one query per request. Split-KV ("flash decoding"): grid (B, Hkv, splits), each
                   program serves the whole GQA group of one KV head over a 1/splits share of the
                   keys (the share is computed in the kernel from seq_lens, so a captured graph
                   serves any length); a second kernel merges the splits by their log-sum-exp.
                   With one split the first kernel writes the output directly.
decode_attention_rope  the decode step in one launch: RoPE + K/V store + split-KV attention, the splits
                   merged by the last program of each (request, KV head) to finish (an arrival counter).
extend_attention   several queries per request (prefill chunks, verify blocks, trees): causal over
                   prefix + new tokens, or, per request, a custom [q, q] mask among the new tokens.

Both take every size from device tensors or from shapes fixed at capture, so they are safe inside
CUDA graphs. Keys beyond a request's seq_len are never read, so block-table columns past a
request's own blocks may hold anything.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl_mode, pdl_small

LOG2E = 1.4426950408889634


@triton.jit
def _prefetch_l2(P, nbytes, pid, nprog, NT: tl.constexpr):
    """Program pid of nprog asks for its share of P's first nbytes in L2 (bulk prefetch, one per thread):
    a hint with no result, so a latency-bound kernel can pull the next layer's weights into L2."""
    per = tl.cdiv(tl.cdiv(nbytes, nprog), 16 * NT) * 16  # bytes per thread, a multiple of 16
    off = (pid * NT + tl.arange(0, NT)).to(tl.int64) * per
    size = (tl.minimum(tl.maximum(nbytes - off, 0), per) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                              "mov.u32 $0, 0; }", "=r,l,r", [P.to(tl.pointer_type(tl.int8)) + off, size],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 models: exact fp32 products
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _softmax_step(s, valid, m_i, l_i, qk_scale):
    """One block of the online softmax: raw scores s [G, N] (valid [N]) -> probabilities, the old terms' rescale,
    the new running max and sum."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_keys(q, KC, VC, BT, b, kvh, start, end, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_bt,
                 qk_scale, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 IEEE: tl.constexpr):
    """Online softmax of q [GROUP_PAD, D] over one KV head's keys [start, end): (max, sum, unnormalised out)."""
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(BT + b * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        k = tl.load(KC + slot[:, None] * stride_kcs + kvh * stride_kch + d[None, :], mask=valid[:, None], other=0.0)
        p, alpha, m_i, l_i = _softmax_step(_dot(q, tl.trans(k), IEEE), valid, m_i, l_i, qk_scale)
        v = tl.load(VC + slot[:, None] * stride_vcs + kvh * stride_vch + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_i, l_i, acc


@triton.jit
def _store_split(m_i, l_i, acc, O, PO, PL, b, heads, gm, d, split, stride_ob, stride_oh, stride_pob, stride_poh,
                 stride_pos, stride_plb, stride_plh, NUM_SPLITS: tl.constexpr):
    """A split's normalised output: straight to O when it is the only split, else its partial output
    and log-sum-exp (base 2) for the merge."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=gm[:, None])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(PO + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + d[None, :], out,
                 mask=gm[:, None])
        tl.store(PL + b * stride_plb + heads * stride_plh + split, lse, mask=gm)


@triton.jit
def _decode_split_kernel(Q, KC, VC, BT, SL, O, PO, PL, PF, pf_bytes,
                         stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_bt,
                         stride_ob, stride_oh, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                         qk_scale, window,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr,
                         PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PREFETCH:
        pid = (tl.program_id(0) * tl.num_programs(1) + kvh) * NUM_SPLITS + split
        _prefetch_l2(PF, pf_bytes, pid, tl.num_programs(0) * tl.num_programs(1) * NUM_SPLITS, 128)
    if PDL:  # the queries, keys and lengths may come from the previous kernel
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(SL + b).to(tl.int32)
    per = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * per
    end = tl.minimum(start + per, seq_len)
    if window > 0:
        start = tl.maximum(start, seq_len - window)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    gm = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None], other=0.0)
    m_i, l_i, acc = _attend_keys(q, KC, VC, BT, b, kvh, start, end, stride_kcs, stride_kch, stride_vcs, stride_vch,
                                 stride_bt, qk_scale, GROUP_PAD, HEAD_DIM, PAGE, BLOCK_N, IEEE)
    if PDL:  # the keys and values are read
        tl.extra.cuda.gdc_launch_dependents()
    _store_split(m_i, l_i, acc, O, PO, PL, b, heads, gm, d, split, stride_ob, stride_oh, stride_pob, stride_poh,
                 stride_pos, stride_plb, stride_plh, NUM_SPLITS)


@triton.jit
def _decode_merge_kernel(PO, PL, O, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    sm = s < NUM_SPLITS
    if PDL:  # the partials are the previous kernel's
        tl.extra.cuda.gdc_wait()
    lse = tl.load(PL + b * stride_plb + h * stride_plh + s, mask=sm, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.where(sm & (lse > float("-inf")), tl.exp2(lse - mx), 0.0)
    po = tl.load(PO + b * stride_pob + h * stride_poh + s[:, None] * stride_pos + d[None, :], mask=sm[:, None],
                 other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(po * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ob + h * stride_oh + d, out.to(O.dtype.element_ty))


def decode_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits per (request, KV head) so that about two waves of programs cover the GPU, a power of two
    (few kernel variants to compile). Depends only on the batch size, so eager and graph runs of one
    size use the same kernels (same rounding)."""
    want = max(1, min(max_splits, (2 * num_sms) // max(1, batch_size * num_kv_heads)))
    return 1 << (want.bit_length() - 1)


def _prefetch_args(prefetch: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(tensor, bytes, on) for a kernel's L2 prefetch: only a contiguous, 16-byte aligned CUDA tensor."""
    ok = (prefetch is not None and prefetch.is_cuda and like.is_cuda and prefetch.is_contiguous()
          and prefetch.data_ptr() % 16 == 0)
    return (prefetch, prefetch.numel() * prefetch.element_size(), True) if ok else (like, 0, False)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, page_size: int, scale: float, num_splits: int,
                     window: int | None = None, out: torch.Tensor | None = None,
                     prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [slots, Hkv, D]; block_tables: [B, W]; seq_lens: [B] (>= 1).
    prefetch: a tensor to pull into L2 meanwhile (the o_proj weight that reads this output). Returns [B, H, D]."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if out is None:
        out = torch.empty((bsz, heads, dim), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    if num_splits > 1:
        part_o = torch.empty((bsz, heads, num_splits, dim), dtype=torch.float32, device=q.device)
        part_l = torch.empty((bsz, heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o, part_l = out, out  # unused
    block_n = 64 if dim <= 128 else 32
    pf, pf_bytes, pf_on = _prefetch_args(prefetch, q)
    pdl = pdl_small(q)
    launch = dict(launch_pdl=True) if pdl else {}
    _decode_split_kernel[(bsz, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_l, pf, pf_bytes,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        part_o.stride(0) if num_splits > 1 else 0, part_o.stride(1) if num_splits > 1 else 0,
        part_o.stride(2) if num_splits > 1 else 0, part_l.stride(0) if num_splits > 1 else 0,
        part_l.stride(1) if num_splits > 1 else 0,
        scale * LOG2E, window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, PAGE=page_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32, PREFETCH=pf_on, PDL=pdl,
        num_warps=4, num_stages=2, **launch)
    if num_splits > 1:
        _merge(part_o, part_l, out, pdl)
    return out


def _merge(part_o: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    """The split-KV partials [B, H, S, D] / [B, H, S] merged into out [B, H, D] (a launch of its own)."""
    bsz, heads, splits, dim = part_o.shape
    _decode_merge_kernel[(bsz, heads)](
        part_o, part_l, out, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=dim, NUM_SPLITS=splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)), PDL=pdl, num_warps=4,
        **(dict(launch_pdl=True) if pdl else {}))


def decode_attention_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, scale: float,
                              num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV decode kernel's partial results, unmerged, for a caller that merges them with attention over
    keys that are not in the paged cache (EAGLE's tree draft: the paged prefix here, the tree's own leaves
    beside it). q: [R, H, D]; block_tables: [R, W]; seq_lens: [R] (0: no keys, that row's partials are empty).
    Returns (outputs [R, H, S, D] fp32, each split's softmax-normalised output; lse [R, H, S] fp32, each split's
    log-sum-exp in base 2 of scale * log2(e) * q.k, -inf for a split with no keys), S = max(2, num_splits)."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    splits = max(2, num_splits)  # the kernel writes partials only when it splits
    part_o = torch.empty((rows, heads, splits, dim), dtype=torch.float32, device=q.device)
    part_l = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
    if rows == 0:
        return part_o, part_l
    _decode_split_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_o, part_l, q, 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), 0, 0, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0),
        part_l.stride(1), scale * LOG2E, 0,
        GROUP=heads // kv_heads, GROUP_PAD=max(16, triton.next_power_of_2(heads // kv_heads)), HEAD_DIM=dim,
        PAGE=page_size, BLOCK_N=64 if dim <= 128 else 32, NUM_SPLITS=splits, IEEE=q.dtype == torch.float32,
        PREFETCH=False, PDL=False, num_warps=4, num_stages=2)
    return part_o, part_l


@triton.jit
def _extend_kernel(Q, KC, VC, O, BT, SL, QS, QL, MASK, MOFF,
                   stride_qt, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_bt,
                   stride_ot, stride_oh, qk_scale, window,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_len = tl.load(QL + b).to(tl.int32)
    if m0 < q_len:
        q_start = tl.load(QS + b).to(tl.int64)
        seq_len = tl.load(SL + b).to(tl.int32)
        prefix = seq_len - q_len
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mv = offs_m < q_len
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=mv[:, None],
                    other=0.0)
        q_pos = prefix + offs_m
        end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
        moff = tl.full([], -1, tl.int64)
        if HAS_MASK:
            moff = tl.load(MOFF + b).to(tl.int64)
            end = tl.where(moff >= 0, seq_len, end)  # a custom mask may look past the causal edge
        lo = prefix * 0
        if window > 0:
            lo = tl.maximum(prefix + m0 - window + 1, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for n0 in range(lo, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            kv_ok = pos < end
            page = tl.load(BT + b * stride_bt + pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
            slot = page * PAGE + pos % PAGE
            k = tl.load(KC + slot[:, None] * stride_kcs + kvh * stride_kch + d[None, :], mask=kv_ok[:, None],
                        other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            allowed = kv_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            if HAS_MASK:
                new = (pos >= prefix) & (moff >= 0)
                mval = tl.load(MASK + moff + offs_m[:, None] * q_len + (pos - prefix)[None, :],
                               mask=mv[:, None] & new[None, :] & kv_ok[None, :], other=0)
                allowed = tl.where(new[None, :], kv_ok[None, :] & (mval != 0), allowed)
            if window > 0:
                allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + slot[:, None] * stride_vcs + kvh * stride_vch + d[None, :], mask=kv_ok[:, None],
                        other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=mv[:, None])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor, max_q_len: int,
                     page_size: int, scale: float, window: int | None = None, masks: torch.Tensor | None = None,
                     mask_offsets: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] packed by request (request b's queries at q_starts[b] .. + q_lens[b]); their K/V are
    already in the cache. masks: flat bool/uint8 [sum q_len^2] with mask_offsets[b] (-1: causal)."""
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if out is None:
        out = torch.empty((t, heads, dim), dtype=q.dtype, device=q.device)
    bsz = seq_lens.shape[0]
    if t == 0 or bsz == 0:
        return out
    block_m = 16 if max_q_len <= 16 else 64
    has_mask = masks is not None
    if has_mask and masks.dtype == torch.bool:
        masks = masks.view(torch.uint8)
    _extend_kernel[(bsz, heads, triton.cdiv(max_q_len, block_m))](
        q, k_cache, v_cache, out, block_tables, seq_lens, q_starts, q_lens,
        masks if has_mask else q_lens, mask_offsets if has_mask else q_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E, window or 0,
        GROUP=heads // kv_heads, HEAD_DIM=dim, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=64 if dim <= 128 else 32,
        HAS_MASK=has_mask, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    return out


@triton.jit
def _attend_new_keys(q, m_i, l_i, acc, QK, V, COS, SIN, r0, kvh, base, lo, hi, stride_qkt, stride_qkh, stride_vt,
                     stride_vh, stride_ct, stride_st, qk_scale, k_dtype, v_dtype, NQ: tl.constexpr,
                     HEAD_DIM: tl.constexpr, T_PAD: tl.constexpr, IEEE: tl.constexpr):
    """The online softmax of _attend_keys continued over a request's new keys at positions [lo, hi) (base:
    the position of its first new token, row r0), rotated and rounded from QK / V as the cache would hold them:
    the rows of a verify block are stored by their own programs, so none reads another's from the cache."""
    i = tl.arange(0, T_PAD)
    pos = base + i
    valid = (pos >= lo) & (pos < hi)
    rows = (r0 + i).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
    vm = valid[:, None]
    kp = QK + rows[:, None] * stride_qkt + (NQ + kvh) * stride_qkh
    kx = tl.load(kp + d[None, :], mask=vm, other=0.0).to(tl.float32)
    kxp = tl.load(kp + partner[None, :], mask=vm, other=0.0).to(tl.float32)
    c = tl.load(COS + rows[:, None] * stride_ct + d[None, :], mask=vm, other=0.0).to(tl.float32)
    sn = tl.load(SIN + rows[:, None] * stride_st + d[None, :], mask=vm, other=0.0).to(tl.float32)
    k = (kx * c + sign[None, :] * kxp * sn).to(k_dtype)
    v = tl.load(V + rows[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=vm, other=0.0).to(v_dtype)
    p, alpha, m_i, l_i = _softmax_step(_dot(q, tl.trans(k), IEEE), valid, m_i, l_i, qk_scale)
    return m_i, l_i, acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)


@triton.jit
def _decode_rope_kernel(QK, V, COS, SIN, LOC, KC, VC, BT, SL, O, PO, PL, CNT, PF, pf_bytes,
                        stride_qkt, stride_qkh, stride_vt, stride_vh, stride_ct, stride_st,
                        stride_kcs, stride_kch, stride_vcs, stride_vch, stride_bt,
                        stride_ob, stride_oh, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                        qk_scale, window, rows,
                        NQ: tl.constexpr, NKV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        SPLITS_PAD: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, MERGE: tl.constexpr,
                        PREFETCH: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        T_PAD: tl.constexpr):
    # rows (a verify block's length) is a runtime value, so each of a run's block sizes does not compile its own
    # kernel; BLOCK_ROWS (rows > 1) and T_PAD (rows rounded up to a tile) are the only compile-time choices
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PREFETCH:  # weights: no dependence on the previous kernel
        pid = (tl.program_id(0) * NKV + kvh) * NUM_SPLITS + split
        _prefetch_l2(PF, pf_bytes, pid, tl.num_programs(0) * NKV * NUM_SPLITS, 128)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    seq_len = tl.load(SL + b).to(tl.int32)
    per = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * per
    end = tl.minimum(start + per, seq_len)
    if window > 0:
        start = tl.maximum(start, seq_len - window)
    d = tl.arange(0, HEAD_DIM)
    # RoPE as fused.rope_store: out[d] = x[d] cos[d] -+ x[d +- D/2] sin[d] (minus in the first half)
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
    c = tl.load(COS + b * stride_ct + d).to(tl.float32)
    sn = tl.load(SIN + b * stride_st + d).to(tl.float32)
    if split == (seq_len - 1) // per:  # this split's keys end with the row's new token: rotate and store it
        kp = QK + b * stride_qkt + (NQ + kvh) * stride_qkh
        kx = tl.load(kp + d).to(tl.float32)
        kxp = tl.load(kp + partner).to(tl.float32)
        loc = tl.load(LOC + b).to(tl.int64)
        tl.store(KC + loc * stride_kcs + kvh * stride_kch + d, (kx * c + sign * kxp * sn).to(KC.dtype.element_ty))
        tl.store(VC + loc * stride_vcs + kvh * stride_vch + d, tl.load(V + b * stride_vt + kvh * stride_vh + d))
    if not BLOCK_ROWS:
        tl.debug_barrier()  # the new key and value are read back below, by other threads of this program
    g = tl.arange(0, GROUP_PAD)
    gm = g < GROUP
    heads = kvh * GROUP + g
    qp = QK + b * stride_qkt + heads[:, None] * stride_qkh
    x = tl.load(qp + d[None, :], mask=gm[:, None], other=0.0)
    xp = tl.load(qp + partner[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
    q = (x.to(tl.float32) * c[None, :] + sign[None, :] * xp * sn[None, :]).to(x.dtype)
    if not BLOCK_ROWS:
        m_i, l_i, acc = _attend_keys(q, KC, VC, BT, b, kvh, start, end, stride_kcs, stride_kch, stride_vcs,
                                     stride_vch, stride_bt, qk_scale, GROUP_PAD, HEAD_DIM, PAGE, BLOCK_N, IEEE)
    else:  # row j of a verify block: the cache up to the block's first position, then the block's keys 0..j
        j = (b % rows).to(tl.int32)
        base = seq_len - 1 - j
        m_i, l_i, acc = _attend_keys(q, KC, VC, BT, b, kvh, start, tl.minimum(end, base), stride_kcs, stride_kch,
                                     stride_vcs, stride_vch, stride_bt, qk_scale, GROUP_PAD, HEAD_DIM, PAGE, BLOCK_N,
                                     IEEE)
        if tl.maximum(start, base) < end:
            m_i, l_i, acc = _attend_new_keys(q, m_i, l_i, acc, QK, V, COS, SIN, b - j, kvh, base, start, end,
                                             stride_qkt, stride_qkh, stride_vt, stride_vh, stride_ct, stride_st,
                                             qk_scale, KC.dtype.element_ty, VC.dtype.element_ty, NQ, HEAD_DIM, T_PAD,
                                             IEEE)
    if PDL >= 2:  # the keys and values are read: the next kernel (the o_proj GEMV) may start streaming
        tl.extra.cuda.gdc_launch_dependents()
    _store_split(m_i, l_i, acc, O, PO, PL, b, heads, gm, d, split, stride_ob, stride_oh, stride_pob, stride_poh,
                 stride_pos, stride_plb, stride_plh, NUM_SPLITS)
    if NUM_SPLITS > 1 and MERGE:
        # the last split of this (request, KV head) to arrive merges them all (no second launch): every
        # thread's partials are stored before the release, and read (past L1) after the acquire
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + b * NKV + kvh, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:  # every head of the group at once: one round of loads, not GROUP
            s = tl.arange(0, SPLITS_PAD)
            sm = s < NUM_SPLITS
            gi = tl.arange(0, GROUP_M)
            h = kvh * GROUP + gi
            hm = gi < GROUP
            lm = hm[:, None] & sm[None, :]
            ls = tl.load(PL + b * stride_plb + h[:, None] * stride_plh + s[None, :], mask=lm, other=float("-inf"),
                         cache_modifier=".cg")
            po = tl.load(PO + b * stride_pob + h[:, None, None] * stride_poh + s[None, :, None] * stride_pos
                         + d[None, None, :], mask=lm[:, :, None], other=0.0, cache_modifier=".cg")
            mx = tl.max(ls, 1)
            w = tl.where(lm & (ls > float("-inf")), tl.exp2(ls - mx[:, None]), 0.0)
            merged = tl.sum(po * w[:, :, None], 1) / tl.sum(w, 1)[:, None]
            tl.store(O + b * stride_ob + h[:, None] * stride_oh + d[None, :], merged.to(O.dtype.element_ty),
                     mask=hm[:, None])
            tl.atomic_xchg(CNT + b * NKV + kvh, 0, sem="relaxed", scope="gpu")  # ready for the next layer


def decode_attention_rope(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          out_cache_loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, scale: float,
                          num_splits: int, counters: torch.Tensor | None, window: int | None = None,
                          merge_in_kernel: bool = True, prefetch: torch.Tensor | None = None,
                          rows: int = 1) -> torch.Tensor:
    """Decode (one query per request) in ONE launch: RoPE on q and the new k, k and v stored at
    out_cache_loc, split-KV attention over the cache, and the merge of the splits, done by the last split
    of each (request, KV head) to finish. qk: [B, H + Hkv, D], v: [B, Hkv, D] (views into the qkv output);
    cos/sin: [B, D] or [B, 1, D]; counters: int32 zeros, at least B * Hkv of them (needed when
    num_splits > 1; each launch leaves them zero). merge_in_kernel=False: a second launch merges instead (no
    counters). prefetch: as decode_attention. Same result as rope_store + decode_attention. Returns [B, H, D].
    rows > 1: a causal verify block as decode rows (the backend's rows metadata): B = requests x rows, row j of
    a request at seq_lens[row] = its first new position + j + 1; each row stores its own key and value and reads
    the block's earlier ones from qk / v, so no row waits for another's store (no rope_store launch before)."""
    bsz, heads_all, dim = qk.shape
    if rows < 1 or bsz % rows:
        raise ValueError(f"decode_attention_rope: {bsz} query rows do not split into blocks of rows={rows}.")
    kv_heads = k_cache.shape[1]
    heads = heads_all - kv_heads
    group = heads // kv_heads
    if qk.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention_rope needs the head dimension contiguous.")
    if dim & (dim - 1):
        raise ValueError(f"decode_attention_rope needs a power-of-two head_dim, got {dim}.")
    merge_in_kernel = merge_in_kernel and num_splits > 1
    if merge_in_kernel and (counters is None or counters.numel() < bsz * kv_heads):
        raise ValueError(f"decode_attention_rope with {num_splits} splits needs {bsz * kv_heads} split counters.")
    out = torch.empty((bsz, heads, dim), dtype=qk.dtype, device=qk.device)
    if bsz == 0:
        return out
    cos2, sin2 = cos.reshape(bsz, -1), sin.reshape(bsz, -1)
    if num_splits > 1:
        part_o = torch.empty((bsz, heads, num_splits, dim), dtype=torch.float32, device=qk.device)
        part_l = torch.empty((bsz, heads, num_splits), dtype=torch.float32, device=qk.device)
        po_strides = part_o.stride()[:3]
        pl_strides = part_l.stride()[:2]
    else:
        part_o, part_l = out, out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    if not merge_in_kernel:
        counters = seq_lens  # unused
    pdl = pdl_mode(qk)
    pf, pf_bytes, pf_on = _prefetch_args(prefetch, qk)
    t_pad = max(16, triton.next_power_of_2(rows))  # the block's keys as one tile (tl.dot: 16 at least)
    _decode_rope_kernel[(bsz, kv_heads, num_splits)](
        qk, v, cos2, sin2, out_cache_loc, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_l, counters,
        pf, pf_bytes,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos2.stride(0), sin2.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), *po_strides, *pl_strides, scale * LOG2E, window or 0, rows,
        NQ=heads, NKV=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        PAGE=page_size, BLOCK_N=64 if dim <= 128 else 32, NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), IEEE=qk.dtype == torch.float32, PDL=pdl,
        MERGE=merge_in_kernel, PREFETCH=pf_on, GROUP_M=max(2, triton.next_power_of_2(group)), BLOCK_ROWS=rows > 1,
        T_PAD=t_pad, num_warps=4,
        num_stages=2, **(dict(launch_pdl=True) if pdl else {}))
    if num_splits > 1 and not merge_in_kernel:
        _merge(part_o, part_l, out, pdl_small(qk))
    return out
