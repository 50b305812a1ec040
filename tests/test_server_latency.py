"""Issue #32: latency under a big neighbour, on this CPU with the default model, as a new user's load
test would try it. A near-cap fan-out (51 prompts x n=5 = 255 completions) is admitted, and 21 small
4-token requests sent beside it finish with a median of at most 3 s while the fan-out runs: on a CPU a step
carries at most 256 prefill tokens, and while requests decode their tokens plus the prefill stay within 128
(max_step_tokens), so a small request's prefill and each of its decode steps wait a few tenths of a second.
"""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from server_harness import async_http_client, http_client, running_server, tiny_server_args

pytestmark = [pytest.mark.timeout(600)]

FANOUT = {"prompt": [f"Item {k}: write one sentence about the number {k * 7 + 3} and its digits." for k in range(51)],
          "n": 5, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
SMALL = {"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
NUM_SMALL = 21


SERVER_ARGS = ("--max-n", "5", "--kv-cache-memory", "256MiB", "--max-model-len", "2048")  # SmolLM2, fp32


def _with_server(*args: str):
    """Start a server, yield it, stop it (one SmolLM2 server at a time on this small machine)."""
    gen = running_server(*args, with_reference=False)
    srv = next(gen)
    try:
        yield srv
    finally:
        next(gen, None)


async def _post(ac, url: str, body: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = await ac.post(url, json=body)
    assert r.status_code == 200, r.text
    return len(r.json()["choices"]), time.perf_counter() - t0


def _scenario(srv) -> tuple[float, list[float], float]:
    """(fan-out seconds, each small request's seconds, seconds from the fan-out's start to the last small's end)"""
    url = srv.base_url + "/v1/completions"

    async def run():
        async with async_http_client(timeout=600.0) as ac:
            t0 = time.perf_counter()
            fan = asyncio.ensure_future(_post(ac, url, FANOUT))
            while srv.metrics()["tercel_num_requests_running"] == 0:  # the fan-out is admitted
                await asyncio.sleep(0.02)
            smalls = []
            for _ in range(NUM_SMALL):
                smalls.append(asyncio.ensure_future(_post(ac, url, SMALL)))
                await asyncio.sleep(0.25)
            small = await asyncio.gather(*smalls)
            small_done = time.perf_counter() - t0
            n_fan, fan_s = await fan
            assert n_fan == 255 and all(n == 1 for n, _ in small)
            return fan_s, [s for _, s in small], small_done

    out = asyncio.run(run())
    assert srv.wait_idle(timeout_s=60)["tercel_kv_blocks_used"] == 0
    return out


def test_small_requests_beside_a_near_cap_fanout():
    """Small requests sent beside an admitted near-cap fan-out finish while it runs, with a median of at most
    3 s (the issue's goal; the fan-out's own time is printed for comparison with a run of the former code)."""
    for srv in _with_server(*SERVER_ARGS):
        fan_s, small, small_done = _scenario(srv)
    median = statistics.median(small)
    print(f"small requests beside the fan-out: median {median:.2f} s, fan-out {fan_s:.1f} s")
    assert small_done < fan_s, (small_done, fan_s)  # they ran while the fan-out did
    assert median <= 3.0, (median, sorted(small))


@pytest.fixture(scope="module")
def tiny_server():
    yield from running_server(*tiny_server_args(), with_reference=False)


def test_cached_tokens_in_usage_and_metrics(tiny_server):
    """A second chat turn reports its cached prompt tokens in usage.prompt_tokens_details and /metrics."""
    server = tiny_server
    system = {"role": "system", "content": "You are a terse assistant. " * 8}
    body = {"messages": [system, {"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0}
    with http_client(base_url=server.base_url, timeout=120.0) as c:
        first = c.post("/v1/chat/completions", json=body).json()["usage"]
        body["messages"] += [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another."}]
        second = c.post("/v1/chat/completions", json=body).json()["usage"]
        stream = c.post("/v1/chat/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}})
        last = [line for line in stream.text.splitlines() if line.startswith("data: {")][-1]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 16
    assert '"cached_tokens"' in last and second["prompt_tokens"] > second["prompt_tokens_details"]["cached_tokens"]
    m = server.metrics()
    assert m["tercel_prefix_cache_hit_tokens"] >= second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < m["tercel_prefix_cache_hit_rate"] < 1 and m["tercel_prefix_cache_queried_tokens"] > 0
