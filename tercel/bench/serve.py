"""`tercel bench serve`: load on an OpenAI-compatible server (a `tercel serve`, or any other) at given request
rates, with Poisson arrivals and streamed chat completions; latency percentiles and throughput per rate."""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..sampling_options import CLI_TEMPERATURE
from .report import percentile

Messages = list[dict[str, str]]


@dataclass(slots=True, frozen=True)
class ServeConfig:
    base_url: str
    prompts: tuple[tuple[tuple[str, str], ...], ...]  # conversations as ((role, content), ...)
    request_rates: tuple[float, ...] = (1.0, 4.0, math.inf)
    num_prompts: int = 100  # requests sent per rate
    max_tokens: int = 128
    temperature: float = CLI_TEMPERATURE
    ignore_eos: bool = True
    model: str | None = None  # None: the first id of /v1/models
    api_key: str | None = None
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    ready_timeout_s: float = 0.0
    warmup_requests: int = 1


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks after the first
    output_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class RateResult:
    request_rate: float
    num_requests: int
    completed: int
    errors: int
    duration_s: float
    request_throughput: float
    output_tok_s: float
    output_tokens: int
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]  # (E2E - TTFT) / (output tokens - 1), per request
    e2e_ms: dict[str, float | None]
    error_samples: list[str] = field(default_factory=list)


def load_prompts(path: Path) -> list[Messages]:
    """.txt: one user message per non-empty line; .jsonl: per line a string, {"messages": [...]}, or
    {"prompt" | "text" | "content": "..."}."""
    if not path.is_file():
        raise ValueError(f"--prompts {path}: no such file; give a .jsonl or .txt file.")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix != ".jsonl":
        convs = [[{"role": "user", "content": ln}] for ln in lines]
    else:
        convs = []
        for i, ln in enumerate(lines, 1):
            try:
                convs.append(_conversation(json.loads(ln)))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"--prompts {path} line {i}: {e}; each line must be a JSON string, "
                                 f"{{\"messages\": [...]}} or {{\"prompt\": \"...\"}}.") from None
    if not convs:
        raise ValueError(f"--prompts {path} holds no prompts; put one per line.")
    return convs


def _conversation(item: object) -> Messages:
    if isinstance(item, str):
        return [{"role": "user", "content": item}]
    if isinstance(item, dict):
        if "messages" in item:
            msgs = item["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in msgs):
                raise ValueError("'messages' is not a list of {role, content}")
            return [{"role": str(m["role"]), "content": str(m["content"])} for m in msgs]
        for key in ("prompt", "text", "content"):
            if isinstance(item.get(key), str):
                return [{"role": "user", "content": item[key]}]
    raise ValueError(f"unrecognised entry {str(item)[:60]!r}")


def held_out_conversations() -> list[Messages]:
    from ..train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    return [[{"role": "user", "content": t}] for t in EVAL_CHAT_PROMPTS + EVAL_CODE_PROMPTS]


def freeze(convs: list[Messages]) -> tuple[tuple[tuple[str, str], ...], ...]:
    return tuple(tuple((m["role"], m["content"]) for m in c) for c in convs)


# ---- one request --------------------------------------------------------------------------------------------
async def stream_chat(client, url: str, payload: dict, headers: dict[str, str]) -> RequestResult:
    """One streamed chat completion: the first content chunk's time, gaps between later ones, the usage."""
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {body[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    res.error = f"stream error: {str(msg['error'])[:200]}"
                    return res
                if msg.get("usage"):
                    res.output_tokens = int(msg["usage"].get("completion_tokens") or 0)
                for choice in msg.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last)
                        last = now
                        chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a counted error, not the end of the run
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e_s = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks  # servers without usage: one token per chunk
    res.ok = res.ttft_s is not None
    if not res.ok:
        res.error = "no content in the stream"
    return res


# ---- one rate -----------------------------------------------------------------------------------------------
def _payload(cfg: ServeConfig, model: str, conv) -> dict:
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in conv], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature, **({"ignore_eos": True} if cfg.ignore_eos else {})}


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values]
    out = {f"p{q}": percentile(ms, q) for q in (50, 90, 99)}
    out["mean"] = sum(ms) / len(ms) if ms else None
    return {k: (round(v, 3) if v is not None else None) for k, v in out.items()}


async def run_rate(client, cfg: ServeConfig, model: str, rate: float, rng: random.Random) -> RateResult:
    url = cfg.base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async def one(conv) -> RequestResult:
        if gate is None:
            return await stream_chat(client, url, _payload(cfg, model, conv), headers)
        async with gate:
            return await stream_chat(client, url, _payload(cfg, model, conv), headers)

    tasks = []
    start = time.perf_counter()
    for i in range(cfg.num_prompts):
        if i and not math.isinf(rate):
            await asyncio.sleep(rng.expovariate(rate))  # Poisson process: exponential gaps
        tasks.append(asyncio.create_task(one(cfg.prompts[i % len(cfg.prompts)])))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    return RateResult(
        request_rate=rate, num_requests=len(results), completed=len(good), errors=len(results) - len(good),
        duration_s=round(duration, 3), request_throughput=round(len(good) / duration, 3),
        output_tok_s=round(out_tokens / duration, 2), output_tokens=out_tokens,
        ttft_ms=_stats_ms([r.ttft_s for r in good]), itl_ms=_stats_ms([g for r in good for g in r.itl_s]),
        tpot_ms=_stats_ms(tpot), e2e_ms=_stats_ms([r.e2e_s for r in good]),
        error_samples=sorted({r.error for r in results if r.error})[:5])


async def wait_ready(client, cfg: ServeConfig) -> None:
    """Poll /health (then /v1/models) until the server answers, up to ready_timeout_s."""
    deadline = time.monotonic() + cfg.ready_timeout_s
    base = cfg.base_url.rstrip("/")
    while True:
        for route in ("/health", "/v1/models"):
            try:
                if (await client.get(base + route, timeout=5.0)).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
        if time.monotonic() >= deadline:
            raise ConnectionError(f"--base-url {cfg.base_url}: no server answered /health or /v1/models"
                                  + (f" within {cfg.ready_timeout_s:g} s" if cfg.ready_timeout_s else "")
                                  + "; start one (tercel serve) or raise --ready-timeout.")
        await asyncio.sleep(0.5)


async def served_model(client, cfg: ServeConfig) -> str:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    r = await client.get(cfg.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ConnectionError(f"--base-url {cfg.base_url}: /v1/models lists no model; pass --model NAME.")
    return str(data[0]["id"])


async def run_serve_bench(cfg: ServeConfig, on_rate=None) -> tuple[str, list[RateResult]]:
    import httpx

    # straight to the server: a proxy from the environment would add its own latency
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=httpx.Timeout(cfg.timeout_s)) as client:
        await wait_ready(client, cfg)
        model = cfg.model or await served_model(client, cfg)
        url = cfg.base_url.rstrip("/") + "/v1/chat/completions"
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        for i in range(cfg.warmup_requests):  # first-request costs (compiles, allocations) stay out of the rates
            warm = await stream_chat(client, url, _payload(cfg, model, cfg.prompts[i % len(cfg.prompts)]), headers)
            if not warm.ok:
                raise ConnectionError(f"the warm-up request to {url} failed: {warm.error}")
        rng = random.Random(cfg.seed)
        results = []
        for rate in cfg.request_rates:
            results.append(await run_rate(client, cfg, model, rate, rng))
            if on_rate is not None:
                on_rate(results[-1])
        return model, results
