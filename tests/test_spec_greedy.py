"""Greedy speculative decoding is lossless: output equals plain decoding token for token (fp32, CPU)
for NGRAM and EAGLE-3 (the bundled trained head and a random head), chains and trees, batch 1 and 8
with mixed prompt lengths, on SmolLM2 (20 prompts x 64 tokens) and on a random-config Qwen3; tree
verify keeps the right KV when the accepted path runs through later siblings; KV is all returned."""
from __future__ import annotations

import pytest
import torch
import transformers
from spec_utils import OracleTreeDrafter, full_lossless, spec_llm

from tercel import LLM, SamplingParams
from tercel.speculative import DEFAULT_EAGLE3_DRAFT, DEFAULT_EAGLE3_TOKEN_MAP
from tercel.speculative.ngram import ngram_lookup
from tercel.train.export import random_eagle3

transformers.logging.set_verbosity_error()
GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
EXTRA = ["Write a Python function that sorts a list of tuples by the second item.",
         "What is the difference between a list and a tuple in Python?", "Explain recursion briefly.",
         "Name five animals that live in the Arctic.", "How does a refrigerator work?",
         "Write a limerick about a cat.", "What is 17 times 23?", "Give me a recipe for pancakes.",
         "Write a bash command that counts lines in all .py files.", "What causes the seasons on Earth?",
         "Translate 'good morning' into French, Spanish and German.", "Summarize the plot of Hamlet."]


@pytest.fixture(scope="module")
def prompts(smol_llm, smol_chat_ids):
    tok = smol_llm.tokenizer
    raw = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. " * 12,
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
    ps = smol_chat_ids + [tok.apply_chat_template([{"role": "user", "content": e}]) for e in EXTRA[:9]]
    ps += [tok.encode(r) for r in raw]
    assert len(ps) == 20 and len({len(p) for p in ps}) > 10  # mixed lengths (6 to 120 tokens)
    return ps


@pytest.fixture(scope="module")
def plain(smol_llm, prompts):
    return [o.outputs[0].token_ids for o in smol_llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def random_head(tmp_path_factory, smol_llm):
    return str(random_eagle3(tmp_path_factory.mktemp("rand_e3"), smol_llm.engine.model_config,
                             draft_vocab_size=4096, intermediate_size=256))


def _check(llm, prompts, plain, n: int = 64):
    """Greedy outputs of n tokens equal the first n plain tokens; every KV block comes back."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [p[:n] for p in plain]
    assert llm.engine.stats().kv_blocks_used == 0  # every block returned
    return llm.engine.spec_stats()


@pytest.mark.parametrize("kw,pick", [
    (dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1), slice(None)),
    (dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_num_draft_tokens=16),
     slice(0, None, 4)),
    (dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_num_draft_tokens=8), slice(2, None, 4)),
    # n-gram at a fixed width: on these rarely-matching texts the adaptive policy may run nearly every step plain
    (dict(speculative_algorithm="NGRAM", speculative_adaptive="off"), slice(1, None, 4)),
], ids=["eagle3-chain", "eagle3-tree16", "eagle3-tree8", "ngram"])
def test_greedy_batch8_equals_plain(smol_llm, prompts, plain, kw, pick):
    """All 20 prompts (x 64 tokens) for the chain; spread subsets for the trees, whose verify of 8-16
    tokens per request is compute-bound on a CPU (CI time)."""
    if kw["speculative_algorithm"] == "EAGLE3":
        kw["speculative_draft_model_path"] = str(DEFAULT_EAGLE3_DRAFT)
    stats = _check(spec_llm(smol_llm, max_num_seqs=8, **kw), prompts[pick], plain[pick])
    assert stats.accepted_tokens > 0 and stats.mean_accept_length > 1.1  # drafts do get accepted


@pytest.mark.parametrize("topk,n", [(1, None), (4, 8)], ids=["chain", "tree8"])
def test_greedy_random_head_equals_plain(smol_llm, prompts, plain, random_head, topk, n):
    llm = spec_llm(smol_llm, max_num_seqs=8, speculative_algorithm="EAGLE3", speculative_draft_model_path=random_head,
                   speculative_eagle_topk=topk, speculative_num_draft_tokens=n)
    _check(llm, prompts[::7], plain[::7], n=32)


@pytest.mark.parametrize("kw", [dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1),
                                dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4,
                                     speculative_num_draft_tokens=16),
                                dict(speculative_algorithm="NGRAM")], ids=["eagle3-chain", "eagle3-tree16", "ngram"])
def test_greedy_batch1_equals_plain(smol_llm, prompts, plain, kw):
    if kw["speculative_algorithm"] == "EAGLE3":
        kw["speculative_draft_model_path"] = str(DEFAULT_EAGLE3_DRAFT)
    _check(spec_llm(smol_llm, max_num_seqs=1, **kw), prompts[1::10], plain[1::10], n=32)


# acceptance item 1 to the letter: every config at batch 8 and 1 on all 20 prompts (spec_utils.full_lossless)
FULL_CONFIGS = [("ngram", None, dict(speculative_algorithm="NGRAM", speculative_adaptive="off"))] + [
    (f"eagle3-{head}-{shape}", head, dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=topk,
                                          speculative_num_draft_tokens=n))
    for head in ("trained", "random") for shape, topk, n in (("chain", 1, None), ("tree8", 4, 8), ("tree16", 4, 16))]


@full_lossless
@pytest.mark.parametrize("batch", [8, 1], ids=["bs8", "bs1"])
@pytest.mark.parametrize("name,head,kw", FULL_CONFIGS, ids=[c[0] for c in FULL_CONFIGS])
def test_full_matrix_equals_plain(smol_llm, prompts, plain, random_head, name, head, kw, batch):
    if head is not None:
        kw = dict(kw, speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT) if head == "trained" else random_head)
    stats = _check(spec_llm(smol_llm, max_num_seqs=batch, **kw), prompts, plain)
    if head != "random":
        assert stats.accepted_tokens > 0


def test_tree_accepting_later_siblings_keeps_the_right_kv(smol_llm, prompts, plain):
    """An oracle hides the right token as the last of 3 siblings at each of 4 levels: every verify
    accepts 4 drafts through non-first children (KV compaction), and output still equals plain."""
    llm = spec_llm(smol_llm, max_num_seqs=8, speculative_algorithm="NGRAM")
    cont = {tuple(p): out for p, out in zip(prompts, plain)}
    llm.engine.spec.drafter = OracleTreeDrafter(cont, depth=4, width=3, vocab=smol_llm.engine.model_config.vocab_size)
    llm.engine.spec.num_draft_tokens = 13
    stats = _check(llm, prompts[::2], plain[::2])
    assert stats.mean_accept_length > 3.5  # 5 except at the end, where max_tokens trims the tree


def test_preemption_and_chunked_prefill_with_eagle3(smol_llm, prompts, plain):
    llm = spec_llm(smol_llm, max_model_len=256, num_kv_blocks=24, block_size=16, max_num_batched_tokens=40,
                   speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT),
                   speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    outs = llm.generate(prompts[:6], GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the small pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == plain[:6]
    assert llm.engine.stats().kv_blocks_used == 0


def test_abort_mid_speculation_frees_kv(smol_llm, prompts):
    llm = spec_llm(smol_llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT))
    ids = [llm.engine.add_request(p, SamplingParams(max_tokens=24, temperature=0)) for p in prompts[:3]]
    for _ in range(3):
        llm.engine.step()
    assert llm.engine.abort_request(ids[0])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.stats().kv_blocks_used == 0


def test_stop_conditions_inside_an_accepted_run(smol_llm, prompts, plain):
    """max_tokens and stop tokens that fall inside an accepted draft run cut it exactly there."""
    llm = spec_llm(smol_llm, speculative_algorithm="NGRAM")
    cont = {tuple(p): out for p, out in zip(prompts, plain)}
    llm.engine.spec.drafter = OracleTreeDrafter(cont, depth=5, width=1, vocab=smol_llm.engine.model_config.vocab_size)
    for n in (1, 2, 7, 13):
        out = llm.generate(prompts[3], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == plain[3][:n] and out.outputs[0].finish_reason == "length"
    stop = plain[3][9]
    out = llm.generate(prompts[3], SamplingParams(max_tokens=64, temperature=0, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == plain[3][:plain[3].index(stop) + 1]
    assert llm.engine.stats().kv_blocks_used == 0


# ---- a random-config Qwen3 ------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, initializer_range=0.2)
    root = tmp_path_factory.mktemp("qwen3")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "target")
    base = LLM(str(root / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False,
               max_model_len=256)
    draft = random_eagle3(root / "draft", base.engine.model_config, draft_vocab_size=128, std=0.3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 5, 41, 12, 22)]
    # repeating prompts give the n-gram drafter something to find
    prompts += [[5, 6, 7, 8] * 6, [9, 10, 11] * 9]
    return base, str(draft), prompts


@pytest.mark.parametrize("kw", [dict(speculative_algorithm="NGRAM"),
                                dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1),
                                dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4,
                                     speculative_num_draft_tokens=8),
                                dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4,
                                     speculative_num_draft_tokens=16)],
                         ids=["ngram", "eagle3-chain", "eagle3-tree8", "eagle3-tree16"])
def test_qwen3_greedy_equals_plain(qwen3, kw):
    base, draft, prompts = qwen3
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    if kw["speculative_algorithm"] == "EAGLE3":
        kw["speculative_draft_model_path"] = draft
    for max_num_seqs in (8, 1):
        llm = spec_llm(base, max_num_seqs=max_num_seqs, **kw)
        _check(llm, prompts, ref)


@pytest.mark.parametrize("topk,n", [(1, None), (4, 8)], ids=["chain", "tree8"])
def test_qwen3_greedy_with_a_draft_on_the_targets_head(qwen3, tmp_path, topk, n):
    """An EAGLE-3 draft without its own lm_head drafts over the full vocabulary through the target's."""
    base, _, prompts = qwen3
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    draft = random_eagle3(tmp_path / "d", base.engine.model_config, std=0.3, head_from_target=True)
    llm = spec_llm(base, max_num_seqs=8, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                   speculative_eagle_topk=topk, speculative_num_draft_tokens=n)
    assert llm.engine.spec.drafter.model.head_from_target
    _check(llm, prompts, ref)


def test_ngram_lookup_takes_the_longest_latest_match():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # latest occurrence of [1 2 3]
    assert ngram_lookup([4, 1, 2, 8, 6, 2], 2, min_n=1, max_n=3) == [8, 6]  # falls back to a 1-gram
    assert ngram_lookup([1, 2, 3, 4], 3) == []


@pytest.mark.parametrize("topk,n", [(1, None), (3, 8)], ids=["chain", "tree8"])
def test_qwen3_greedy_with_an_eagle_v1_head(qwen3, tmp_path, topk, n):
    """EAGLE (v1/v2) heads: fc over [embedding; the target's final hidden], target lm_head."""
    from spec_utils import write_random_eagle

    base, _, prompts = qwen3
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    draft = write_random_eagle(tmp_path / "eagle", base.engine.model_config, layers=2)
    llm = spec_llm(base, max_num_seqs=8, speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft),
                   speculative_eagle_topk=topk, speculative_num_draft_tokens=n)
    assert llm.engine.spec.drafter.aux_layer_ids == ()  # reads the final normed hidden state
    _check(llm, prompts, ref)


def test_default_model_gets_its_bundled_eagle3_head(smol_llm):
    from tercel.cli import build_parser, speculative_kwargs

    llm = spec_llm(smol_llm, speculative_algorithm="EAGLE3")  # no draft path: the bundled head
    assert llm.engine.spec_config.draft_model_path == DEFAULT_EAGLE3_DRAFT
    assert llm.engine.spec.drafter.aux_layer_ids == (1, 14, 26)  # SmolLM2's 30 layers: low / mid / high
    gen = lambda *a: speculative_kwargs(build_parser().parse_args(["generate", *a]))["speculative_algorithm"]  # noqa: E731
    assert gen("--device", "cpu") == "EAGLE3"  # tercel generate on the default model: EAGLE3 out of the box
    # on a GPU the eager speculative step loses to plain decoding's CUDA graphs: AUTO leaves it off
    assert gen("--device", "cuda") is None if torch.cuda.is_available() else gen() == "EAGLE3"
    assert gen("--device", "cpu", "--speculative-algorithm", "eagle3") == "EAGLE3"  # asked for: on
    kw = lambda *a: speculative_kwargs(build_parser().parse_args(["generate", *a]))["speculative_token_map"]  # noqa: E731
    assert kw("--device", "cpu") == str(DEFAULT_EAGLE3_TOKEN_MAP)  # AUTO brings the bundled head's token map
    assert kw("--device", "cpu", "--speculative-algorithm", "eagle3") is None  # an explicit choice: as given
    assert gen("--model", "x.gguf") is None and gen("--speculative-algorithm", "NONE") in (None, "NONE")  # off
    assert gen("--model", "x.gguf", "--speculative-algorithm", "ngram") == "NGRAM"


def test_greedy_with_penalties_and_logprobs_equals_plain(smol_llm, prompts):
    """Penalties depend on the tokens accepted so far along the path; logprobs come from the verify rows."""
    params = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, presence_penalty=0.4,
                            frequency_penalty=0.2, min_tokens=8, logprobs=2)
    ref = smol_llm.generate(prompts[:2], params)
    for kw in (dict(speculative_algorithm="NGRAM"),
               dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT),
                    speculative_eagle_topk=4, speculative_num_draft_tokens=8)):
        outs = spec_llm(smol_llm, **kw).generate(prompts[:2], params)
        for o, r in zip(outs, ref):
            assert o.outputs[0].token_ids == r.outputs[0].token_ids
            for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)
