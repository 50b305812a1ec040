"""The load cache: the first start with a GGUF keeps its metadata, tokenizer and CPU-prepared weights; a
later start reads them back without parsing the file, converting the tokenizer or packing any weight,
and runs the same model (identical logits); a changed file gets a new entry; --no-load-cache (load_cache=
False) reads and writes nothing."""
from __future__ import annotations

import os

import pytest
import torch
import transformers
from conftest import last_logits
from gguf_utils import tiny_q4_gguf

from tercel import LLM
from tercel.loader import cache, gguf_file, model_loader
from tercel.models import cpu_linear
from tercel.models.cpu_linear import PackedInt4
from tercel.models.cpu_q8 import PackedQ4Q8

pytestmark = pytest.mark.skipif(not cpu_linear.cpu_packing_available(),
                                reason="this torch build lacks oneDNN / int4 CPU matmul")
transformers.logging.set_verbosity_error()
PROMPT = [3, 17, 200, 45, 9]
KW = dict(dtype="bfloat16", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64)


@pytest.fixture
def tiny_q4(tmp_path, monkeypatch):
    """A tiny Q4_1 Llama GGUF and an empty cache of its own."""
    monkeypatch.setenv("TERCEL_CACHE_DIR", str(tmp_path / "cache"))
    return tiny_q4_gguf(tmp_path)


def _forbid(monkeypatch, *names: str) -> None:
    def fail(*a, **k):
        raise AssertionError("a cached start prepared the checkpoint again")

    for name in names:
        module, attr = name.rsplit(".", 1)
        monkeypatch.setattr({"gguf_file": gguf_file, "cpu_linear": cpu_linear}[module], attr, fail)


def test_a_cached_start_reads_nothing_from_the_gguf_and_runs_the_same_model(tiny_q4, monkeypatch):
    first = LLM(str(tiny_q4), **KW)
    want = last_logits(first, PROMPT)
    entry = cache.entry_dir(tiny_q4)
    assert (entry / "metadata.json").is_file() and list(entry.glob("prepared-bfloat16-q4*-*.pt"))
    # a later start: no GGUF header parse, no tensor read, no int4 packing
    _forbid(monkeypatch, "gguf_file.open_reader", "gguf_file.iter_gguf_tensors", "gguf_file.iter_q4_weights")
    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None, raising=False)
    second = LLM(str(tiny_q4), **KW)
    assert second.engine.dtype == torch.bfloat16 and second.engine.dtype_note == first.engine.dtype_note
    assert isinstance(second.engine.model.layers[0].mlp.down_proj.gemv, (PackedQ4Q8, PackedInt4))
    assert torch.equal(last_logits(second, PROMPT), want)


def test_a_changed_file_gets_a_new_entry(tiny_q4):
    LLM(str(tiny_q4), **KW)
    old = cache.entry_dir(tiny_q4)
    st = tiny_q4.stat()
    os.utime(tiny_q4, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache.entry_dir(tiny_q4) != old
    ckpt = model_loader.read_checkpoint(tiny_q4)
    assert ckpt._reader is not None  # parsed again, not read from the old entry


def test_no_load_cache_writes_nothing(tiny_q4):
    LLM(str(tiny_q4), load_cache=False, **KW)
    assert not cache.cache_root().exists()


def test_a_damaged_prepared_file_is_prepared_again(tiny_q4):
    want = last_logits(LLM(str(tiny_q4), **KW), PROMPT)
    (prepared,) = cache.entry_dir(tiny_q4).glob("prepared-*.pt")
    prepared.write_bytes(b"not a torch file")
    assert torch.equal(last_logits(LLM(str(tiny_q4), **KW), PROMPT), want)
    assert prepared.stat().st_size > 1000  # rewritten


def test_a_prepared_file_with_a_kind_this_version_does_not_know_is_prepared_again(tiny_q4):
    want = last_logits(LLM(str(tiny_q4), **KW), PROMPT)
    (prepared,) = cache.entry_dir(tiny_q4).glob("prepared-*.pt")
    state = torch.load(prepared, weights_only=True)
    key = next(iter(state["linears"]))
    state["linears"][key] = ("from_the_future", state["linears"][key][1])
    torch.save(state, prepared)
    assert torch.equal(last_logits(LLM(str(tiny_q4), **KW), PROMPT), want)
    assert torch.load(prepared, weights_only=True)["linears"][key][0] != "from_the_future"  # rewritten


@pytest.mark.slow
def test_the_cached_tokenizer_equals_the_converted_one(smol_path, tmp_path, monkeypatch):
    from tercel.loader.tokenizer import load_tokenizer

    monkeypatch.setenv("TERCEL_CACHE_DIR", str(tmp_path))
    path = model_loader.resolve_model_path(smol_path)
    entry = cache.entry_dir(path)
    converted = load_tokenizer(path, True, entry)
    assert (entry / "tokenizer" / "tokenizer.json").is_file()
    cached = load_tokenizer(path, True, entry)
    messages = [{"role": "user", "content": "Write a haiku about speculative decoding."}]
    assert cached.apply_chat_template(messages) == converted.apply_chat_template(messages)
    for text in ["Hello world", " leading space", "def f(x):\n    return x  # ok", "ünïcödé 日本語 🙂"]:
        assert cached.encode(text) == converted.encode(text)
        assert cached.decode(cached.encode(text)) == converted.decode(converted.encode(text))
    assert (cached.eos_token_id, cached.vocab_size) == (converted.eos_token_id, converted.vocab_size)
