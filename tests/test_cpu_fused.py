"""The fused CPU decoder layer (tercel/models/cpu_layer_kernel.cpp, tercel.models.cpu_fused).

Specification: one call computes a Llama-family layer (RMSNorm, q/k/v with optional bias, optional q/k RMSNorm,
RoPE, the K/V store, causal attention over the paged cache with an optional sliding window, o_proj + residual,
RMSNorm, SwiGLU MLP + residual) as a float reference built from the same Q4 x Q8 matmuls computes it; a step of
several rows per request (a verify) gives what the same rows fed one at a time give, bit for bit, at any thread
count; bad inputs are refused with the name of what is wrong. In a model: bf16 with the Q4 x Q8 kernel takes it,
its logits track the fp32 model as closely as the eager bf16 loop's, speculative greedy output equals plain
greedy output through it, TERCEL_CPU_FUSED=0 and fp32 keep the eager loop.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import last_logits
from gguf_utils import tiny_q4_gguf
from spec_utils import spec_llm
from test_spec_greedy import prompts  # noqa: F401  (the 20 SmolLM2 prompts fixture)

from tercel import LLM, SamplingParams
from tercel.models import cpu_q8
from tercel.models.cpu_fused import CpuFusedLayers
from tercel.models.cpu_linear import Q4_GROUP, Q4Blocks, cpu_packing_available
from tercel.models.cpu_q8 import PackedQ4Q8

pytestmark = [
    pytest.mark.skipif(not cpu_packing_available(), reason="this torch build lacks the int4 CPU matmul"),
    pytest.mark.skipif(cpu_q8.kernel_error() is not None, reason=f"no Q4 x Q8 kernel: {cpu_q8.kernel_error()}"),
]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 64, 4, 2, 16, 96, 4
EPS = 1e-5


def q4(n: int, k: int, g: torch.Generator) -> PackedQ4Q8:
    d = (torch.rand(n, k // Q4_GROUP, generator=g) * 0.05 + 0.01).half().float()
    m = -8 * d
    return PackedQ4Q8(Q4Blocks(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), d, m))


class Layer:
    """Random weights of one layer and the op's tensor list."""

    def __init__(self, seed: int, bias: bool, qk_norm: bool, window: int) -> None:
        g = torch.Generator().manual_seed(seed)
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.window = window
        self.norm1 = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        self.norm2 = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        self.qkv, self.o = q4(width, HIDDEN, g), q4(HIDDEN, HEADS * HEAD_DIM, g)
        self.gate_up, self.down = q4(2 * INTER, HIDDEN, g), q4(HIDDEN, INTER, g)
        self.qkv_bias = 0.1 * torch.randn(width, generator=g) if bias else None
        self.q_norm = 1 + 0.1 * torch.randn(HEAD_DIM, generator=g) if qk_norm else None
        self.k_norm = 1 + 0.1 * torch.randn(HEAD_DIM, generator=g) if qk_norm else None

    def tensors(self) -> list[torch.Tensor]:
        e = torch.empty(0)
        opt = lambda t: e if t is None else t  # noqa: E731
        proj = lambda p, b=None: [p.qs, p.d, p.m, opt(b)]  # noqa: E731
        return [self.norm1, *proj(self.qkv, self.qkv_bias), opt(self.q_norm), opt(self.k_norm), *proj(self.o),
                self.norm2, *proj(self.gate_up), *proj(self.down)]

    def dims(self) -> list[int]:
        return [HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, self.window]


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, EPS)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class Step:
    """Rows of a step over a shuffled paged cache: request 0 verifies `t0` tokens after a prefix of `p0`, request 1
    decodes one token after `p1`; the caches hold random prefixes."""

    def __init__(self, p0: int, t0: int, p1: int, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        blocks = torch.randperm(40, generator=g)
        self.tables = torch.stack([blocks[:10], blocks[10:20]])
        lens = [(p0, t0), (p1, 1)]
        self.req = torch.tensor([r for r, (_, t) in enumerate(lens) for _ in range(t)])
        self.kv_len = torch.tensor([p + o + 1 for p, t in lens for o in range(t)])
        pos = self.kv_len - 1
        self.slots = self.tables[self.req, pos // BLOCK] * BLOCK + pos % BLOCK
        freqs = pos[:, None].float() * (10000.0 ** (-torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))[None]
        emb = torch.cat((freqs, freqs), -1)
        self.cos_sin = torch.cat((emb.cos(), emb.sin()), -1).contiguous()
        self.k = torch.randn(160, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
        self.v = torch.randn(160, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
        self.h = torch.randn(len(self.req), HIDDEN, generator=g)

    def run(self, layer: Layer, rows: slice = slice(None)) -> None:
        """The op on rows (in place on self.h and the caches)."""
        h = self.h[rows].contiguous()
        torch.ops.tercel_cpu_q8.decoder_layer(
            h, layer.tensors(), layer.dims(), EPS, HEAD_DIM ** -0.5, self.k, self.v, self.slots[rows].contiguous(),
            self.req[rows].contiguous(), self.kv_len[rows].contiguous(), self.tables, self.cos_sin[rows].contiguous(),
            BLOCK)
        self.h[rows] = h


def reference(step: Step, layer: Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, k cache, v cache) after the layer, from torch ops and the same Q4 x Q8 matmuls."""
    k_cache, v_cache = step.k.clone(), step.v.clone()
    h = step.h.clone()
    qkv = layer.qkv(rms(h, layer.norm1))
    if layer.qkv_bias is not None:
        qkv = qkv + layer.qkv_bias
    heads = qkv.view(len(h), HEADS + 2 * KV_HEADS, HEAD_DIM)
    qk, v = heads[:, :HEADS + KV_HEADS], heads[:, HEADS + KV_HEADS:]
    if layer.q_norm is not None:
        qk = torch.cat([rms(qk[:, :HEADS], layer.q_norm), rms(qk[:, HEADS:], layer.k_norm)], 1)
    d = HEAD_DIM
    qk = rope(qk, step.cos_sin[:, None, :d], step.cos_sin[:, None, d:])
    k_cache[step.slots], v_cache[step.slots] = qk[:, HEADS:].bfloat16(), v.bfloat16()
    out = torch.empty(len(h), HEADS, d)
    for r in range(len(h)):
        end = int(step.kv_len[r])
        start = max(0, end - layer.window) if layer.window else 0
        pos = torch.arange(start, end)
        slots = step.tables[step.req[r], pos // BLOCK] * BLOCK + pos % BLOCK
        keys = k_cache[slots].float().repeat_interleave(HEADS // KV_HEADS, 1)  # [S, H, D]
        vals = v_cache[slots].float().repeat_interleave(HEADS // KV_HEADS, 1)
        p = (torch.einsum("hd,shd->hs", qk[r, :HEADS], keys) * d ** -0.5).softmax(-1)
        out[r] = torch.einsum("hs,shd->hd", p, vals)
    h = h + layer.o(out.view(len(h), -1))
    gate, up = layer.gate_up(rms(h, layer.norm2)).chunk(2, -1)
    return h + layer.down(F.silu(gate) * up), k_cache, v_cache


VARIANTS = {"llama": dict(bias=False, qk_norm=False, window=0), "qwen": dict(bias=True, qk_norm=True, window=0),
            "sliding_window": dict(bias=False, qk_norm=False, window=5)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("p0,t0,p1", [(0, 1, 0), (7, 3, 13), (30, 5, 2)])
def test_one_call_is_the_layer(variant, p0, t0, p1):
    layer, step = Layer(1, **VARIANTS[variant]), Step(p0, t0, p1)
    want_h, want_k, want_v = reference(step, layer)
    step.run(layer)
    torch.testing.assert_close(step.k.float(), want_k.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(step.v, want_v)
    # the op's fp32 norms round differently from torch's, which can move a Q8 quantisation step: a small slack
    torch.testing.assert_close(step.h, want_h, rtol=0.02, atol=0.02 * float(want_h.abs().max()))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_verify_is_its_rows_one_at_a_time_bit_for_bit(threads):
    layer = Layer(2, **VARIANTS["qwen"])
    together, apart = Step(9, 4, 6), Step(9, 4, 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together.run(layer)
        torch.set_num_threads(1)
        for r in range(len(apart.req)):
            apart.run(layer, slice(r, r + 1))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together.h, apart.h)
    assert torch.equal(together.k, apart.k) and torch.equal(together.v, apart.v)


def test_bad_inputs_name_what_is_wrong():
    layer, step = Layer(1, **VARIANTS["llama"]), Step(3, 1, 3)
    args = lambda h, tensors: (h, tensors, layer.dims(), EPS, 0.25, step.k, step.v, step.slots, step.req,  # noqa: E731
                               step.kv_len, step.tables, step.cos_sin, BLOCK)
    with pytest.raises(RuntimeError, match="h must be a contiguous fp32"):
        torch.ops.tercel_cpu_q8.decoder_layer(*args(step.h.bfloat16(), layer.tensors()))
    with pytest.raises(RuntimeError, match="expected 20 weight tensors, got 19"):
        torch.ops.tercel_cpu_q8.decoder_layer(*args(step.h, layer.tensors()[:-1]))
    with pytest.raises(RuntimeError, match="does not hold a"):
        torch.ops.tercel_cpu_q8.decoder_layer(*args(step.h, layer.tensors()[::-1]))


KW = dict(device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=128)
PROMPT = [3, 17, 200, 45, 9, 3, 17, 200, 45, 9, 3, 17]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return str(tiny_q4_gguf(tmp_path_factory.mktemp("fused")))


def test_a_bf16_model_takes_it_and_tracks_fp32_as_the_eager_loop_does(gguf, monkeypatch):
    exact = last_logits(LLM(gguf, dtype="float32", **KW), PROMPT)
    fused_llm = LLM(gguf, dtype="bfloat16", **KW)
    fused = last_logits(fused_llm, PROMPT)
    assert isinstance(fused_llm.engine.model.cpu_fused, CpuFusedLayers)
    monkeypatch.setenv("TERCEL_CPU_FUSED", "0")
    eager_llm = LLM(gguf, dtype="bfloat16", **KW)
    eager = last_logits(eager_llm, PROMPT)
    assert eager_llm.engine.model.cpu_fused is None
    assert not torch.equal(fused, eager)  # two paths, not one
    err = lambda x: float((x - exact).abs().max())  # noqa: E731
    assert err(fused) <= 1.5 * err(eager) + 1e-3, (err(fused), err(eager))


def test_fp32_keeps_the_eager_loop(gguf):
    llm = LLM(gguf, dtype="float32", **KW)
    last_logits(llm, PROMPT)
    assert llm.engine.model.cpu_fused is None


def test_speculative_greedy_equals_plain_greedy_through_it(gguf):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain_llm = LLM(gguf, dtype="bfloat16", **KW)
    plain = plain_llm.generate([PROMPT], params)[0].outputs[0].token_ids
    spec_llm = LLM(gguf, dtype="bfloat16", speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                   speculative_adaptive=False, **KW)
    calls = []
    model = spec_llm.engine.model
    real = CpuFusedLayers.forward

    def counting(self, model, batch, kv, input_embeds):
        calls.append(batch.input_ids.shape[0])
        return real(self, model, batch, kv, input_embeds)

    CpuFusedLayers.forward = counting
    try:
        spec = spec_llm.generate([PROMPT], params)[0].outputs[0].token_ids
    finally:
        CpuFusedLayers.forward = real
    assert isinstance(model.cpu_fused, CpuFusedLayers)
    assert spec == plain
    assert any(n > 1 for n in calls[1:]), calls  # verify steps of several rows went through the fused layers


@contextlib.contextmanager
def fp32_fused_context(smol_llm):
    """The fp32 SmolLM2's layers through the op (TERCEL_CPU_FUSED=fp32: exact fp32 matmuls), put back after;
    yields the list of row counts of the forwards it ran."""
    model = smol_llm.engine.model
    smol_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # the default's decision taken: eager for fp32
    assert model.cpu_fused is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TERCEL_CPU_FUSED", "fp32")
        fused = CpuFusedLayers.build(model)
    assert isinstance(fused, CpuFusedLayers)
    rows: list[int] = []
    real = fused.forward

    def counting(model, batch, kv, input_embeds):
        rows.append(batch.input_ids.shape[0])
        return real(model, batch, kv, input_embeds)

    fused.forward = counting
    model.cpu_fused = fused
    try:
        yield rows
    finally:
        model.cpu_fused = None


N = 24
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


def _tokens(llm, token_prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts, params)]


def test_fp32_layers_through_it_give_the_eager_greedy_tokens_on_the_20_prompts(smol_llm, prompts):  # noqa: F811
    eager = _tokens(smol_llm, prompts, GREEDY)
    with fp32_fused_context(smol_llm) as rows:
        fused = _tokens(smol_llm, prompts, GREEDY)
    assert fused == eager
    assert rows.count(20) >= N - 1  # the decode steps of all 20 requests ran through the op


def test_fp32_layers_through_it_sample_as_the_eager_forward_does(smol_llm, prompts):  # noqa: F811
    params = [SamplingParams(max_tokens=N, temperature=0.8, top_p=0.9, top_k=50, seed=7 + i, ignore_eos=True)
              for i in range(4)]
    eager = _tokens(smol_llm, prompts[:4], params)
    with fp32_fused_context(smol_llm):
        assert _tokens(smol_llm, prompts[:4], params) == eager


def test_fp32_eagle3_verify_through_it_equals_plain_greedy(smol_llm, prompts):  # noqa: F811
    plain = _tokens(smol_llm, prompts[:3], GREEDY)
    llm = spec_llm(smol_llm, max_num_seqs=1, speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                   speculative_adaptive=False)
    with fp32_fused_context(smol_llm) as rows:
        assert _tokens(llm, prompts[:3], GREEDY) == plain
    assert any(n > 1 for n in rows)  # verify steps of several rows ran through the op


def test_auto_leaves_speculation_off_where_the_fused_layers_serve_the_default_model(smol_path, monkeypatch):
    """On the fused CPU layers a verify row costs about half a plain step, and plain decoding measured faster
    than every speculative width (benchmarks/results/cpu_fused_vs_llamacpp_smollm2.json): AUTO takes plain there,
    and the bundled EAGLE-3 head where the eager layer loop runs."""
    kw = dict(device="cpu", progress=False, max_model_len=256, speculative_algorithm="AUTO")
    fused = LLM(smol_path, **kw)  # dtype auto: bf16 with the GGUF's 4-bit matrices
    assert isinstance(fused.engine.model.cpu_fused, CpuFusedLayers) and fused.engine.spec is None
    monkeypatch.setenv("TERCEL_CPU_FUSED", "0")
    eager = LLM(smol_path, **kw)
    assert eager.engine.model.cpu_fused is None and eager.engine.spec_config.algorithm == "EAGLE3"
