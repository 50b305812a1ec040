"""--speculative-token-map (SGLang's name; FR-Spec's hot tokens): the draft proposes only the map's
target ids through the matching head rows, output stays the target's, bad maps fail at load."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from spec_utils import spec_llm, tiny_llama_target

from tercel import LLM, SamplingParams
from tercel.config import ConfigError
from tercel.loader.drafts import load_eagle_draft
from tercel.speculative.token_map import load_token_map
from tercel.train.export import random_eagle3

VOCAB = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hot")
    _, target = tiny_llama_target(root, vocab=VOCAB, layers=4, max_positions=128, init_range=0.2)
    llm = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=96)
    return root, llm


@pytest.mark.parametrize("head", ["own-reduced", "target-head"])
def test_restricted_logits_are_the_kept_columns(tiny, head):
    root, llm = tiny
    tcfg, target = llm.engine.model_config, llm.engine.model
    d = random_eagle3(root / f"d-{head}", tcfg, aux_layer_ids=(0, 1, 2), std=0.3, draft_vocab_size=40,
                      head_from_target=head == "target-head")
    full = load_eagle_draft(d, tcfg, torch.float32, torch.device("cpu"), 96)
    hot = load_eagle_draft(d, tcfg, torch.float32, torch.device("cpu"), 96)
    for m in (full, hot):
        m.share_target(target.embed_tokens.weight, target.lm_head_weight)
    ids_before = full.draft_to_target.clone() if full.maps_vocab else torch.arange(VOCAB)
    wanted = torch.tensor([1, 5, 9, 17, 33, 40, 41, 63])
    kept = hot.restrict_vocab(wanted)
    keep = torch.isin(ids_before, wanted)
    assert kept == int(keep.sum()) > 0 and hot.vocab_size == kept and hot.maps_vocab
    assert hot.draft_to_target.tolist() == ids_before[keep].tolist()
    h = torch.randn(3, tcfg.hidden_size)
    torch.testing.assert_close(hot.compute_logits(h), full.compute_logits(h)[:, keep])
    if head == "own-reduced":  # a map that misses every draft token
        other = load_eagle_draft(d, tcfg, torch.float32, torch.device("cpu"), 96)
        other.share_target(target.embed_tokens.weight, target.lm_head_weight)
        outside = torch.tensor(sorted(set(range(VOCAB)) - set(ids_before.tolist())))
        with pytest.raises(ConfigError, match="shares no token with this draft"):
            other.restrict_vocab(outside)


def _greedy_case(root, llm, name: str, seed: int):
    """A random EAGLE-3 head on the target's lm_head, a token map of the even ids, four prompts of mixed lengths,
    greedy params and plain's tokens for them."""
    d = random_eagle3(root / f"d-{name}", llm.engine.model_config, aux_layer_ids=(0, 1, 2), std=0.3,
                      head_from_target=True)
    (root / f"{name}.json").write_text(json.dumps(list(range(0, VOCAB, 2))))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 7, 20)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return d, root / f"{name}.json", prompts, params, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("shape", [dict(speculative_eagle_topk=1), dict(speculative_eagle_topk=4,
                                                                       speculative_num_draft_tokens=12)],
                         ids=["chain", "tree"])
def test_greedy_with_a_token_map_equals_plain(tiny, shape):
    root, llm = tiny
    d, token_map, prompts, params, ref = _greedy_case(root, llm, "greedy", 1)
    spec = spec_llm(llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(d),
                    speculative_token_map=str(token_map), **shape)
    assert spec.engine.spec.drafter.model.vocab_size == VOCAB // 2
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == ref  # batch 4, mixed lengths
    assert [spec.generate(p, params)[0].outputs[0].token_ids for p in prompts[:2]] == ref[:2]  # batch 1
    stats = spec.engine.spec_stats()
    assert stats.draft_tokens > 0


def test_token_map_files(tmp_path):
    (tmp_path / "a.json").write_text("[5, 3, 5, 9]")
    assert load_token_map(tmp_path / "a.json", 10).tolist() == [3, 5, 9]  # distinct, sorted
    torch.save(torch.tensor([7, 1], dtype=torch.int32), tmp_path / "b.pt")
    assert load_token_map(tmp_path / "b.pt", 10).tolist() == [1, 7]
    torch.save([4, 2], tmp_path / "c.pt")
    assert load_token_map(tmp_path / "c.pt", 10).tolist() == [2, 4]
    bad = {"missing.json": None, "d.txt": "1 2", "e.json": "{\"a\": 1}", "f.json": "[1, 2.5]", "g.json": "[]",
           "h.json": "[1, 10]", "i.json": "not json", "j.pt": torch.tensor([0.5, 1.0]), "k.pt": "junk"}
    expect = {"missing.json": "is not a file", "d.txt": "unknown suffix", "e.json": "JSON list of integer",
              "f.json": "JSON list of integer", "g.json": "non-empty 1-D", "h.json": "token id 10, outside",
              "i.json": "not valid JSON", "j.pt": "integer tensor", "k.pt": "could not be read"}
    for name, content in bad.items():
        if isinstance(content, torch.Tensor):
            torch.save(content, tmp_path / name)
        elif content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(ConfigError, match=expect[name]):
            load_token_map(tmp_path / name, 10)


def test_token_map_needs_an_eagle_draft(tiny):
    root, llm = tiny
    (root / "ok.json").write_text("[1, 2, 3]")
    for algo, match in ((None, "speculative decoding is off"), ("NGRAM", "applies to EAGLE / EAGLE3")):
        with pytest.raises(ConfigError, match=match):
            spec_llm(llm, speculative_algorithm=algo, speculative_token_map=str(root / "ok.json"))
    d = random_eagle3(root / "d-small", llm.engine.model_config, aux_layer_ids=(0, 1, 2), head_from_target=True)
    with pytest.raises(ConfigError, match="leaves the draft 3 tokens, fewer than speculative_eagle_topk=4"):
        spec_llm(llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(d), speculative_eagle_topk=4,
                 speculative_token_map=str(root / "ok.json"))


def test_hot_token_ids_rank_answers_then_prompts():
    from tercel.train.data import Sample
    from tercel.train.token_map import hot_token_ids

    samples = [Sample([40, 41, 41], [5, 5, 7, 2]), Sample([41, 42], [7, 5, 9])]
    assert hot_token_ids(samples, 3, always=(2,)) == [2, 5, 7]  # EOS first, then the answers' top tokens
    assert hot_token_ids(samples, 6, always=(2,)) == [2, 5, 7, 9, 40, 41]  # then the prompts' by count
    assert hot_token_ids(samples, 99) == [2, 5, 7, 9, 40, 41, 42]  # never padded with unseen ids


def test_smollm2_with_the_bundled_token_map_equals_plain(smol_llm):
    """The bundled head through its bundled map (what `tercel generate` runs on the CPU): plain greedy
    output, batch 1 and a batch of mixed lengths, chain and tree."""
    from tercel.speculative import DEFAULT_EAGLE3_TOKEN_MAP

    tok = smol_llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in
               ("Name three rivers in Europe.", "Write a Python function that adds two numbers.",
                "What is a prime number?", "Give me a haiku about rain.")]
    params = SamplingParams(max_tokens=32, temperature=0)
    ref = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    for shape in (dict(speculative_eagle_topk=1), dict(speculative_eagle_topk=4, speculative_num_draft_tokens=16)):
        spec = spec_llm(smol_llm, speculative_algorithm="EAGLE3", speculative_token_map=str(DEFAULT_EAGLE3_TOKEN_MAP),
                        **shape)
        assert spec.engine.spec.drafter.model.vocab_size == len(json.loads(DEFAULT_EAGLE3_TOKEN_MAP.read_text()))
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == ref
        assert spec.generate(prompts[1], params)[0].outputs[0].token_ids == ref[1]
        assert spec.engine.spec_stats().accepted_tokens > 0


@pytest.mark.parametrize("shape", [dict(speculative_eagle_topk=1), dict(speculative_eagle_topk=4,
                                                                       speculative_num_draft_tokens=12)],
                         ids=["chain", "tree"])
def test_an_int8_draft_head_keeps_the_plain_tokens(tiny, shape, monkeypatch):
    """TERCEL_DRAFT_HEAD=int8 (developer switch): the draft's head product reads int8 rows with per-row scales
    (EagleDraftModel.quantize_head, kernels/gemv_q8.py); its logits stay close to the full-precision head's, and
    greedy output is plain's, with a token map too (the kept rows are quantized)."""
    root, llm = tiny
    d, even_ids, prompts, params, ref = _greedy_case(root, llm, "int8", 2)
    monkeypatch.setenv("TERCEL_DRAFT_HEAD", "int8")
    for token_map in (None, str(even_ids)):
        spec = spec_llm(llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(d),
                        speculative_token_map=token_map, **shape)
        model = spec.engine.spec.drafter.model
        q, scale = model.head_q
        assert q.dtype == torch.int8 and q.shape[0] == model.vocab_size == (VOCAB if token_map is None else VOCAB // 2)
        h = torch.randn(5, llm.engine.model_config.hidden_size)
        full = (model.hot_head(model.norm(h)) if model.hot_head is not None
                else F.linear(model.norm(h), model._head_weight())).float()
        assert float((model.compute_logits(h) - full).norm() / full.norm()) < 2e-2
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == ref
        assert spec.engine.spec_stats().draft_tokens > 0
    monkeypatch.setenv("TERCEL_DRAFT_HEAD", "fp8")
    with pytest.raises(ValueError, match="TERCEL_DRAFT_HEAD='fp8': use one of native, int8"):
        spec_llm(llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(d), **shape)
