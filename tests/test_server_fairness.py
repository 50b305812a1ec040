"""Issue #25, acceptance 3: one HTTP request's fan-out does not hold everyone else (one real server,
tiny random model, 2 running sequences at most so the fan-out takes many rounds).

A small request sent while a 64-completion fan-out runs finishes long before the fan-out does (the
engine loop admits HTTP requests round-robin), a fan-out over --max-request-fanout is a 400 that
names the cap, and a fan-out abandoned while most of it still queues frees everything.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from server_harness import HOST, async_http_client, http_client, running_server, tiny_server_args

pytestmark = [pytest.mark.timeout(180)]

FANOUT_CAP = 64
MAX_NUM_SEQS = 2
FANOUT = {"prompt": [[10 + k, 20, 30, 40] for k in range(16)], "n": 4, "max_tokens": 24, "ignore_eos": True,
          "temperature": 0}  # 16 prompts x n=4 = 64 engine requests = 32 rounds of 2
SMALL = {"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    yield from running_server(*tiny_server_args("--max-num-seqs", str(MAX_NUM_SEQS), "--max-n", "4",
                                                "--max-request-fanout", str(FANOUT_CAP)), with_reference=False)


async def _post(ac, url: str, body: dict, t0: float) -> tuple[int, float]:
    r = await ac.post(url, json=body)
    assert r.status_code == 200, r.text
    return len(r.json()["choices"]), time.perf_counter() - t0


def test_small_request_is_not_queued_behind_a_large_fanout(server):
    url = server.base_url + "/v1/completions"

    async def scenario():
        async with async_http_client(timeout=120.0) as ac:
            t0 = time.perf_counter()
            fan = asyncio.ensure_future(_post(ac, url, FANOUT, t0))
            while server.metrics()["tercel_num_requests_running"] == 0:  # the fan-out has started
                await asyncio.sleep(0.02)
            small = asyncio.ensure_future(_post(ac, url, SMALL, time.perf_counter()))
            sent_at = time.perf_counter() - t0
            (n_small, small_s), (n_fan, fan_s) = await small, await fan
            return n_small, small_s, sent_at, n_fan, fan_s

    n_small, small_s, sent_at, n_fan, fan_s = asyncio.run(scenario())
    assert (n_small, n_fan) == (1, 64)
    assert sent_at + small_s < fan_s, (sent_at, small_s, fan_s)  # finished before the fan-out
    assert small_s < 0.25 * fan_s, (small_s, fan_s)  # within a few rounds, not behind 64 requests
    m = server.wait_idle()
    assert m["tercel_kv_blocks_used"] == 0


def test_fanout_over_the_cap_is_a_400_naming_it(server):
    with http_client(base_url=server.base_url, timeout=30.0) as c:
        r = c.post("/v1/completions", json={"prompt": ["a"] * 17, "n": 4, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "too_many_completions" and err["param"] == "n"
        assert "68" in err["message"] and str(FANOUT_CAP) in err["message"]
        assert "--max-request-fanout" in err["message"]
        at_cap = c.post("/v1/completions", json={"prompt": ["a"] * 16, "n": 4, "max_tokens": 1})
        assert at_cap.status_code == 200 and len(at_cap.json()["choices"]) == FANOUT_CAP
        assert server.metrics()["tercel_prompt_tokens_total"] > 0


def test_fanout_abandoned_while_queued_frees_everything(server):
    body = FANOUT | {"max_tokens": 200}
    payload = json.dumps(body).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    with socket.create_connection((HOST, server.port), timeout=10.0) as s:
        s.sendall(raw)
        deadline = time.monotonic() + 30
        while server.metrics()["tercel_num_requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        m = server.metrics()
        assert m["tercel_num_requests_running"] == MAX_NUM_SEQS
        assert m["tercel_num_requests_waiting"] >= 60  # the rest waits in the server's fair queue
    m = server.wait_idle(timeout_s=30)  # the client left: running and queued requests are all gone
    assert m["tercel_kv_blocks_used"] == 0 and m["tercel_num_requests_waiting"] == 0
    with http_client(timeout=30.0) as c:
        assert c.post(server.base_url + "/v1/completions", json=SMALL).status_code == 200
