"""`python -m pagedref.serve`: the OpenAI-compatible HTTP server (vLLM's `vllm serve`), on the CLI.

One idea: the engine flags are `pagedref.generate`'s own (`add_engine_args`: one definition), plus
the server's (--host, --port, --served-model-name, --api-key, ...); everything is checked and the model
loaded (by the engine's process, `pagedref.serve.engine_core`) before the socket opens, so a bad flag or
model is an argparse-style error (exit status 2) and a server that printed its "ready" line serves.

    python -m pagedref.serve                                  # the embedded default model on 127.0.0.1:8000
    python -m pagedref.serve --model tests/models/stories260K --port 8001 --api-key secret
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "# Stage 6", "max_tokens": 32, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedref.generate import add_engine_args, check_engine_ranges, engine_kwargs, resolve_device, resolve_model

MiB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedref.serve",
                                description="An OpenAI-compatible HTTP server (completions, chat completions, streaming) "
                                            "on pagedref's engine. With no --model: the small model embedded in the package.")
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0, help="the engine's seed: requests that give no seed draw theirs from it")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port; the ready line says which)")
    s.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model as given, or 'pagedref-default' for the embedded model)")
    s.add_argument("--api-key", default=os.environ.get("PAGEDREF_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDREF_API_KEY; none: open)")
    s.add_argument("--max-request-bytes", type=int, default=10 * MiB, help="largest request body accepted (413 beyond)")
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are aborted")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False, help="log every HTTP request")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_engine_ranges(parser, args)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key is empty")
    model_dir = resolve_model(parser, args.model)
    device = resolve_device(args.device, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    import uvicorn

    from pagedref.serve.api import ServerConfig, build_app
    from pagedref.serve.async_engine import AsyncLLM, EngineStartError
    from pagedref.serve.server import Server, raise_open_file_limit

    try:  # the engine's process loads the model; the refusals the engine makes of its arguments are usage errors
        engine = AsyncLLM({**engine_kwargs(args, model_dir, device), "seed": args.seed},
                          log_level=logging.getLogger().getEffectiveLevel())
    except EngineStartError as err:
        if err.kind not in ("TypeError", "ValueError", "FileNotFoundError"):
            raise
        parser.error(str(err))
    try:
        name = args.served_model_name or (args.model if args.model is not None else "pagedref-default")
        app = build_app(engine, ServerConfig(name, model_dir, args.api_key, args.max_request_bytes))
        f = engine.facts
        logging.getLogger("pagedref.serve").info(
            "serving %s as %r on %s (%s), %d KV blocks of %d tokens, max_model_len %d; engine process %d", model_dir, name,
            f.device, f.dtype, f.num_blocks, f.block_size, f.max_model_len, f.pid)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
                                timeout_graceful_shutdown=max(args.shutdown_timeout, 1.0) + 5.0, lifespan="on")
        server = Server(config, engine, args.shutdown_timeout)
        raise_open_file_limit()
        server.run()
        if not server.started:  # the socket could not be bound (uvicorn logged why)
            return 1
    finally:
        engine.shutdown()  # the engine's process is gone (it exited after the lifespan's stop, or is ended now)
    return 0

if __name__ == "__main__":
    sys.exit(main())
