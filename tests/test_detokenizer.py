"""Incremental detokenization is exact: at every token, over many random token sequences decoded by
the real SmolLM2 tokenizer (split multi-byte characters, special tokens, stop strings included),
output_text, the streamable length and the stop string found equal those of decoding the whole
output each step (the specification below)."""
from __future__ import annotations

import random

import torch

from tercel.detokenizer import update_text
from tercel.outputs import RequestMetrics
from tercel.request import Request
from tercel.sampling_params import SamplingParams


def full_decode_update(req: Request, tokenizer) -> str | None:
    """The specification: decode the whole output, find stop strings, hold back what may still change."""
    prev_len = len(req.output_text)
    text = tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
    stops = req.params.stop
    if stops:
        search_from = max(0, min(prev_len, len(text)) - max(len(s) for s in stops) + 1)
        hits = [(idx, s) for s in stops if (idx := text.find(s, search_from)) != -1]
        if hits:
            idx, s = min(hits)
            req.output_text, req.output_text_safe_len = text[:idx], idx
            return s
    req.output_text = text
    safe = len(text)
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    hold = max([k for s in stops for k in range(1, min(len(s) - 1, safe) + 1) if text[safe - k:safe] == s[:k]],
               default=0)
    req.output_text_safe_len = safe - hold
    return None


def _request(params: SamplingParams) -> Request:
    return Request("r", None, [1], params, torch.Generator(), RequestMetrics(arrival_time=0.0, num_prompt_tokens=1))


def _random_tokens(rng: random.Random, tok, n: int) -> list[int]:
    """Mostly byte-level pieces of multi-byte characters (split across tokens), some whole words,
    some special tokens."""
    byte_ids = list(range(3, 300))
    return [rng.choice(byte_ids) if (u := rng.random()) < 0.5 else rng.randrange(3) if u < 0.55
            else rng.randrange(tok.vocab_size) for _ in range(n)]


def test_incremental_text_equals_a_full_decode_at_every_token(smol_llm):
    tok = smol_llm.tokenizer
    rng = random.Random(0)
    held_back = stopped = 0
    for case in range(300):
        ids = _random_tokens(rng, tok, rng.randrange(1, 40))
        full = tok.decode(ids)
        stops = [full[i:i + rng.randrange(1, 4)] for i in sorted(rng.sample(range(len(full)), 2))] if (
            case % 3 == 0 and len(full) > 4) else []
        params = SamplingParams(stop=stops, skip_special_tokens=case % 2 == 0)
        ours, spec = _request(params), _request(params)
        for t in ids:
            ours.output_token_ids.append(t)
            spec.output_token_ids.append(t)
            hit = update_text(ours, tok)
            assert hit == full_decode_update(spec, tok), (case, ids)
            assert (ours.output_text, ours.output_text_safe_len) == (spec.output_text, spec.output_text_safe_len), \
                (case, ids)
            held_back += ours.output_text_safe_len < len(ours.output_text)
            if hit is not None:
                stopped += 1
                break
    assert held_back > 50 and stopped > 20  # the cases exercised holding back and stop strings


def test_incremental_decode_reads_a_short_window(smol_llm):
    """The per-token cost does not grow with the output: each update decodes a few tokens."""
    tok = smol_llm.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 40)
    lengths: list[int] = []

    class Counting:
        def decode(self, x, skip_special_tokens=True):
            lengths.append(len(x))
            return tok.decode(x, skip_special_tokens=skip_special_tokens)

    req = _request(SamplingParams())
    for t in ids:
        req.output_token_ids.append(t)
        update_text(req, Counting())
    assert req.output_text == tok.decode(ids)
    assert len(ids) > 300 and max(lengths) <= 4


def test_final_only_requests_without_stop_strings_decode_once_at_the_end(smol_llm, monkeypatch):
    """LLM.generate (FINAL_ONLY) without stop strings skips the per-token incremental decode and decodes the
    output once when it finishes: the same text as the streaming path. Stop strings, or outputs handed out
    before the end (CUMULATIVE / DELTA), keep the incremental decode."""
    import tercel.output_sink as output_sink

    calls = []
    real = output_sink.update_text
    monkeypatch.setattr(output_sink, "update_text", lambda req, tok: (calls.append(req.request_id), real(req, tok))[1])
    prompts = ["Write a haiku about the sea.", "List three primes:"]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    final = smol_llm.generate(prompts, plain)
    assert calls == []  # nothing decoded token by token
    streamed = [smol_llm.engine.add_request(smol_llm.tokenizer.encode(p), plain) for p in prompts]  # CUMULATIVE
    last = {}
    while smol_llm.engine.has_unfinished_requests():
        last.update((o.request_id, o) for o in smol_llm.engine.step())
    assert len(calls) >= 2 * 12  # every token of both requests
    for out, rid in zip(final, streamed):
        got, want = out.outputs[0], last[rid].outputs[0]
        assert got.token_ids == want.token_ids and len(got.token_ids) == 12
        assert got.text == want.text == smol_llm.tokenizer.decode(got.token_ids) != ""
    calls.clear()
    stop = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["zzz-not-there"])
    assert smol_llm.generate(prompts[:1], stop)[0].outputs[0].text == final[0].outputs[0].text
    assert len(calls) == 12  # stop strings are searched as the text grows
