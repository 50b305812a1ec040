"""Generate the self-distillation dataset (data.pt) once, for every draft trainer to share.

The target answers the offline prompts of tercel.train.data (held-out eval prompts excluded) with
Tercel's engine at a large batch; `tercel train-draft --out DIR` reuses DIR/data.pt when present.
Usage: PYTHONPATH=. python benchmarks/draft_data.py --out DIR [--model GGUF] [--device cuda]
       [--num-prompts 8000] [--max-new-tokens 320] [--batch 512] [--time-budget 150]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from tercel import LLM
from tercel.train.data import build_prompts, generate_responses, save_samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=8000)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--max-len", type=int, default=1024, help="prompt + response tokens")
    ap.add_argument("--batch", type=int, default=512, help="requests running at once (and CUDA-graph max bs)")
    ap.add_argument("--time-budget", type=float, default=None, help="stop starting new waves after this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, max_model_len=args.max_len, max_num_seqs=args.batch,
              max_num_batched_tokens=max(8192, 4 * args.batch), cuda_graph_max_bs=args.batch, progress=False)
    prompts = build_prompts(args.num_prompts, args.seed)
    samples = generate_responses(llm, prompts, args.max_new_tokens, 0.0, args.seed, use_tqdm=False,
                                 wave=2 * args.batch, time_budget_s=args.time_budget)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_samples(samples, out / "data.pt")
    n = sum(len(s.response) for s in samples)
    print(f"{len(samples)} samples of {len(prompts)} prompts, {n} response tokens, "
          f"{time.perf_counter() - t0:.0f} s -> {out / 'data.pt'}", flush=True)


if __name__ == "__main__":
    main()
