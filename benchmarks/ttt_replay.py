"""Is the chain's accept length held back by the engine or by the draft? Replays the trainer's
training-time test (TTT) on the held-out prompts and compares it with the engine.

For each held-out prompt the target answers greedily (fp32); the TTT forward of tercel.train.eagle3
then runs over prompt + answer, teacher-forced, and gives the draft's top-1 at every row and step.
A chain of `steps` drafted at row i accepts the longest run of steps whose top-1 equals the answer's
next tokens (with greedy verification the drafted inputs equal the teacher-forced ones exactly while
the chain is still accepted). Walking the answer verify by verify gives the accept length the trainer
"expects"; the engine's own speculative run gives the measured one. Equal numbers mean the engine
drafts what the draft learned, and the draft's accuracy is what limits the chain.

Usage: PYTHONPATH=. python benchmarks/ttt_replay.py [--draft DIR] [--steps 5] [--max-tokens 128]
       [--out benchmarks/results/ttt_replay_smollm2_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402


def ttt_top1(draft, target, seq: list[int], steps: int) -> torch.Tensor:
    """[len(seq), steps] draft top-1 (target ids) of the TTT forward over seq; row i, step j predicts
    seq[i + 2 + j] (-1 where that is past the end)."""
    from tercel.train.data import target_features
    from tercel.train.eagle3 import TTTRows, ttt_loss

    ids = torch.tensor([seq])
    mask = torch.ones_like(ids, dtype=torch.bool)
    aux, final = target_features(target, ids, tuple(sorted(draft.config.aux_layer_ids)))
    caught, orig = [], draft.compute_logits

    def spy(h: torch.Tensor) -> torch.Tensor:
        logits = orig(h)
        caught.append(logits.argmax(-1))
        return logits

    draft.compute_logits = spy
    try:
        ttt_loss(draft, target.embed_tokens.weight, aux, final, target.lm_head_weight[draft.draft_to_target],
                 ids, mask, steps)
    finally:
        draft.compute_logits = orig
    rows = TTTRows.of(mask, steps, ids.device).label_rows
    top1 = torch.full((len(seq), steps), -1, dtype=torch.long)
    for j in range(steps):
        top1[rows[j], j] = draft.draft_to_target[caught[j]]
    return top1


def replay_chain(top1: torch.Tensor, seq: list[int], prompt_len: int) -> list[int]:
    """Accepted drafts per verify step of a greedy chain over the answer seq[prompt_len:]: after the
    prefill the target has emitted seq[prompt_len]; each verify at row i accepts the run of steps
    whose top-1 matches, then emits the bonus token."""
    steps = top1.shape[1]
    x = torch.tensor(seq)
    last = len(seq) - 1
    i, accepted = prompt_len - 1, []
    while i + 1 < last:
        a = 0
        while a < steps and i + 2 + a <= last and top1[i, a] == x[i + 2 + a]:
            a += 1
        accepted.append(a)
        i += a + 1
    return accepted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft dir (default: the bundled SmolLM2 head)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ttt_replay_smollm2_cpu.json"))
    args = ap.parse_args()
    from tercel import LLM, SamplingParams
    from tercel.engine import LLMEngine
    from tercel.loader.drafts import load_eagle_draft
    from tercel.speculative import DEFAULT_EAGLE3_DRAFT
    from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    torch.manual_seed(0)
    draft_dir = args.draft or str(DEFAULT_EAGLE3_DRAFT)
    base = LLM(args.model, device="cpu", dtype="float32", progress=False, kv_cache_memory=1 << 30)
    eng, tok = base.engine, base.tokenizer
    spec = LLM.__new__(LLM)
    spec.engine = LLMEngine(loaded=eng.loaded, device="cpu", dtype=eng.dtype, kv_cache_memory=1 << 30,
                            speculative_algorithm="EAGLE3", speculative_draft_model_path=draft_dir,
                            speculative_num_steps=args.steps, speculative_eagle_topk=1)
    draft = load_eagle_draft(draft_dir, eng.model_config, torch.float32, torch.device("cpu"), 4096)
    draft.share_target(eng.model.embed_tokens.weight, eng.model.lm_head_weight)
    results = {}
    with torch.no_grad():
        for name, prompts in (("chat", EVAL_CHAT_PROMPTS), ("code", EVAL_CODE_PROMPTS)):
            ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=0) for _ in ids]
            plain = base.generate(ids, params)
            measured = spec.generate(ids, params)
            accepted: list[int] = []
            hits = [0] * args.steps
            rows = 0
            for p, out in zip(ids, plain):
                seq = p + list(out.outputs[0].token_ids)
                x = torch.tensor(seq)
                top1 = ttt_top1(draft, eng.model, seq, args.steps)
                accepted += replay_chain(top1, seq, len(p))
                for j in range(args.steps):  # teacher-forced top-1 accuracy of step j over the answer's rows
                    r = torch.arange(len(p) - 1, len(seq) - 2 - j)
                    hits[j] += int((top1[r, j] == x[r + 2 + j]).sum())
                rows += len(seq) - len(p) - 1
            steps_m = sum(o.metrics.spec_verify_steps for o in measured)
            acc_m = sum(o.metrics.spec_accepted_tokens for o in measured)
            hist_m: list[int] = [0] * (args.steps + 1)
            for o in measured:
                for k, c in enumerate(o.metrics.spec_accept_histogram):
                    hist_m[k] += c
            same_tokens = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, measured))
            results[name] = {
                "engine": {"mean_accept_length": round((acc_m + steps_m) / max(1, steps_m), 3), "verify_steps": steps_m,
                           "accepted_drafts_histogram": hist_m},
                "ttt_replay": {"mean_accept_length": round((sum(accepted) + len(accepted)) / max(1, len(accepted)), 3),
                               "verify_steps": len(accepted),
                               "accepted_drafts_histogram": [accepted.count(k) for k in range(args.steps + 1)]},
                "teacher_forced_top1_accuracy_per_step": [round(h / max(1, rows - j), 3) for j, h in enumerate(hits)],
                "speculative_tokens_equal_plain": same_tokens,
            }
            r = results[name]
            print(f"{name}: engine {r['engine']['mean_accept_length']:.3f} ({steps_m} verifies), TTT replay "
                  f"{r['ttt_replay']['mean_accept_length']:.3f} ({len(accepted)}), teacher-forced top-1 per step "
                  f"{r['teacher_forced_top1_accuracy_per_step']}", flush=True)
    payload = {"benchmark": "TTT replay: the chain accept length the trainer's forward predicts vs the engine's, "
                            "held-out prompts (tercel.train.data EVAL_*_PROMPTS), T=0, fp32 CPU",
               "environment": environment(), "model": args.model or "SmolLM2-135M-Instruct (default)",
               "draft": draft_dir, "num_steps": args.steps, "max_tokens": args.max_tokens, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
