"""Tensor parallelism (tercel.distributed) on CPU: two ranks over gloo, the second spawned by Tercel.

TP=2 greedy output equals TP=1 output token for token (fp32), with and without speculative decoding,
from safetensors and from GGUF; `tercel serve --tp-size 2` answers; an unsplittable config fails
before anything loads or starts. Every engine here is closed, and its follower must be gone after.
"""
from __future__ import annotations

import multiprocessing
import time

import httpx
import pytest
import torch
import transformers

from tercel import LLM, SamplingParams
from tercel.config import ConfigError
from tercel.train.export import random_eagle3

transformers.logging.set_verbosity_error()

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BASE = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=160,
            num_kv_blocks=64)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 5, [100], [5, 6, 7, 8] * 6, list(range(40, 70))]


def _save(cfg: transformers.PretrainedConfig, path) -> str:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """4 heads, 2 KV heads (each rank: 2 and 1), untied head, biases on attention and MLP (the row-parallel
    o / down biases are added once)."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.2, attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=False)
    return _save(cfg, tmp_path_factory.mktemp("tp_llama") / "target")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """One KV head for two ranks: each rank keeps a replica of it; tied embeddings."""
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True)
    return _save(cfg, tmp_path_factory.mktemp("tp_qwen3") / "target")


def _greedy(path: str, **kw) -> list[list[int]]:
    with LLM(path, **BASE, **kw) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.engine.stats().kv_blocks_used == 0
        group = llm.engine.tp_group
        if kw.get("speculative_algorithm") is not None:  # drafts were verified (a multi-token forward)
            assert llm.engine.spec_stats().draft_tokens > 0
    if group is not None:  # closed: the spawned rank is gone, the process group shut down before exit
        assert all(not p.is_alive() for p in group.followers)
        assert group.pg is None and group.closed
    return outs


def _eagle3(path: str, root) -> str:
    cfg = LLM(path, **BASE).engine.model_config
    return str(random_eagle3(root, cfg, draft_vocab_size=128, std=0.3, aux_layer_ids=(0, 1, 3)))


@pytest.mark.parametrize("spec", ["plain", "ngram", "eagle3-tree"])
def test_llama_tp2_greedy_equals_tp1(llama, tmp_path, spec):
    ref = _greedy(llama)
    kw: dict = {}
    if spec == "ngram":
        kw = dict(speculative_algorithm="NGRAM", speculative_adaptive=False)
    elif spec == "eagle3-tree":  # tree verify: the custom masks travel to the follower too
        kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=_eagle3(llama, tmp_path / "d"),
                  speculative_eagle_topk=4, speculative_num_draft_tokens=8, speculative_adaptive=False)
    assert _greedy(llama, tp_size=2, **kw) == ref


@pytest.mark.parametrize("spec", ["plain", "eagle3-chain"])
def test_qwen3_with_fewer_kv_heads_than_ranks_tp2_equals_tp1(qwen3, tmp_path, spec):
    ref = _greedy(qwen3)
    kw: dict = {}
    if spec == "eagle3-chain":
        kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=_eagle3(qwen3, tmp_path / "d"),
                  speculative_eagle_topk=1, speculative_adaptive=False)
    assert _greedy(qwen3, tp_size=2, **kw) == ref


def test_gguf_q8_0_tp2_equals_tp1(tmp_path):
    """Each rank slices the memory-mapped Q8_0 blocks (rows for column-parallel, whole blocks of each row
    for row-parallel), and undoes llama.cpp's q/k permutation on its heads; an EAGLE-3 draft on rank 0
    reads the whole embedding dequantized from the GGUF file."""
    from gguf_utils import write_gguf

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf.state_dict(), cfg, "llama", "Q8_0")
    ref = _greedy(str(path))
    assert _greedy(str(path), tp_size=2) == ref
    draft = str(random_eagle3(tmp_path / "d", LLM(str(path), **BASE).engine.model_config, draft_vocab_size=128,
                              std=0.3, aux_layer_ids=(0, 1, 2)))
    assert _greedy(str(path), tp_size=2, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_eagle_topk=1, speculative_adaptive=False) == ref


TORCHRUN_SCRIPT = """
import json, sys
from tercel import LLM, SamplingParams
llm = LLM(sys.argv[1], tp_size=2, **json.loads(sys.argv[2]))  # ranks > 0 serve rank 0 here, then exit
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
llm.close()
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_torchrun_ranks_run_the_same_script(llama, tmp_path):
    """Under torchrun every rank runs the user's script: rank 1 becomes a follower inside LLM(...) and exits
    when rank 0 closes (the same code path as several hosts)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from server_harness import free_port

    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(free_port()), str(script), llama, json.dumps(BASE), json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS"))
    assert json.loads(line.removeprefix("TOKENS ")) == _greedy(llama)


def test_unsplittable_heads_fail_before_loading(tmp_path):
    """SmolLM2-135M's 9 heads do not split over 2 ranks: a ConfigError with the fix, raised from the config
    alone (this checkpoint has no weights at all) and before any rank starts."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=72, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=9, num_key_value_heads=3)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"tp_size=2 does not divide num_attention_heads=9; use tp_size 1, 3 or 9"):
        LLM(str(tmp_path), tp_size=2, **BASE)
    assert multiprocessing.active_children() == []
    transformers.LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=12, num_key_value_heads=4).save_pretrained(tmp_path / "kv")
    with pytest.raises(ConfigError, match=r"tp_size=3 neither divides num_key_value_heads=4 nor is a multiple"):
        LLM(str(tmp_path / "kv"), tp_size=3, **BASE)


def test_a_rank_failing_to_start_stops_every_rank(llama):
    """Rank 0 fails after the follower loaded (this checkpoint has no tokenizer): the follower is told,
    exits, and the error reaches the caller; nothing waits in a collective."""
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="tokenizer"):
        LLM(llama, tp_size=2, **{**BASE, "skip_tokenizer_init": False})
    assert multiprocessing.active_children() == []
    assert time.perf_counter() - start < 60


UNGUARDED_SCRIPT = """
import json, sys, time
from tercel import LLM
start = time.perf_counter()
try:  # no `if __name__ == "__main__":` guard: the spawned rank re-imports this file and fails there
    LLM(sys.argv[1], tp_size=2, **json.loads(sys.argv[2]))
finally:
    print("SECONDS", time.perf_counter() - start)
"""


def test_a_spawned_rank_failing_at_import_stops_the_start_with_its_error_and_the_fix(llama, tmp_path):
    """A script without the `__main__` guard: the spawned rank dies re-importing it, before it joins. Rank 0
    stops within 30 s (not the store's 300 s timeout) with an error naming the rank, its exception and the fix."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, str(script), llama, json.dumps(BASE)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode != 0
    seconds = float(next(x for x in proc.stdout.splitlines() if x.startswith("SECONDS")).split()[1])
    assert seconds < 30, proc.stderr[-4000:]
    err = proc.stderr
    assert "RankStartError: tensor-parallel rank 1" in err, err[-4000:]
    # the rank's own exception, its message included
    assert "exited with code 1 before it joined rank 0: RuntimeError: An attempt has been made to start" in err
    assert 'if __name__ == "__main__":' in err and "torchrun" in err and str(script) in err


def test_tp_size_is_one_setting_of_both_command_lines():
    from tercel.cli import build_parser
    from tercel.cli_args import engine_config_from_args

    for cmd in ("generate", "serve"):
        assert engine_config_from_args(build_parser().parse_args([cmd, "--tp-size", "2"])).parallel.tp_size == 2
        assert engine_config_from_args(build_parser().parse_args([cmd])).parallel.tp_size == 1


def test_serve_with_tp2_answers_a_completion():
    from server_harness import ServerProcess, tiny_model_dir, tiny_server_args

    with LLM(str(tiny_model_dir()), dtype="float32", device="cpu", progress=False, num_kv_blocks=64) as ref_llm:
        ref = ref_llm.generate("The capital of France", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    srv = ServerProcess(*tiny_server_args("--tp-size", "2", "--device", "cpu", "--dtype", "float32")).start()
    try:
        srv.wait_ready()
        start = time.perf_counter()
        r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60, trust_env=False,
                       json={"prompt": "The capital of France", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text
        assert time.perf_counter() - start < 60
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log_tail()


@pytest.mark.parametrize("how", [(0, 2, 6), (1, 32, 64), (1, 48, 96), (1, 5, 40)],
                         ids=["rows", "cols-on-blocks", "cols-mid-block", "cols-unaligned"])
def test_gguf_slices_of_quantized_blocks_equal_slices_of_the_whole(how):
    """A rank's slice of a Q8_0 matrix, dequantizing only the blocks it covers, equals the same slice of
    the whole dequantized matrix (also when K / tp_size splits a 32-weight block)."""
    from types import SimpleNamespace

    import gguf
    import numpy as np

    from tercel.distributed.loader import _gguf_piece

    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(0)).numpy()
    q8 = gguf.GGMLQuantizationType.Q8_0
    raw = gguf.quants.quantize(w, q8)
    whole = np.asarray(gguf.quants.dequantize(raw, q8)).reshape(8, 96)
    dim, start, end = how
    want = whole[start:end] if dim == 0 else whole[:, start:end]
    got = _gguf_piece(SimpleNamespace(data=raw, tensor_type=q8), (8, 96), how, "Q8_0")
    np.testing.assert_array_equal(got, want)
