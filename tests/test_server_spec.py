"""The server with speculative decoding (--speculative-algorithm NGRAM: no draft model needed).

Greedy speculative decoding is lossless, so the server must still equal the offline (non-speculative)
LLM.generate / LLM.chat output; the accept-length histogram and accept-rate gauge must fill, labelled
by algorithm. Add EAGLE / EAGLE3 servers here once their draft models ship with the repo.
"""
from __future__ import annotations

import pytest
from server_harness import offline, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "The capital of France is"]
MESSAGES = [{"role": "user", "content": "Repeat after me: red, green, blue, red, green, blue."}]


@pytest.fixture(scope="module")
def server():
    yield from running_server("--speculative-algorithm", "NGRAM", "--speculative-num-steps", "4",
                              "--max-model-len", "1024")


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_spec_greedy_completion_matches_offline(client, prompt):
    ref = offline(prompt, max_tokens=24)
    r = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_spec_greedy_chat_stream_matches_offline(client):
    ref = offline(MESSAGES, chat=True, max_tokens=24)
    chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_spec_seeded_sampling_is_reproducible(client):
    kw = dict(model="default", prompt=PROMPTS[0], max_tokens=24, temperature=0.8, seed=11, n=2)
    a = [c.text for c in client.completions.create(**kw).choices]
    b = [c.text for c in client.completions.create(**kw).choices]
    assert a == b


def test_spec_metrics_fill(server, client):
    client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    m = server.metrics()
    assert m['tercel_spec_decode_accept_length_count{algorithm="NGRAM"}'] > 0
    assert 0.0 <= m['tercel_spec_decode_accept_rate{algorithm="NGRAM"}'] <= 1.0
    # the counting prompt is easy for n-grams: some verify steps accept drafts
    assert m['tercel_spec_decode_accept_length_sum{algorithm="NGRAM"}'] > \
        m['tercel_spec_decode_accept_length_count{algorithm="NGRAM"}']
    server.wait_idle()
