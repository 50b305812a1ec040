"""Multi-step decode (num_scheduler_steps = N) gives exactly the outputs of one step per sync:
the same tokens, finish reasons, text and stream deltas, with requests of mixed lengths, finishing
inside a window (max_tokens not a multiple of N, EOS, stop ids, stop strings), arriving while others
decode, aborted, or preempted by a tiny KV pool; seeded sampling included; batches that need host
data per step (penalties, logprobs, pending min_tokens) fall back to single steps; the CUDA-graph
runner path (driven on CPU) replays the decode graph once per forward with device-fed, padded input
ids."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from graph_utils import tiny_model

from tercel import LLM, SamplingParams
from tercel.config import ConfigError
from tercel.engine import LLMEngine
from tercel.loader.model_loader import LoadedModel

N = 4
EOS = 7
# (num_scheduler_steps, overlap schedule): windows read back at once; windows left in flight while the
# next one is launched; the overlap schedule's single-forward windows (its GPU default)
MODES = pytest.mark.parametrize("steps,overlap", [(N, False), (N, True), (1, True)],
                                ids=["multistep", "multistep-overlap", "overlap"])


@pytest.fixture(scope="module")
def tiny_loaded() -> LoadedModel:
    model, cfg = tiny_model()
    return LoadedModel(model, cfg, None, Path("tiny-random"), (EOS,))


def tiny_engine(loaded: LoadedModel, steps: int, overlap: bool = False, **kw) -> LLMEngine:
    kw = {"max_model_len": 128, "num_kv_blocks": 64, "block_size": 4, **kw}
    return LLMEngine(loaded=loaded, dtype="float32", device="cpu", num_scheduler_steps=steps,
                     disable_overlap_schedule=not overlap, **kw)


def count_windows(engine: LLMEngine) -> list[int]:
    """Record the size of every decode window the engine launches."""
    sizes: list[int] = []
    real = engine._launch_window

    def wrapped(reqs, num_steps, *args, **kw):
        sizes.append(num_steps)
        return real(reqs, num_steps, *args, **kw)

    engine._launch_window = wrapped
    return sizes


def record_preemptions(engine: LLMEngine) -> list[int]:
    """Record each output's request preemption count."""
    counts: list[int] = []
    real = engine.sink.make_output
    engine.sink.make_output = lambda r: (counts.append(r.metrics.num_preemptions), real(r))[1]
    return counts


def run(engine: LLMEngine, prompts, params, arrivals: dict[int, list] | None = None, aborts=None):
    """Step to the end. arrivals: step index -> [(prompt, params)] added before that step; aborts: step
    index -> prompt indices to abort. Returns per request (token ids, finish reason, stop reason, text,
    streamed token ids, streamed text)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streamed = {i: ([], []) for i in ids}
    final = {}
    step = 0
    while engine.has_unfinished_requests() or (arrivals and any(k >= step for k in arrivals)):
        for p, sp in (arrivals or {}).get(step, []):
            rid = engine.add_request(p, sp)
            ids.append(rid)
            streamed[rid] = ([], [])
        for i in (aborts or {}).get(step, []):
            engine.abort_request(ids[i])
        for out in engine.step():
            streamed[out.request_id][0].extend(out.delta_token_ids)
            streamed[out.request_id][1].append(out.delta_text)
            if out.finished:
                c = out.outputs[0]
                final[out.request_id] = (c.token_ids, c.finish_reason, c.stop_reason, c.text)
        step += 1
    return [final.get(i, (None,)) + (streamed[i][0], "".join(streamed[i][1])) for i in ids]


def tiny_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 256, (2 + 3 * i % 11,), generator=g).tolist() for i in range(n)]


# ---- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", None])
def test_bad_num_scheduler_steps_is_a_clear_error(tiny_loaded, bad):
    with pytest.raises(ConfigError, match=rf"num_scheduler_steps={bad!r} must be an integer >= 1"):
        tiny_engine(tiny_loaded, bad)


def test_cli_flag_reaches_the_engine():
    from tercel.cli import build_parser
    from tercel.cli_args import engine_kwargs
    from tercel.server.cli import add_serve_arguments

    args = build_parser().parse_args(["generate", "--num-scheduler-steps", "8"])
    assert engine_kwargs(args)["num_scheduler_steps"] == 8
    assert engine_kwargs(args)["disable_overlap_schedule"] is None  # the engine's default: on a GPU only
    args = build_parser().parse_args(["generate", "--disable-overlap-schedule"])
    assert engine_kwargs(args)["disable_overlap_schedule"] is True
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["--num-scheduler-steps", "6"]).num_scheduler_steps == 6
    assert p.parse_args(["--disable-overlap-schedule"]).disable_overlap_schedule is True


# ---- tiny random model -----------------------------------------------------------------------

@MODES
def test_tiny_mixed_batch_equals_single_step(tiny_loaded, steps, overlap):
    prompts = tiny_prompts(7)
    # max_tokens not multiples of N; every request may hit EOS (id 7) or its stop id inside a window
    params = [SamplingParams(max_tokens=3 + 5 * i, temperature=0, stop_token_ids=[40 + i]) for i in range(7)]
    want = run(tiny_engine(tiny_loaded, 1), prompts, params)
    ms = tiny_engine(tiny_loaded, steps, overlap)
    windows = count_windows(ms)
    got = run(ms, prompts, params)
    assert got == want
    assert windows and max(windows) == steps and (steps == 1 or min(windows) < steps)  # full and shortened
    assert {w[1] for w in want} >= {"length", "stop"}  # some requests stopped early, inside windows
    assert ms.stats().kv_blocks_used == 0
    for tokens, *_, streamed, _ in got:
        assert streamed == tokens  # stream deltas add up to the output


@MODES
def test_tiny_windows_never_pass_max_model_len(tiny_loaded, steps, overlap):
    prompts = tiny_prompts(3, seed=3)
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    want = run(tiny_engine(tiny_loaded, 1, max_model_len=40), prompts, params)
    got = run(tiny_engine(tiny_loaded, steps, overlap, max_model_len=40), prompts, params)
    assert got == want and all(len(p) + len(w[0]) == 40 and w[1] == "length" for p, w in zip(prompts, want))


@MODES
def test_tiny_arrivals_and_aborts_between_windows(tiny_loaded, steps, overlap):
    prompts = tiny_prompts(4, seed=1)
    late = tiny_prompts(3, seed=2)
    params = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
    arrivals = {3: [(late[0], params)], 4: [(late[1], params), (late[2], params)]}
    aborts = {5: [1]}
    want = run(tiny_engine(tiny_loaded, 1), prompts, params, arrivals, aborts)
    ms = tiny_engine(tiny_loaded, steps, overlap)
    got = run(ms, prompts, params, arrivals, aborts)
    # the abort lands after a window in a windowed run (more or fewer tokens done), so request 1 differs in
    # length only; every other request (arrivals included) gives the same tokens
    assert [g for i, g in enumerate(got) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    aborted_ids = got[1][1]  # (no final output, streamed ids, streamed text)
    whole = run(tiny_engine(tiny_loaded, 1), [prompts[1]], params)[0][0]
    assert got[1][0] is None and 0 < len(aborted_ids) < len(whole) and aborted_ids == whole[:len(aborted_ids)]
    alone = [run(tiny_engine(tiny_loaded, 1), [p], params)[0] for p in late]
    assert got[4:] == alone  # arrivals waited for the window, then decoded as if alone
    assert ms.stats().kv_blocks_used == 0


@MODES
def test_tiny_kv_pool_too_small_for_windows(tiny_loaded, steps, overlap):
    """A pool that cannot hold every window: windows fall back or preempt; nothing crashes or is lost."""
    prompts = tiny_prompts(6, seed=4)
    params = SamplingParams(max_tokens=22, temperature=0, ignore_eos=True)
    want = [run(tiny_engine(tiny_loaded, 1), [p], params)[0][:2] for p in prompts]
    ms = tiny_engine(tiny_loaded, steps, overlap, num_kv_blocks=12, max_model_len=40)  # 44 slots, 6 requests
    windows = count_windows(ms)
    preempted = record_preemptions(ms)
    got = run(ms, prompts, params)
    assert [g[:2] for g in got] == want
    assert windows and max(preempted) > 0 and ms.stats().kv_blocks_used == 0


@MODES
def test_seeded_sampling_in_windows_equals_single_step(tiny_loaded, steps, overlap):
    """Sampled requests draw their noise from their own generator in the same order either way."""
    prompts = tiny_prompts(5, seed=7)
    params = [SamplingParams(max_tokens=11 + 2 * i, temperature=0.9, top_p=0.9, seed=i) for i in range(3)] + [
        SamplingParams(max_tokens=13, temperature=1.3, top_k=20, min_p=0.01, seed=9),
        SamplingParams(max_tokens=10, temperature=0)]
    want = run(tiny_engine(tiny_loaded, 1), prompts, params)
    ms = tiny_engine(tiny_loaded, steps, overlap)
    windows = count_windows(ms)
    assert run(ms, prompts, params) == want
    assert windows and max(windows) == steps


@MODES
def test_sampled_windows_draw_inside_the_decode_graph(tiny_loaded, steps, overlap):
    """With decode graphs (breakable-debug on CPU), a window's sampled rows decode and draw in one replay of the
    sampled decode step (graphs/sampled_decode.py): the single-step engine's tokens, greedy rows of a mixed batch
    by argmax, a variant per filter set (top-p / top-k, or none), padded buckets (3 live -> 4)."""
    from tercel.executor import sampled_decode_key

    prompts = tiny_prompts(3, seed=11)
    mixes = {(True, True): [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1),
                            SamplingParams(max_tokens=12, temperature=0),
                            SamplingParams(max_tokens=12, temperature=1.3, top_k=20, min_p=0.01, seed=2)],
             (False, False): [SamplingParams(max_tokens=12, temperature=1.1, seed=i) for i in range(3)]}
    for (filtered, mixed), params in mixes.items():
        want = run(tiny_engine(tiny_loaded, 1), prompts, params)
        ms = tiny_engine(tiny_loaded, steps, overlap, cuda_graph_backend="breakable-debug", cuda_graph_bs=[1, 2, 4])
        windows = count_windows(ms)
        assert run(ms, prompts, params) == want, (filtered, mixed)
        runner = ms.executor.runner(sampled_decode_key(filtered, mixed))
        assert windows and runner is not None and runner.stats.replays >= sum(windows) // 2
        assert set(runner.graphs) <= {1, 2, 4} and 4 in runner.graphs


@MODES
def test_penalties_logprobs_and_min_tokens_take_single_steps(tiny_loaded, steps, overlap):
    prompts = tiny_prompts(4, seed=5)
    for special in (SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.3),
                    SamplingParams(max_tokens=9, temperature=0.7, frequency_penalty=0.5, seed=1),
                    SamplingParams(max_tokens=9, temperature=0, logprobs=2),
                    SamplingParams(max_tokens=9, temperature=0, min_tokens=30)):
        params = [SamplingParams(max_tokens=9, temperature=0)] * 3 + [special]
        want = run(tiny_engine(tiny_loaded, 1), prompts, params)
        ms = tiny_engine(tiny_loaded, steps, overlap)
        windows = count_windows(ms)
        assert run(ms, prompts, params) == want
        assert windows == []  # the special request is in every decode batch until it finishes last
    # once the special one has finished, the rest run windows
    params = [SamplingParams(max_tokens=20, temperature=0)] * 3 + [SamplingParams(max_tokens=3, logprobs=1)]
    ms = tiny_engine(tiny_loaded, steps, overlap)
    windows = count_windows(ms)
    assert run(ms, prompts, params) == run(tiny_engine(tiny_loaded, 1), prompts, params)
    assert windows


@MODES
def test_graph_runner_replays_once_per_forward_with_padded_buckets(tiny_loaded, steps, overlap):
    """The GPU path, on CPU: the decode graph runner (breakable-debug: the forward re-runs eagerly over
    the static buffers) serves every forward of a window; input ids come from the previous forward's
    argmax on the device and are staged into padded buckets (3 and 5 live requests -> buckets 4 and 8)."""
    from tercel.graphs import GraphConfig
    from tercel.graphs.steps import decode_graph_runner

    prompts = tiny_prompts(5, seed=6)
    params = [SamplingParams(max_tokens=6 + 4 * i, temperature=0, ignore_eos=True) for i in range(5)]
    want = run(tiny_engine(tiny_loaded, 1), prompts, params)
    ms = tiny_engine(tiny_loaded, steps, overlap)
    ms.graph_runner = decode_graph_runner(ms.model, ms.kv, ms.config.max_model_len,
                                          GraphConfig(batch_sizes=(1, 2, 4, 8), backend="breakable-debug"))
    windows = count_windows(ms)
    batch_sizes: list[int] = []
    real_build = ms._build_window
    ms._build_window = lambda reqs, *a: (batch_sizes.append(len(reqs)), real_build(reqs, *a))[1]
    assert run(ms, prompts, params) == want
    stats = ms.graph_runner.stats
    # every forward of every window replayed (the rest: single decode steps); only the prefill ran eagerly
    assert sum(windows) <= stats.replays and stats.eager == 1
    assert {3, 5} <= set(batch_sizes)  # windows ran padded (buckets 4 and 8)


# ---- overlap schedule -------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, "yes", 1.0])
def test_bad_disable_overlap_schedule_is_a_clear_error(tiny_loaded, bad):
    with pytest.raises(ConfigError, match=rf"disable_overlap_schedule={bad!r} must be True, False or None"):
        LLMEngine(loaded=tiny_loaded, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
                  max_model_len=128, disable_overlap_schedule=bad)


def test_overlap_is_a_gpu_default(tiny_loaded):
    cpu = LLMEngine(loaded=tiny_loaded, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
                    max_model_len=128)
    assert not cpu.overlap_schedule  # the CPU forward runs on the host: nothing to overlap with
    assert tiny_engine(tiny_loaded, 1, overlap=True).overlap_schedule


def test_overlap_launches_the_next_window_before_reading_the_last(tiny_loaded):
    """The point of the overlap: each step launches window k+1 (fed window k's tokens on the device)
    and only then reads window k back; requests stop on time, none of the extra work shows."""
    ms = tiny_engine(tiny_loaded, 1, overlap=True)
    events: list[str] = []
    launch, collect = ms._launch_window, ms._collect_window
    ms._launch_window = lambda *a, **k: (events.append("launch"), launch(*a, **k))[1]
    ms._collect_window = lambda w: (events.append("collect"), collect(w))[1]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = tiny_prompts(2, seed=8)
    got = run(ms, prompts, params)
    assert got == run(tiny_engine(tiny_loaded, 1), prompts, params)
    # prefill (normal step), then 5 one-forward windows: each launched one step before it is read
    assert events == ["launch"] + ["launch", "collect"] * 4 + ["collect"]
    assert ms._inflight is None and ms.stats().kv_blocks_used == 0


def test_overlap_window_of_stopped_requests_is_dropped_and_new_work_runs(tiny_loaded):
    """Requests that all stop (EOS) inside the in-flight window leave a wasted window behind; the next
    step drops it and serves a new arrival in the same step."""
    prompts = tiny_prompts(8, seed=9)
    params = SamplingParams(max_tokens=40, temperature=0)
    ref = [run(tiny_engine(tiny_loaded, 1), [p], params)[0] for p in prompts]
    stopping = [i for i, r in enumerate(ref) if r[1] == "stop"]
    assert stopping, "some prompt must hit EOS for this test"
    ms = tiny_engine(tiny_loaded, 1, overlap=True)
    first = run(ms, [prompts[stopping[0]]], params)[0]
    assert first == ref[stopping[0]] and ms._inflight is not None  # the wasted window is still there
    rid = ms.add_request(prompts[0], params)
    assert [o.request_id for o in ms.step()] == [rid]  # the dropped window's step ran its prefill
    while ms.has_unfinished_requests():
        ms.step()
    assert ms.stats().kv_blocks_used == 0


# ---- SmolLM2 (the default model), with its tokenizer ------------------------------------------

@pytest.fixture(scope="module")
def smol_prompts(smol_chat_ids, smol_llm):
    tok = smol_llm.tokenizer
    extra = ["Once upon a time", "def fibonacci(n):", "The three primary colors are", "A list of fruits: apple,"]
    return smol_chat_ids[:4] + [tok.encode(e) for e in extra]


def smol_engine(smol_llm, steps: int, **kw) -> LLMEngine:
    kw = {"max_model_len": 256, **kw}
    return LLMEngine(loaded=smol_llm.engine.loaded, dtype="float32", device="cpu", num_scheduler_steps=steps, **kw)


@pytest.mark.parametrize("overlap", [False, True], ids=["multistep", "multistep-overlap"])
def test_smollm2_greedy_text_and_stream_equal_single_step(smol_llm, smol_prompts, overlap):
    # EOS on; stop strings and ids that fire inside windows; max_tokens not multiples of N
    params = [SamplingParams(max_tokens=9 + 3 * i, temperature=0, stop=[" the", "\n"] if i % 2 else [", "],
                             stop_token_ids=[30] if i == 3 else []) for i in range(len(smol_prompts))]
    want = run(smol_engine(smol_llm, 1), smol_prompts, params)
    ms = smol_engine(smol_llm, N, disable_overlap_schedule=not overlap)
    windows = count_windows(ms)
    got = run(ms, smol_prompts, params)
    assert got == want
    assert windows and any(w[2] is not None for w in want)  # some stop strings / ids fired
    for tokens, _, _, text, streamed_ids, streamed_text in got:
        assert streamed_ids == tokens and streamed_text == text


def test_smollm2_seeded_sampling_equals_single_step(smol_llm, smol_prompts):
    params = [SamplingParams(max_tokens=14 + i, temperature=0.8, top_p=0.95, seed=10 + i, stop=["\n\n"])
              for i in range(4)]
    want = run(smol_engine(smol_llm, 1), smol_prompts[:4], params)
    ms = smol_engine(smol_llm, N)
    windows = count_windows(ms)
    assert run(ms, smol_prompts[:4], params) == want
    assert windows


def test_smollm2_preemption_with_windows(smol_llm, smol_prompts):
    params = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)
    want = run(smol_engine(smol_llm, 1), smol_prompts, params)
    ms = smol_engine(smol_llm, N, num_kv_blocks=17, block_size=16, max_model_len=128)
    windows = count_windows(ms)
    preempted = record_preemptions(ms)
    got = run(ms, smol_prompts, params)
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert windows and max(preempted) > 0, "the pool was meant to force preemption"
    assert ms.stats().kv_blocks_used == 0


def test_llm_api_takes_num_scheduler_steps(smol_llm, smol_prompts):
    llm = LLM.__new__(LLM)
    llm.engine = smol_engine(smol_llm, 8)
    out = llm.generate(smol_prompts[:2], SamplingParams(max_tokens=13, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == \
        [o.outputs[0].token_ids for o in smol_llm.generate(smol_prompts[:2],
                                                             SamplingParams(max_tokens=13, temperature=0,
                                                                            ignore_eos=True))]
