"""SamplingParams.output_kind (vLLM's RequestOutputKind): CUMULATIVE returns the text and tokens so far
every step; DELTA only what each step added (joined, they are the CUMULATIVE result); FINAL_ONLY one
output when the request finishes, equal to the CUMULATIVE final one. Plain steps, multi-step windows,
the overlap schedule and speculative steps (NGRAM) alike; LLM.generate asks for FINAL_ONLY without
changing the caller's params."""
from __future__ import annotations

from pathlib import Path

import pytest
from graph_utils import tiny_model

from tercel import LLM, RequestOutputKind, SamplingParams
from tercel.engine import LLMEngine
from tercel.loader.model_loader import LoadedModel

EOS = 7
ENGINES = pytest.mark.parametrize("kw", [
    dict(num_scheduler_steps=1, disable_overlap_schedule=True),
    dict(num_scheduler_steps=4, disable_overlap_schedule=False),
    dict(num_scheduler_steps=1, disable_overlap_schedule=False),
    # fixed width: adaptive widths follow wall time, and logprobs of different verify shapes differ in the last bit
    dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_adaptive=False,
         disable_overlap_schedule=True),
], ids=["single", "multistep-overlap", "overlap", "ngram"])


@pytest.fixture(scope="module")
def tiny_loaded() -> LoadedModel:
    model, cfg = tiny_model()
    return LoadedModel(model, cfg, None, Path("tiny-random"), (EOS,))


def engine(loaded: LoadedModel, **kw) -> LLMEngine:
    return LLMEngine(loaded=loaded, dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64,
                     block_size=4, **kw)


def prompts() -> list[list[int]]:
    # repeated patterns give the n-gram drafter matches to propose
    return [[9, 10, 11, 9, 10, 11, 9, 10], [40, 41, 42, 43], [100, 101, 100, 101, 100], [12] * 6]


def params(kind: RequestOutputKind) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0, logprobs=1 if i == 1 else None, seed=i, output_kind=kind)
            for i, n in enumerate([13, 20, 7, 16])]


def run(eng: LLMEngine, kind: RequestOutputKind) -> tuple[dict[str, list], list[str]]:
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts(), params(kind))]
    per_request: dict[str, list] = {i: [] for i in ids}
    while eng.has_unfinished_requests():
        for out in eng.step():
            per_request[out.request_id].append(out)
    return per_request, ids


@ENGINES
def test_delta_and_final_only_give_the_cumulative_result(tiny_loaded, kw):
    cum, ids_c = run(engine(tiny_loaded, **kw), RequestOutputKind.CUMULATIVE)
    delta, ids_d = run(engine(tiny_loaded, **kw), RequestOutputKind.DELTA)
    final, ids_f = run(engine(tiny_loaded, **kw), RequestOutputKind.FINAL_ONLY)
    for c_id, d_id, f_id in zip(ids_c, ids_d, ids_f):
        want = cum[c_id][-1].outputs[0]
        assert cum[c_id][-1].finished and len(want.token_ids) > 0
        # DELTA: each output holds its step's tokens / text / logprobs only; joined they are the result
        outs = delta[d_id]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.outputs[0].token_ids] == want.token_ids
        assert "".join(o.outputs[0].text for o in outs) == want.text
        assert all(o.outputs[0].token_ids == o.delta_token_ids and o.outputs[0].text == o.delta_text for o in outs)
        if want.logprobs is not None:
            assert [lp for o in outs for lp in o.outputs[0].logprobs] == want.logprobs
        assert outs[-1].outputs[0].finish_reason == want.finish_reason
        # FINAL_ONLY: one output, the finished one, equal to CUMULATIVE's last
        assert len(final[f_id]) == 1 and final[f_id][0].finished
        got = final[f_id][0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason, got.logprobs) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason, want.logprobs)
        assert final[f_id][0].delta_token_ids == want.token_ids  # nothing was sent before
    # CUMULATIVE outputs are snapshots: an earlier one is not changed by later steps
    first = cum[ids_c[1]][0].outputs[0]
    assert len(first.token_ids) < len(cum[ids_c[1]][-1].outputs[0].token_ids)


def test_generate_asks_for_final_only_and_leaves_the_callers_params(tiny_loaded):
    llm = LLM.__new__(LLM)
    llm.engine = engine(tiny_loaded)
    sp = SamplingParams(max_tokens=9, temperature=0)
    seen: list[RequestOutputKind] = []
    real = llm.engine.add_request
    llm.engine.add_request = lambda p, s, *a: (seen.append(s.output_kind), real(p, s, *a))[1]
    outs = llm.generate(prompts(), sp)
    assert sp.output_kind == RequestOutputKind.CUMULATIVE  # the caller's object is unchanged
    assert seen == [RequestOutputKind.FINAL_ONLY] * len(prompts())
    ref = engine(tiny_loaded)
    ids = [ref.add_request(p, sp) for p in prompts()]
    done = {}
    while ref.has_unfinished_requests():
        done.update((o.request_id, o) for o in ref.step() if o.finished)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == \
        [(done[i].outputs[0].token_ids, done[i].outputs[0].text) for i in ids]


@pytest.mark.parametrize("bad", ["FINAL_ONLY", 2, None])
def test_bad_output_kind_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"SamplingParams.output_kind=.* must be a RequestOutputKind"):
        SamplingParams(output_kind=bad)
