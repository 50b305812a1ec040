"""A small speculative run for `compute-sanitizer --tool memcheck`: a random-weight Llama (HF format, made
here) and a random EAGLE-3 head, bf16 on the GPU with every speculative graph captured (verify with and
without tree masks, the draft loop, draft_extend), NGRAM / EAGLE3 chain / EAGLE3 tree at batch 1 and 4,
with a request aborted mid-run. Prints one line per run; memcheck's summary says whether any access was bad.

Usage: PYTHONPATH=. compute-sanitizer --tool memcheck python benchmarks/spec_memcheck.py
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers

from tercel import LLM, SamplingParams
from tercel.engine import LLMEngine
from tercel.train.export import random_eagle3


def main() -> None:
    root = Path(tempfile.mkdtemp())
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "t")
    base = LLM(str(root / "t"), dtype="bfloat16", device="cuda", skip_tokenizer_init=True, progress=False,
               max_model_len=256, kv_cache_memory=64 << 20, cuda_graph_max_bs=4)
    head = random_eagle3(root / "e3", base.engine.model_config, draft_vocab_size=256, intermediate_size=128,
                        aux_layer_ids=(0, 1, 3))
    runs = {"NGRAM": dict(speculative_algorithm="NGRAM"),
            "EAGLE3-chain": dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head),
            "EAGLE3-tree": dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                                speculative_eagle_topk=2, speculative_num_draft_tokens=6)}
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for name, kw in runs.items():
        eng = LLMEngine(loaded=base.engine.loaded, dtype="bfloat16", device="cuda", max_model_len=256,
                        kv_cache_memory=64 << 20, cuda_graph_max_bs=4, **kw)
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
        torch.cuda.synchronize()
        print(f"{name}: {replays} verify replays, {spec.verify_runner.stats.eager} eager, KV used "
              f"{eng.stats().kv_blocks_used}", flush=True)


if __name__ == "__main__":
    main()
