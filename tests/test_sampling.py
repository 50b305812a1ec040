"""Sampling: reproducible seeds, top-k / top-p / min-p never leave their allowed set, temperature
-> 0 is greedy, penalties, stop conditions, logprobs and streaming."""
from __future__ import annotations

import math

import pytest
import torch

from tercel import SamplingParams
from tercel.outputs import RequestMetrics
from tercel.request import Request
from tercel.sampling import Sampler, apply_penalties, draw_keys, draw_noise, sample_batch


def _req(params: SamplingParams, seed: int, prompt=(1, 2, 3), output=()) -> Request:
    return Request("r", None, list(prompt), params, torch.Generator().manual_seed(seed), RequestMetrics(0.0),
                   output_token_ids=list(output), seed=seed)


def _allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The allowed set, computed independently of tercel.sampling, in float64 on sorted probabilities."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep = order[:p.top_k] if p.top_k else order
    if p.top_p < 1.0:
        renorm = probs[keep] / probs[keep].sum()
        mass, cut = 0.0, []
        for i, q in zip(keep, renorm.tolist()):
            cut.append(i)
            mass += q
            if mass >= p.top_p - 1e-9:
                break
        keep = cut
    if p.min_p > 0:
        kept = probs[keep] / probs[keep].sum()
        top = kept.max().item()
        keep = [i for i, q in zip(keep, kept.tolist()) if q >= p.min_p * top]
    return set(keep)


FILTERS = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.7, top_p=0.6),
           SamplingParams(temperature=1.3, min_p=0.2), SamplingParams(temperature=1.0, top_k=20, top_p=0.8, min_p=0.05)]


@pytest.mark.parametrize("params", FILTERS, ids=["top_k", "top_p", "min_p", "combined"])
def test_filters_never_emit_outside_the_allowed_set(params):
    g = torch.Generator().manual_seed(0)
    sampler = Sampler()
    for trial in range(20):
        logits = torch.randn(64, generator=g) * 2.5
        allowed = _allowed(logits, params)
        assert 0 < len(allowed) < 64
        reqs = [_req(params, seed=trial * 1000 + i) for i in range(100)]
        tokens, _ = sampler.sample(logits.expand(100, -1), reqs)
        assert set(tokens) <= allowed
        if len(allowed) > 1:
            assert len(set(tokens)) > 1  # it does sample, not just take the argmax


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=1.0, top_k=3)
    reqs = [_req(params, seed=i) for i in range(6000)]
    tokens, _ = Sampler().sample(logits.expand(len(reqs), -1), reqs)
    expected = torch.softmax(logits[:3], -1)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double() / len(tokens)
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3], expected.double(), atol=0.03)


def test_noise_is_exponential_and_depends_only_on_seed_and_draw_count():
    from scipy.stats import kstest

    reqs = [_req(SamplingParams(temperature=1.0), seed=s) for s in (3, 3, 4)]
    e = draw_noise(draw_keys(reqs), 50_000, torch.device("cpu"))
    assert torch.equal(e[0], e[1]) and not torch.equal(e[0], e[2])  # same seed and count: same draw
    assert kstest(e[0].double().numpy(), "expon").pvalue > 0.01 and kstest(e[2].double().numpy(), "expon").pvalue > 0.01
    assert [r.draws for r in reqs] == [1, 1, 1]
    e2 = draw_noise(draw_keys(reqs[:1]), 50_000, torch.device("cpu"))  # the next draw of the stream differs
    assert not torch.equal(e2[0], e[0]) and abs(float(torch.corrcoef(torch.stack([e2[0], e[0]]))[0, 1])) < 0.02


def test_a_requests_draws_do_not_depend_on_its_batch():
    """The same request (seed) gets the same tokens alone or in any batch, at any row, beside other
    filter settings: its noise is a function of (seed, draw count) only."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g) * 3
    p = SamplingParams(temperature=0.8, top_p=0.9)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=7), p]
    alone = [[int(sample_batch(logits[i:i + 1], [r])[0]) for _ in range(4)]
             for i, r in enumerate([_req(p, seed=10 + i) for i in range(6)])]
    reqs = [_req(p, seed=10 + i) for i in range(6)]
    for _ in range(4):
        batch = [_req(others[j % 3], seed=99 + j) for j in range(5)] + reqs[::-1]
        rows = torch.cat([torch.randn(5, 300, generator=g), logits.flip(0)])
        toks = sample_batch(rows, batch).tolist()[5:][::-1]
        for i in range(6):
            alone[i].append(toks[i])
    assert all(a[:4] == a[4:] for a in alone) and len({tuple(a) for a in alone}) > 1


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    r = _req(SamplingParams(repetition_penalty=2.0), 0, prompt=[0], output=[1])
    out = apply_penalties(logits, r)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied, unseen untouched
    r = _req(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), 0, prompt=[3], output=[2, 2, 0])
    out = apply_penalties(logits, r)
    assert out.tolist() == pytest.approx([2.0 - 0.5 - 0.25, -2.0, 1.0 - 1.0 - 0.25, 0.5])


def test_seeded_runs_reproduce(smol_llm, smol_chat_ids):
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)
    a = smol_llm.generate(smol_chat_ids[:3], p)
    b = smol_llm.generate(smol_chat_ids[:3], p)
    c = smol_llm.generate(smol_chat_ids[:3], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=99))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_unseeded_runs_are_reproducible_per_engine_seed_but_vary_per_request(smol_llm, smol_chat_ids):
    outs = smol_llm.generate([smol_chat_ids[0]] * 4, SamplingParams(max_tokens=24, temperature=1.0))
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_temperature_to_zero_equals_greedy(smol_llm, smol_chat_ids):
    greedy = smol_llm.generate(smol_chat_ids[:3], SamplingParams(max_tokens=32, temperature=0))
    cold = smol_llm.generate(smol_chat_ids[:3], SamplingParams(max_tokens=32, temperature=1e-4, seed=7))
    assert [o.outputs[0].token_ids for o in cold] == [o.outputs[0].token_ids for o in greedy]


def test_top_k_end_to_end_within_raw_top_k(smol_llm, smol_chat_ids):
    out = smol_llm.generate(smol_chat_ids[1], SamplingParams(max_tokens=32, temperature=1.5, top_k=3, logprobs=5,
                                                             seed=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 32
    for tok, lp in zip(out.token_ids, out.logprobs):
        top3 = sorted(lp.items(), key=lambda kv: -kv[1])[:3]
        assert tok in {t for t, _ in top3}
        assert all(v <= 0 for v in lp.values())
        assert math.isclose(sum(math.exp(v) for v in lp.values()), sum(math.exp(v) for v in lp.values()))


def test_logprobs_of_greedy_tokens_are_the_max(smol_llm, smol_chat_ids):
    out = smol_llm.generate(smol_chat_ids[0], SamplingParams(max_tokens=8, temperature=0, logprobs=3))[0].outputs[0]
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert next(iter(lp)) == tok and lp[tok] == max(lp.values()) and len(lp) == 3


def test_max_tokens_and_length_finish(smol_llm, smol_chat_ids):
    out = smol_llm.generate(smol_chat_ids[0], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_cuts_text(smol_llm, smol_chat_ids):
    full = smol_llm.generate(smol_chat_ids[0], SamplingParams(max_tokens=40, temperature=0))[0].outputs[0].text
    word = full.split()[5]
    out = smol_llm.generate(smol_chat_ids[0], SamplingParams(max_tokens=40, temperature=0, stop=[word]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == word
    assert c.text == full[:full.index(word)]


def test_stop_token_ids(smol_llm, smol_chat_ids):
    full = smol_llm.generate(smol_chat_ids[0], SamplingParams(max_tokens=20, temperature=0))[0].outputs[0]
    stop_tok = full.token_ids[6]
    out = smol_llm.generate(smol_chat_ids[0], SamplingParams(max_tokens=20, temperature=0,
                                                             stop_token_ids=[stop_tok]))[0].outputs[0]
    first = full.token_ids.index(stop_tok)
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_min_tokens_blocks_eos(smol_llm):
    ids = smol_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say just: yes"}])
    short = smol_llm.generate(ids, SamplingParams(max_tokens=40, temperature=0))[0].outputs[0]
    assert short.finish_reason == "stop"
    n = len(short.token_ids) + 5
    longer = smol_llm.generate(ids, SamplingParams(max_tokens=40, temperature=0, min_tokens=n))[0].outputs[0]
    assert len(longer.token_ids) >= n


def test_stream_deltas_add_up_to_the_final_text(smol_llm, smol_chat_ids):
    params = SamplingParams(max_tokens=30, temperature=0)
    final = smol_llm.generate(smol_chat_ids[2], params)[0].outputs[0]
    deltas = list(smol_llm.stream(smol_chat_ids[2], params))
    assert "".join(d.delta_text for d in deltas) == final.text
    assert sum((d.delta_token_ids for d in deltas), []) == final.token_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_stream_with_stop_string_never_leaks_it(smol_llm, smol_chat_ids):
    full = smol_llm.generate(smol_chat_ids[0], SamplingParams(max_tokens=40, temperature=0))[0].outputs[0].text
    stop = full.split()[4] + " " + full.split()[5]
    deltas = list(smol_llm.stream(smol_chat_ids[0], SamplingParams(max_tokens=40, temperature=0, stop=stop)))
    text = "".join(d.delta_text for d in deltas)
    assert text == full[:full.index(stop)] and stop not in text


def test_metrics(smol_llm, smol_chat_ids):
    out = smol_llm.generate(smol_chat_ids[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    assert m.time_to_first_token > 0 and m.decode_tokens_per_s > 0
    assert m.num_prompt_tokens == len(smol_chat_ids[0]) and m.num_generated_tokens == 10


@pytest.mark.parametrize("kw,name", [({"temperature": float("inf")}, "temperature"),
                                     ({"max_tokens": True}, "max_tokens"), ({"seed": -1}, "seed"),
                                     ({"seed": 2**64}, "seed"), ({"top_k": 2.5}, "top_k")])
def test_bad_sampling_params_name_the_field(kw, name):
    with pytest.raises(ValueError, match=f"SamplingParams.{name}="):
        SamplingParams(**kw)


@pytest.mark.parametrize("vocab", [5, 1000, 49152, 70000])
def test_cpu_noise_is_the_whole_batch_formula_bit_for_bit(vocab):
    """The CPU's in-place, few-rows-at-a-time noise equals the formula the other devices run on whole tensors,
    so a seed gives the same tokens on every device."""
    from tercel.sampling import _GOLDEN, _mix64, _shr, draw_noise

    keys = torch.randint(-2**62, 2**62, (3, 5), generator=torch.Generator().manual_seed(vocab))
    idx = torch.arange(1, vocab + 1, dtype=torch.int64)
    u = (_shr(_mix64(keys[..., None] + idx * _GOLDEN), 11).double() + 0.5) * 2.0 ** -53
    assert torch.equal(draw_noise(keys, vocab, torch.device("cpu")), (-torch.log(u)).float())
