"""An LLM gives back what it holds when it is shut down, leaves a `with` block, or is deleted: notebook and test
users build several engines in one process (vLLM issues #1908, #6544, #21073: `del llm`, then a second LLM
runs out of memory).

Each test builds and drops an SmolLM2 LLM with the bundled EAGLE-3 head three times, each time another way
(`del llm`, `with LLM(...)`, `llm.shutdown()`), and checks that the engine, the target, the draft and the
KV pool are garbage afterwards; on the CPU that no thread or open file is left behind, on the GPU that the
memory in use returns to the baseline.
"""
from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest
import torch
from conftest import smollm2_gguf_or_skip

from tercel import LLM, SamplingParams
from tercel.speculative import DEFAULT_EAGLE3_DRAFT

WAYS = ("del", "with", "shutdown")


def _build(path: str, device: str) -> LLM:
    return LLM(path, device=device, speculative_algorithm="EAGLE3",
               speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT), max_model_len=256, num_kv_blocks=64,
               max_num_seqs=4, progress=False)


def _parts(llm: LLM) -> dict[str, weakref.ref]:
    e = llm.engine
    assert e.spec is not None and e.spec_config.algorithm == "EAGLE3"
    return {"engine": weakref.ref(e), "target": weakref.ref(e.model), "draft": weakref.ref(e.spec.drafter.model),
            "worker": weakref.ref(e.spec), "kv": weakref.ref(e.kv)}


def _use(llm: LLM) -> None:
    out = llm.generate(["The capital of France is", "def fib(n):"], SamplingParams(max_tokens=12, temperature=0,
                                                                                    ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    assert llm.engine.spec_stats().verify_steps > 0  # the draft ran


def _life(path: str, device: str, way: str, use=_use) -> dict[str, weakref.ref]:
    """Build, use and drop one LLM `way`; the weak references to its parts."""
    if way == "with":
        with _build(path, device) as llm:
            use(llm)
            parts = _parts(llm)
        # the block's end gave everything back though `llm` is still bound
        assert {k for k, r in parts.items() if r() is not None} <= {"engine"}, "shut down but still held"
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate("again", SamplingParams(max_tokens=2))
        del llm
        return parts
    llm = _build(path, device)
    use(llm)
    parts = _parts(llm)
    if way == "shutdown":
        llm.shutdown()
        llm.shutdown()  # idempotent
        assert {k for k, r in parts.items() if r() is not None} <= {"engine"}, "shut down but still held"
    del llm
    return parts


def _alive(parts: dict[str, weakref.ref]) -> list[str]:
    return [k for k, r in parts.items() if r() is not None]


def _open_files() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the directory's own descriptor, closed by now
            pass
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_an_eagle3_llm_built_and_dropped_three_times_leaves_nothing_behind(smol_path):
    threads0 = {t.ident for t in threading.enumerate()}
    files0 = _open_files()
    for i, way in enumerate(WAYS):
        parts = _life(smol_path, "cpu", way)
        # `del` alone frees the engine: nothing outside it refers back to it (no gc pass needed)
        assert not _alive(parts), f"{way}: still referenced after del: {_alive(parts)}"
        gc.collect()
        assert not _alive(parts)
        new_threads = [t.name for t in threading.enumerate() if t.ident not in threads0]
        # tqdm starts one monitor thread per process with the first bar it draws; nothing else may stay
        assert all(n == "tqdm_monitor" for n in new_threads), f"{way}: threads left: {new_threads}"
        new_files = {f for f in _open_files() - files0 if not f.startswith(("pipe:", "anon_inode:", "socket:"))}
        assert not new_files, f"{way}: files left open: {new_files}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_returns_to_the_baseline_each_time():
    """memory_allocated after each drop is within 5% of the engine's own footprint of the baseline (the
    baseline is about 0 in a fresh process, so 5% of the baseline alone would mean 'exactly'); the cached
    blocks go back to the driver too (memory_reserved)."""
    path = smollm2_gguf_or_skip()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for way in WAYS:
        held: list[int] = []
        parts = _life_measured(path, way, held)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert not _alive(parts), f"{way}: still referenced: {_alive(parts)}"
        footprint = held[0] - base
        assert footprint > 0
        now = torch.cuda.memory_allocated()
        assert abs(now - base) <= 0.05 * footprint, (
            f"{way}: {now / 2**20:.1f} MiB allocated after the drop against {base / 2**20:.1f} MiB before "
            f"(the engine held {footprint / 2**20:.1f} MiB)")
        assert torch.cuda.memory_reserved() - base_reserved <= 0.05 * footprint + 2 * 2**20


def _life_measured(path: str, way: str, held: list[int]) -> dict[str, weakref.ref]:
    """_life on the GPU, recording the memory in use while the engine is alive."""
    def use_and_measure(llm: LLM) -> None:
        _use(llm)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())

    return _life(path, "cuda", way, use_and_measure)
