"""Helpers for the server tests: run a real `python -m tercel.server` process on 127.0.0.1 with a free
port, clients that never use a proxy, a shared offline LLM for reference outputs, /metrics parsing.

Only loopback is ever contacted; every wait is bounded.
"""
from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 40.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tercel.server ARGS --host 127.0.0.1 --port P`, output to a log file."""

    def __init__(self, *args: str, api_key: str | None = None, open_files: int | None = None) -> None:
        self.open_files = open_files  # RLIMIT_NOFILE (soft and hard) of the server process, if given
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.api_key = api_key
        # fp32 unless a test asks otherwise: the server's outputs are compared with the offline fp32 reference
        # (dtype auto would pick bf16 on a CPU with a fast bf16 path)
        pinned = [] if "--dtype" in args else ["--dtype", "float32"]
        self.args = list(args) + pinned + (["--api-key", api_key] if api_key else [])
        self.log_path = Path(tempfile.mkstemp(prefix="tercel-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        env.pop("TERCEL_API_KEY", None)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tercel.server", *self.args, "--host", HOST, "--port", str(self.port)],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=self._limit_open_files)
        return self

    def _limit_open_files(self) -> None:
        if self.open_files is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        with http_client(timeout=2.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if c.get(self.base_url + "/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then wait; returns the exit code (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                self._log.close()
                return None
        self._log.close()
        return self.proc.returncode

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=120.0, http_client=http_client(timeout=120.0), **kw)

    def async_openai(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                                  timeout=120.0, http_client=async_http_client(timeout=120.0), **kw)

    def metrics(self) -> dict[str, float]:
        with http_client(timeout=10.0) as c:
            r = c.get(self.base_url + "/metrics", headers=self.headers())
            r.raise_for_status()
            return parse_metrics(r.text)

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and every KV block is free; returns the last sample."""
        deadline = time.monotonic() + timeout_s
        m: dict[str, float] = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if (m["tercel_num_requests_running"] == 0 and m["tercel_num_requests_waiting"] == 0
                    and m["tercel_kv_blocks_used"] == 0):
                return m
            time.sleep(0.2)
        raise AssertionError(f"server not idle after {timeout_s} s: {m}")

    def health_ok(self) -> bool:
        with http_client(timeout=10.0) as c:
            return c.get(self.base_url + "/health").status_code == 200


def http_client(**kw) -> httpx.Client:
    return httpx.Client(trust_env=False, **kw)  # never a proxy: loopback only


def async_http_client(**kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, **kw)


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value (labels kept verbatim, so unlabelled gauges are just their name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


@functools.cache
def offline_llm():
    """The reference: the offline LLM on the default model (loaded once per pytest session)."""
    import torch

    from tercel import LLM

    # One intra-op thread: the test process shares the (small) machine with the server process, and
    # two processes each spinning two OpenMP threads on two cores slow both down many times over.
    torch.set_num_threads(1)
    return LLM(dtype="float32", progress=False)  # the exact reference; the server runs fp32 too


TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.cache
def tiny_model_dir() -> Path:
    """A seeded random 2-layer Llama (hidden 64) with a 300-token byte-level BPE tokenizer and a chat
    template, as an HF directory: a server on it starts in seconds (no real weights to load)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(tempfile.mkdtemp(prefix="tercel-tiny-model-"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["The capital of France is Paris. Once upon a time there was a hash table."], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                bos_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(root)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    return root


def tiny_server_args(*args: str) -> tuple[str, ...]:
    """Arguments for a server on the tiny model with a small KV cache (allocating 1 GiB takes seconds)."""
    return (str(tiny_model_dir()), "--kv-cache-memory", "16MiB", *args)


def running_server(*args: str, api_key: str | None = None, with_reference: bool = True,
                   open_files: int | None = None):
    """Body of a module-scoped server fixture (`yield from running_server(...)`): start the server,
    load the offline reference meanwhile, yield once ready; stop it afterwards and demand a clean
    exit (code 0 after SIGTERM)."""
    srv = ServerProcess(*args, api_key=api_key, open_files=open_files).start()
    try:
        if with_reference:
            offline_llm()  # load the reference model while the server loads
        srv.wait_ready()
        yield srv
    finally:
        rc = srv.stop()
    assert rc == 0, f"server exit code {rc} after SIGTERM:\n{srv.log_tail()}"


_offline_cache: dict[str, object] = {}


def offline(prompt, chat: bool = False, **params):
    """The offline output (CompletionOutput) for one prompt or conversation; greedy unless told."""
    from tercel import SamplingParams

    params.setdefault("temperature", 0.0)
    key = repr((prompt, chat, sorted(params.items())))
    if key not in _offline_cache:
        sp = SamplingParams(**params)
        llm = offline_llm()
        out = llm.chat(prompt, sp) if chat else llm.generate(prompt, sp)
        _offline_cache[key] = out[0].outputs[0]
    return _offline_cache[key]
