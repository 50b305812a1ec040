"""Speculative steps under CUDA graphs on a GPU (SmolLM2 with the bundled drafts; skipped without CUDA):
graph-mode output equals eager-mode output (bf16 greedy, 128 tokens, batch 1 and 16) for every algorithm;
fp32 greedy speculative output equals plain output on the SmolLM2 prompts (a mismatch is reported with the
target's logit margin there); every block size / tree budget runs; a batch shrinks 32 -> 12 -> 1 with
cancellations and nothing crashes. The kernel variants behind developer switches (TERCEL_VERIFY_ATTN=rope,
TERCEL_DRAFT_HEAD=int8) pass the graph == eager and fp32 == plain checks too."""
from __future__ import annotations

import pytest
import torch
from conftest import CHAT_PROMPTS, smollm2_gguf_or_skip
from spec_utils import spec_llm

from tercel import LLM, SamplingParams
from tercel.speculative import DEFAULT_DFLASH_DRAFT, DEFAULT_EAGLE3_DRAFT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E3, DF = (dict(speculative_draft_model_path=DEFAULT_EAGLE3_DRAFT),
          dict(speculative_draft_model_path=DEFAULT_DFLASH_DRAFT))
ALGOS = {  # the bundled drafts, named: the device machine's GGUF is not the installed default model
    "ngram": dict(speculative_algorithm="NGRAM"),
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, **E3),
    "eagle3-tree": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_num_draft_tokens=16,
                        **E3),
    "dflash": dict(speculative_algorithm="DFLASH", **DF),
    "ddtree": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16, **DF),
}
GRAPH_BS = dict(cuda_graph_max_bs=32, kv_cache_memory=2 << 30)


@pytest.fixture(scope="module")
def gguf():
    return smollm2_gguf_or_skip()


@pytest.fixture(scope="module")
def bf16(gguf):
    return LLM(gguf, dtype="bfloat16", device="cuda", max_model_len=1024, kv_cache_memory=2 << 30,
               progress=False)


@pytest.fixture(scope="module")
def chats(bf16):
    tok = bf16.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    extra = [tok.encode("def fibonacci(n):"), tok.encode("The quick brown fox jumps over the lazy dog. " * 8)]
    return (chat + extra) * 2


def _tokens(llm, prompts, n):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _replays(llm) -> int:
    """Graph replays of the speculative steps: verify, and the chained greedy / sampled steps where they run."""
    spec = llm.engine.spec
    chained = 0 if spec.chain is None else spec.chain.runner.stats.replays + (
        spec.chain.sampled.stats.replays if spec.chain.sampled else 0)
    return spec.verify_runner.stats.replays + chained


def _draft_runner(llm):
    """What drafts a tree under graphs: the chained tree step (draft, verify, acceptance and draft_extend or the
    context injection in one replay), or DDTREE's block forward where its steps run unchained; None for chains."""
    spec = llm.engine.spec
    if not getattr(spec.drafter, "uses_trees", False):
        return None
    return spec.chain.runner if spec.chain is not None else spec.drafter.block_runner


# the kernel variants behind developer switches (off by default until measured): the same checks as the defaults
SWITCHED = {"verify-rows-rope": dict(TERCEL_VERIFY_ATTN="rope"), "int8-draft-head": dict(TERCEL_DRAFT_HEAD="int8"),
            "small-m-rowgrid": dict(TERCEL_SMALL_M="rowgrid"), "pdl-late-all": dict(TERCEL_PDL="late_all"),
            "draft-fused-mlp": dict(TERCEL_DRAFT_FUSED_MLP="1")}


def _switch(llm: LLM, switch: str, monkeypatch) -> None:
    for var, value in SWITCHED[switch].items():
        monkeypatch.setenv(var, value)
    if switch == "small-m-rowgrid":  # set at load where the switch is on; the shared target was loaded without
        from tercel.models.gemv_tuning import rowgrid_rows

        rowgrid_rows(llm.engine.loaded.model)  # tables only: engines with TERCEL_SMALL_M=0 never read them


@pytest.mark.parametrize("name", list(ALGOS))
def test_graph_mode_equals_eager_mode_bf16(bf16, chats, name, monkeypatch):
    # bit-for-bit against eager needs the same steps in the same batches: the overlap schedule (a chained
    # EAGLE step runs one step past a request's end) is checked in fp32 against plain decoding below
    # and the same widths: adaptive widths follow measured step costs, which differ between the two engines
    # and prefix caching off: each engine prefills every prompt whole (a cached prefix, or a copy of a prompt
    # waiting for another's blocks, computes only the tail, which rounds differently in bf16)
    # and DFLASH's and DDTREE's separate steps: their chained steps draft over the padded context cache (the same
    # math, other bf16 rounding, so other drafts and batches); the chained steps are checked lossless in fp32 below
    if name in ("dflash", "ddtree"):
        monkeypatch.setenv("TERCEL_SPEC_CHAIN", "0")
    graph = spec_llm(bf16, **GRAPH_BS, disable_overlap_schedule=True, speculative_adaptive="off",
                     enable_prefix_caching=False, **ALGOS[name])
    eager = spec_llm(bf16, disable_cuda_graph=True, kv_cache_memory=2 << 30, speculative_adaptive="off",
                     enable_prefix_caching=False, **ALGOS[name])
    for batch in (chats[:1], chats[:16]):
        assert _tokens(graph, batch, 128) == _tokens(eager, batch, 128)
    runner = graph.engine.spec.verify_runner
    assert _replays(graph) > 0 and runner.stats.eager == 0, dict(runner.stats.fallbacks)
    drafts = _draft_runner(graph)
    if drafts is not None:  # trees: the whole draft loop / block forward replays too
        assert drafts.stats.replays > 0 and drafts.stats.eager == 0, dict(drafts.stats.fallbacks)
    assert graph.engine.stats().kv_blocks_used == 0


@pytest.fixture(scope="module")
def fp32(gguf):
    return LLM(gguf, dtype="float32", device="cuda", max_model_len=1024, kv_cache_memory=2 << 30,
               progress=False)


# where each switch changes a kernel: causal verify rows (chains, DFLASH's block), the EAGLE draft's head
SWITCHED_RUNS = [("eagle3-chain", "verify-rows-rope"), ("dflash", "verify-rows-rope"),
                 ("eagle3-chain", "int8-draft-head"), ("eagle3-chain", "small-m-rowgrid"),
                 ("dflash", "small-m-rowgrid"),
                 ("eagle3-chain", "pdl-late-all"), ("eagle3-tree", "pdl-late-all"), ("eagle3-chain", "draft-fused-mlp")]


@pytest.mark.parametrize("name,switch", SWITCHED_RUNS)
def test_switched_kernels_graph_equals_eager_bf16(bf16, chats, name, switch, monkeypatch):
    _switch(bf16, switch, monkeypatch)
    test_graph_mode_equals_eager_mode_bf16(bf16, chats, name, monkeypatch)


@pytest.mark.parametrize("name,switch", SWITCHED_RUNS + [("eagle3-tree", "int8-draft-head")])
def test_switched_kernels_fp32_speculative_equals_plain(fp32, chats, name, switch, monkeypatch):
    _switch(fp32, switch, monkeypatch)
    test_fp32_speculative_equals_plain(fp32, chats, name)


@pytest.mark.parametrize("name", list(ALGOS))
def test_fp32_speculative_equals_plain(fp32, chats, name):
    prompts = chats[:len(chats) // 2]
    plain = _tokens(fp32, prompts, 64)
    spec = _tokens(spec_llm(fp32, **GRAPH_BS, **ALGOS[name]), prompts, 64)
    report = []
    for i, (p, s) in enumerate(zip(plain, spec)):
        if p != s:  # the target's margin between its top two tokens where the outputs part
            j = next(k for k, (a, b) in enumerate(zip(p, s)) if a != b)
            out = fp32.generate([prompts[i] + p[:j]], SamplingParams(max_tokens=1, temperature=0, logprobs=2))[0]
            top = sorted(out.outputs[0].logprobs[0].values(), reverse=True)
            report.append((i, j, top[0] - top[1]))
    assert all(margin < 1e-3 for *_, margin in report), report  # only near-ties may part


def test_fp32_sampled_eagle_chains_run_chained_and_give_the_plain_tokens(fp32, chats):
    """Seeded T = 1 (top-p 0.95, one greedy request beside them): the sampled chain step's replays give the
    tokens plain sampling gives (fp32; a near-tie of the target's draw may part them, as for greedy)."""
    prompts = chats[:8]
    params = [SamplingParams(max_tokens=64, seed=11 + i, ignore_eos=True,
                             **(dict(temperature=0.0) if i == 3 else dict(temperature=1.0, top_p=0.95)))
              for i in range(len(prompts))]
    plain = [o.outputs[0].token_ids for o in fp32.generate(prompts, params)]
    llm = spec_llm(fp32, **GRAPH_BS, speculative_adaptive="off", **ALGOS["eagle3-chain"])
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    chain = llm.engine.spec.chain
    assert chain.sampled is not None and chain.sampled.stats.replays > 0 and chain.sampled.stats.eager == 0
    same = sum(p == s for p, s in zip(plain, spec))
    assert same >= len(prompts) - 1, [next((k for k, (a, b) in enumerate(zip(p, s)) if a != b), None)
                                      for p, s in zip(plain, spec)]
    assert llm.engine.spec_stats().mean_accept_length > 1.5


@pytest.mark.parametrize("kw", [dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=n, **DF)
                                for n in (2, 8, 9, 16, 32, 64)]
                         + [dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=n, **DF)
                            for n in (2, 8, 9, 16, 32, 64)]
                         + [dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=4,
                                 speculative_num_draft_tokens=n, **E3) for n in (2, 8, 9, 16, 32, 64)],
                         ids=lambda kw: "-".join(str(v) for k, v in kw.items() if k != "speculative_draft_model_path"))
def test_every_block_size_and_budget_runs(bf16, chats, kw):
    llm = spec_llm(bf16, cuda_graph_max_bs=4, kv_cache_memory=2 << 30, speculative_adaptive="off", **kw)
    outs = _tokens(llm, chats[:4], 32)
    assert all(len(o) == 32 for o in outs) and llm.engine.stats().kv_blocks_used == 0
    assert _replays(llm) > 0 and llm.engine.spec.verify_runner.stats.eager == 0
    if kw["speculative_algorithm"] == "DFLASH":  # every block size runs as the chained step
        assert llm.engine.spec.chain is not None and llm.engine.spec.chain.runner.stats.replays > 0
    else:  # every budget's and tree size's draft step replays
        assert _draft_runner(llm).stats.replays > 0 and _draft_runner(llm).stats.eager == 0


@pytest.mark.parametrize("name", ["eagle3-chain", "eagle3-tree", "ddtree"])
def test_batch_shrinks_with_cancellations(bf16, chats, name):
    llm = spec_llm(bf16, **GRAPH_BS, **ALGOS[name])
    eng = llm.engine
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    ids = [eng.add_request(chats[i % len(chats)], params) for i in range(32)]
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps == 4:
            for rid in ids[12:]:
                eng.abort_request(rid)
        if steps == 8:
            for rid in ids[1:12]:
                eng.abort_request(rid)
    assert eng.stats().kv_blocks_used == 0
