"""Fast server tests without a model: CLI wiring, speculative flag pass-through, import hygiene,
the catch-all 500 and engine-failure paths (in-process app on a stub engine, no network)."""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
from server_harness import REPO


def _serve_args(*argv: str) -> argparse.Namespace:
    from tercel.server.cli import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def keep_sigterm():
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def test_import_tercel_does_not_import_web_stack():
    code = ("import sys, tercel, tercel.cli, tercel.server.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('fastapi', 'uvicorn', 'starlette', 'pydantic', 'prometheus_client')]; "
            "assert not bad, bad; tercel.cli.build_parser().parse_args(['serve', '--port', '1'])")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_main_cli_has_serve():
    from tercel.cli import build_parser
    from tercel.server.cli import run_serve

    args = build_parser().parse_args(["serve", "m.gguf", "--port", "1234", "--kv-cache-memory", "512MiB",
                                      "--max-body-bytes", "1k"])
    assert args.func is run_serve
    assert (args.model_pos, args.port, args.kv_cache_memory, args.max_body_bytes) == ("m.gguf", 1234, 512 << 20, 1000)
    assert args.host == "127.0.0.1" and args.api_key is None


def test_parse_size():
    from tercel.server.cli import parse_size

    assert parse_size("1024") == 1024
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5k") == 1500
    for bad in ("", "-1", "1 XB", "abc"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_speculative_flags_reach_the_engine_config(monkeypatch, keep_sigterm, tmp_path):
    import tercel.engine
    from tercel.config import ConfigError
    from tercel.server.cli import run_serve

    seen: list = []

    class FakeEngine:
        def __init__(self, config, **_):
            seen.append(config)
            raise ConfigError("stop here")

    monkeypatch.setattr(tercel.engine, "LLMEngine", FakeEngine)
    draft = tmp_path / "draft"  # the checks before load want a draft directory that looks like one
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    (draft / "model.safetensors").write_bytes(b"")
    assert run_serve(_serve_args()) == 2
    assert seen[-1].speculative.algorithm is None  # serve: plain decoding unless asked
    assert run_serve(_serve_args("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                                 "--speculative-draft-model-path", str(draft), "--speculative-eagle-topk", "2",
                                 "--speculative-num-draft-tokens", "4")) == 2
    spec = seen[-1].speculative
    assert (spec.algorithm, spec.num_steps, spec.draft_model_path, spec.eagle_topk, spec.num_draft_tokens) == (
        "EAGLE", 3, str(draft), 2, 4)
    assert run_serve(_serve_args("--speculative-algorithm", "auto")) == 2
    assert seen[-1].speculative.algorithm == "AUTO"  # resolved by the engine, as for generate


# ---- in-process app on a stub engine -----------------------------------------------------------

class _StubTokenizer:
    chat_template = None  # no template of its own: the server picks no tool parser from it
    supports_tools = False

    def __init__(self, explode: bool = False) -> None:
        self.explode = explode

    def encode(self, text: str) -> list[int]:
        if self.explode:
            raise RuntimeError("secret internal detail")
        return [ord(c) % 90 + 1 for c in text]

    def encode_with_special(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(i + 32) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(i + 32) for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        return self.encode("".join(m["content"] for m in messages))


class _StubScheduler:
    """The scheduler's lists and the admission room the engine loop asks for (one token per request)."""

    def __init__(self, engine: "_StubEngine") -> None:
        self.engine = engine
        self.running: list[str] = []
        self.waiting: list[str] = []

    def admission_room(self):
        cfg = self.engine.config
        room = SimpleNamespace(slots=cfg.max_num_seqs - len(self.running) - len(self.waiting),
                               tokens=cfg.max_num_batched_tokens)

        def take(req) -> None:
            room.slots -= 1
            room.tokens -= 1

        room.take = take
        return room


class _StubEngine:
    """Enough of LLMEngine for the server; step() raises when told to."""

    def __init__(self, explode_tokenizer: bool = False, explode_step: bool = False) -> None:
        from tercel.engine import EngineStats

        self._stats = EngineStats(0, 0, 10, 10)
        self.tokenizer = _StubTokenizer(explode_tokenizer)
        self.config = SimpleNamespace(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=256)
        self.model_config = SimpleNamespace(vocab_size=100)
        self.requests: dict[str, object] = {}
        self.scheduler = _StubScheduler(self)
        self.explode_step = explode_step
        self.lock = threading.Lock()

    def stats(self):
        return self._stats

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, prompt, params, request_id):
        self.requests[request_id] = prompt

    def abort_request(self, request_id) -> bool:
        return self.requests.pop(request_id, None) is not None

    def step(self):
        if self.explode_step:
            raise RuntimeError("secret step failure")
        return []


def _client(engine):
    from fastapi.testclient import TestClient

    from tercel.server.app import ServerSettings, build_app

    return TestClient(build_app(engine, ServerSettings(served_model_name="stub")), raise_server_exceptions=False)


def test_unexpected_error_is_a_generic_500():
    with _client(_StubEngine(explode_tokenizer=True)) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500
        assert r.json() == {"error": {"message": "Internal server error.", "type": "server_error", "param": None,
                                      "code": "internal_error"}}
        assert "secret" not in r.text
        assert c.get("/health").status_code == 200


def test_engine_step_failure_fails_the_request_not_the_server():
    with _client(_StubEngine(explode_step=True)) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert "secret" not in r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 200
        assert '"engine_error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "hi", "model": "other"}).status_code == 400


def test_server_asks_for_delta_outputs_and_joins_them():
    """The server's requests ask for DELTA outputs (no per-step copy of the completion so far);
    collect() joins them into the full completion without touching the engine's objects."""
    from tercel.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from tercel.sampling_params import RequestOutputKind
    from tercel.server.app import _join_delta

    def delta(text, ids, lps, finish=None):
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, ids, finish, None, lps)],
                             finish is not None, RequestMetrics(0.0), delta_text=text, delta_token_ids=ids)

    first, second, last = (delta("He", [5], [{5: -0.1}]), delta("", [], []),
                           delta("llo", [6, 7], [{6: -1.0}, {7: -2.0}], "stop"))
    joined = None
    for d in (first, second, last):
        joined = _join_delta(joined, d)
    c = joined.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, joined.finished) == ("Hello", [5, 6, 7], "stop", True)
    assert c.logprobs == [{5: -0.1}, {6: -1.0}, {7: -2.0}]
    assert (first.outputs[0].token_ids == [5] and first.delta_token_ids == [5]
            and first.outputs[0].logprobs == [{5: -0.1}])
    no_lps = _join_delta(_join_delta(None, delta("a", [3], None)), delta("b", [4], None, "length"))
    assert no_lps.outputs[0].logprobs is None and no_lps.outputs[0].token_ids == [3, 4]

    from tercel.server.app import OpenAIServer
    from tercel.server.protocol import CompletionRequest

    params = OpenAIServer.sampling_params(SimpleNamespace(), CompletionRequest(model="m", prompt="x"), 8, None, None)
    assert params.output_kind == RequestOutputKind.DELTA


# ---- issue #25: flags, connection guard, fair admission -------------------------------------------

def test_serve_flags_are_validated_with_the_flag_and_the_fix(capsys, keep_sigterm):
    from tercel.server.cli import run_serve

    for flag, value in (("--header-timeout", "0"), ("--body-timeout", "-1"), ("--keep-alive-timeout", "x"),
                        ("--max-connections", "0"), ("--max-request-fanout", "0")):
        with pytest.raises(SystemExit):
            _serve_args(flag, value)
        assert f"argument {flag}" in capsys.readouterr().err
    args = _serve_args("--header-timeout", "1.5", "--max-connections", "100", "--max-request-fanout", "32")
    assert (args.header_timeout, args.body_timeout, args.keep_alive_timeout) == (1.5, 30.0, 5.0)
    assert (args.max_connections, args.max_request_fanout) == (100, 32)
    assert run_serve(_serve_args("--max-n", "16", "--max-request-fanout", "8")) == 2  # before any model loads
    err = capsys.readouterr().err
    assert "--max-request-fanout 8 is below --max-n 16" in err and "at least 16" in err


def test_max_connections_beyond_the_open_file_limit_is_a_clear_error(monkeypatch):
    from tercel.server import connections as c

    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(c.resource, "setrlimit", lambda what, limits: set_to.append(limits))
    monkeypatch.setattr(c.resource, "getrlimit", lambda what: (256, 4096))
    c.ensure_file_limit(1000)  # fits under the hard limit: the soft limit is raised
    assert set_to == [(1000 + c.FD_RESERVE, 4096)]
    with pytest.raises(ValueError) as e:
        c.ensure_file_limit(5000)
    msg = str(e.value)
    assert "--max-connections 5000" in msg and f"Lower --max-connections to {4096 - c.FD_RESERVE}" in msg
    assert "ulimit -n" in msg
    monkeypatch.setattr(c.resource, "getrlimit", lambda what: (256, 512))
    assert c.default_max_connections() == 512 - c.FD_RESERVE
    with pytest.raises(ValueError, match="header_timeout_s=0"):
        c.ConnectionLimits(header_timeout_s=0)


def test_rate_limited_log_writes_one_line_per_interval(caplog):
    import logging

    from tercel.server.connections import RateLimitedLog

    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("tercel.test"), logging.WARNING, 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tercel.test"):
        for i in range(1000):
            now[0] = i * 0.1  # 100 s of events, 10 a second
            rl("out of %s", "files")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["out of files", "out of files (and 599 more times in the last 60 s)"]


def test_accept_errors_are_logged_once_per_interval_other_loop_errors_unchanged(caplog):
    import asyncio
    import errno
    import logging

    from tercel.server.connections import ConnectionGuard, ConnectionLimits

    loop = asyncio.new_event_loop()
    seen: list[dict] = []
    loop.set_exception_handler(lambda loop, context: seen.append(context))
    try:
        ConnectionGuard(ConnectionLimits(log_interval_s=60.0)).install_accept_error_handler(loop)
        with caplog.at_level(logging.WARNING, logger="tercel.server.connections"):
            for _ in range(500):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
            loop.call_exception_handler({"message": "something else", "exception": RuntimeError("x")})
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "tercel.server.connections"]
    assert len(lines) == 1 and "Too many open files" in lines[0] and "--max-connections" in lines[0]
    assert [c["message"] for c in seen] == ["something else"]  # the previous handler still gets the rest


class _OneSlotEngine(_StubEngine):
    """One running request at a time; each step finishes it. Records the order of add_request."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=256)
        self.added: list[str] = []

    def add_request(self, prompt, params, request_id):
        super().add_request(prompt, params, request_id)
        self.added.append(request_id)
        self.scheduler.running.append(request_id)

    def step(self):
        import time

        from tercel.outputs import CompletionOutput, RequestMetrics, RequestOutput

        time.sleep(0.002)
        rid = self.scheduler.running.pop()
        self.requests.pop(rid, None)
        return [RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [5], "length", None, None)], True,
                              RequestMetrics(0.0), delta_text="x", delta_token_ids=[5])]


def test_engine_loop_admits_http_requests_round_robin():
    """A 12-request group and a 2-request group submitted together: the small one's requests reach
    the engine within the first few slots, not after the whole fan-out (FIFO would put them last)."""
    import asyncio

    from tercel.sampling_params import SamplingParams
    from tercel.server.engine_loop import AsyncEngine, EngineRequest

    engine = _OneSlotEngine()

    async def run() -> None:
        ae = AsyncEngine(engine, idle_wait_s=0.01)
        ae.start()
        big = [EngineRequest(f"big-{i}", [1, 2], SamplingParams(max_tokens=1)) for i in range(12)]
        small = [EngineRequest(f"small-{i}", [1, 2], SamplingParams(max_tokens=1)) for i in range(2)]
        groups = await asyncio.gather(ae.submit(big), ae.submit(small))
        for g, total in zip(groups, (12, 2)):
            for _ in range(total):
                idx, out = await asyncio.wait_for(g.queue.get(), 10)
                assert out.finished
        assert ae.num_waiting() == 0
        await ae.shutdown()

    asyncio.run(run())
    assert sorted(engine.added) == sorted([f"big-{i}" for i in range(12)] + ["small-0", "small-1"])
    positions = [engine.added.index(f"small-{i}") for i in range(2)]
    assert max(positions) <= 4, engine.added


class _RefusingEngine(_StubEngine):
    """add_request refuses a group's second request (the server validates first, so only a bug or an
    engine change could get here)."""

    def add_request(self, prompt, params, request_id):
        if request_id.endswith("-1"):
            raise ValueError("secret refusal")
        super().add_request(prompt, params, request_id)


def test_engine_refusing_part_of_a_group_fails_it_whole():
    engine = _RefusingEngine()
    with _client(engine) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error" and "secret" not in r.text
        assert engine.requests == {}  # the request added before the refusal was aborted
        assert c.get("/health").status_code == 200
        assert c.app.state.server.aengine.num_waiting() == 0
