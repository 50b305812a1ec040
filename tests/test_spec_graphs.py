"""Speculative steps under the graph runner, tested on the CPU with the breakable-debug backend (every
captured forward re-runs on the static buffers: the marshalling, padding policies and static shapes of
verify, the EAGLE draft loop and draft_extend are exercised; only the CUDA graph itself is not).

Graph-mode greedy output equals eager-mode output equals plain output (fp32, SmolLM2), for every
algorithm, as batches shrink and requests are cancelled; the graphs are really replayed; batched device
acceptance equals the host walk of the tree."""
from __future__ import annotations

import random

import pytest
import torch
from spec_utils import spec_llm

from tercel import SamplingParams
from tercel.batching import blocks_covering, padded_tables
from tercel.outputs import RequestMetrics
from tercel.request import Request
from tercel.speculative.tree import DraftTree, select_tree_nodes
from tercel.speculative.verify import accept_greedy_batched, accept_walk

GRAPHS = dict(cuda_graph_backend="breakable-debug", max_model_len=320)
ALGOS = {
    "ngram": dict(speculative_algorithm="NGRAM"),
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1),
    "eagle3-tree": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_num_draft_tokens=16),
    "dflash": dict(speculative_algorithm="DFLASH"),
    "ddtree": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=8),
}


def _random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(j) for j in range(1, n)]
    tokens = [rng.randrange(vocab)]
    for j in range(1, n):  # siblings carry distinct tokens, as every drafter's do
        used = {tokens[c] for c in range(1, j) if parents[c] == parents[j]}
        tokens.append(rng.choice([t for t in range(vocab) if t not in used]))
    return DraftTree(tokens, parents)


@pytest.mark.parametrize("chains", [True, False])
def test_batched_device_acceptance_equals_the_host_walk(chains):
    rng = random.Random(0)
    vocab, width, b = 5, 9, 64  # a small vocabulary: long accepted runs happen often
    trees = [DraftTree.chain(rng.randrange(vocab), [rng.randrange(vocab) for _ in range(rng.randrange(width))])
             if chains else _random_tree(rng, rng.randrange(1, width + 1), vocab) for _ in range(b)]
    argmax = torch.randint(0, vocab, (b, width), generator=torch.Generator().manual_seed(1))
    for i, t in enumerate(trees):  # the target agrees with most drafts: long accepted paths happen
        for j in range(1, len(t)):
            if rng.random() < 0.7:
                argmax[i, t.parents[j]] = t.tokens[j]
    tokens = torch.tensor([t.tokens + [t.tokens[0]] * (width - len(t)) for t in trees])
    lens = torch.tensor([len(t) for t in trees])
    extra = {}
    if not chains:
        masks = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1)
        for i, t in enumerate(trees):
            masks[i, :len(t), :len(t)] = t.attention_mask()
        extra = dict(parents=torch.tensor([t.parents + [-1] * (width - len(t)) for t in trees]),
                     depth=torch.tensor([t.depth + [0] * (width - len(t)) for t in trees]), masks=masks)
    best, bonus = accept_greedy_batched(argmax, tokens, lens, **extra)
    total = 0
    req = Request("r", None, [1], SamplingParams(temperature=0), torch.Generator(), RequestMetrics(0.0))
    for i, t in enumerate(trees):
        logits = torch.nn.functional.one_hot(argmax[i, :len(t)], vocab).float()
        ref = accept_walk(t, logits, req)
        assert t.path_to(int(best[i]))[1:] == ref.nodes and int(bonus[i]) == ref.bonus
        total += len(ref.nodes)
    assert total > b // 2  # the check saw accepted runs, not only rejections


@pytest.fixture(scope="module")
def prompts(smol_llm, smol_chat_ids):
    tok = smol_llm.tokenizer
    return smol_chat_ids[:2] + [tok.encode("The quick brown fox. " * 6)]


@pytest.fixture(scope="module")
def plain(smol_llm, prompts):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]


def _replays(llm) -> int:
    spec = llm.engine.spec
    runners = [spec.verify_runner, spec.chain.runner if spec.chain else None] + [
        getattr(spec.drafter, f"{kind}_runner", None) for kind in ("loop", "tree", "extend", "block")]
    return sum(r.stats.replays for r in runners if r is not None)


@pytest.mark.parametrize("name", list(ALGOS))
def test_graph_mode_equals_eager_and_plain(smol_llm, prompts, plain, name):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    graph = spec_llm(smol_llm, **GRAPHS, cuda_graph_max_bs=4, **ALGOS[name])
    eager = spec_llm(smol_llm, max_model_len=320, **ALGOS[name])
    assert eager.engine.spec.verify_runner is None and graph.engine.spec.verify_runner is not None
    for batch in (prompts, prompts[:1]):  # batch 3, then 1
        g = [o.outputs[0].token_ids for o in graph.generate(batch, params)]
        e = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
        assert g == e == plain[:len(batch)]
    assert _replays(graph) > 0 and graph.engine.spec.verify_runner.stats.eager == 0
    assert graph.engine.stats().kv_blocks_used == 0
    if name in ("eagle3-tree", "ddtree"):  # the whole tree step (draft, verify, accept, extend) replays
        chain = graph.engine.spec.chain.runner
        assert chain.stats.replays > 0 and chain.stats.eager == 0, dict(chain.stats.fallbacks)


def _prefilled(llm, prompts) -> tuple[list, list[int], torch.Tensor]:
    """The prompts added and stepped until every request's draft state is current after its prefill: the
    requests, their positions (base) and their block tables covering [0, base) ([B, cols], zero-padded)."""
    eng, drafter = llm.engine, llm.engine.spec.drafter
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    reqs = [eng.requests[eng.add_request(p, params)] for p in prompts]
    while not all(r.num_computed_tokens > 0 and drafter.ready(r) for r in reqs):
        eng.step()
    base = [r.num_computed_tokens for r in reqs]
    cols = blocks_covering(max(base), eng.kv.block_size)
    return reqs, base, torch.tensor(padded_tables(reqs, cols)).view(len(reqs), cols)


def test_the_tree_draft_step_replays_what_it_computes_eagerly(smol_llm, prompts):
    """The captured tree draft loop (prefix padded to the block tables' capacity) gives the eager loop's
    candidates (the batch's own prefix): the same tokens and parents, the same scores, for requests of
    different lengths and a padded bucket."""
    from tercel.executor import DRAFT_TREE
    from tercel.speculative.eagle_tree_step import TreeDraftBatch

    llm = spec_llm(smol_llm, **GRAPHS, cuda_graph_bs=[4], **ALGOS["eagle3-tree"])
    eng, drafter = llm.engine, llm.engine.spec.drafter
    reqs, base, tables = _prefilled(llm, prompts)
    batch = TreeDraftBatch(torch.stack([r.spec_state.logits for r in reqs]),
                           torch.stack([r.spec_state.hidden for r in reqs]), torch.tensor(base), tables)
    replays = drafter.tree_runner.stats.replays
    with torch.inference_mode():  # as the engine runs its steps
        want = drafter.tree_step.eager(batch, max(base))
        got = eng.executor.run(DRAFT_TREE, batch)
    assert drafter.tree_runner.stats.replays == replays + 1
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-6)
    assert got.tokens.shape == (3, 4 + 4 * 4 * (drafter.num_steps - 1))
    assert torch.equal(got.tree_tokens, want.tree_tokens) and torch.equal(got.tree_parents, want.tree_parents)
    for i in range(3):  # re-ranked on the device as the host re-ranks
        kept, parents = select_tree_nodes(got.scores[i].float(), got.parents[i], drafter.num_draft_tokens - 1)
        assert got.tree_tokens[i].tolist() == got.tokens[i, kept].tolist() and got.tree_parents[i].tolist() == parents


@pytest.mark.parametrize("name,kw", [
    ("dflash-2", dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=2)),
    ("dflash-9", dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=9)),
    ("ddtree-2", dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=2)),
    ("ddtree-32", dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=32)),
    ("eagle3-chain-2", dict(speculative_algorithm="EAGLE3", speculative_num_steps=1)),
    ("eagle3-tree-9", dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=2,
                           speculative_num_draft_tokens=9)),
])
def test_every_width_runs_under_graphs(smol_llm, prompts, plain, name, kw):
    llm = spec_llm(smol_llm, **GRAPHS, cuda_graph_max_bs=2, **kw)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]
    assert outs == [p[:8] for p in plain[:2]]
    assert _replays(llm) > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_batches_shrink_with_cancellations_under_graphs(smol_llm, prompts, plain, overlap):
    """32 requests, then 12 after 20 are cancelled mid-run, then 1: every survivor's output is plain's;
    every KV block comes back; nothing ran eagerly that a graph could serve (with the overlap schedule,
    cancellations land while a chained step is in flight)."""
    # the buckets the batch passes through (32, 12 -> 16, 1): capturing every default bucket up to 32 took
    # most of this test's time on the CPU
    llm = spec_llm(smol_llm, **GRAPHS, **ALGOS["eagle3-chain"], cuda_graph_bs=[1, 16, 32],
                   disable_overlap_schedule=not overlap)
    eng = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ids = [eng.add_request(prompts[i % len(prompts)], params) for i in range(32)]
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 3:
            for rid in ids[12:]:
                eng.abort_request(rid)
        if steps == 6:
            for rid in ids[1:12]:
                eng.abort_request(rid)
    assert ids[0] in done and done[ids[0]] == plain[0]
    for i, rid in enumerate(ids[:12]):
        if rid in done:
            assert done[rid] == plain[i % len(prompts)][:len(done[rid])]
    assert eng.stats().kv_blocks_used == 0
    assert eng.spec.verify_runner.stats.eager == 0 and eng.spec.chain.runner.stats.replays > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_eagle_chain_runs_into_max_model_len(smol_llm, prompts, plain, graphs):
    """Near max_model_len the device chain (verified whole) gives way to trimmed trees: no position
    passes the limit, the output is plain's, and it ends for length there."""
    p = prompts[2]
    kw = dict(GRAPHS, cuda_graph_max_bs=2) if graphs else {}
    llm = spec_llm(smol_llm, **{**kw, "max_model_len": len(p) + 11}, **ALGOS["eagle3-chain"])
    out = llm.generate([p], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(p) + len(out.token_ids) == len(p) + 11
    assert out.token_ids == plain[2][:11]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("name", ["dflash", "ddtree"])
def test_chained_dflash_steps_equal_plain(smol_llm, prompts, plain, name, overlap):
    """Greedy DFLASH / DDTREE as one chained step (block forward over the context cache; DDTREE's tree built from
    the block's marginals, ddtree_chain.ddtree_nodes; verify, accept, the accepted path's KV compaction, context
    injection; the state carried in the graph's buffers), the host one step behind under the overlap schedule:
    plain's tokens at different stopping lengths, no KV block left, and a new batch restarts it."""
    from tercel.speculative.ddtree_chain import DDTreeChainStep

    llm = spec_llm(smol_llm, **GRAPHS, cuda_graph_max_bs=4, disable_overlap_schedule=not overlap,
                   speculative_adaptive="off", **ALGOS[name])
    chain = llm.engine.spec.chain
    assert chain is not None and isinstance(chain.runner.step, DDTreeChainStep) == (name == "ddtree")
    lengths = [16, 5, 11]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs == [p[:n] for p, n in zip(plain, lengths)]
    assert chain.runner.stats.replays > 0 and chain.runner.stats.eager == 0 and chain.inflight is None
    assert llm.engine.spec_stats().accepted_tokens > 0
    assert llm.engine.stats().kv_blocks_used == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params[0])] == [plain[0]]


@pytest.mark.parametrize("name", ["dflash", "ddtree"])
def test_chained_sampled_dflash_steps_give_the_plain_tokens(smol_llm, prompts, name):
    """Sampled DFLASH blocks / DDTREE trees run as the sampled chained step: every target token drawn in the graph
    with the request's noise for its output position (a greedy request beside them by argmax; DFLASH's drafts
    race the same noise), so seeded requests get plain sampling's tokens."""
    llm = spec_llm(smol_llm, **GRAPHS, cuda_graph_max_bs=4, speculative_adaptive="off", **ALGOS[name])
    chain = llm.engine.spec.chain
    assert chain is not None and chain.sampled is not None
    params = [SamplingParams(max_tokens=14, seed=5, temperature=1.0, top_p=0.9, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, seed=9, temperature=0.7, top_k=20, ignore_eos=True)]
    want = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert chain.sampled.stats.replays > 0 and chain.sampled.stats.eager == 0
    assert llm.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_chained_eagle_steps_equal_plain(smol_llm, prompts, plain, overlap):
    """Greedy EAGLE chains as one chained step (draft, verify, accept, draft_extend; the state carried in the
    graph's buffers), with the host one step behind under the overlap schedule: requests stopping at
    different lengths get plain's tokens, the discarded step of a stopped request leaks no KV block."""
    llm = spec_llm(smol_llm, **GRAPHS, cuda_graph_max_bs=4, disable_overlap_schedule=not overlap,
                   **ALGOS["eagle3-chain"])
    chain = llm.engine.spec.chain
    assert chain is not None
    lengths = [16, 5, 11]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs == [p[:n] for p, n in zip(plain, lengths)]
    assert chain.runner.stats.replays > 0 and chain.inflight is None
    assert llm.engine.stats().kv_blocks_used == 0
    # a batch of one after the batch of three: the chain restarts from the request's own draft state
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params[0])] == [plain[0]]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_chained_eagle_tree_steps_equal_plain(smol_llm, prompts, plain, overlap):
    """EAGLE trees (topk 4, 16 nodes) as one chained step: the draft loop and its re-ranking, the tree verify,
    acceptance, the compaction of the accepted path's KV and draft_extend on the device, the state carried in
    the graph's buffers, the host one step behind under the overlap schedule. Requests stopping at different
    lengths get plain's tokens, paths through later siblings were accepted (their KV moved), no KV block is
    left, and a new batch restarts the chain from each request's own draft state."""
    from tercel.speculative.tree_chain import EagleTreeChainStep, tree_accept

    moved = []

    def spy(*args):
        acc = tree_accept(*args)
        moved.append(acc.src)
        return acc

    llm = spec_llm(smol_llm, **GRAPHS, cuda_graph_max_bs=4, disable_overlap_schedule=not overlap,
                   speculative_adaptive="off", **ALGOS["eagle3-tree"])
    chain = llm.engine.spec.chain
    assert chain is not None and isinstance(chain.runner.step, EagleTreeChainStep)
    lengths = [16, 5, 11]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    import tercel.speculative.tree_chain as tc
    original = tc.tree_accept
    tc.tree_accept = spy
    try:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        tc.tree_accept = original
    assert outs == [p[:n] for p, n in zip(plain, lengths)]
    assert chain.runner.stats.replays > 0 and chain.runner.stats.eager == 0 and chain.inflight is None
    assert llm.engine.spec_stats().accepted_tokens > 0
    assert any(bool((m != 0).any()) for m in moved)  # some accepted path left the first-child order
    assert llm.engine.stats().kv_blocks_used == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params[0])] == [plain[0]]


@pytest.mark.parametrize("name", ["eagle3-tree", "ddtree"])
def test_chained_tree_steps_survive_cancellations_in_flight(smol_llm, prompts, plain, name):
    """Requests cancelled while a chained tree step is in flight (overlap schedule): the batch shrinks, the chain
    restarts for the survivors from their own state, their output is plain's, and every KV block comes back."""
    llm = spec_llm(smol_llm, **GRAPHS, cuda_graph_bs=[1, 2, 4], speculative_adaptive="off",
                   disable_overlap_schedule=False, **ALGOS[name])
    eng = llm.engine
    # more tokens than a step's width: the chain goes on while a request may need another step
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ids = [eng.add_request(prompts[i % len(prompts)], params) for i in range(4)]
    done: dict[str, list[int]] = {}
    aborted = False
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        inflight = eng.spec.chain.inflight
        if not aborted and inflight is not None and len(inflight.reqs) == 4:  # a step of all four on the device
            for rid in (ids[1], ids[3]):
                eng.abort_request(rid)
            aborted = True
    assert aborted
    want = [o.outputs[0].token_ids for o in smol_llm.generate([prompts[0], prompts[2]], params)]
    assert [done[ids[0]], done[ids[2]]] == want
    assert eng.stats().kv_blocks_used == 0
    assert eng.spec.chain.runner.stats.replays > 0 and eng.spec.chain.runner.stats.eager == 0


def test_the_dflash_block_step_replays_what_it_computes_eagerly(smol_llm, prompts):
    """DDTREE's captured block forward (the context padded to the block tables' capacity) gives the eager
    forward's logits (the batch's own context), for requests of different lengths and a padded bucket."""
    from tercel.executor import DRAFT_BLOCK
    from tercel.speculative.dflash_block_step import BlockBatch

    llm = spec_llm(smol_llm, **GRAPHS, cuda_graph_bs=[4], **ALGOS["ddtree"])
    eng, drafter = llm.engine, llm.engine.spec.drafter
    reqs, base, tables = _prefilled(llm, prompts)
    roots = torch.tensor([(r.output_token_ids or r.prompt_token_ids)[-1] for r in reqs])
    block_lens = torch.tensor([drafter.block_size, 3, drafter.block_size])  # one block cut short
    batch = BlockBatch(roots, torch.tensor(base), tables, block_lens)
    replays = drafter.block_runner.stats.replays
    with torch.inference_mode():
        want = drafter.block_step.eager(batch).clone()
        got = eng.executor.run(DRAFT_BLOCK, batch)
    assert drafter.block_runner.stats.replays == replays + 1
    assert got.shape == (3, drafter.block_size - 1, eng.model_config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
