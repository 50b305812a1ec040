"""A small speculative run for `compute-sanitizer --tool memcheck`: a random-weight Llama (HF format, made
here), a random EAGLE-3 head and a random DFlash draft, bf16 on the GPU with every speculative graph captured
(verify with and without tree masks, the draft loop, draft_extend, the greedy and the sampled chained EAGLE
step), NGRAM / EAGLE3 chain (greedy and T = 1) / EAGLE3 tree / DFLASH / DDTREE at batch 1 and 4, with a request
aborted mid-run. Prints one line per run; memcheck's summary says whether any access was bad.

Usage: PYTHONPATH=. compute-sanitizer --tool memcheck python benchmarks/spec_memcheck.py [--runs DDTREE,DFLASH]
(--runs: some of the runs, by name; memcheck slows a run ~100x, so a session can finish the ones a cut call left)
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from tercel import LLM, SamplingParams
from tercel.engine import LLMEngine
from tercel.train.export import random_eagle3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from dflash_utils import write_random_dflash  # noqa: E402


def main() -> None:
    # --device cpu: the same runs in fp32 under breakable-debug graphs (a check of this script without a GPU)
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    dev = dict(device="cuda", dtype="bfloat16") if device == "cuda" else dict(
        device="cpu", dtype="float32", cuda_graph_backend="breakable-debug")
    root = Path(tempfile.mkdtemp())
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "t")
    base = LLM(str(root / "t"), skip_tokenizer_init=True, progress=False, max_model_len=256,
               kv_cache_memory=64 << 20, cuda_graph_max_bs=4, **dev)
    head = random_eagle3(root / "e3", base.engine.model_config, draft_vocab_size=256, intermediate_size=128,
                        aux_layer_ids=(0, 1, 3))
    dflash = write_random_dflash(root / "df", vocab=512, hidden=128, num_target_layers=4, block_size=8,
                                 mask_token_id=511, target_layer_ids=[0, 1, 3])
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    runs = {"NGRAM": (dict(speculative_algorithm="NGRAM"), greedy),
            "EAGLE3-chain": (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head), greedy),
            "EAGLE3-chain-T1": (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head), sampled),
            "EAGLE3-tree": (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                                 speculative_eagle_topk=2, speculative_num_draft_tokens=6), greedy),
            "DFLASH": (dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(dflash)), greedy),
            "DDTREE": (dict(speculative_algorithm="DDTREE", speculative_draft_model_path=str(dflash),
                            speculative_ddtree_budget=6), greedy)}
    if "--runs" in sys.argv:
        wanted = sys.argv[sys.argv.index("--runs") + 1].split(",")
        bad = [w for w in wanted if w not in runs]
        if bad:
            raise SystemExit(f"--runs: unknown {bad}; choose from {', '.join(runs)}")
        runs = {k: v for k, v in runs.items() if k in wanted}
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    for name, (kw, params) in runs.items():
        eng = LLMEngine(loaded=base.engine.loaded, max_model_len=256, kv_cache_memory=64 << 20, cuda_graph_max_bs=4,
                        speculative_adaptive="off", **dev, **kw)
        for batch in (prompts[:1], prompts):
            ids = [eng.add_request(p, params) for p in batch]
            steps = 0
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
                if steps == 3 and len(ids) > 1:
                    eng.abort_request(ids[1])
        spec = eng.spec
        replays = spec.verify_runner.stats.replays
        chained = "" if spec.chain is None else (f", {spec.chain.runner.stats.replays} chained greedy, "
                                                 f"{spec.chain.sampled.stats.replays if spec.chain.sampled else 0} "
                                                 f"chained sampled")
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"{name}: {replays} verify replays, {spec.verify_runner.stats.eager} eager{chained}, KV used "
              f"{eng.stats().kv_blocks_used}", flush=True)


if __name__ == "__main__":
    main()
