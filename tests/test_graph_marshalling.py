"""Replay marshalling and padding, on CPU tensors: grouped copies by dtype pair, big tensors and
strided destinations outside the group, every padding policy applied to the tail, and buffers
reused from a larger batch never leaking stale values into what a graph reads. Then the whole
runner, driven on CPU in its breakable-debug mode (the forward re-runs eagerly over the static
buffers), against the eager model: buckets, shrinking and growing batches, verify-shaped steps,
capture-hidden mode upgrades and eager fallbacks."""
from __future__ import annotations

import pytest
import torch
from graph_utils import FakeRequests, kv_pool, tiny_model

from tercel.forward_batch import CaptureHiddenMode
from tercel.graphs import BufferSpec, CudaGraphRunner, GraphConfig, Pad, Per, StaticBuffers, default_batch_sizes
from tercel.graphs import buffers as B
from tercel.graphs.steps import ModelStep


@pytest.fixture
def foreach_calls(monkeypatch):
    calls = []
    real = torch._foreach_copy_

    def counting(dsts, srcs):
        calls.append(([d.dtype for d in dsts], [s.dtype for s in srcs]))
        return real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    return calls


def test_copies_are_grouped_by_dtype_pair(foreach_calls):
    dsts = [torch.zeros(4, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.zeros(5, dtype=torch.int32),
            torch.zeros(2), torch.zeros(2, dtype=torch.long)]
    srcs = [torch.arange(4), torch.arange(3) + 10, torch.arange(5), torch.ones(2),
            torch.tensor([7, 8], dtype=torch.int32)]
    plan = B.grouped_copy_(dsts, srcs)
    assert set(plan.groups) == {(torch.long, torch.long), (torch.int32, torch.long), (torch.float32, torch.float32),
                                (torch.long, torch.int32)}
    assert len(plan.groups[(torch.long, torch.long)][0]) == 2  # two small int64 copies, one launch
    assert len(foreach_calls) == 4 and plan.num_launches == 4
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.to(d.dtype))


def test_big_and_strided_tensors_get_their_own_copy(foreach_calls):
    hidden_dst, hidden_src = torch.zeros(64, 32), torch.randn(64, 32)  # 8 KiB: "big" under an 8 KiB threshold
    table = torch.zeros(4, 6, dtype=torch.long)
    dsts = [torch.zeros(3, dtype=torch.long), hidden_dst, table[:2, :3]]
    srcs = [torch.arange(3), hidden_src, torch.ones(2, 3, dtype=torch.long)]
    plan = B.grouped_copy_(dsts, srcs, big_copy_bytes=8 * 1024)
    assert [d for d, _ in plan.singles] == [hidden_dst, dsts[2]]
    assert all(hidden_dst is not d for d in plan.groups[(torch.long, torch.long)][0])
    assert len(foreach_calls) == 1 and foreach_calls[0][0] == [torch.long]
    assert torch.equal(hidden_dst, hidden_src) and table[:2, :3].eq(1).all() and table[2:].eq(0).all()


def test_per_tensor_fallback_gives_the_same_result(monkeypatch, foreach_calls):
    dsts = [torch.zeros(4, dtype=torch.long), torch.zeros(3)]
    srcs = [torch.arange(4), torch.ones(3)]
    B.grouped_copy_(dsts, srcs, use_foreach=False)
    assert not foreach_calls
    monkeypatch.setattr(B, "HAS_FOREACH_COPY", False)  # a torch without _foreach_copy_
    dsts2 = [torch.zeros(4, dtype=torch.long), torch.zeros(3)]
    B.grouped_copy_(dsts2, srcs)
    assert not foreach_calls
    assert all(torch.equal(a, b) for a, b in zip(dsts, dsts2))


SPECS = [
    BufferSpec("input_ids", Per.TOKEN, torch.long, Pad.HEAD_ONLY),
    BufferSpec("positions", Per.TOKEN, torch.long, Pad.ZERO),
    BufferSpec("out_cache_loc", Per.TOKEN, torch.long, Pad.ZERO),
    BufferSpec("seq_lens", Per.REQUEST, torch.long, Pad.SENTINEL, sentinel=2),
    BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(6,)),
    BufferSpec("hidden", Per.TOKEN, torch.float32, Pad.ZERO, shape=(16,)),
]


def _live(n: int, t: int, width: int, base: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(n * t) + base, "positions": torch.arange(n * t) + base + 100,
            "out_cache_loc": torch.arange(n * t) + base + 200, "seq_lens": torch.arange(n) + base + 300,
            "block_tables": torch.arange(n * width).view(n, width) + base + 400,
            "hidden": torch.randn(n * t, 16) + base}


@pytest.mark.parametrize("t", [1, 3])
def test_padding_policies_overwrite_stale_rows_from_a_larger_batch(t):
    bufs = StaticBuffers(SPECS, max_requests=8, tokens_per_request=t, device="cpu")
    big = _live(8, t, 6, base=1000)  # an earlier, larger batch leaves stale values everywhere
    B.grouped_copy_(*bufs.copy_pairs(big, 8, 8), big_copy_bytes=256)
    live = _live(3, t, 4, base=0)  # 3 requests into bucket 5, block tables narrower than the buffer
    B.grouped_copy_(*bufs.copy_pairs(live, 3, 5), big_copy_bytes=256)
    n, b = 3 * t, 5 * t
    view = bufs.tensors
    assert torch.equal(view["input_ids"][:n], live["input_ids"])
    assert torch.equal(view["input_ids"][n:], big["input_ids"][n:])  # HEAD_ONLY: the tail is left alone
    for name in ("positions", "out_cache_loc"):
        assert torch.equal(view[name][:n], live[name])
        assert view[name][n:b].eq(0).all(), f"{name}: padded tokens must point at the dummy slot"
        assert torch.equal(view[name][b:], big[name][b:])  # rows no bucket-5 graph reads
    assert torch.equal(view["seq_lens"][:3], live["seq_lens"]) and view["seq_lens"][3:5].eq(2).all()
    assert torch.equal(view["block_tables"][:3, :4], live["block_tables"])
    assert view["block_tables"][3:5].eq(0).all(), "padded requests may only see the dummy block"
    assert torch.equal(view["hidden"][:n], live["hidden"]) and view["hidden"][n:b].eq(0).all()


def test_buffers_reject_what_they_cannot_hold():
    bufs = StaticBuffers(SPECS, max_requests=4, tokens_per_request=1, device="cpu")
    with pytest.raises(ValueError, match="wider"):
        bufs.copy_pairs(_live(2, 1, 7, 0), 2, 2)
    with pytest.raises(ValueError, match="missing"):
        bufs.copy_pairs({k: v for k, v in _live(2, 1, 4, 0).items() if k != "hidden"}, 2, 2)
    with pytest.raises(ValueError, match="bucket"):
        bufs.copy_pairs(_live(2, 1, 4, 0), 2, 1)
    with pytest.raises(ValueError, match="sentinel"):
        BufferSpec("x", Per.REQUEST, torch.long, Pad.SENTINEL)


def test_default_buckets():
    assert default_batch_sizes(256)[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert default_batch_sizes(256)[-3:] == [224, 240, 256]
    assert default_batch_sizes(100)[-1] == 100 and default_batch_sizes(3) == [1, 2, 3]
    assert GraphConfig(batch_sizes=(4, 1, 2)).buckets() == [1, 2, 4]


# ---- the runner on CPU (breakable-debug: the captured forward re-runs eagerly on the static buffers) ----

def _runner(model, kv, t=1, mask=False, max_bs=8, **cfg):
    step = ModelStep(model, kv, max_blocks_per_request=16, tokens_per_request=t, custom_mask=mask)
    runner = CudaGraphRunner(step, GraphConfig(max_bs=max_bs, backend="breakable-debug", **cfg), "cpu")
    return runner, step


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def test_replay_equals_eager_as_batches_shrink_and_grow(tiny):
    model, cfg = tiny
    kv = kv_pool(cfg, "cpu", torch.float32)
    runner, step = _runner(model, kv)
    runner.capture_all()
    reqs = FakeRequests(8, kv, cfg.vocab_size)
    kv_ref = kv_pool(cfg, "cpu", torch.float32)  # the same pool, run eagerly
    step_ref = ModelStep(model, kv_ref, 16)
    for rows in ([0, 1, 2, 3, 4, 5, 6, 7], [1, 3, 4], [6], [0, 2, 3, 5, 7]):  # 8 -> 3 -> 1 -> 5
        batch = reqs.batch(rows)
        before = kv.k.clone()
        out = runner.run(batch)
        ref = step_ref.eager(reqs.batch(rows))
        assert out.logits.shape == ref.logits.shape
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
        # padded slots wrote only the dummy block; live requests wrote only their own new slot
        changed = (kv.k != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        allowed = set(batch.out_cache_loc.tolist()) | set(range(kv.block_size))
        assert set(changed) <= allowed
        torch.testing.assert_close(kv.k[:, kv.block_size:], kv_ref.k[:, kv.block_size:])
        reqs.advance(rows, out.logits.argmax(-1).tolist())
    assert runner.stats.replays == 4 and runner.stats.eager == 0


def test_verify_step_with_tree_masks_equals_eager(tiny):
    model, cfg = tiny
    kv, kv_ref = kv_pool(cfg, "cpu", torch.float32), kv_pool(cfg, "cpu", torch.float32)
    runner, _ = _runner(model, kv, t=4, mask=True)
    runner.capture_all()
    reqs = FakeRequests(8, kv, cfg.vocab_size)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    for rows in ([0, 1, 2, 3, 4, 5], [2, 7], [5]):
        masks = [tree if i % 2 else None for i in rows]  # None: a chain (causal)
        out = runner.run(reqs.batch(rows, 4, masks))
        ref = model(reqs_ref_batch(reqs, kv_ref, rows, masks), kv_ref)
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    assert runner.stats.replays == 3


def reqs_ref_batch(reqs: FakeRequests, kv_ref, rows, masks):
    kv_live = reqs.kv
    reqs.kv = kv_ref
    try:
        return reqs.batch(rows, 4, masks)
    finally:
        reqs.kv = kv_live


def test_fallbacks_are_eager_and_counted(tiny):
    model, cfg = tiny
    kv = kv_pool(cfg, "cpu", torch.float32)
    runner, _ = _runner(model, kv, max_bs=4)
    runner.capture_all()
    reqs = FakeRequests(8, kv, cfg.vocab_size)
    out = runner.run(reqs.batch(list(range(6))))  # larger than the largest bucket
    assert out.logits.shape[0] == 6
    prefill = reqs.batch([0, 1], tokens_per_request=3)  # not a decode batch
    assert runner.run(prefill).logits.shape[0] == 6
    assert runner.stats.replays == 0 and runner.stats.eager == 2
    assert any("larger than" in r for r in runner.stats.fallbacks)
    assert any("uniform" in r for r in runner.stats.fallbacks)


def test_higher_hidden_mode_recaptures_and_aux_change_invalidates(tiny):
    model, cfg = tiny
    kv = kv_pool(cfg, "cpu", torch.float32)
    runner, step = _runner(model, kv, max_bs=4)
    runner.capture_all(CaptureHiddenMode.NULL)
    reqs = FakeRequests(4, kv, cfg.vocab_size)
    batch = reqs.batch([0, 1, 2])
    batch.capture_hidden_mode = CaptureHiddenMode.FULL
    out = runner.run(batch)
    assert runner.graphs[runner.bucket_for(3)].mode == CaptureHiddenMode.FULL and out.hidden_states is not None
    ref = step.eager(batch)
    torch.testing.assert_close(out.hidden_states, ref.hidden_states, atol=1e-4, rtol=1e-4)
    batch.capture_hidden_mode = CaptureHiddenMode.LAST  # a FULL graph serves LAST without recapture
    captures = runner.stats.captures
    assert runner.run(batch).hidden_states.shape == ref.hidden_states.shape and runner.stats.captures == captures
    model.set_aux_layers([0, 2])  # the graph baked in "no aux layers": it must not be replayed
    try:
        captures = runner.stats.captures
        plain = reqs.batch([0, 1])  # NULL mode reads no hidden states: its graph stays valid
        torch.testing.assert_close(runner.run(plain).logits, step.eager(plain).logits, atol=1e-4, rtol=1e-4)
        assert runner.stats.captures == captures
        batch.capture_hidden_mode = CaptureHiddenMode.FULL
        out = runner.run(batch)
        ref = step.eager(batch)
        assert out.hidden_states.shape[-1] == 2 * cfg.hidden_size
        torch.testing.assert_close(out.hidden_states, ref.hidden_states, atol=1e-4, rtol=1e-4)
    finally:
        model.set_aux_layers([])
    no_recapture, _ = _runner(model, kv, max_bs=4, recapture=False)
    no_recapture.capture_all(CaptureHiddenMode.NULL)
    out = no_recapture.run(batch)
    assert out.hidden_states is not None and no_recapture.stats.eager == 1
    assert any("recapture is off" in r for r in no_recapture.stats.fallbacks)


def test_cached_staging_plans_copy_fresh_values(foreach_calls):
    bufs = StaticBuffers(SPECS, max_requests=8, tokens_per_request=1, device="cpu")
    bufs.stage(_live(8, 1, 6, base=1000), 8, 8, big_copy_bytes=256)
    for base in (0, 50):  # the same shapes twice: the second call reuses the plan with the new tensors
        live = _live(3, 1, 4, base=base)
        bufs.stage(live, 3, 5, big_copy_bytes=256)
        assert torch.equal(bufs.tensors["positions"][:3], live["positions"])
        assert bufs.tensors["positions"][3:5].eq(0).all() and bufs.tensors["seq_lens"][3:5].eq(2).all()
        assert torch.equal(bufs.tensors["block_tables"][:3, :4], live["block_tables"])
        assert torch.equal(bufs.tensors["hidden"][:3], live["hidden"])
    assert len(bufs._plans) == 2
    # per replay one launch per dtype pair (int64: 4 live + 4 pads, float32: hidden + its pad); the
    # narrower block table has its own copy
    assert len(foreach_calls) == 5
    assert foreach_calls[-2][0] == [torch.long] * 8 and foreach_calls[-1][0] == [torch.float32] * 2


def test_capture_collects_garbage_first_and_pauses_the_collector(tiny):
    """A dead engine's graphs freed by a cyclic collection in the middle of a capture invalidate it
    on the GPU (seen on the H200: a second engine built after the first was dropped); so garbage is
    collected before capture and the collector is paused until capture ends."""
    import gc

    model, cfg = tiny
    kv = kv_pool(cfg, "cpu", torch.float32)
    events = []

    class Graph:
        def capture(self, fn):
            events.append(("capture", gc.isenabled()))
            return fn()

    runner, _ = _runner(model, kv, max_bs=2)
    runner._new_graph = lambda: Graph()

    class DeadEngine:  # a reference cycle only the cyclic collector frees
        def __init__(self):
            self.me = self

        def __del__(self):
            events.append(("freed", None))

    DeadEngine()
    assert gc.isenabled()
    runner.capture_all()
    # collected before the first capture; every capture ran with the collector paused; resumed after
    assert events == [("freed", None)] + [("capture", False)] * len(runner.buckets) and gc.isenabled()
    DeadEngine()
    runner.capture(1, CaptureHiddenMode.FULL)  # a lone (re)capture does the same
    assert events[-2:] == [("freed", None), ("capture", False)] and gc.isenabled()
