"""Peak memory and time of one EAGLE-3 training step (training-time test, forward + backward) with
the per-step head logits checkpointed (recomputed in backward, --checkpoint-logits) and kept (default).
The target has SmolLM2-135M's shape with random weights (labelled so); the draft serves the full
vocabulary through the target's head, as the bundled SmolLM2 draft does.

Usage: PYTHONPATH=. python benchmarks/ttt_memory.py [--device cuda] [--batch 64] [--seq 640]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, exact_dtype, write_result  # noqa: E402


def build(device: str, tmp: str):
    import transformers

    from tercel import LLM
    from tercel.loader.drafts import load_eagle_draft
    from tercel.train.export import random_eagle3

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                                   max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(f"{tmp}/t")
    eng = LLM(f"{tmp}/t", device=device, dtype=exact_dtype(device), skip_tokenizer_init=True, progress=False,
              max_model_len=1024, kv_cache_memory=256 << 20, disable_cuda_graph=True).engine
    tcfg = eng.model_config
    draft = load_eagle_draft(random_eagle3(f"{tmp}/d", tcfg, head_from_target=True), tcfg, torch.float32,
                             torch.device(device), 1024)
    draft.share_target(eng.model.embed_tokens.weight, eng.model.lm_head_weight)
    draft.requires_grad_(True)
    return eng.model, draft


def step(target, draft, ids, mask, device, checkpoint_logits: bool):
    from tercel.train.data import target_features
    from tercel.train.eagle3 import ttt_loss

    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda")
           else torch.autocast("cpu", enabled=False))
    with torch.no_grad(), amp:
        aux, final = target_features(target, ids, tuple(draft.config.aux_layer_ids))
    with amp:
        loss, _ = ttt_loss(draft, target.embed_tokens.weight, aux, final, target.lm_head_weight, ids, mask, 6,
                           checkpoint_logits=checkpoint_logits)
    draft.zero_grad(set_to_none=True)
    loss.backward()
    return float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=640)
    ap.add_argument("--label-share", type=float, default=0.5, help="share of rows that are response tokens")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build(args.device, tmp)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 49152, (args.batch, args.seq), generator=g).to(args.device)
        mask = torch.zeros(args.batch, args.seq, dtype=torch.bool)
        mask[:, int(args.seq * (1 - args.label_share)):] = True  # responses follow the prompts
        rows = {}
        for ckpt in (True, False):
            name = "checkpointed" if ckpt else "kept"
            try:
                step(target, draft, ids, mask, args.device, ckpt)  # warm-up
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times, losses = [], []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    losses.append(step(target, draft, ids, mask, args.device, ckpt))
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                rows[name] = {"step_ms": round(1e3 * statistics.median(times), 1), "loss": losses[0],
                              "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
            except torch.OutOfMemoryError as e:
                rows[name] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
                torch.cuda.empty_cache()
            print(name, rows[name], flush=True)
    write_result(f"ttt_memory_{'h200' if cuda else 'cpu'}", {
        "benchmark": "EAGLE-3 training step (TTT, 6 steps, full 49152 vocabulary): head logits checkpointed vs kept",
        "environment": environment(), "model": "SmolLM2-135M shape, random weights", "device": args.device,
        "batch": args.batch, "seq": args.seq, "label_rows": int(mask.sum()), "results": rows})


if __name__ == "__main__":
    main()
