"""Checks of the Triton kernels against the PyTorch reference, shared by the GPU tests (native
kernels on CUDA) and the CPU tests (TRITON_INTERPRET=1, in a subprocess). Run directly:
TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernel_checks.py
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch
import torch.nn.functional as F


def _patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns 1-element arrays into loop bounds with int(array), which
    NumPy 2 rejects; take the element instead (CPU development only)."""
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_for_numpy2()


def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


class _TorchPaths:
    """Inside the block the given modules' use_triton says no: their torch paths run (the reference)."""

    def __init__(self, *modules) -> None:
        self.modules = modules

    def __enter__(self) -> None:
        self.saved = [m.use_triton for m in self.modules]
        for m in self.modules:
            m.use_triton = lambda *a: False

    def __exit__(self, *exc) -> None:
        for m, f in zip(self.modules, self.saved):
            m.use_triton = f


def check_norms(device: str, dtype: torch.dtype) -> None:
    from tercel.kernels.fused import add_rms_norm, rms_norm, silu_mul

    g = torch.Generator(device="cpu").manual_seed(0)
    for rows, cols in [(1, 576), (7, 4096), (33, 100)]:
        x = torch.randn(rows, cols, generator=g).to(device, dtype)
        r = torch.randn(rows, cols, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(cols, generator=g)).to(device, dtype)
        s = (r + x)
        ref = w * (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        y, r_out = add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(r_out, s), "residual sum differs"
        assert _rel(y, ref) < _tol(dtype), _rel(y, ref)
        y2 = rms_norm(s, w, 1e-5)
        assert _rel(y2, ref) < _tol(dtype)
        gu = torch.randn(rows, 2 * cols, generator=g).to(device, dtype)
        gate, up = gu.chunk(2, dim=-1)
        assert _rel(silu_mul(gu), F.silu(gate) * up) < _tol(dtype)


def check_rope_store(device: str, dtype: torch.dtype) -> None:
    from tercel.kernels.fused import rope_store
    from tercel.models.rope import apply_rope

    g = torch.Generator(device="cpu").manual_seed(1)
    t, nq, nkv, d, slots = 5, 6, 2, 64, 40
    qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g).to(device, dtype)
    qk = qkv[:, :(nq + nkv) * d].view(t, nq + nkv, d)
    v = qkv[:, (nq + nkv) * d:].view(t, nkv, d)
    ang = torch.rand(t, d // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(device, dtype)[:, None, :]
    loc = torch.tensor([3, 17, 0, 39, 8], device=device)
    kc = torch.zeros(slots, nkv, d, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    q = rope_store(qk, v, cos, sin, loc, kc, vc, nq)
    ref = apply_rope(qk, cos, sin)
    assert _rel(q, ref[:, :nq]) < _tol(dtype)
    assert _rel(kc[loc], ref[:, nq:]) < _tol(dtype)
    assert torch.equal(vc[loc], v)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert kc[untouched.to(device)].abs().sum() == 0


def _paged_case(device: str, dtype: torch.dtype, seq_lens: list[int], nq: int, nkv: int, d: int, page: int,
                seed: int):
    """A random paged cache with shuffled blocks (block 0 reserved) and the block tables of len(seq_lens) requests."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = [math.ceil(s / page) for s in seq_lens]
    num_blocks = sum(need) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, i = [], 0
    width = max(need) + 2
    for n in need:
        row = perm[i:i + n]
        i += n
        # columns past a request's blocks hold other requests' blocks: kernels must not read them
        tables.append(row + perm[:width - n])
    kc = torch.randn(num_blocks * page, nkv, d, generator=g).to(device, dtype)
    vc = torch.randn(num_blocks * page, nkv, d, generator=g).to(device, dtype)
    bt = torch.tensor(tables, device=device)
    return kc, vc, bt


def _ref_attention(q_rows: torch.Tensor, kc, vc, table: torch.Tensor, seq_len: int, page: int, scale: float,
                   mask: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(seq_len, device=kc.device)
    slots = table[pos // page] * page + pos % page
    keys = kc[slots].double().transpose(0, 1)  # [Hkv, S, D]
    vals = vc[slots].double().transpose(0, 1)
    qd = q_rows.double().transpose(0, 1)  # [H, q, D]
    rep = qd.shape[0] // keys.shape[0]
    keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
    s = (qd @ keys.transpose(1, 2)) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    return (s.softmax(-1) @ vals).transpose(0, 1)  # [q, H, D]


def check_decode(device: str, dtype: torch.dtype) -> None:
    from tercel.kernels.attention import decode_attention

    nq, nkv, d, page = 8, 2, 64, 16
    seq_lens = [1, 17, 100, 64, 250]
    kc, vc, bt = _paged_case(device, dtype, seq_lens, nq, nkv, d, page, seed=2)
    g = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(len(seq_lens), nq, d, generator=g).to(device, dtype)
    sl = torch.tensor(seq_lens, device=device)
    scale = d ** -0.5
    for splits in (1, 3, 8):
        for window in (None, 40):
            out = decode_attention(q, kc, vc, bt, sl, page, scale, splits, window=window, prefetch=kc)
            for b, s in enumerate(seq_lens):
                pos = torch.arange(s, device=device)
                mask = torch.ones(1, s, dtype=torch.bool, device=device)
                if window:
                    mask &= pos[None] > (s - 1 - window)
                ref = _ref_attention(q[b:b + 1], kc, vc, bt[b], s, page, scale, mask)
                err = _rel(out[b:b + 1], ref)
                assert err < _tol(dtype), (splits, window, b, err)


def check_extend(device: str, dtype: torch.dtype) -> None:
    from tercel.kernels.attention import extend_attention

    nq, nkv, d, page = 6, 3, 64, 16
    seq_lens = [5, 70, 33, 90]
    q_lens = [5, 70, 4, 4]  # a whole prefill, a long chunk, two verify blocks
    kc, vc, bt = _paged_case(device, dtype, seq_lens, nq, nkv, d, page, seed=4)
    g = torch.Generator(device="cpu").manual_seed(5)
    t = sum(q_lens)
    q = torch.randn(t, nq, d, generator=g).to(device, dtype)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    scale = d ** -0.5
    for use_mask in (False, True):
        for window in (None, 24):
            masks = offsets = None
            if use_mask:  # request 3 verifies a tree; the others stay causal
                masks = tree.flatten().to(device)
                offsets = torch.tensor([-1, -1, -1, 0], device=device)
            out = extend_attention(q, kc, vc, bt, torch.tensor(seq_lens, device=device),
                                   torch.tensor(starts, device=device), torch.tensor(q_lens, device=device),
                                   max(q_lens), page, scale, window=window, masks=masks, mask_offsets=offsets)
            for b, (s, ql, st) in enumerate(zip(seq_lens, q_lens, starts)):
                prefix = s - ql
                kv_idx = torch.arange(s, device=device)
                q_idx = torch.arange(ql, device=device) + prefix
                mask = kv_idx[None, :] <= q_idx[:, None]
                if use_mask and b == 3:
                    mask[:, prefix:] = tree.to(device)
                if window:
                    mask &= kv_idx[None, :] > (q_idx[:, None] - window)
                ref = _ref_attention(q[st:st + ql], kc, vc, bt[b], s, page, scale, mask)
                err = _rel(out[st:st + ql], ref)
                assert err < _tol(dtype), (use_mask, window, b, err)


def check_gemv(device: str, dtype: torch.dtype) -> None:
    """The batch-1 GEMV, one and several K splits, ragged N and K, and the model's routing to it."""
    from tercel.kernels.gemv import GemvConfig, gemv
    from tercel.models.linear import Linear

    g = torch.Generator(device="cpu").manual_seed(5)
    for n, k in [(96, 256), (77, 300), (40, 1000)]:
        w = torch.randn(n, k, generator=g).to(device, dtype)
        x = torch.randn(1, k, generator=g).to(device, dtype)
        ref = F.linear(x.double(), w.double())
        for c in [GemvConfig(block_n=8, block_k=128), GemvConfig(block_n=16, block_k=64, split_k=3),
                  GemvConfig(block_n=4, block_k=128, split_k=4, num_warps=8)]:
            y = gemv(x, w, c)
            assert y.shape == (1, n) and y.dtype == dtype
            assert _rel(y, ref) < _tol(dtype), (n, k, c)
            y32 = gemv(x, w, c, out_dtype=torch.float32)  # fp32 logits: the same values, widened
            assert y32.dtype == torch.float32 and torch.equal(y32, y.float()), (n, k, c, "out_dtype")
    lin = Linear(64, 48, bias=False).to(device, dtype)
    lin.gemv = GemvConfig(block_n=8, block_k=32, split_k=2)
    x = torch.randn(1, 64, generator=g).to(device, dtype)
    with torch.no_grad():
        assert _rel(lin(x), F.linear(x.double(), lin.weight.double())) < _tol(dtype)
        x3 = torch.randn(3, 64, generator=g).to(device, dtype)  # several rows: cuBLAS
        assert torch.equal(lin(x3), F.linear(x3, lin.weight))
        from tercel.models.linear import linear
        for rows in (x, x3):  # out_dtype: GEMV-stored or widened after cuBLAS, the same values
            assert torch.equal(linear(rows, lin.weight, lin.gemv, out_dtype=torch.float32), lin(rows).float())


def check_gemv_fused(device: str, dtype: torch.dtype) -> None:
    """The batch-1 decode GEMVs with their prologue / epilogue equal the unfused kernels they replace."""
    from tercel.kernels.fused import rms_norm, silu_mul
    from tercel.kernels.gemv import GemvConfig, gemv

    g = torch.Generator(device="cpu").manual_seed(6)
    configs = [GemvConfig(block_n=8, block_k=128), GemvConfig(block_n=16, block_k=64, split_k=3),
               GemvConfig(block_n=4, block_k=256, split_k=2, num_warps=8)]
    for n, k in [(96, 256), (77, 300)]:
        w = torch.randn(n, k, generator=g).to(device, dtype)
        x = torch.randn(1, k, generator=g).to(device, dtype)
        gu = torch.randn(1, 2 * k, generator=g).to(device, dtype)
        r = torch.randn(1, n, generator=g).to(device, dtype)
        nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
        want_norm = gemv(rms_norm(x, nw, 1e-5), w, configs[0])
        want_silu = r + gemv(silu_mul(gu), w, configs[0])
        want_add = r + gemv(x, w, configs[0])
        for c in configs:
            y = gemv(x, w, c, norm_weight=nw, eps=1e-5)
            assert y.shape == (1, n) and y.dtype == dtype
            assert _rel(y, want_norm) < _tol(dtype) / 4, (n, k, c, "norm")
            assert _rel(gemv(gu, w, c, silu=True, residual=r), want_silu) < _tol(dtype) / 4, (n, k, c, "silu")
            assert _rel(gemv(x, w, c, residual=r), want_add) < _tol(dtype) / 4, (n, k, c, "add")
        ref = F.linear(rms_norm(x, nw, 1e-5).double(), w.double())  # and against float64
        assert _rel(gemv(x, w, configs[1], norm_weight=nw, eps=1e-5), ref) < _tol(dtype)
        # norm_after: the rms applied to the fp32 product (no rounding of the normed row), so measured
        # against the exact float64 norm + product, and at least as close to it as the unfused kernels
        xd = x.double()
        exact = F.linear(xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double(), w.double())
        for c in (GemvConfig(block_n=8, block_k=128, norm_after=True),
                  GemvConfig(block_n=4, block_k=64, norm_after=True)):
            y = gemv(x, w, c, norm_weight=nw, eps=1e-5)
            assert y.shape == (1, n) and y.dtype == dtype
            assert _rel(y, exact) <= (max(_rel(want_norm, exact), 1e-6) * 1.5
                                      + (1e-6 if dtype == torch.float32 else 4e-3)), (n, k, c)
            assert torch.equal(gemv(x, w, c, norm_weight=nw, eps=1e-5, out_dtype=torch.float32), y.float())
        try:
            gemv(x, w, GemvConfig(block_n=8, block_k=64, split_k=2, norm_after=True), norm_weight=nw, eps=1e-5)
        except ValueError as e:
            assert "norm_after" in str(e) or "split_k=1" in str(e)
        else:
            raise AssertionError("norm_after with split_k > 1 must be refused")


def _small_m_case(device: str, dtype: torch.dtype, m: int, n: int, k: int, g: torch.Generator) -> dict:
    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    return dict(w=rnd(n, k), x=rnd(m, k), gu=rnd(m, 2 * k), r=rnd(m, n),
                nw=(1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype))


def check_gemm_small(device: str, dtype: torch.dtype) -> None:
    """The small-M GEMM (2..32 rows, kernels.gemm_small) with every fusion equals the unfused kernels row
    by row: several row counts and shapes, the broadcast product and tl.dot (rows or weights as the MMA's M),
    split-K; fp32 logits are the rounded values widened; rows never see each other (a changed row leaves the
    others bit-equal)."""
    from tercel.kernels.fused import rms_norm, silu_mul
    from tercel.kernels.gemv import GemvConfig, gemv

    g = torch.Generator(device="cpu").manual_seed(12)
    cases = [(2, 40, 96, GemvConfig(block_n=8, block_k=32)),
             (5, 33, 80, GemvConfig(block_n=4, block_k=32, split_k=2)),
             (13, 48, 96, GemvConfig(block_n=16, block_k=32, dot=True)),
             (32, 40, 64, GemvConfig(block_n=16, block_k=16, split_k=3, dot=True)),
             (6, 33, 80, GemvConfig(block_n=4, block_k=128, rowloop=True)),
             (16, 40, 96, GemvConfig(block_n=8, block_k=128, num_warps=8, rowloop=True)),
             (3, 40, 64, GemvConfig(block_n=2, block_k=64, rowloop=True)),
             (7, 40, 96, GemvConfig(block_n=16, block_k=32, dot=True, swap=True)),  # w @ x^T
             (20, 48, 80, GemvConfig(block_n=32, block_k=16, split_k=2, dot=True, swap=True)),
             (6, 33, 80, GemvConfig(block_n=4, block_k=32, rowgrid=True)),  # the batch-1 kernel per row
             (5, 40, 96, GemvConfig(block_n=8, block_k=32, split_k=2, rowgrid=True))]
    if dtype != torch.float32:  # bf16 under the interpreter is slow: the five kernels, one case each
        cases = cases[1:3] + cases[4:5] + cases[7:8] + cases[10:]
    tol = _tol(dtype) / (4 if dtype == torch.float32 else 2)  # bf16: both sides round the product, then the sum
    for m, n, k, c in cases:
        d = _small_m_case(device, dtype, m, n, k, g)
        w, x, gu, r, nw = d["w"], d["x"], d["gu"], d["r"], d["nw"]
        y = gemv(x, w, c)
        assert y.shape == (m, n) and y.dtype == dtype
        assert _rel(y, F.linear(x.double(), w.double())) < _tol(dtype), (m, c, "plain")
        normed = gemv(x, w, c, norm_weight=nw, eps=1e-5)
        assert _rel(normed, F.linear(rms_norm(x, nw, 1e-5), w)) < tol, (m, c, "norm")
        assert _rel(gemv(gu, w, c, silu=True, residual=r), r + F.linear(silu_mul(gu), w)) < tol, (m, c, "silu")
        added = gemv(x, w, c, residual=r)
        assert _rel(added, r + F.linear(x, w)) < tol, (m, c, "add")
        logits = gemv(x, w, c, norm_weight=nw, eps=1e-5, out_dtype=torch.float32)
        assert logits.dtype == torch.float32 and torch.equal(logits, normed.float()), (m, c, "out_dtype")
        x2, r2 = x.clone(), r.clone()
        x2[0], r2[0] = 3 * x2[0], -r2[0]
        assert torch.equal(gemv(x2, w, c, residual=r2)[1:], added[1:]), (m, c, "rows mixed")
        assert torch.equal(gemv(x2, w, c, norm_weight=nw, eps=1e-5)[1:], normed[1:]), (m, c, "norm rows mixed")
        if c.rowgrid:  # each row is the batch-1 GEMV of that row, bit for bit (a verify row = its decode)
            one = dataclasses.replace(c, rowgrid=False)
            for i in (0, m - 1):
                assert torch.equal(normed[i:i + 1], gemv(x[i:i + 1].contiguous(), w, one, norm_weight=nw, eps=1e-5))
                assert torch.equal(added[i:i + 1], gemv(x[i:i + 1].contiguous(), w, one, residual=r[i:i + 1]))
                assert torch.equal(gemv(gu, w, c, silu=True, residual=r)[i:i + 1],
                                   gemv(gu[i:i + 1].contiguous(), w, one, silu=True, residual=r[i:i + 1]))
    m, n, k = 6, 40, 96  # norm_after: the rms on the fp32 product, as close to exact as the unfused kernels
    d = _small_m_case(device, dtype, m, n, k, g)
    xd = d["x"].double()
    exact = F.linear(xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * d["nw"].double(), d["w"].double())
    unfused = F.linear(rms_norm(d["x"], d["nw"], 1e-5), d["w"])
    for c in (GemvConfig(block_n=8, block_k=32, norm_after=True), GemvConfig(block_n=16, block_k=32, norm_after=True,
                                                                            dot=True),
              GemvConfig(block_n=4, block_k=128, norm_after=True, rowloop=True),
              GemvConfig(block_n=16, block_k=32, norm_after=True, dot=True, swap=True),
              GemvConfig(block_n=4, block_k=32, norm_after=True, rowgrid=True)):
        y = gemv(d["x"], d["w"], c, norm_weight=d["nw"], eps=1e-5)
        bound = max(_rel(unfused, exact), 1e-6) * 1.5 + (1e-6 if dtype == torch.float32 else 4e-3)
        assert _rel(y, exact) <= bound, (c, _rel(y, exact), bound)
    for bad in (GemvConfig(block_n=16, block_k=32, split_k=2, norm_after=True), GemvConfig(block_n=8, dot=True),
                GemvConfig(block_n=4, block_k=64, rowloop=True),  # K = 96 does not fit one 64-wide tile
                GemvConfig(block_n=16, block_k=32, swap=True),  # swap transposes a tl.dot product
                GemvConfig(block_n=16, block_k=32, dot=True, rowgrid=True)):  # rowgrid is the batch-1 GEMV
        try:
            gemv(d["x"], d["w"], bad, norm_weight=d["nw"], eps=1e-5)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{bad} must be refused")
    try:
        gemv(torch.zeros(33, k, device=device, dtype=dtype), d["w"], GemvConfig())
    except ValueError as e:
        assert "33 rows" in str(e)
    else:
        raise AssertionError("33 rows must be refused")


def check_decode_rope(device: str, dtype: torch.dtype) -> None:
    """One-launch decode (RoPE + K/V store + split attention + in-kernel merge) equals rope_store followed
    by decode_attention: output, stored K/V, untouched cache elsewhere; counters left at zero."""
    from tercel.kernels.attention import decode_attention, decode_attention_rope
    from tercel.kernels.fused import rope_store

    nq, nkv, d, page = 8, 2, 64, 16
    seq_lens = [1, 17, 100, 64, 250]
    kc, vc, bt = _paged_case(device, dtype, seq_lens, nq, nkv, d, page, seed=7)
    g = torch.Generator(device="cpu").manual_seed(8)
    b = len(seq_lens)
    qkv = torch.randn(b, (nq + 2 * nkv) * d, generator=g).to(device, dtype)
    qk = qkv[:, :(nq + nkv) * d].view(b, nq + nkv, d)
    v = qkv[:, (nq + nkv) * d:].view(b, nkv, d)
    ang = torch.rand(b, d // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(device, dtype)[:, None, :]
    sl = torch.tensor(seq_lens, device=device)
    pos = sl - 1
    loc = bt.gather(1, (pos // page)[:, None])[:, 0] * page + pos % page  # the new token's slot
    counters = torch.zeros(b * nkv + 3, dtype=torch.int32, device=device)
    scale = d ** -0.5
    for splits in (1, 3, 8):
        for window in (None, 40):
            kc_ref, vc_ref, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            q = rope_store(qk, v, cos, sin, loc, kc_ref, vc_ref, nq)
            want = decode_attention(q, kc_ref, vc_ref, bt, sl, page, scale, splits, window=window)
            # the in-kernel merge, or a merge launch after; with an L2 prefetch of some tensor (a hint only)
            merge = splits != 3
            out = decode_attention_rope(qk, v, cos, sin, loc, kc2, vc2, bt, sl, page, scale, splits,
                                        counters if merge else None, window=window, merge_in_kernel=merge,
                                        prefetch=qkv)
            assert out.shape == want.shape and out.dtype == dtype
            assert _rel(out, want) < _tol(dtype) / 4, (splits, window, _rel(out, want))
            assert _rel(kc2[loc], kc_ref[loc]) < _tol(dtype) / 4 and torch.equal(vc2, vc_ref), (splits, window)
            kc2[loc] = kc_ref[loc]
            assert torch.equal(kc2, kc_ref), "keys written outside out_cache_loc"
            assert int(counters.abs().sum()) == 0, "split counters must be left at zero"


def check_rows_rope(device: str, dtype: torch.dtype) -> None:
    """A causal verify block of t rows per request in one launch (decode_attention_rope rows=t: each row stores
    its own K/V and reads the block's earlier keys from qk / v) equals rope_store of every row followed by the
    split-KV kernel over the rows: output, stored K/V, untouched cache elsewhere; counters left at zero."""
    from tercel.kernels.attention import decode_attention, decode_attention_rope
    from tercel.kernels.fused import rope_store

    nq, nkv, page = 8, 2, 16
    totals = [5, 17, 100, 64, 250]  # per request, the block's tokens included
    g = torch.Generator(device="cpu").manual_seed(12)
    # (rows per request, splits, window, head_dim): 3 splits merge in a second launch, the others in the kernel
    for t, splits, window, d in ((2, 1, None, 64), (2, 8, 40, 64), (5, 3, None, 64), (5, 8, None, 64),
                                 (4, 3, 40, 64), (3, 8, None, 128)):
        kc, vc, bt = _paged_case(device, dtype, totals, nq, nkv, d, page, seed=11)
        b = len(totals)
        r = b * t
        qkv = torch.randn(r, (nq + 2 * nkv) * d, generator=g).to(device, dtype)
        qk = qkv[:, :(nq + nkv) * d].view(r, nq + nkv, d)
        v = qkv[:, (nq + nkv) * d:].view(r, nkv, d)
        ang = torch.rand(r, d // 2, generator=g) * 6
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(device, dtype)[:, None, :]
        # row j of request i: position totals[i] - t + j, seeing keys [0, that position]
        seq = torch.tensor([n - t + j + 1 for n in totals for j in range(t)], device=device)
        tables = bt.repeat_interleave(t, dim=0)
        pos = seq - 1
        loc = tables.gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
        counters = torch.zeros(r * nkv + 3, dtype=torch.int32, device=device)
        scale = d ** -0.5
        kc_ref, vc_ref, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        q = rope_store(qk, v, cos, sin, loc, kc_ref, vc_ref, nq)
        want = decode_attention(q, kc_ref, vc_ref, tables, seq, page, scale, splits, window=window)
        merge = splits != 3
        out = decode_attention_rope(qk, v, cos, sin, loc, kc2, vc2, tables, seq, page, scale, splits,
                                    counters if merge else None, window=window, merge_in_kernel=merge, rows=t)
        assert out.shape == want.shape and out.dtype == dtype
        assert _rel(out, want) < _tol(dtype) / 4, (t, splits, window, _rel(out, want))
        assert _rel(kc2[loc], kc_ref[loc]) < _tol(dtype) / 4 and torch.equal(vc2, vc_ref), (t, splits)
        kc2[loc] = kc_ref[loc]
        assert torch.equal(kc2, kc_ref), "keys written outside out_cache_loc"
        assert int(counters.abs().sum()) == 0, "split counters must be left at zero"
    try:
        decode_attention_rope(qk[:7], v[:7], cos[:7], sin[:7], loc[:7], kc, vc, tables[:7], seq[:7], page,
                              0.125, 1, None, rows=2)
    except ValueError as e:
        assert "rows=2" in str(e), e
    else:
        raise AssertionError("7 rows in blocks of 2 must be refused")


def check_gemv_q8(device: str, dtype: torch.dtype) -> None:
    """The int8 head product (kernels/gemv_q8.py) equals its torch reference for one and several rows, ragged
    N and K; int8 rows with per-row scales stay within half a step of the weights; bad operands are refused."""
    from tercel.kernels.gemv_q8 import gemv_q8, gemv_q8_reference, quantize_rows_int8

    g = torch.Generator(device="cpu").manual_seed(21)
    for m, n, k, block_n, block_k in ((1, 200, 96, 32, 64), (3, 77, 130, 16, 64), (5, 40, 576, 32, 256)):
        w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).to(device, dtype)
        w[3] = 0  # an all-zero row: its scale must not divide by zero
        q, scale = quantize_rows_int8(w)
        assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (n,)
        err = (q.float() * scale[:, None] - w.float()).abs()
        assert bool((err <= scale[:, None] * 0.5 + 1e-6).all()), "int8 rounding beyond half a step"
        assert bool((q[3] == 0).all())
        x = torch.randn(m, k, generator=g).to(device, dtype)
        got = gemv_q8(x, q, scale, block_n=block_n, block_k=block_k)
        want = gemv_q8_reference(x, q, scale)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert _rel(got, want) < 1e-5, (m, n, k, _rel(got, want))
        assert _rel(got, torch.nn.functional.linear(x.float(), w.float())) < 2e-2  # the int8 head's own error
    for bad_x, bad_q, bad_s in ((x[:, :-1], q, scale), (x, q.float(), scale), (x, q, scale[:-1])):
        try:
            gemv_q8(bad_x, bad_q, bad_s)
        except ValueError as e:
            assert "gemv_q8" in str(e)
        else:
            raise AssertionError("gemv_q8 must refuse mismatched operands")


def check_argmax(device: str, dtype: torch.dtype) -> None:
    """Row argmax equals torch.argmax: vocabularies that are and are not a multiple of the slice width,
    ties inside a slice and across slices (the first index wins), -inf rows, NaN, and bf16 logits."""
    from tercel.kernels.argmax import BLOCK, argmax_rows
    from tercel.sampling import greedy_tokens

    g = torch.Generator(device="cpu").manual_seed(11)
    for b, v in [(1, 128256), (3, 49152), (5, BLOCK), (2, 7), (8, 3 * BLOCK + 1)]:
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(b, v, generator=g).to(device, dt)
            assert torch.equal(argmax_rows(x), x.argmax(-1)), (b, v, dt)
    x = torch.zeros(4, 3 * BLOCK + 5, device=device)
    x[0, [5, 9]] = 2.0  # a tie inside one slice
    x[1, [BLOCK + 3, 2 * BLOCK + 1]] = 2.0  # a tie across slices
    x[2] = float("-inf")  # no finite value: index 0, like torch
    x[3, [7, BLOCK + 8]] = float("nan")  # NaN wins; the first one
    assert argmax_rows(x).tolist() == [5, BLOCK + 3, 0, 7]
    assert torch.equal(argmax_rows(x[:3]), x[:3].argmax(-1))
    assert argmax_rows(torch.empty(0, 10, device=device)).shape == (0,)
    logits = torch.randn(6, 1000, generator=g).to(device)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    ids = torch.randperm(5000, generator=g)[:1000].to(device)  # a draft vocabulary mapped into a larger one
    assert torch.equal(argmax_rows(logits, ids), ids[logits.argmax(-1)])
    assert torch.equal(greedy_tokens(logits, ids), ids[logits.argmax(-1)])


def check_race(device: str, dtype: torch.dtype) -> None:
    """The fused race (noise made in the kernel) equals torch's race over draw_noise, token for token: vocabularies
    on and off the slice width, bf16 and fp32 probabilities, zero-probability tokens, the sorted-domain form with
    an id map, and the whole device sampler (sample_rows) against one request at a time through filter_logits."""
    from tercel.kernels.race import BLOCK, race_rows
    from tercel.sampling import SamplingTensors, draw_noise, filter_logits, race, sample_rows, stream_keys
    from tercel.sampling_params import SamplingParams

    g = torch.Generator(device="cpu").manual_seed(12)
    for b, v in [(1, 49152), (3, BLOCK), (2, 7), (4, 2 * BLOCK + 3)]:
        probs = torch.rand(b, v, generator=g).pow(8).softmax(-1).to(device, dtype)
        probs[:, ::3] = 0
        keys = stream_keys(torch.arange(b) * 7919, torch.arange(b) + 3).to(device)
        want = race(probs, draw_noise(keys, v, probs.device))
        assert torch.equal(race_rows(probs, keys), want), (b, v, dtype)
        ids = torch.argsort(torch.rand(b, v, generator=g), -1).to(device)
        want = ids.gather(1, race(probs, draw_noise(keys, v, probs.device).gather(1, ids))[:, None])[:, 0]
        assert torch.equal(race_rows(probs, keys, ids), want), (b, v, dtype, "ids")
    # a NaN row (a graph's padding row divided by a zeroed temperature) names a column inside the row, ids or not;
    # the kernel once named one past it (an illegal address on the H200, a ValueError in the interpreter)
    for v in (2 * BLOCK - 700, 49152):
        probs = torch.rand(2, v, generator=g).to(device)
        probs[1] = float("nan")
        keys = torch.tensor([5, 6], device=device)
        ids = torch.arange(v, device=device).flip(0).expand(2, -1).contiguous()
        for got in (race_rows(probs, keys), race_rows(probs, keys, ids)):
            assert 0 <= int(got[1]) < v, (v, got)
        assert int(race_rows(probs, keys)[0]) == int(race(probs[:1], draw_noise(keys[:1], v, probs.device))[0])
    logits = (torch.randn(5, 3000, generator=g) * 4).to(device)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.3, min_p=0.05),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.8, min_p=0.02)]
    for seed in range(4):
        keys = stream_keys(torch.full((5,), seed), torch.arange(5)).to(device)
        got = sample_rows(logits, SamplingTensors.of(params, 3000, torch.device(device)), keys)
        for i, p in enumerate(params):
            probs = filter_logits(logits[i:i + 1], p).softmax(-1)
            assert got[i] == race(probs, draw_noise(keys[i:i + 1], 3000, probs.device))[0], (seed, i)


def check_tree_draft_attention(device: str, dtype: torch.dtype) -> None:
    """EAGLE's tree draft attention with the prefix through the split-KV kernel's partials (merged by
    log-sum-exp with the scratch of earlier leaves) against the gathered prefix + SDPA path, the CPU's."""
    from types import SimpleNamespace

    from tercel.attention.paged_merge import PagedPrefix
    from tercel.batching import device_context_slots
    from tercel.speculative.eagle_tree_step import DraftAttention

    nq, nkv, d, page, w, cap = 6, 2, 32, 16, 3, 6
    bases = [37, 0, 100]  # the second request is padding: no prefix, only its own leaves
    kc, vc, bt = _paged_case(device, dtype, [max(1, s) for s in bases], nq, nkv, d, page, seed=4)
    cache = SimpleNamespace(k=[kc], v=[vc])
    b = len(bases)
    base = torch.tensor(bases, device=device)
    entries = torch.tensor([2, 3, 4], device=device)
    mask = torch.zeros(b, w, cap, dtype=torch.bool)
    mask[:, :, 0] = True  # an earlier leaf every row descends from
    mask[:, 1, 1] = True
    mask[:, torch.arange(w), entries.cpu()] = True  # each row sees itself
    mask = mask.to(device)
    for splits in (2, 4):
        outs = []
        for paged in (False, True):
            gen = torch.Generator(device="cpu").manual_seed(6)
            q = torch.randn(b * w, nq, d, generator=gen).to(device, dtype)
            k = torch.randn(b * w, nkv, d, generator=gen).to(device, dtype)
            v = torch.randn(b * w, nkv, d, generator=gen).to(device, dtype)
            if paged:
                pp = PagedPrefix(bt.repeat_interleave(w, dim=0), base.repeat_interleave(w), page, splits, b)
                attn = DraftAttention(cache, None, None, cap, d ** -0.5, pp)
            else:
                slots, valid = device_context_slots(bt, base, bt.shape[1] * page, page)
                attn = DraftAttention(cache, slots, valid, cap, d ** -0.5)
            attn.entries, attn.mask = entries, mask
            prior = torch.randn(b, cap, nkv, d, generator=gen).to(device, dtype)  # earlier steps' leaves
            attn.block_k[0], attn.block_v[0] = prior.clone(), (prior * 0.5).clone()
            if not paged:
                attn.prefix_kv[0] = (kc[slots], vc[slots])
            outs.append(attn(0, q, k, v))
        err = _rel(outs[1], outs[0])
        assert err < _tol(dtype), (splits, err)
        assert torch.isfinite(outs[1]).all()


def check_paged_dense_merge(device: str, dtype: torch.dtype) -> None:
    """The dense-keys-and-merge kernel equals its torch reference on the same split partials: grouped heads, dense
    masks with rows that see no dense key, splits with no keys (lse -inf), a row that sees nothing at all (zeros),
    a mask broadcast over rows (stride 0, as DFlash's block mask) and one sliced from a wider buffer (the tree's)."""
    from tercel.attention.paged_merge import merge_dense_torch
    from tercel.kernels.paged_dense_merge import paged_dense_merge

    g = torch.Generator(device="cpu").manual_seed(37)
    for b, w, c, nq, nkv, d, s in [(3, 4, 12, 9, 3, 64, 4), (2, 16, 16, 4, 2, 32, 2), (1, 1, 5, 8, 8, 16, 16)]:
        q = torch.randn(b * w, nq, d, generator=g)
        dk, dv = torch.randn(b, c, nkv, d, generator=g), torch.randn(b, c, nkv, d, generator=g)
        part_o = torch.randn(b * w, nq, s, d, generator=g)
        part_l = torch.randn(b * w, nq, s, generator=g) * 4
        part_l[:, :, -1] = float("-inf")  # the last split saw no key
        part_l[0] = float("-inf")  # the first row has no prefix at all
        wide = torch.rand(b, w, c + 3, generator=g) > 0.5
        wide[0, 0] = False  # ... and no dense key either: zeros
        wide[-1, -1, :c] = False  # a row of the prefix alone
        masks = [wide[:, :, :c], (torch.rand(b, 1, c, generator=g) > 0.3).expand(b, w, c)]
        for mask in masks:
            want = merge_dense_torch(q, part_o, part_l, dk, dv, mask, d ** -0.5)
            got = paged_dense_merge(q.to(device, dtype), part_o.to(device), part_l.to(device), dk.to(device, dtype),
                                    dv.to(device, dtype), mask.to(device), d ** -0.5)
            ref = merge_dense_torch(q.to(dtype).float(), part_o, part_l, dk.to(dtype).float(),
                                    dv.to(dtype).float(), mask, d ** -0.5)  # the inputs as the kernel sees them
            assert got.dtype == dtype and torch.isfinite(got).all(), (b, w, c)
            assert _rel(got.float().cpu(), ref) < _tol(dtype), (b, w, c, _rel(got.float().cpu(), ref))
            assert torch.equal(got[0].float().cpu(), torch.zeros(nq, d)) or not (~mask[0, 0]).all(), (b, w, c)
            assert want.shape == got.shape


def check_dflash_paged_attention(device: str, dtype: torch.dtype) -> None:
    """DFlash's block attention with the context read by the split-KV kernel (forward_paged) against the
    gathered context + SDPA (forward): a block cut short and a padding request without context included."""
    from types import SimpleNamespace

    from tercel.attention.paged_merge import PagedPrefix
    from tercel.batching import device_context_slots
    from tercel.models.dflash import DFlashAttention

    nq, nkv, d, hidden, page, s = 4, 2, 32, 64, 16, 4
    bases = [45, 0, 70]
    kc, vc, bt = _paged_case(device, dtype, [max(1, x) for x in bases], nq, nkv, d, page, seed=7)
    cfg = SimpleNamespace(num_heads=nq, num_kv_heads=nkv, head_dim=d, hidden_size=hidden, attention_bias=False,
                          rms_norm_eps=1e-6)
    torch.manual_seed(8)
    attn = DFlashAttention(cfg, 0).to(device, dtype)
    b = len(bases)
    g = torch.Generator(device="cpu").manual_seed(9)
    x = torch.randn(b, s, hidden, generator=g).to(device, dtype)
    ang = torch.rand(b * s, 1, d // 2, generator=g).repeat(1, 1, 2).to(device)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    base = torch.tensor(bases, device=device)
    block_mask = torch.arange(s, device=device)[None, :] < torch.tensor([s, s, 2], device=device)[:, None]
    slots, valid = device_context_slots(bt, base, bt.shape[1] * page, page)
    with torch.no_grad():
        want = attn(x, cos, sin, kc[slots], vc[slots], valid, block_mask)
        for splits in (2, 8):
            paged = PagedPrefix(bt.repeat_interleave(s, dim=0), base.repeat_interleave(s), page, splits, b)
            got = attn.forward_paged(x, cos, sin, kc, vc, paged, block_mask)
            err = _rel(got, want)
            assert err < _tol(dtype), (splits, err)


def check_sample_filter(device: str, dtype: torch.dtype) -> None:
    """The one-launch filter (kernels/sample_filter.py) gives torch's filtered probabilities in the sorted domain
    (the same kept set, values within a few ulps; min-p zeroes without renormalising, as sample_rows does), and
    sample_rows through it draws torch's tokens: ties at the top-k boundary, top-k 1, off values, unsorted rows
    with and without min-p, bf16 logits, a vocabulary off the chunk width, a mapped draft vocabulary; float32
    logits exact in bf16 sorted as bf16 (exact=) draw the float32 sort's tokens. Draws for 12
    seeds natively, 4 in the interpreter (every case above in each draw; the interpreter runs each of the race's
    ~130 programs in Python)."""
    import tercel.sampling as sampling
    from tercel.kernels.sample_filter import BLOCK, filtered_probs
    from tercel.sampling import SamplingTensors, sample_rows, stream_keys
    from tercel.sampling_params import SamplingParams

    g = torch.Generator(device="cpu").manual_seed(15)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=2.0, min_p=0.1),
              SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_k=7, top_p=0.5)]
    for v in (3 * BLOCK + 17, 49152):
        logits = torch.randn(len(params), v, generator=g) * 3
        logits[:, 100:110] = logits[:, 99:100]  # ties, some at the top-k boundary
        logits[6, :20] = logits[6, :20].max()  # a tie wider than top-k
        logits = logits.to(device, dtype)
        st = SamplingTensors.of(params, v, torch.device(device))
        x, order = torch.sort(logits.float(), dim=-1, descending=True)
        got = filtered_probs(x, st.temperature, st.top_k, st.top_p, st.min_p, True, True, True, True)
        sx = x / st.temperature[:, None]  # torch's sorted path (sampling.sample_rows on the CPU)
        sx = sx.masked_fill(sx < sx.gather(1, (st.top_k - 1)[:, None]), float("-inf"))
        probs = sx.softmax(-1)
        drop = ((probs.cumsum(-1) - probs) >= st.top_p[:, None]) & (st.top_p < 1.0)[:, None]
        probs = sx.masked_fill(drop, float("-inf")).softmax(-1)
        want = probs.masked_fill(probs < st.min_p[:, None] * probs[:, :1], 0.0)
        assert torch.equal(got > 0, want > 0), (v, (got > 0).sum(1), (want > 0).sum(1))
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-9), (v, (got - want).abs().max())
        ids = torch.randperm(2 * v, generator=g)[:v].to(device)
        for seed in range(12 if device == "cuda" else 4):
            keys = stream_keys(torch.full((len(params),), seed), torch.arange(len(params))).to(device)
            fused = (sample_rows(logits, st, keys), sample_rows(logits, st, keys, ids, 2 * v))
            with _TorchPaths(sampling):
                ref = (sample_rows(logits, st, keys), sample_rows(logits, st, keys, ids, 2 * v))
            assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1]), (v, seed, fused, ref)
        # float32 logits holding bf16 values (a bf16 target's head): sorted as bf16 (exact=), the same tokens
        exact = logits.to(torch.bfloat16).float()
        for seed in range(2 if device == "cuda" else 1):
            keys = stream_keys(torch.full((len(params),), seed), torch.arange(len(params))).to(device)
            assert torch.equal(sample_rows(exact, st, keys, exact=torch.bfloat16), sample_rows(exact, st, keys)), v
        unsorted = SamplingTensors.of([SamplingParams(temperature=0.7, min_p=0.05), SamplingParams(temperature=1.3)],
                                      v, torch.device(device))
        got = filtered_probs(logits[:2].float(), unsorted.temperature, unsorted.top_k, unsorted.top_p,
                             unsorted.min_p, False, False, False, True)
        p = (logits[:2].float() / unsorted.temperature[:, None]).softmax(-1)
        want = p.masked_fill(p < unsorted.min_p[:, None] * p.amax(-1, keepdim=True), 0.0)
        assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=1e-5, atol=1e-9), v


def check_norm_rope(device: str, dtype: torch.dtype) -> None:
    """The one-launch per-head norm + RoPE (kernels/fused.rms_norm_rope, a DFlash draft's q and k) equals
    apply_rope(RMSNorm(x)) through torch: heads off a power of two, x a column slice of a wider projection, cos /
    sin the rope table's strided views, head dims 64 and 128; DFlashAttention's q / k / v take it."""
    from graph_utils import TINY

    from tercel.config import ModelConfig
    from tercel.kernels.fused import rms_norm_rope
    from tercel.models import dflash
    from tercel.models.llama import RMSNorm
    from tercel.models.rope import RotaryEmbedding, apply_rope

    g = torch.Generator(device="cpu").manual_seed(41)
    for n, heads, d in [(16, 9, 64), (5, 3, 64), (7, 4, 128), (1, 1, 64)]:
        cfg = ModelConfig.from_hf_dict({**TINY, "hidden_size": heads * d, "num_attention_heads": heads,
                                        "num_key_value_heads": heads, "head_dim": d})
        rope = RotaryEmbedding(cfg, 64, dtype).to(device)
        norm = RMSNorm(d, 1e-6).to(device, dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
        wide = (torch.randn(n, heads * d + 24, generator=g) * 2).to(device, dtype)
        x = wide[:, :heads * d].view(n, heads, d)  # rows strided past the heads
        cos, sin = rope.lookup(torch.randint(0, 64, (n,), generator=g).to(device))
        with torch.no_grad():
            got = rms_norm_rope(x, norm.weight, norm.eps, cos, sin)
            with _TorchPaths(sys.modules["tercel.models.llama"]):
                want = apply_rope(norm(x), cos, sin)
        assert got.shape == want.shape and _rel(got, want) < _tol(dtype) / 4, (n, heads, d, _rel(got, want))
        with torch.no_grad():  # the model's path takes it: q, k of a DFlash attention layer
            attn = dflash.DFlashAttention(cfg, 0).to(device, dtype)
            h = wide[:, :heads * d].reshape(1, n, heads * d).contiguous()
            fused = attn._qkv(h, cos, sin)
            with _TorchPaths(dflash, sys.modules["tercel.models.llama"]):
                ref = attn._qkv(h, cos, sin)
        for a, b in zip(fused, ref):
            assert _rel(a, b) < _tol(dtype) / 4, (n, heads, d, _rel(a, b))


def check_stream_keys(device: str, dtype: torch.dtype) -> None:
    """The one-launch stream keys equal torch's int64 arithmetic bit for bit: 1-D, 2-D, broadcast columns and rows,
    strided views, a 0-d seed, negative seeds; tercel.sampling.stream_keys takes it on the device."""
    from tercel.kernels.race import stream_keys_2d
    from tercel.sampling import _GOLDEN, _mix64, stream_keys

    g = torch.Generator(device="cpu").manual_seed(14)
    seeds = torch.randint(-(2**62), 2**62, (8,), generator=g)
    cases = [(seeds[:5], torch.arange(5)), (seeds[:3, None], torch.arange(4)),
             (seeds[:3, None], torch.randint(0, 1000, (3, 6), generator=g)), (seeds[0], torch.arange(9)),
             (seeds[::2], torch.arange(4)),
             (seeds[:4, None], torch.randint(0, 9, (4, 1), generator=g) + torch.arange(5)),
             (seeds[1], torch.tensor(5))]
    for s, i in cases:
        want = _mix64(_mix64(s) + i * _GOLDEN)
        got = stream_keys_2d(s.to(device), i.to(device))
        assert got.shape == want.shape and torch.equal(got.cpu(), want), (s, i)
        assert torch.equal(stream_keys(s.to(device), i.to(device)).cpu(), want)


def check_chain_positions(device: str, dtype: torch.dtype) -> None:
    """The chained step's positions kernel equals ChainPositions.of's torch path: random bases and block tables,
    widths off a power of two, positions clamped to a short RoPE table, a padding request (base 0, zero table), a
    table given as a column slice (row stride past its width)."""
    from tercel.kernels.chain_positions import chain_positions
    from tercel.speculative import eagle_steps as es

    g = torch.Generator(device="cpu").manual_seed(31)
    for n, w, bs, mb, max_pos in [(1, 6, 16, 8, 4096), (5, 16, 4, 12, 30), (3, 3, 16, 2, 20), (2, 65, 16, 10, 100)]:
        base = torch.randint(0, mb * bs - w, (n,), generator=g)
        wide = torch.randint(1, 500, (n, mb + 3), generator=g)
        tables = wide[:, :mb]
        base[-1] = 0
        tables[-1] = 0
        with _TorchPaths(es):
            want = es.ChainPositions.of(base, tables, bs, w, max_pos)
        got = chain_positions(base.to(device), tables.to(device), bs, w, max_pos)
        for name, a in zip(("positions", "slots", "seq_lens", "rope_positions"), got):
            assert torch.equal(a.cpu(), getattr(want, name)), (n, w, name)


def check_chain_accept(device: str, dtype: torch.dtype) -> None:
    """The chained step's acceptance kernel equals the torch path on the same inputs: every accepted count from 0
    to W - 1 (targets built to match the drafts up to a chosen place), padding requests (live 0), slots given as
    the [W, B] layout and as a transposed view, widths off a power of two."""
    from tercel.kernels.chain_accept import chain_accept_rows
    from tercel.speculative import chain_accept as ca

    g = torch.Generator(device="cpu").manual_seed(13)
    for n, w in [(1, 6), (7, 6), (5, 3), (9, 8), (4, 2)]:
        tokens = torch.randint(0, 50, (n, w), generator=g)
        cut = torch.randint(0, w, (n,), generator=g)  # request b's first mismatch: draft cut[b] + 1
        targets = torch.randint(50, 100, (n, w), generator=g)  # never a draft...
        for b in range(n):
            targets[b, :cut[b]] = tokens[b, 1:cut[b] + 1]  # ... except where they are meant to match
        if n > 1:
            targets[1, cut[1] + 1:] = torch.cat([tokens[1, cut[1] + 2:], tokens[1, :1]])[:w - cut[1] - 1]
        slots_bw = torch.randint(1, 1000, (n, w), generator=g)
        base = torch.randint(0, 300, (n,), generator=g)
        live = (torch.rand(n, generator=g) > 0.25).long()
        roots = torch.randint(0, 50, (n,), generator=g)
        for slots in (slots_bw.t().contiguous(), slots_bw.t()):
            want_base, want_roots = base.clone(), roots.clone()
            with torch.no_grad():
                with _TorchPaths(ca):  # the torch path, on the CPU copies
                    want = ca.chain_accept(targets, tokens, slots, want_base, live, want_roots)
            got_base, got_roots = base.clone().to(device), roots.clone().to(device)
            got = chain_accept_rows(targets.to(device), tokens.to(device), slots.to(device), got_base,
                                    live.to(device), got_roots)
            assert torch.equal(want.accepted, cut), (n, w)
            for name, a, b in zip(("k", "bonus", "ext_ids", "ext_slots", "ext_seq"), got,
                                  (want.accepted, want.bonus, want.ext_ids, want.ext_slots, want.ext_seq_lens)):
                assert torch.equal(a.cpu(), b), (n, w, name, a, b)
            assert torch.equal(got_base.cpu(), want_base) and torch.equal(got_roots.cpu(), want_roots), (n, w)
    assert chain_accept_rows(*(torch.empty(0, 4, dtype=torch.long, device=device),) * 2,
                             torch.empty(4, 0, dtype=torch.long, device=device),
                             *(torch.empty(0, dtype=torch.long, device=device),) * 3)[0].shape == (0,)


def check_tree_accept(device: str, dtype: torch.dtype) -> None:
    """The chained tree step's layout and acceptance kernels equal the torch paths on the same inputs: random trees
    (parents before children, depths up to the walk's limit) of 2 to 64 nodes, targets that follow a random path
    some way down (so accepted paths leave the first-child order and KV moves), padding requests (live 0), slots
    given as the [N, B] layout and as a transposed view."""
    from tercel.kernels.tree_accept import tree_accept_rows, tree_layout_rows
    from tercel.speculative import tree_chain as tc

    g = torch.Generator(device="cpu").manual_seed(17)
    for n, w, max_depth in [(1, 2, 5), (5, 6, 5), (3, 16, 5), (4, 17, 15), (2, 64, 15), (6, 9, 3), (2, 65, 15)]:
        parents = torch.zeros(n, w - 1, dtype=torch.long)
        depth_of = torch.zeros(n, w, dtype=torch.long)
        for b in range(n):
            for j in range(1, w):  # a parent among the earlier nodes that is not already at the deepest level
                choices = [p for p in range(j) if depth_of[b, p] < max_depth]
                p_ = choices[int(torch.randint(0, len(choices), (1,), generator=g))]
                parents[b, j - 1], depth_of[b, j] = p_, depth_of[b, p_] + 1
        tree_tokens = torch.randint(0, 40, (n, w - 1), generator=g)
        roots = torch.randint(0, 40, (n,), generator=g)
        with torch.no_grad():
            with _TorchPaths(tc):  # the torch paths, on the CPU copies
                want_layout = tc.tree_layout(roots, tree_tokens, parents, max_depth)
        got = tree_layout_rows(roots.to(device), tree_tokens.to(device), parents.to(device), max_depth)
        for name, a, b_ in zip(("tokens", "parents", "depth", "masks"), got,
                               (want_layout.tokens, want_layout.parents, want_layout.depth, want_layout.masks)):
            assert torch.equal(a.cpu(), b_), (n, w, name)
        assert torch.equal(want_layout.depth, depth_of), (n, w)
        # targets: no draft's token, except along the path to a deep node, cut at a random depth
        targets = torch.randint(100, 140, (n, w), generator=g)
        tokens, par = want_layout.tokens, want_layout.parents
        for b in range(n):
            node = int(torch.randint(w // 2, w, (1,), generator=g))
            path = [node]
            while path[-1] != 0:
                path.append(int(par[b, path[-1]]))
            keep = int(torch.randint(0, len(path), (1,), generator=g)) if b % 2 else len(path) - 1
            for c in path[len(path) - 1 - keep:-1]:  # the kept edges nearest the root
                targets[b, par[b, c]] = tokens[b, c]
        slots_bw = torch.randint(1, 1000, (n, w), generator=g)
        base = torch.randint(0, 300, (n,), generator=g)
        live = (torch.rand(n, generator=g) > 0.25).long()
        live[0] = 1
        for slots in (slots_bw.t().contiguous(), slots_bw.t()):
            want_base, want_roots = base.clone(), roots.clone()
            with torch.no_grad():
                with _TorchPaths(tc):
                    want = tc.tree_accept(targets, want_layout, slots, want_base, live, want_roots)
            got_base, got_roots = base.clone().to(device), roots.clone().to(device)
            got = tree_accept_rows(targets.to(device), *(t.to(device) for t in (want_layout.tokens,
                                   want_layout.parents, want_layout.depth, want_layout.masks)), slots.to(device),
                                   got_base, live.to(device), got_roots)
            for name, a, b_ in zip(("path_tokens", "accepted", "bonus", "src", "dst", "ext_ids", "ext_rows",
                                    "ext_slots", "ext_seq_lens"), got,
                                   (want.path_tokens, want.accepted, want.bonus, want.src, want.dst, want.ext_ids,
                                    want.ext_rows, want.ext_slots, want.ext_seq_lens)):
                assert torch.equal(a.cpu(), b_), (n, w, name, a, b_)
            assert torch.equal(got_base.cpu(), want_base) and torch.equal(got_roots.cpu(), want_roots), (n, w)
        if w >= 16:
            assert int(want.accepted.max()) >= 2 and bool((want.src != 0).any()), (n, w)  # deep paths, KV moves


def check_ddtree_beams(device: str, dtype: torch.dtype) -> None:
    """DDTREE's beams kernel gives the torch path's beams and so its tree (random block marginals without ties):
    budgets below, at and above K, beams that saturate at the budget, one depth, a batch of several requests."""
    from tercel.kernels.ddtree_beams import ddtree_beams
    from tercel.speculative import ddtree_chain as dc
    from tercel.speculative import tree

    g = torch.Generator(device="cpu").manual_seed(19)
    for b, d, k, budget in [(3, 15, 4, 16), (2, 7, 4, 64), (4, 3, 2, 2), (1, 1, 4, 3), (2, 5, 3, 9), (2, 15, 4, 64)]:
        lp, tk = torch.randn(b, d, 60, generator=g).mul(2).log_softmax(-1).topk(k, dim=-1)
        with _TorchPaths(dc, tree):  # the torch paths, on the CPU copies
            want = dc.ddtree_nodes(lp, tk, budget)
        sizes = dc.beam_sizes(d, k, budget)
        scores, parents, toks = ddtree_beams(lp.to(device), tk.to(device), budget, sizes)
        assert scores.shape == (b, sum(sizes)), (b, d, k, budget)
        kept, tree_parents = tree.select_tree_nodes_batched(scores, parents, budget)
        assert torch.equal(toks.gather(1, kept).cpu(), want[0]), (b, d, k, budget)
        assert torch.equal(tree_parents.cpu(), want[1]), (b, d, k, budget)
        for i in range(b):  # each beam best first, after the previous one
            off = 0
            for w in sizes:
                row = scores[i, off:off + w].cpu()
                assert torch.equal(row, row.sort(descending=True).values), (b, d, k, budget, i)
                off += w


def check_tree_draft(device: str, dtype: torch.dtype) -> None:
    """The tree draft loop's expansion kernel equals its torch path over a whole loop (the root's children, then
    each draft step's K x K children; random picks without ties, with and without a vocabulary map, K = 2, 4, 8):
    the candidate slabs, the next leaves (tokens, scores, candidate indices, hidden states) and the ancestor rows;
    the re-ranking kernel equals select_tree_nodes_batched + gather on those candidates and on scores full of ties
    (halvings of the parent's score), up to 456 candidates."""
    from tercel.kernels.tree_draft import tree_expand, tree_select
    from tercel.speculative import tree as tr
    from tercel.speculative.eagle_tree_step import EagleTreeDraftStep, _Leaves

    g = torch.Generator(device="cpu").manual_seed(29)
    for n, k, steps, vd, mapped, h in [(3, 4, 5, 50, True, 40), (2, 2, 3, 30, False, 8), (1, 8, 4, 90, True, 300),
                                       (2, 4, 1, 20, False, 8)]:
        vmap = torch.randperm(1000, generator=g)[:vd] if mapped else None
        cap = max(1, (steps - 1) * k)
        c = k + (steps - 1) * k * k
        cands = [tuple(torch.full((n, c), -7, dtype=t) for t in (torch.long, torch.float32, torch.long))
                 for _ in range(2)]
        ancs = [torch.zeros(n, cap, cap, dtype=torch.bool) for _ in range(2)]
        ancs[1] = ancs[1].to(device)
        cands[1] = tuple(t.to(device) for t in cands[1])
        leaves: list = [None, None]
        p = 1
        for step in range(steps):
            probs = torch.rand(n, p, vd, generator=g).softmax(-1)
            scores, ids = probs.topk(k, dim=-1)
            last = step == steps - 1
            hidden = torch.randn(n, p, h, generator=g).to(dtype)
            off, e_prev, e_next = (0, 0, 0) if step == 0 else (k + (step - 1) * k * k, (step - 1) * k, step * k)
            want = EagleTreeDraftStep._expand_torch(scores, ids, leaves[0], vmap, None if last else hidden,
                                                    None if last else ancs[0], cands[0], off, e_prev, e_next)
            prev = leaves[1]
            got = _Leaves(*tree_expand(scores.to(device), ids.to(device), None if prev is None else prev.scores,
                                       None if prev is None else prev.cand, None if vmap is None else vmap.to(device),
                                       None if last else hidden.to(device), None if last else ancs[1], cands[1], off,
                                       e_prev, e_next))
            where = (n, k, steps, step)
            for name in ("tokens", "scores", "cand"):
                assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (where, name)
            assert (got.hidden is None) == (want.hidden is None) == last, where
            if not last:
                assert torch.equal(got.hidden.cpu(), want.hidden), where
            for a, b_ in zip(cands[1], cands[0]):
                assert torch.equal(a.cpu(), b_), where
            if steps > 1:
                written = slice(0, min(cap, (step + 1) * k))  # rows the kernel wrote so far
                assert torch.equal(ancs[1][:, written].cpu(), ancs[0][:, written]), where
            leaves = [want, got]
            p = k
        num = min(15, c)
        with _TorchPaths(tr):
            want_sel = tr.select_tree(cands[0][1], cands[0][2], cands[0][0], num)
        got_sel = tree_select(*(t.contiguous() for t in (cands[1][1], cands[1][2], cands[1][0])), num)
        assert torch.equal(got_sel[0].cpu(), want_sel[0]) and torch.equal(got_sel[1].cpu(), want_sel[1]), (n, k, steps)
    # ties: every child's score is its parent's, or a half or a quarter of it (parents before children)
    for n, c, num in [(3, 52, 15), (2, 456, 63), (1, 9, 9), (2, 20, 1)]:
        parents = torch.full((n, c), -1, dtype=torch.long)
        scores = torch.ones(n, c)
        for j in range(1, c):
            parents[:, j] = torch.randint(-1, j, (n,), generator=g)
            above = scores.gather(1, parents[:, j:j + 1].clamp(min=0))[:, 0]
            base = torch.where(parents[:, j] < 0, torch.ones(n), above)
            scores[:, j] = base * torch.tensor([1.0, 0.5, 0.25])[torch.randint(0, 3, (n,), generator=g)]
        tokens = torch.randint(0, 500, (n, c), generator=g)
        with _TorchPaths(tr):
            want_sel = tr.select_tree(scores, parents, tokens, num)
        got_sel = tree_select(scores.to(device), parents.to(device), tokens.to(device), num)
        assert torch.equal(got_sel[0].cpu(), want_sel[0]) and torch.equal(got_sel[1].cpu(), want_sel[1]), (n, c, num)


def check_race_logits(device: str, dtype: torch.dtype) -> None:
    """The draft picks' race on logits (kernels/race.py race_logits_rows) gives sampling.race_logits' torch
    path: sampled rows at several temperatures, greedy rows (the argmax), a padding row with T = 0, a vocabulary
    map (the noise of the mapped ids, the mapped id returned), vocabularies off the slice width; with the keys
    hashed in the launch from seeds and draws (race_logits_seeded)."""
    from tercel import sampling
    from tercel.kernels.race import race_logits_rows

    g = torch.Generator(device="cpu").manual_seed(23)
    for n, v, mapped in [(6, 5000, False), (5, 2048 * 3 + 7, True), (1, 49152, False)]:
        logits = torch.randn(n, v, generator=g) * 3
        t = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.0, 2.0][:n])
        sampled = torch.tensor([1, 1, 1, 0, 0, 1][:n])
        keys = torch.randint(0, 2 ** 62, (n,), generator=g)
        ids = torch.randperm(3 * v, generator=g)[:v] if mapped else None
        with _TorchPaths(sampling):  # the torch path, on the CPU copies
            want = sampling.race_logits(logits, t, sampled, keys, ids, 3 * v if mapped else None)
        full = None if ids is None else ids.expand(n, -1).to(device)
        got = race_logits_rows(logits.to(device), keys.to(device), t.to(device), sampled.to(device), full)
        assert torch.equal(got.cpu(), want), (n, v, mapped, got, want)
        greedy = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
        assert torch.equal(want[sampled == 0], greedy[sampled == 0]), (n, v)
        assert not torch.equal(want[sampled == 1], greedy[sampled == 1]) or n == 1, (n, v)  # the noise counts
        # keys hashed in the launch from the rows' seeds and draws + ahead (a chained step's draft picks)
        seeds, draws = keys // 3, torch.randint(0, 1000, (n,), generator=g)
        for ahead in (0, 1, 5):
            with _TorchPaths(sampling):
                want = sampling.race_logits_seeded(logits, t, sampled, seeds, draws, ahead, ids,
                                                   3 * v if mapped else None)
            got = race_logits_rows(logits.to(device), seeds.to(device), t.to(device), sampled.to(device), full,
                                   draws.to(device), ahead)
            assert torch.equal(got.cpu(), want), (n, v, mapped, ahead, got, want)


def check_topk_rows(device: str, dtype: torch.dtype) -> None:
    """The tree drafts' top k of a softmax (kernels/topk_rows.py) gives torch's softmax / log_softmax + topk: the
    same values, distinct columns that hold them, the lower column first on ties; vocabularies off the slice
    width, a slice with fewer finite values than k, k up to 16."""
    from tercel.kernels.topk_rows import softmax_topk_rows

    g = torch.Generator(device="cpu").manual_seed(29)
    for r, v, k, log in [(4, 49152, 4, False), (3, 4096 * 2 + 5, 8, True), (2, 100, 16, False), (5, 4097, 1, True)]:
        x = (torch.randn(r, v, generator=g) * 3).to(dtype)
        x[0, 9] = x[0].max() + 1  # a tie at the top: the lower column first
        x[0, 4000 % v] = x[0, 9]
        x[1, :] = float("-inf")
        x[1, v - 1] = 1.0  # one finite column, in the last slice: the rest are -inf columns, each once
        ref = x.float().log_softmax(-1) if log else x.float().softmax(-1)
        want = ref.topk(k, dim=-1).values
        got, cols = softmax_topk_rows(x.to(device), k, log)
        got, cols = got.cpu(), cols.cpu()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (r, v, k, log, got, want)
        assert torch.allclose(ref.gather(1, cols), got, rtol=1e-5, atol=1e-7), (r, v, k, log)
        assert all(len(set(row)) == k for row in cols.tolist()), (r, v, k, cols)
        assert cols[0, :2].tolist() == sorted([9, 4000 % v])[:k] and cols[1, 0] == v - 1, (r, v, k, cols)


def _tiny_eagle3_draft(device: str, dtype: torch.dtype, seed: int):
    """(target config, a random EAGLE-3 draft for the tiny target sharing a random embedding and head, the Triton
    attention backend for its layer, a generator for the caller's inputs)."""
    import tempfile
    from pathlib import Path

    from graph_utils import TINY

    from tercel.attention.triton_backend import TritonAttentionBackend
    from tercel.config import ModelConfig
    from tercel.loader.drafts import load_eagle_draft
    from tercel.train.export import random_eagle3

    cfg = ModelConfig.from_hf_dict(TINY)
    g = torch.Generator(device="cpu").manual_seed(seed)
    with tempfile.TemporaryDirectory() as d:
        head = random_eagle3(Path(d) / "head", cfg, draft_vocab_size=128, aux_layer_ids=(0, 1, 2), std=0.3)
        draft = load_eagle_draft(head, cfg, dtype, torch.device(device), 512)
    draft.share_target(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).to(device, dtype),
                       torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).to(device, dtype))
    lc = draft.config.layers
    return cfg, draft, TritonAttentionBackend(lc.num_heads, lc.num_kv_heads, lc.head_dim, None), g


def check_draft_rope_attention(device: str, dtype: torch.dtype) -> None:
    """An EAGLE-3 draft layer through the Triton backend with RoPE and the K/V store in the backend's kernels
    (eagle_steps.BackendAttend.rope: one-row decode batches in the split-KV kernel, several rows through
    rope_store or, with TERCEL_VERIFY_ATTN=rope, the split-KV kernel's verify rows) gives the unfused path
    (apply_rope, then backend.forward): the same hidden states and draft KV."""
    from graph_utils import FakeRequests

    from tercel.kv import PagedKVCache
    from tercel.speculative.eagle_steps import BackendAttend

    cfg, draft, backend, g = _tiny_eagle3_draft(device, dtype, 31)
    assert backend.fuses_rope
    # decode rows (RoPE in the split kernel), then verify-like rows: rope_store before the split kernel, or
    # (TERCEL_VERIFY_ATTN=rope) in it
    for rows, verify_attn in ((1, "split"), (3, "split"), (3, "rope")):
        os.environ["TERCEL_VERIFY_ATTN"] = verify_attn
        kv = PagedKVCache(draft.kv_spec(4, dtype), 64, torch.device(device))
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        kv_ref = PagedKVCache(draft.kv_spec(4, dtype), 64, torch.device(device))
        kv_ref.k.copy_(kv.k)
        kv_ref.v.copy_(kv.v)
        batch = FakeRequests(3, kv, cfg.vocab_size).batch([0, 1, 2], rows)
        hidden = torch.randn(batch.input_ids.shape[0], draft.config.fc_in, generator=g).to(device, dtype)
        fused = BackendAttend(backend, batch, backend.prepare(batch, kv.block_size), kv)
        plain = BackendAttend(backend, batch, backend.prepare(batch, kv.block_size), kv_ref)
        plain.rope = None
        got = draft(batch.input_ids, hidden, batch.positions, fused, from_target=True)
        want = draft(batch.input_ids, hidden, batch.positions, plain, from_target=True)
        assert _rel(got, want) < _tol(dtype), (rows, verify_attn, _rel(got, want))
        assert _rel(kv.k, kv_ref.k) < _tol(dtype) / 4 and _rel(kv.v, kv_ref.v) < _tol(dtype) / 4, rows
    os.environ.pop("TERCEL_VERIFY_ATTN")



def _draft_fused_equals_unfused(device: str, dtype: torch.dtype, cfg, draft, backend, g, requests: int) -> None:
    """The draft's hidden states over `requests` one-token decode rows (random K/V and target hidden states) with
    TERCEL_FUSED_DECODE=1 equal those with 0 (the unfused layer), each run on its own copy of the K/V."""
    from graph_utils import FakeRequests

    from tercel.kv import PagedKVCache
    from tercel.speculative.eagle_steps import BackendAttend

    kv = PagedKVCache(draft.kv_spec(4, dtype), 64, torch.device(device))
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    batch = FakeRequests(requests, kv, cfg.vocab_size).batch(list(range(requests)), 1)
    hidden = torch.randn(requests, draft.config.fc_in, generator=g).to(device, dtype)
    out = {}
    for fused in ("1", "0"):
        os.environ["TERCEL_FUSED_DECODE"] = fused
        kv_run = PagedKVCache(draft.kv_spec(4, dtype), 64, torch.device(device))
        kv_run.k.copy_(kv.k)
        kv_run.v.copy_(kv.v)
        attend = BackendAttend(backend, batch, backend.prepare(batch, kv.block_size), kv_run)
        out[fused] = draft(batch.input_ids, hidden, batch.positions, attend, from_target=True)
    assert _rel(out["1"], out["0"]) < _tol(dtype) / 4, (requests, _rel(out["1"], out["0"]))


def _restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def check_draft_input_and_add(device: str, dtype: torch.dtype) -> None:
    """An EAGLE-3 draft layer whose input (embedding lookup, both norms, concatenation) is one kernel
    (kernels.fused.embed_norms) and whose MLP residual add rides in the down product (cuBLAS addmm over three rows,
    the batch-1 GEMV's residual epilogue over one) gives the unfused layer's hidden states (TERCEL_FUSED_DECODE=0)."""
    from tercel.kernels.fused import embed_norms
    from tercel.kernels.gemv import GemvConfig

    cfg, draft, backend, g = _tiny_eagle3_draft(device, dtype, 43)
    layer = draft.midlayer
    ids = torch.tensor([5, 0, 255, 17], device=device)
    h = torch.randn(4, cfg.hidden_size, generator=g).to(device, dtype)
    want = torch.cat([layer.input_layernorm(draft.embed(ids)), layer.hidden_norm(h)], dim=-1)
    assert _rel(embed_norms(ids, draft.embed_weight, h, layer.input_layernorm.weight, layer.hidden_norm.weight,
                            layer.input_layernorm.eps), want) < _tol(dtype) / 4
    layer.mlp.down_proj.gemv = GemvConfig(block_n=4, block_k=64)  # one row: the GEMV with its residual epilogue
    saved = {"TERCEL_FUSED_DECODE": os.environ.pop("TERCEL_FUSED_DECODE", None)}
    try:
        for requests in (1, 3):
            _draft_fused_equals_unfused(device, dtype, cfg, draft, backend, g, requests)
    finally:
        _restore_env(saved)


def check_draft_mlp_fused(device: str, dtype: torch.dtype) -> None:
    """An EAGLE-3 draft layer whose MLP takes the fused GEMVs (gemv_tuning.tune_draft: the post-attention norm
    in gate_up's prologue, SwiGLU and the residual add around down) gives the unfused layer's hidden states: one
    row (the chain's draft steps) and, with TERCEL_SMALL_M=rowgrid, three (draft_extend's rows)."""
    from tercel.kernels.gemv import GemvConfig
    from tercel.models.gemv_tuning import rowgrid_rows

    cfg, draft, backend, g = _tiny_eagle3_draft(device, dtype, 41)
    mlp = draft.midlayer.mlp
    mlp.gate_up_fused, mlp.down_fused = GemvConfig(block_n=8, block_k=32), GemvConfig(block_n=4, block_k=64)
    saved = {k: os.environ.pop(k, None) for k in ("TERCEL_SMALL_M", "TERCEL_FUSED_DECODE")}
    try:
        for requests, small_m in ((1, "0"), (3, "rowgrid")):
            os.environ["TERCEL_SMALL_M"] = small_m
            rowgrid_rows(draft)  # the rows tables (read only when TERCEL_SMALL_M is on)
            _draft_fused_equals_unfused(device, dtype, cfg, draft, backend, g, requests)
    finally:
        _restore_env(saved)

def check_folded_norms(device: str, dtype: torch.dtype) -> None:
    """LlamaForCausalLM.fold_norms: a verify of one request, of two, and a prefill with logits on its last rows give
    the unfolded forward's logits, captured hidden states and K/V cache (fp32 within 1e-4 and the same greedy
    tokens; bf16 within 2% of each tensor's norm, since the folded weight and the 1/rms after the GEMM round
    elsewhere than the norm)."""
    import dataclasses

    from graph_utils import FakeRequests, kv_pool, tiny_model

    from tercel.attention.triton_backend import TritonAttentionBackend
    from tercel.forward_batch import CaptureHiddenMode

    model, cfg = tiny_model(device, dtype, num_hidden_layers=3)
    if not isinstance(model.attn_backend, TritonAttentionBackend):  # CPU under the interpreter
        model.attn_backend = TritonAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, None, num_sms=8)
    model.set_aux_layers((0, 2))
    saved = {"TERCEL_FOLD_NORMS": os.environ.get("TERCEL_FOLD_NORMS")}

    def folded(mode: str, fn):
        os.environ["TERCEL_FOLD_NORMS"] = mode
        return fn()

    fp32 = dtype == torch.float32

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        if fp32:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:
            assert _rel(got, want) < _tol(dtype), _rel(got, want)

    try:
        assert folded("1", model.fold_norms) and model.layers[1].mlp.gate_up_folded is not None
        mlp, norm = model.layers[1].mlp, model.layers[1].post_attention_layernorm
        assert _rel(mlp.gate_up_folded, mlp.gate_up_proj.weight.float() * norm.weight.float()) < _tol(dtype) / 4
        kv_f, kv_u = kv_pool(cfg, device, dtype, 100, 16), kv_pool(cfg, device, dtype, 100, 16)
        reqs = FakeRequests(3, kv_f, cfg.vocab_size)
        prefill = dataclasses.replace(reqs.batch([0, 2], 5), logits_indices=torch.tensor([4, 9], device=device))
        for batch in (reqs.batch([1], 4), reqs.batch([0, 2], 3), prefill):
            batch = dataclasses.replace(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
            meta = model.attn_backend.prepare(batch, kv_f.block_size)
            h = torch.zeros(batch.input_ids.shape[0], cfg.hidden_size, device=device, dtype=dtype)
            assert folded("1", lambda: model._folds(h, meta)), "the folded layers did not take this batch"
            assert not folded("0", lambda: model._folds(h, meta))
            got = folded("1", lambda: model(batch, kv_f))
            want = folded("0", lambda: model(batch, kv_u))
            assert got.logits.shape == want.logits.shape == (batch.logits_indices.shape[0], cfg.vocab_size)
            close(got.logits, want.logits)
            if fp32:  # bf16 may part at a near-tie of a random model's logits
                assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
            close(got.hidden_states, want.hidden_states)
        close(kv_f.k, kv_u.k)
        close(kv_f.v, kv_u.v)
    finally:
        _restore_env(saved)


ALL = [check_race, check_argmax, check_norms, check_rope_store, check_decode, check_extend, check_gemv,
       check_gemv_fused, check_gemm_small, check_gemv_q8, check_decode_rope, check_rows_rope,
       check_tree_draft_attention, check_dflash_paged_attention, check_paged_dense_merge, check_chain_accept,
       check_stream_keys,
       check_sample_filter, check_tree_accept, check_ddtree_beams, check_race_logits,
       check_topk_rows, check_draft_rope_attention, check_draft_input_and_add, check_draft_mlp_fused,
       check_folded_norms, check_tree_draft, check_chain_positions, check_norm_rope]


def run_in_interpreter(check: str, timeout: int = 300) -> None:
    """kernel_checks.<check>('cpu', float32) in a subprocess under TRITON_INTERPRET=1 (the interpreter is chosen
    when triton is imported, so the test process itself cannot switch to it); fails with the child's output."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = ("import sys, torch; sys.path.insert(0, 'tests'); import kernel_checks as k; "
            f"k.{check}('cpu', torch.float32); print('check ok')")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root,
                         timeout=timeout)
    assert out.returncode == 0 and "check ok" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def run_all(device: str, dtype: torch.dtype) -> None:
    for check in ALL:
        check(device, dtype)
        print(f"ok {check.__name__} {device} {dtype}", flush=True)


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    run_all(dev, torch.float32)
