"""`tercel bench`: an offline sweep on SmolLM2 through the public API, HF peers on a random-weight shape, and
`bench serve` against a real `tercel serve`, each run as users run it (`python -m tercel bench ...`)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_harness import REPO, ServerProcess, tiny_server_args

from tercel.bench.environment import command_line
from tercel.bench.offline import PassResult, RoundsPoint, stats_delta, stats_snapshot
from tercel.bench.report import percentile
from tercel.speculative.worker import SpecStats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, timeout: float = 600, cwd: Path = REPO, path_first: tuple[Path, ...] = ()
          ) -> subprocess.CompletedProcess:
    """`python -m tercel bench ARGS` in cwd; path_first: directories put before the project on sys.path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, path_first), str(REPO),
                                                       *filter(None, [os.environ.get("PYTHONPATH")])]))
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.pop("TERCEL_COMMIT", None)
    # one intra-op thread: CI machines are small and shared, and spinning OpenMP threads slow each other down
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "tercel", "bench", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    with Image.open(path) as im:
        im.verify()
        assert im.format == "PNG" and im.size[0] > 200 and im.size[1] > 200, (path, im.size)


# ---- pieces -------------------------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 0.0, 20.0], 90) == pytest.approx(18.0)


def test_results_record_commands_relative_to_the_project_root(tmp_path):
    script, draft = REPO / "benchmarks" / "spec_speed.py", REPO / "tercel" / "drafts" / "smollm2-eagle3"
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.touch()
    got = command_line("python", [str(script), f"--draft={draft}", "--model", str(gguf), "--out", str(tmp_path)])
    assert got == (f"python benchmarks/spec_speed.py --draft=tercel/drafts/smollm2-eagle3 --model $SMOLLM2_GGUF "
                   f"--out {tmp_path}")


def test_a_long_argument_that_is_no_path_is_recorded_as_typed():
    # a comma list of configurations longer than a file name may be: os.stat raises ENAMETOOLONG
    configs = ",".join(f"eagle3-chain@TERCEL_VERIFY_ATTN=rope@TERCEL_DRAFT_HEAD=int8_{i}" for i in range(8))
    assert len(configs) > 255
    assert command_line("python", ["x.py", "--configs", configs]) == f"python x.py --configs {configs}"


def test_spec_stats_delta_reads_every_counter_and_histogram():
    s = SpecStats()
    s.record(4, 1)
    before = stats_snapshot(s)
    s.record(4, 3)
    s.record(4, 0)
    d = stats_delta(before, stats_snapshot(s))
    assert d == {"verify_steps": 2, "draft_tokens": 8, "accepted_tokens": 3, "accept_histogram": [1, 0, 0, 1],
                 "width_histogram": {}, "plain_window_steps": 0, "chain_reads": 0, "chain_wait_s": 0.0,
                 "worker_steps": 0, "worker_step_s": 0.0, "flushes": 0, "flush_s": 0.0, "flush_host_s": 0.0,
                 "flush_rows": 0, "probes": 0, "probe_s": 0.0}


def test_rounds_point_takes_the_median_round_and_the_median_paired_ratio():
    warm = PassResult(wall_s=1.0, output_tokens=10, tok_s=10.0)
    p = RoundsPoint("NGRAM", 1, 8, warm, warm)
    for tok_s, plain in ((30.0, 20.0), (12.0, 10.0), (50.0, 25.0), (40.0, None)):  # the last round: no plain
        p.add_round(PassResult(wall_s=1.0, output_tokens=int(tok_s), tok_s=tok_s), plain)
    assert p.second.tok_s == 30.0  # the lower middle of 12, 30, 40, 50: a measured pass
    assert p.round_speedups == [1.5, 1.2, 2.0, None]
    assert p.median_speedup() == 1.5  # an unpaired round has no ratio
    assert p.first is warm


def test_rounds_without_plain_fail_at_once(tmp_path):
    start = time.perf_counter()
    r = bench("offline", "--algorithms", "NGRAM", "--rounds", "2", "--no-plots", timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --rounds 2") and "--algorithms NGRAM" in r.stderr and "NONE" in r.stderr
    assert time.perf_counter() - start < 10, "checked before any model loads"
    assert not list(tmp_path.iterdir()), "nothing is written"


def test_bad_flags_fail_fast_with_one_line():
    r = bench("offline", "--concurrency", "1,zero", timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--concurrency" in r.stderr and "e.g. 1,4,16" in r.stderr
    r = bench("offline", "--model", "llama-3.1-8b", "--algorithms", "NONE,DFLASH", timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--dflash-draft DIR" in r.stderr, r.stderr
    r = bench("serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1", timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --base-url"), r.stderr


def test_without_matplotlib_bench_fails_at_once_naming_the_extra(tmp_path):
    blocker = tmp_path / "blocked"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    for args in (("offline", "--model", "llama-tiny", "--algorithms", "plain", "--concurrency", "1"),
                 ("serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1")):
        start = time.perf_counter()
        r = bench(*args, timeout=120, cwd=tmp_path, path_first=(blocker,))
        elapsed = time.perf_counter() - start
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "pip install 'tercel[bench]'" in r.stderr and "--no-plots" in r.stderr, r.stderr
        assert elapsed < 10, f"the missing extra was found after {elapsed:.1f} s"
        assert list(tmp_path.iterdir()) == [blocker], "nothing is written"


# ---- offline ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_offline_sweep_on_smollm2(tmp_path):
    # adaptive off: at 8 tokens on this CPU the policy would rightly pick plain steps, and the test reads verifies
    r = bench("offline", "--algorithms", "NONE,NGRAM", "--concurrency", "1,2", "--output-len", "8",
              "--num-prompts", "2", "--speculative-adaptive", "off", "--out-dir", str(tmp_path), "--name", "sweep")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NGRAM" in r.stdout and "api/token-id" in r.stdout  # the table
    d = json.loads((tmp_path / "sweep.json").read_text())
    assert d["complete"] is True and d["result"]["engine_errors"] == {} and d["result"]["point_errors"] == []
    env = d["environment"]
    import torch

    assert env["torch"] == torch.__version__ and env["python"].count(".") == 2 and env["cpu"]
    assert env["commit"] not in ("", "unknown") and "gpu" not in env
    assert env["command"].startswith("python -m tercel bench offline --algorithms NONE,NGRAM --concurrency 1,2")
    res = d["result"]
    assert res["device"] == "cpu" and res["weight_bytes"] > 50e6 and res["copy_bandwidth_bytes_per_s"] > 1e8
    points = {(p["algorithm"], p["concurrency"]): p for p in res["points"]}
    assert sorted(points) == [("NGRAM", 1), ("NGRAM", 2), ("NONE", 1), ("NONE", 2)]
    for (algo, c), p in points.items():
        for run in (p["first"], p["second"]):
            assert run["output_tokens"] == 8 * c  # ignore_eos: exactly --output-len each
            assert run["tok_s"] == pytest.approx(run["output_tokens"] / run["wall_s"], rel=0.01)
        assert p["weight_roofline_tok_s"] == pytest.approx(c * res["copy_bandwidth_bytes_per_s"] / res["weight_bytes"],
                                                           rel=0.01)
        assert p["roofline_fraction"] == pytest.approx(p["second"]["tok_s"] / p["weight_roofline_tok_s"], rel=0.01)
        plain = points[("NONE", c)]["second"]["tok_s"]
        assert p["speedup_over_plain"] == pytest.approx(p["second"]["tok_s"] / plain, rel=0.01)
        if algo == "NONE":
            assert p["second"]["mean_accept_length"] is None and p["second"]["spec_stats"] == {}
            tid = p["token_id"]
            assert tid["output_tokens"] == 8 * c
            assert p["api_fraction_of_token_id"] == pytest.approx(p["second"]["tok_s"] / tid["tok_s"], rel=0.01)
        else:
            s = p["second"]["spec_stats"]
            hist = p["second"]["accept_histogram"]
            # the engine-wide counters over the pass agree with the requests' own
            assert s["verify_steps"] == sum(hist) == sum(s["accept_histogram"]) > 0
            assert s["accept_histogram"] == hist
            mal = (s["accepted_tokens"] + s["verify_steps"]) / s["verify_steps"]
            assert p["second"]["mean_accept_length"] == pytest.approx(mal, abs=1e-3) and mal >= 1
            assert p["token_id"] is None
    prof = points[("NGRAM", 1)]["step_breakdown_us"]
    assert prof["steps"] > 0 and prof["host_us"]["verify"] > 0 and prof["gpu_us"] == {}
    assert points[("NGRAM", 2)]["step_breakdown_us"] is None  # --profile first: the smallest concurrency only
    pytest.importorskip("matplotlib")
    assert d["files"] == {"speedup_png": "sweep_speedup.png", "accept_histogram_png": "sweep_accept_histogram.png"}
    for name in d["files"].values():
        assert_png(tmp_path / name)


def test_offline_random_shape_with_hf_peer(tmp_path):
    """A random-weight shape (no tokenizer: token ids both ways) and the HF peers, on the CPU."""
    r = bench("offline", "--model", "llama-tiny", "--algorithms", "plain", "--concurrency", "1", "--output-len",
              "6", "--kv-cache-memory", "16000000", "--hf-peers", "--no-plots", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # no --output-dir: the current directory (not the checkout's benchmarks/results)
    d = json.loads((tmp_path / "bench_offline_llama-tiny_cpu.json").read_text())
    res = d["result"]
    assert res["model"].startswith("llama-tiny shape, random weights") and "token ids" in res["prompts"]
    (p,) = res["points"]
    assert p["second"]["output_tokens"] == 6 and p["token_id"] is None
    assert "method" not in d and "rounds" not in p and d["config"]["rounds"] == 1  # --rounds 1: the file as before
    peers = {row["config"]: row for row in res["hf_peers"]}
    assert set(peers) == {"eager", "prompt_lookup"}  # static cache + compile is CUDA only
    for row in peers.values():
        assert "error" not in row, row
        assert row["tok_s"] > 0 and row["output_len"] == 6
        assert row["tercel_speedup"]["NONE"] == pytest.approx(p["second"]["tok_s"] / row["tok_s"], rel=0.02)
    assert d["files"] == {} and not list(tmp_path.glob("*.png"))


def test_offline_rounds_pair_every_pass_with_plain(tmp_path):
    """--rounds 3: a warm-up pass, then 3 rounds of (plain, NGRAM) pairs; the speed-up is the median of the
    per-round ratios, `second` the median round."""
    r = bench("offline", "--model", "llama-tiny", "--algorithms", "NONE,NGRAM", "--concurrency", "1,2",
              "--output-len", "6", "--rounds", "3", "--speculative-adaptive", "off", "--kv-cache-memory", "16000000",
              "--no-hf-peers", "--no-plots", "--out-dir", str(tmp_path), "--name", "rounds")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads((tmp_path / "rounds.json").read_text())
    assert d["complete"] is True and d["config"]["rounds"] == 3 and "3 interleaved rounds" in d["method"]
    res = d["result"]
    assert res["engine_errors"] == {} and res["point_errors"] == []
    points = {(p["algorithm"], p["concurrency"]): p for p in res["points"]}
    assert sorted(points) == [("NGRAM", 1), ("NGRAM", 2), ("NONE", 1), ("NONE", 2)]
    for (algo, c), p in points.items():
        assert len(p["rounds"]) == len(p["paired_plain_tok_s"]) == len(p["round_speedups"]) == 3
        for run in (p["first"], *p["rounds"]):
            assert run["output_tokens"] == 6 * c
        tok_s = [run["tok_s"] for run in p["rounds"]]
        assert p["second"] == p["rounds"][tok_s.index(sorted(tok_s)[1])]  # the median round
        ratios = [t / b for t, b in zip(tok_s, p["paired_plain_tok_s"])]
        assert p["round_speedups"] == pytest.approx(ratios, abs=1e-4)
        assert p["speedup_over_plain"] == pytest.approx(statistics.median(ratios), abs=1e-3)
        plain = points[("NONE", c)]
        if algo == "NONE":  # one speculative algorithm: each round's plain is the pass paired with it
            assert p["paired_plain_tok_s"] == tok_s and p["speedup_over_plain"] == 1.0
        else:
            assert p["paired_plain_tok_s"] == [run["tok_s"] for run in plain["rounds"]]
            assert sum(run["spec_stats"]["verify_steps"] for run in p["rounds"]) > 0
        assert p["roofline_fraction"] == pytest.approx(p["second"]["tok_s"] / p["weight_roofline_tok_s"], rel=0.01)
    assert "NGRAM" in r.stdout  # the table reads the median round as the second pass


# ---- serve --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server():
    srv = ServerProcess(*tiny_server_args()).start()
    try:
        yield srv.wait_ready()
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log_tail()


def test_serve_against_tercel_serve(tiny_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"Once upon a time"\n{"prompt": "The capital of France is"}\n'
                       '{"messages": [{"role": "user", "content": "a hash table"}]}\n')
    r = bench("serve", "--base-url", tiny_server.base_url, "--request-rate", "20,inf", "--num-prompts", "6",
              "--max-tokens", "8", "--prompts", str(prompts), "--label", "tiny", "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TTFT p50" in r.stdout
    d = json.loads((tmp_path / "bench_serve_tiny.json").read_text())
    assert d["environment"]["command"].startswith("python -m tercel bench serve --base-url")
    assert d["model"] == tiny_server_args()[0].rsplit("/", 1)[-1] and d["config"]["distinct_prompts"] == 3
    rates = [r["request_rate"] for r in d["results"]]
    assert rates == [20.0, "inf"]
    for row in d["results"]:
        assert row["num_requests"] == row["completed"] == 6 and row["errors"] == 0 and row["error_samples"] == []
        assert row["output_tokens"] == 6 * 8  # ignore_eos, counted from the stream's usage
        # (duration_s is rounded in the file: a short run's ratio is off by up to a few %)
        assert row["output_tok_s"] == pytest.approx(row["output_tokens"] / row["duration_s"], rel=0.05)
        assert row["request_throughput"] == pytest.approx(6 / row["duration_s"], rel=0.05)
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            q = row[key]
            assert 0 < q["p50"] <= q["p90"] <= q["p99"] < 120_000, (key, q)
        assert row["e2e_ms"]["p50"] > row["ttft_ms"]["p50"]
        assert row["e2e_ms"]["p99"] >= row["ttft_ms"]["p99"]
    pytest.importorskip("matplotlib")
    assert_png(tmp_path / d["files"]["latency_png"])


def test_rounds_on_a_gpu_share_the_kv_memory_between_engines(monkeypatch):
    """Every engine of a rounds sweep lives at once: without a pool size of the user's each takes an equal share
    of half of gpu_memory_utilization x free memory (sized from free memory, the third engine ran out on the
    H200; with whole shares the fourth did)."""
    import torch

    from tercel.bench.offline import OfflineConfig, shared_kv_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 30, 140 << 30))
    cuda = torch.device("cuda")
    cfg = OfflineConfig(model=None, rounds=5, engine={"gpu_memory_utilization": 0.8, "kv_cache_memory": None})
    assert shared_kv_budget(cfg, cuda, 5) == {"kv_cache_memory": int((100 << 30) * 0.8 / 10)}
    assert shared_kv_budget(OfflineConfig(model=None, engine={"kv_cache_memory": 1 << 30}), cuda, 5) == {}
    assert shared_kv_budget(OfflineConfig(model=None, engine={"num_kv_blocks": 64}), cuda, 5) == {}
    assert shared_kv_budget(cfg, cuda, 1) == {} and shared_kv_budget(cfg, torch.device("cpu"), 5) == {}


def test_adaptive_points_record_what_the_policy_believed(tmp_path):
    """Adaptive speculation on: each pass records the cost model (step ms per bucket x width, the forward's, the
    real steps behind it), to read beside the measured pace; plain passes have none."""
    r = bench("offline", "--model", "llama-tiny", "--algorithms", "NONE,NGRAM", "--concurrency", "2",
              "--output-len", "6", "--kv-cache-memory", "16000000", "--no-hf-peers", "--no-plots",
              "--out-dir", str(tmp_path), "--name", "costs")
    assert r.returncode == 0, r.stderr[-3000:]
    points = {p["algorithm"]: p for p in json.loads((tmp_path / "costs.json").read_text())["result"]["points"]}
    assert points["NONE"]["second"]["cost_model"] == {}
    costs = points["NGRAM"]["second"]["cost_model"]
    assert "2x1" in costs and len(costs) >= 2 and all(k.startswith("2x") for k in costs)
    for c in costs.values():
        assert c["step_ms"] > 0 and c["forward_ms"] > 0 and c["observed"] >= 0


def test_a_benchmark_configuration_carries_its_own_developer_switches(monkeypatch):
    """benchmarks/common.py: 'eagle3-chain@TERCEL_VERIFY_ATTN=rope' names the configuration and the switches its
    engine runs under (spec_rounds.py / step_profile.py measure a variant beside the default in one process);
    an undocumented or malformed switch is refused with the list of names; switches() restores the environment."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", REPO / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert common.split_config("eagle3-chain") == ("eagle3-chain", {})
    assert common.split_config("eagle3-chain@TERCEL_VERIFY_ATTN=rope@TERCEL_SPEC_CHAIN=0") == (
        "eagle3-chain", {"TERCEL_VERIFY_ATTN": "rope", "TERCEL_SPEC_CHAIN": "0"})
    for bad in ("plain@TERCEL_NOPE=1", "plain@TERCEL_VERIFY_ATTN"):
        with pytest.raises(SystemExit, match="not VAR=VALUE with VAR one of .*TERCEL_VERIFY_ATTN"):
            common.split_config(bad)
    monkeypatch.delenv("TERCEL_VERIFY_ATTN", raising=False)
    monkeypatch.setenv("TERCEL_SPEC_CHAIN", "1")
    with pytest.raises(RuntimeError):
        with common.switches({"TERCEL_VERIFY_ATTN": "rope", "TERCEL_SPEC_CHAIN": "0"}):
            assert os.environ["TERCEL_VERIFY_ATTN"] == "rope" and os.environ["TERCEL_SPEC_CHAIN"] == "0"
            raise RuntimeError("a run that fails still restores the environment")
    assert "TERCEL_VERIFY_ATTN" not in os.environ and os.environ["TERCEL_SPEC_CHAIN"] == "1"


def test_spec_rounds_runs_each_configuration_between_two_plain_runs(monkeypatch):
    """benchmarks/spec_rounds.py: the host's speed drifts between passes (plain's own passes spread 1142-1742 tok/s in
    one H100 call), so each configuration runs between two runs of its plain reference and its ratio is to their
    geometric mean; the run after one configuration is the run before the next of the same reference."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import spec_rounds

    calls: list[str] = []

    def run_point(llm, convs, c, tokens, temp):
        calls.append(llm)
        return dict(tok_s=10.0 * len(calls), accept_length=None, steps_by_width={}, worker_steps=0, worker_share=0.0)

    monkeypatch.setattr(spec_rounds, "run_point", run_point)
    names = ["plain", "eagle3-chain", "ngram-adaptive", "plain-t1", "eagle3-chain-t1"]
    results: dict = {}
    spec_rounds.rounds({n: n for n in names}, {1: [None]}, 1, {1: 8}, results, lambda: None)
    assert calls == ["plain", "eagle3-chain", "plain", "ngram-adaptive", "plain", "plain-t1", "eagle3-chain-t1",
                     "plain-t1"]
    chain, ngram, sampled = (results[n]["1"][0] for n in ("eagle3-chain", "ngram-adaptive", "eagle3-chain-t1"))
    assert chain["plain_before_after_tok_s"] == [10.0, 30.0] and ngram["plain_before_after_tok_s"] == [30.0, 50.0]
    assert sampled["plain_before_after_tok_s"] == [60.0, 80.0]
    assert chain["paired_plain_tok_s"] == pytest.approx((10.0 * 30.0) ** 0.5)
    table = spec_rounds.summarize(results)
    assert table["ngram-adaptive"]["1"]["vs_plain"] == pytest.approx(40.0 / (30.0 * 50.0) ** 0.5, abs=1e-3)
    assert table["eagle3-chain-t1"]["1"]["vs_plain"] == pytest.approx(70.0 / (60.0 * 80.0) ** 0.5, abs=1e-3)
