"""DFLASH and DDTREE are lossless: greedy output equals plain output token for token (SmolLM2 with
the bundled trained draft); seeded sampled output equals plain sampled output token for token, and follows
exactly the target's distribution (chi-square against the enumerated joint distribution of the first two
tokens of a tiny model)."""
from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from dflash_utils import write_random_dflash
from scipy.stats import chisquare
from spec_utils import full_lossless, tiny_llama_target

from tercel import LLM, SamplingParams
from tercel.sampling import filter_logits

transformers.logging.set_verbosity_error()
VOCAB = 16
PROMPT = [3, 7, 1, 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    hf, target = tiny_llama_target(root, vocab=VOCAB, layers=2, max_positions=128, init_range=0.15)
    draft = write_random_dflash(root / "draft", vocab=VOCAB, hidden=32, num_target_layers=2, block_size=4,
                                mask_token_id=VOCAB - 1, target_layer_ids=[0, 1], std=0.3)
    return hf, target, draft


def _exact_joint(hf, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2) under the request's filtered distribution, by enumeration: [V, V]."""
    with torch.no_grad():
        p1 = filter_logits(hf(torch.tensor([PROMPT])).logits[0, -1].double(), params).softmax(-1)
        ctx = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        p2 = filter_logits(hf(ctx).logits[:, -1].double(), params).softmax(-1)
    return p1[:, None] * p2


SAMPLING = [SamplingParams(max_tokens=2, temperature=1.0), SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9),
            SamplingParams(max_tokens=2, temperature=1.0, top_k=5)]
CASES = list(itertools.product([("DFLASH", None), ("DDTREE", 6)], range(len(SAMPLING))))


@pytest.mark.parametrize("algo,which", CASES, ids=[f"{a[0]}-{['T1', 'T0.7-top_p0.9', 'top_k5'][w]}" for a, w in CASES])
def test_sampling_matches_the_target_distribution(tiny, algo, which):
    hf, target, draft = tiny
    (name, budget), base = algo, SAMPLING[which]
    n = 20_000
    llm = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64,
              max_num_seqs=2048, max_num_batched_tokens=16384, speculative_algorithm=name,
              speculative_draft_model_path=str(draft), speculative_ddtree_budget=budget, speculative_adaptive="off")
    # max_tokens=3: the spec step after the prefill token drafts t2 (and t3), so t2 goes through verify (a fixed
    # width: adaptive would run 2048 requests' wide verify on this CPU only if it could pay)
    params = [SamplingParams(max_tokens=3, temperature=base.temperature, top_p=base.top_p, top_k=base.top_k,
                             seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([PROMPT] * n, params)
    stats = llm.engine.spec_stats()
    assert stats.verify_steps > 0 and 0 < stats.accepted_tokens < stats.draft_tokens  # both paths exercised
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for o in outs:
        t1, t2 = o.outputs[0].token_ids[:2]
        counts[t1, t2] += 1
    expected = _exact_joint(hf, base).flatten() * n
    observed = counts.flatten()
    assert observed[expected == 0].sum() == 0, "a token outside the allowed set was emitted"
    keep = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs = torch.cat([observed[keep], observed[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    p = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
    assert p > 0.01, f"chi-square p = {p:.4g}"


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed"])
@pytest.mark.parametrize("name,budget", [("DFLASH", None), ("DDTREE", 6)])
def test_seeded_sampling_gives_the_plain_tokens(tiny, name, budget, adaptive):
    hf, target, draft = tiny
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64)
    plain = LLM(str(target), **kw)
    llm = LLM(str(target), speculative_algorithm=name, speculative_draft_model_path=str(draft),
              speculative_ddtree_budget=budget, speculative_adaptive=adaptive, **kw)
    prompts = [PROMPT[: 1 + i % 4] for i in range(8)]
    params = [SamplingParams(max_tokens=16, seed=7 + i, ignore_eos=True, **[dict(temperature=1.0),
              dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=5)][i % 3]) for i in range(8)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    if not adaptive:
        stats = llm.engine.spec_stats()
        assert 0 < stats.accepted_tokens < stats.draft_tokens


# ---- greedy losslessness on the real model with the bundled draft ----------------------------

@pytest.fixture(scope="module")
def smol_prompts(smol_llm, smol_chat_ids):
    tok = smol_llm.tokenizer
    extra = ["Write a Python function that sorts a list of tuples by the second item.",
             "What is the difference between a list and a tuple in Python?", "Explain recursion briefly.",
             "Name five animals that live in the Arctic.", "How does a refrigerator work?",
             "Write a limerick about a cat.", "What is 17 times 23?", "Give me a recipe for pancakes.",
             "Write a bash command that counts lines in all .py files.", "What causes the seasons on Earth?",
             "Translate 'good morning' into French, Spanish and German.", "Summarize the plot of Hamlet."]
    ps = smol_chat_ids + [tok.apply_chat_template([{"role": "user", "content": e}]) for e in extra]
    assert len(ps) >= 20
    return ps


@pytest.fixture(scope="module")
def smol_plain(smol_llm, smol_prompts):
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in smol_llm.generate(smol_prompts, params)]


def _spec_llm(smol_llm, algo: str, **kw) -> LLM:
    from tercel.engine import LLMEngine
    from tercel.speculative import DEFAULT_DFLASH_DRAFT

    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(loaded=smol_llm.engine.loaded, dtype="float32", device="cpu", max_model_len=2048,
                           speculative_algorithm=algo, speculative_draft_model_path=DEFAULT_DFLASH_DRAFT, **kw)
    return llm


# (algorithm, kwargs, prompts): a wide tree costs a verify of budget + 1 rows per request on the CPU,
# so the widest budgets run on fewer of the 20 prompts to keep CI time sane.
GREEDY_CASES = [("DFLASH", {}, 20), ("DDTREE", {"speculative_ddtree_budget": 4}, 20),
                ("DDTREE", {"speculative_ddtree_budget": 16}, 8), ("DDTREE", {"speculative_ddtree_budget": 64}, 2)]


@pytest.mark.parametrize("algo,kw,n", GREEDY_CASES, ids=["dflash", "ddtree4", "ddtree16", "ddtree64"])
def test_greedy_equals_plain_on_smollm2(smol_llm, smol_prompts, smol_plain, algo, kw, n):
    llm = _spec_llm(smol_llm, algo, max_num_seqs=8, **kw)  # batches of 8, mixed prompt lengths
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    outs = llm.generate(smol_prompts[:n], params)
    assert [o.outputs[0].token_ids for o in outs] == smol_plain[:n]
    assert llm.engine.spec_stats().accepted_tokens > 0  # drafts do get accepted


# acceptance item 1 to the letter: every config at batch 8 and 1 on all 20 prompts (spec_utils.full_lossless)
FULL_CASES = [("DFLASH", {}), ("DDTREE", {"speculative_ddtree_budget": 4}),
              ("DDTREE", {"speculative_ddtree_budget": 16}), ("DDTREE", {"speculative_ddtree_budget": 64})]


@full_lossless
@pytest.mark.parametrize("batch", [8, 1], ids=["bs8", "bs1"])
@pytest.mark.parametrize("algo,kw", FULL_CASES, ids=["dflash", "ddtree4", "ddtree16", "ddtree64"])
def test_full_matrix_equals_plain(smol_llm, smol_prompts, smol_plain, algo, kw, batch):
    llm = _spec_llm(smol_llm, algo, max_num_seqs=batch, **kw)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    outs = llm.generate(smol_prompts[:20], params)
    assert [o.outputs[0].token_ids for o in outs] == smol_plain[:20]
    assert llm.engine.spec_stats().accepted_tokens > 0


def test_greedy_batch_of_one_equals_plain(smol_llm, smol_prompts, smol_plain):
    llm = _spec_llm(smol_llm, "DDTREE", speculative_ddtree_budget=8, max_num_seqs=1)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    outs = llm.generate(smol_prompts[:3], params)
    assert [o.outputs[0].token_ids for o in outs] == smol_plain[:3]
    llm = _spec_llm(smol_llm, "DFLASH", max_num_seqs=1)
    outs = llm.generate(smol_prompts[3:6], params)
    assert [o.outputs[0].token_ids for o in outs] == smol_plain[3:6]
