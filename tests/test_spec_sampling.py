"""Speculative sampling is exactly lossless. A seeded request gets the very tokens plain sampling gives it
(the target draws each token with the noise of its output position; drafts are kept while they carry it),
whatever the algorithm, the adaptive width or the batch. And on a tiny random model (vocab 16) the joint
distribution of the first three generated tokens, computed by enumeration under the request's filters,
matches the empirical one from EAGLE-3 chains (drafts sampled from q with the target's noise) and trees
(deterministic top-k siblings): chains at T=1, T=0.7 + top-p 0.9 and top-k 5, a chain at T=1 whose draft
proposes only a 9-token map, trees at T=1 and with penalties + min-p (chi-square, p > 0.01, 20,000 seeded
requests batched 2,000 at a time)."""
from __future__ import annotations

import pytest
import torch
import transformers
from scipy.stats import chisquare
from spec_utils import tiny_llama_target

from tercel import LLM, SamplingParams
from tercel.sampling import filter_logits
from tercel.train.export import random_eagle3

transformers.logging.set_verbosity_error()
VOCAB = 16
PROMPT = [3, 7, 1, 12, 5]
N = 20_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    hf, target = tiny_llama_target(root, vocab=VOCAB, layers=3, max_positions=64, init_range=0.2)
    llm = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=32)
    draft = random_eagle3(root / "draft", llm.engine.model_config, aux_layer_ids=(0, 1, 2), std=0.4)
    (root / "hot.json").write_text("[0, 2, 3, 5, 7, 8, 11, 12, 14]")  # a token map: 9 of the 16 ids
    return hf, llm, str(draft), str(root / "hot.json")


def _exact_joint(hf, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) by enumeration, float64: [V, V, V]."""
    if params.has_penalties:
        return _exact_joint_with_penalties(hf, params)
    with torch.no_grad():
        p1 = filter_logits(hf(torch.tensor([PROMPT])).logits[0, -1].double(), params).softmax(-1)
        ctx2 = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
        p2 = filter_logits(hf(ctx2).logits[:, -1].double(), params).softmax(-1)
        ctx3 = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p3 = filter_logits(hf(ctx3).logits[:, -1].double(), params).softmax(-1).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def _exact_joint_with_penalties(hf, params: SamplingParams) -> torch.Tensor:
    """Penalties depend on the tokens generated so far: evaluate the plain sampler's distribution
    (tercel.sampling.target_probs) after every enumerated prefix."""
    from tercel.outputs import RequestMetrics
    from tercel.request import Request
    from tercel.sampling import target_probs

    def probs(logits, out):
        req = Request("r", None, list(PROMPT), params, torch.Generator(), RequestMetrics(0.0), output_token_ids=out)
        return target_probs(logits, req)

    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    with torch.no_grad():
        p1 = probs(hf(torch.tensor([PROMPT])).logits[0, -1].double(), [])
        l2 = hf(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1].double()
        l3 = hf(torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])).logits[:, -1].double()
        for a in range(VOCAB):
            p2 = probs(l2[a], [a])
            for b in range(VOCAB):
                joint[a, b] = p1[a] * p2[b] * probs(l3[a * VOCAB + b], [a, b])
    return joint


FILTERS = {"T1": dict(temperature=1.0), "T0.7-top_p0.9": dict(temperature=0.7, top_p=0.9),
           "top_k5": dict(temperature=1.0, top_k=5),
           "penalties-min_p": dict(temperature=1.0, min_p=0.05, repetition_penalty=1.5, presence_penalty=0.5,
                                   frequency_penalty=0.3)}
SHAPES = {"chain": dict(speculative_eagle_topk=1, speculative_num_steps=3),
          "tree": dict(speculative_eagle_topk=3, speculative_num_steps=3, speculative_num_draft_tokens=8),
          # the draft proposes only the token map's ids; tokens outside it still come from rejection
          "chain-token-map": dict(speculative_eagle_topk=1, speculative_num_steps=3)}
# every filter through the chain (drafts sampled from q), and the tree (one-hot q) at T=1 and with
# penalties (which depend on the path accepted so far); 5 cases keep CI time reasonable
CASES = [("chain", "T1"), ("chain", "T0.7-top_p0.9"), ("chain", "top_k5"), ("tree", "T1"), ("tree", "penalties-min_p"),
         ("chain-token-map", "T1")]


@pytest.mark.parametrize("shape,filt", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_sampling_matches_the_target_distribution(tiny, shape, filt):
    from spec_utils import spec_llm

    hf, base, draft, hot = tiny
    extra = dict(speculative_token_map=hot) if shape.endswith("token-map") else {}
    # a fixed width: adaptive would run 2000 requests' verify on this CPU only if it could pay
    llm = spec_llm(base, max_num_seqs=2000, max_num_batched_tokens=16384, speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=draft, speculative_adaptive="off", **SHAPES[shape], **extra)
    if extra:
        assert llm.engine.spec.drafter.model.draft_to_target.tolist() == [0, 2, 3, 5, 7, 8, 11, 12, 14]
    # max_tokens=4: t1 comes from the prefill, t2 and t3 from verify (drafted, accepted or resampled)
    params = [SamplingParams(max_tokens=4, seed=i, ignore_eos=True, **FILTERS[filt]) for i in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    stats = llm.engine.spec_stats()
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # both the accept and the reject paths ran
    counts = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    for o in outs:
        t1, t2, t3 = o.outputs[0].token_ids[:3]
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    expected = _exact_joint(hf, SamplingParams(**FILTERS[filt])).flatten() * N
    assert counts[expected == 0].sum() == 0, "a token outside the allowed set was emitted"
    keep = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] == 0:  # top-k: nothing outside the kept cells
        obs, exp = obs[:-1], exp[:-1]
    p = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
    assert p > 0.01, f"chi-square p = {p:.4g} ({keep.sum().item()} cells)"


def _exact_chain_outcomes(p: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """P(k accepted drafts, bonus y) for a chain of deterministic drafts under rejection sampling (draft x
    kept with probability p(x); the bonus drawn from p without x where it stops): [len(drafts) + 1, V]."""
    n, v = len(drafts), p.shape[-1]
    out = torch.zeros(n + 1, v, dtype=torch.float64)
    reach = 1.0
    for i, x in enumerate(drafts):
        residual = p[i].clone()
        residual[x] = 0.0
        out[i] = reach * residual
        reach *= float(p[i, x])
    out[n] = reach * p[n]
    return out


def test_device_acceptance_of_deterministic_drafts_has_the_rejection_sampling_law():
    """Keeping drafts while they carry the target's own draw accepts a deterministic draft as often as
    rejection sampling does, and the (accepted, bonus) pair has its exact law; each request takes one draw
    per emitted token."""
    from tercel.outputs import RequestMetrics
    from tercel.request import Request
    from tercel.speculative.verify import accept_greedy_batched, sampled_targets

    g = torch.Generator().manual_seed(3)
    v, drafts = 6, [2, 0, 5]
    w = len(drafts) + 1
    logits = torch.randn(w, v, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    p = filter_logits(logits.double(), params).softmax(-1)
    reqs = [Request("r", None, [1], params, torch.Generator(), RequestMetrics(0.0), seed=s) for s in range(N)]
    tokens = torch.tensor([[1] + drafts] * N)
    targets = sampled_targets(logits.expand(N, -1, -1), torch.arange(w).expand(N, w), reqs)
    k, bonus = accept_greedy_batched(targets, tokens, torch.full((N,), w))
    want = _exact_chain_outcomes(p, drafts).flatten()
    got = torch.bincount(k * v + bonus, minlength=want.numel()).double()
    assert got[want == 0].sum() == 0  # nothing outside the support (top-k's cut token, a rejected draft)
    assert chisquare(got[want > 0], want[want > 0] / want.sum() * N).pvalue > 0.01


SEEDED = {"eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, speculative_num_steps=3),
          "eagle3-tree": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=3, speculative_num_steps=3,
                              speculative_num_draft_tokens=8),
          "ngram": dict(speculative_algorithm="NGRAM", speculative_num_steps=4)}


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed"])
@pytest.mark.parametrize("shape", list(SEEDED))
def test_seeded_sampling_gives_the_plain_tokens(tiny, shape, adaptive):
    """Same seeds, same tokens as plain sampling: for filters and for penalties (the host walk), with the
    adaptive policy choosing widths by wall time or a fixed width, requests of different lengths batched."""
    from spec_utils import spec_llm

    hf, base, draft, hot = tiny
    kw = dict(SEEDED[shape])
    if kw["speculative_algorithm"] == "EAGLE3":
        kw["speculative_draft_model_path"] = draft
    llm = spec_llm(base, max_num_seqs=16, speculative_adaptive=adaptive, **kw)
    prompts = [PROMPT[: 2 + i % 4] for i in range(12)]
    params = [SamplingParams(max_tokens=20, seed=100 + i, ignore_eos=True,
                             **FILTERS[["T1", "T0.7-top_p0.9", "top_k5", "penalties-min_p"][i % 4]])
              for i in range(12)]
    plain = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spec == plain
    stats = llm.engine.spec_stats()
    if not adaptive:  # (the policy may well pick plain steps on this random model)
        assert stats.draft_tokens > 0
        if shape.startswith("eagle3"):
            assert stats.accepted_tokens > 0  # drafts were kept, not only bonus tokens


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("token_map", [False, True], ids=["full-vocab", "token-map"])
def test_sampled_eagle_chains_run_as_one_chained_step_with_the_plain_tokens(tiny, token_map, overlap):
    """Sampled (T > 0) EAGLE chains run as the chained graph step too (breakable-debug graphs on the CPU): each
    draft, target token and next first draft drawn in the graph with the request's noise for that output
    token, greedy rows by argmax, so a seeded batch mixing filters and greedy requests gets plain's tokens,
    with the host one step behind under the overlap schedule."""
    from spec_utils import spec_llm

    hf, base, draft, hot = tiny
    extra = dict(speculative_token_map=hot) if token_map else {}
    llm = spec_llm(base, max_num_seqs=16, speculative_adaptive=False, cuda_graph_backend="breakable-debug",
                   cuda_graph_max_bs=16, disable_overlap_schedule=not overlap, speculative_draft_model_path=draft,
                   **SEEDED["eagle3-chain"], **extra)
    chain = llm.engine.spec.chain
    assert chain is not None and chain.sampled is not None
    prompts = [PROMPT[: 2 + i % 4] for i in range(12)]
    settings = [FILTERS["T1"], FILTERS["T0.7-top_p0.9"], FILTERS["top_k5"], dict(temperature=0.0),
                dict(temperature=1.0, min_p=0.05)]
    params = [SamplingParams(max_tokens=12 + i % 5, seed=100 + i, ignore_eos=True, **settings[i % 5])
              for i in range(12)]
    plain = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spec == plain
    assert chain.sampled.stats.replays > 0 and chain.sampled.stats.eager == 0 and chain.inflight is None
    assert llm.engine.spec_stats().accepted_tokens > 0
    assert llm.engine.stats().kv_blocks_used == 0


def test_a_sampled_chains_first_draft_takes_its_output_tokens_noise(tiny, monkeypatch):
    """When a sampled chain starts, each request's first draft races the draft's logits with the noise of the
    output token it proposes (draw `draws`): the draw the target takes at verify row 0, so that agreeing
    distributions agree on the token. (It raced draw 2 x draws once: lossless, but a first draft wasted.)"""
    from spec_utils import spec_llm

    from tercel.sampling import race_logits, stream_keys
    from tercel.speculative.eagle import EagleDrafter

    hf, base, draft, hot = tiny
    seen = []
    chain_batch = EagleDrafter.chain_batch

    def spy(self, reqs, roots, base_, tables, live, sampling, step):
        batch = chain_batch(self, reqs, roots, base_, tables, live, sampling, step)
        if sampling is not None:
            seen.append((torch.stack([r.spec_state.logits for r in reqs]), sampling.temperature.clone(),
                         sampling.sampled.clone(), sampling.seeds.clone(), sampling.draws.clone(), batch.first.clone()))
        return batch

    monkeypatch.setattr(EagleDrafter, "chain_batch", spy)
    llm = spec_llm(base, max_num_seqs=4, speculative_adaptive=False, cuda_graph_backend="breakable-debug",
                   cuda_graph_max_bs=4, disable_overlap_schedule=True, speculative_draft_model_path=draft,
                   **SEEDED["eagle3-chain"])
    params = [SamplingParams(max_tokens=10, seed=7 + i, ignore_eos=True, temperature=1.0) for i in range(3)]
    llm.generate([PROMPT, PROMPT[:3], PROMPT[:4]], params)
    assert seen and all(int(d.min()) > 0 for *_, d, _ in seen)  # the prefill drew draw 0: a start is past it
    for logits, temperature, sampled, seeds, draws, first in seen:
        want = race_logits(logits, temperature, sampled, stream_keys(seeds, draws))
        assert torch.equal(first, want)


def test_adaptive_plain_windows_draw_inside_the_one_token_verify_graph(tiny):
    """Sampled batches that adaptive EAGLE speculation sends plain (here every width but 1 costs 100 plain steps)
    decode in windows whose one-token verify graph also draws each row's token (graphs/sampled_decode.py,
    Executor.sampled): plain sampling's tokens, greedy rows of the mixed batch by argmax, the drafter's hidden rows
    kept for its deferred draft_extend."""
    from spec_utils import spec_llm

    from tercel.executor import sampled_decode_key, verify_key
    from tercel.speculative.adaptive import CostModel

    class Fixed(CostModel):
        def observe(self, batch_size: int, width: int, wall_s: float) -> None:
            pass

    hf, base, draft, hot = tiny
    llm = spec_llm(base, max_num_seqs=8, cuda_graph_backend="breakable-debug", cuda_graph_bs=[1, 2, 4, 8],
                   num_scheduler_steps=4, speculative_draft_model_path=draft, **SEEDED["eagle3-chain"])
    spec = llm.engine.spec
    spec.adaptive.costs = Fixed((1, 2, 4, 8), {(b, w): 1.0 if w == 1 else 100.0 for b in (1, 2, 4, 8)
                                               for w in spec.widths()})
    prompts = [PROMPT[: 2 + i % 4] for i in range(4)]
    params = [SamplingParams(max_tokens=16, seed=7 + i, ignore_eos=True,
                             **[FILTERS["T0.7-top_p0.9"], dict(temperature=0.0), FILTERS["T1"]][i % 3])
              for i in range(4)]
    plain = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    runner = llm.engine.executor.runner(sampled_decode_key(True, True, verify_key(1)))
    assert runner is not None and runner.stats.replays > 0, llm.engine.executor.runners.keys()
    assert llm.engine.spec_stats().plain_window_steps > 0
    assert llm.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_sampled_eagle_trees_run_as_one_chained_step_with_the_plain_tokens(tiny, overlap):
    """Sampled EAGLE trees run as the sampled tree step (tree_chain.py): every node's target token is drawn in the
    graph with the request's noise for its output position (draws + depth), greedy rows by argmax, so a seeded
    batch mixing filters and greedy requests gets plain's tokens."""
    from spec_utils import spec_llm

    from tercel.speculative.tree_chain import EagleTreeChainStep

    hf, base, draft, hot = tiny
    llm = spec_llm(base, max_num_seqs=16, speculative_adaptive=False, cuda_graph_backend="breakable-debug",
                   cuda_graph_max_bs=16, disable_overlap_schedule=not overlap, speculative_draft_model_path=draft,
                   **SEEDED["eagle3-tree"])
    chain = llm.engine.spec.chain
    assert chain is not None and isinstance(chain.sampled.step, EagleTreeChainStep)
    prompts = [PROMPT[: 2 + i % 4] for i in range(10)]
    settings = [FILTERS["T1"], FILTERS["T0.7-top_p0.9"], FILTERS["top_k5"], dict(temperature=0.0),
                dict(temperature=1.0, min_p=0.05)]
    params = [SamplingParams(max_tokens=10 + i % 5, seed=200 + i, ignore_eos=True, **settings[i % 5])
              for i in range(10)]
    plain = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert chain.sampled.stats.replays > 0 and chain.sampled.stats.eager == 0 and chain.inflight is None
    assert llm.engine.spec_stats().accepted_tokens > 0
    assert llm.engine.stats().kv_blocks_used == 0


def test_a_sampled_chain_step_that_fails_to_capture_leaves_sampled_chains_unchained(tiny, monkeypatch, caplog):
    """The sampled chain step is never fatal: when its capture fails, the engine starts, logs why, and sampled
    requests take the worker's unchained steps (still plain's tokens)."""
    from spec_utils import spec_llm

    from tercel.speculative.chain import EagleChainStep

    step = EagleChainStep._step

    def broken(self, s):
        if self.sampled:
            raise RuntimeError("an op this backend cannot capture")
        return step(self, s)

    monkeypatch.setattr(EagleChainStep, "_step", broken)
    hf, base, draft, hot = tiny
    with caplog.at_level("WARNING"):
        llm = spec_llm(base, max_num_seqs=4, speculative_adaptive=False, cuda_graph_backend="breakable-debug",
                       cuda_graph_max_bs=4, speculative_draft_model_path=draft, **SEEDED["eagle3-chain"])
    assert llm.engine.spec.chain.sampled is None and "could not be captured" in caplog.text
    params = [SamplingParams(max_tokens=12, seed=7 + i, ignore_eos=True, temperature=1.0) for i in range(3)]
    prompts = [PROMPT[: 2 + i] for i in range(3)]
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in base.generate(prompts, params)])
