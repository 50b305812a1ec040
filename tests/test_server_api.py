"""Acceptance 1: a real server on SmolLM2 driven by the official `openai` client.

Completions and chat, streaming and not, stop strings, n=2, seeds, logprobs, usage; greedy server
output must equal the offline LLM.generate / LLM.chat output with the same parameters.
One server process for the whole module.
"""
from __future__ import annotations

import math

import openai
import pytest
from server_harness import http_client, offline, offline_llm, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    yield from running_server("--max-n", "4")


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_models_and_health(server, client, model_id):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id]
    assert model_id == "SmolLM2-135M-Instruct.Q4_1.gguf"  # the model file name
    with http_client(base_url=server.base_url, timeout=30.0, headers=server.headers()) as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == model_id  # the default model: its name, not its path in site-packages
    assert client.models.retrieve(model_id).id == model_id
    assert client.models.retrieve("default").id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert server.health_ok()


def test_completion_greedy_matches_offline(client, model_id):
    ref = offline(PROMPT, max_tokens=MAX_TOKENS)
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.model == model_id
    assert len(r.choices) == 1
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    n_prompt = len(offline_llm().tokenizer.encode(PROMPT))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == n_prompt + len(ref.token_ids)


def test_completion_default_alias_and_token_ids_prompt(client):
    ids = offline_llm().tokenizer.encode(PROMPT)
    ref = offline(ids, max_tokens=MAX_TOKENS)
    r = client.completions.create(model="default", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(ids)


def test_completion_default_max_tokens_is_16(client, model_id):
    r = client.completions.create(model=model_id, prompt="Once upon a time", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length"


def test_completion_batch_prompts(client, model_id):
    prompts = [PROMPT, "1, 2, 3, 4,"]
    r = client.completions.create(model=model_id, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, prompts):
        assert c.text == offline(p, max_tokens=8).text


def test_completion_stream_matches_offline(client, model_id):
    ref = offline(PROMPT, max_tokens=MAX_TOKENS)
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert len(chunks) > 3  # really streamed
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == len(ref.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_greedy_matches_offline(client, model_id):
    ref = offline(MESSAGES, chat=True, max_tokens=MAX_TOKENS)
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    n_prompt = len(offline_llm().tokenizer.apply_chat_template(MESSAGES, True))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ref.token_ids))


def test_chat_max_completion_tokens_and_content_parts(client, model_id):
    ref = offline(MESSAGES, chat=True, max_tokens=5)
    parts = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    r = client.chat.completions.create(model=model_id, messages=parts, max_completion_tokens=5, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids) <= 5


def test_chat_stream_matches_offline(client, model_id):
    ref = offline(MESSAGES, chat=True, max_tokens=MAX_TOKENS)
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [ref.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stream_without_usage_has_no_usage_chunk(client, model_id):
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, temperature=0,
                                                 stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def _stop_word(text: str) -> str:
    """A stop string from the middle of a reference output."""
    words = [w for w in text.split() if w.isalpha() and len(w) >= 3]
    assert len(words) >= 2, text
    return words[len(words) // 2]


def test_stop_string_completion(client, model_id):
    stop = _stop_word(offline(PROMPT, max_tokens=MAX_TOKENS).text)
    ref = offline(PROMPT, max_tokens=MAX_TOKENS, stop=[stop])
    assert ref.finish_reason == "stop" and stop not in ref.text
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=stop)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stop=[stop, "zzzz"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_chat_stream(client, model_id):
    stop = _stop_word(offline(MESSAGES, chat=True, max_tokens=MAX_TOKENS).text)
    ref = offline(MESSAGES, chat=True, max_tokens=MAX_TOKENS, stop=[stop])
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n2_seeded_choices(client, model_id):
    """n=2 with seed s: choice i is sampled with seed s+i, so it equals an n=1 request with that seed
    and the offline output with SamplingParams(seed=s+i)."""
    kw = dict(model=model_id, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=1234)
    r = client.chat.completions.create(n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    texts = [c.message.content for c in r.choices]
    assert texts[0] != texts[1]  # different seeds: different samples (true for this prompt)
    for i, t in enumerate(texts):
        assert t == offline(MESSAGES, chat=True, max_tokens=16, temperature=1.0, seed=1234 + i).text, i
    single = client.chat.completions.create(**{**kw, "seed": 1235})
    assert single.choices[0].message.content == texts[1]
    refs = [offline(MESSAGES, chat=True, max_tokens=16, temperature=1.0, seed=1234 + i) for i in range(2)]
    assert r.usage.completion_tokens == sum(len(x.token_ids) for x in refs)


def test_n2_stream_completion(client, model_id):
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0.9, seed=7,
                                            n=2, stream=True, stream_options={"include_usage": True}))
    texts = ["", ""]
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    for i in range(2):
        assert texts[i] == offline(PROMPT, max_tokens=12, temperature=0.9, seed=7 + i).text
    assert chunks[-1].usage.completion_tokens > 0


def test_seed_reproducibility(client, model_id):
    kw = dict(model=model_id, prompt="My favourite food is", max_tokens=16, temperature=1.0, top_p=0.9, seed=42,
              extra_body={"top_k": 50})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 43}).choices[0].text
    assert a == b
    assert a != c
    assert a == offline("My favourite food is", max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=42).text


def test_completion_logprobs(client, model_id):
    ref = offline(PROMPT, max_tokens=8, logprobs=3)
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    tok = offline_llm().tokenizer
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ref.token_ids)
    for got, want, tid, top in zip(lp.token_logprobs, ref.logprobs, ref.token_ids, lp.top_logprobs):
        assert math.isclose(got, want[tid], abs_tol=1e-3)
        assert 3 <= len(top) <= 4  # top-3 plus the chosen token
        assert math.isclose(max(top.values()), got, abs_tol=1e-6)  # greedy: the chosen token is the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_and_stream(client, model_id):
    ref = offline(MESSAGES, chat=True, max_tokens=6, logprobs=2)
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids)
    for entry, tid, want in zip(content, ref.token_ids, ref.logprobs):
        assert math.isclose(entry.logprob, want[tid], abs_tol=1e-3)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert bytes(entry.bytes).decode(errors="replace") == entry.token or "\ufffd" in entry.token
    assert "".join(e.token for e in content) == ref.text
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    no_top = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3, temperature=0,
                                            logprobs=True)
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)
    assert client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3,
                                          temperature=0).choices[0].logprobs is None


def test_unknown_fields_and_user_are_accepted(server, model_id):
    """Policy: unknown fields are ignored; `user` is accepted and unused."""
    with http_client(timeout=60) as c:
        r = c.post(server.base_url + "/v1/completions",
                   json={"model": model_id, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "user": "u-1",
                         "some_future_field": {"x": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline(PROMPT, max_tokens=2).text


def test_metrics_exposition(server, client, model_id):
    client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, temperature=0)
    with http_client(timeout=10) as c:
        text = c.get(server.base_url + "/metrics").text
    for name in ("tercel_requests_total", "tercel_num_requests_running", "tercel_num_requests_waiting",
                 "tercel_kv_blocks_used", "tercel_kv_blocks_total", "tercel_prompt_tokens_total",
                 "tercel_generation_tokens_total", "tercel_time_to_first_token_seconds",
                 "tercel_inter_token_latency_seconds", "tercel_spec_decode_accept_length",
                 "tercel_spec_decode_accept_rate"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    m = server.metrics()
    assert m['tercel_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert m["tercel_kv_blocks_total"] > 0
    assert m["tercel_generation_tokens_total"] >= 2
    assert m["tercel_time_to_first_token_seconds_count"] >= 1
    assert m["tercel_inter_token_latency_seconds_count"] >= 1


# Speculative decoding: tests/test_server_spec.py runs a second server with --speculative-algorithm and
# repeats the greedy parity checks there (one server per module).
