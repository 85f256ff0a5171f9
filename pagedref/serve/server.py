"""The HTTP server around the app: uvicorn, with pagedref's start-up line and its shutdown.

One idea: a SIGTERM or SIGINT (or `Server.should_exit`) shuts the server down in four moves: stop
admitting (new requests get 503 while the socket still accepts), give the requests in flight
`shutdown_timeout` seconds to finish, abort the rest (their streams end with finish_reason "abort"
and `data: [DONE]`), then close the socket and stop the engine's process (the app's lifespan), which
frees the KV pool and exits. The process then exits 0: unlike uvicorn's own handling, the signal is not
raised again after the graceful shutdown, so a clean stop is a success.

Invariant: the "ready" line (`pagedref.serve: ready on http://HOST:PORT`) is printed only once the
socket listens, with the port it really got (`--port 0` picks a free one), so a script can wait on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import sys
import threading

import uvicorn

from pagedref.serve.async_engine import AsyncLLM

log = logging.getLogger("pagedref.serve")
READY = "pagedref.serve: ready on"


class Server(uvicorn.Server):
    """uvicorn's Server with pagedref's graceful shutdown (module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout: float = 5.0) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.port: int | None = None  # the port bound, once started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:  # start-up failed (uvicorn logged why)
            return
        self.port = self.servers[0].sockets[0].getsockname()[1]
        print(f"{READY} http://{_url_host(self.config.host)}:{self.port}", file=sys.stderr, flush=True)

    def handle_exit(self, sig, frame) -> None:
        self.engine.accepting = False  # at once: uvicorn notices should_exit only at its next 0.1 s tick
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        engine = self.engine
        engine.accepting = False
        if engine.num_open_streams:
            log.info("shutting down: %d request(s) in flight get %.1f s to finish", engine.num_open_streams,
                     self.shutdown_timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while engine.num_open_streams and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if engine.num_open_streams:
            log.info("shutting down: aborting %d request(s) still in flight", engine.num_open_streams)
            engine.abort_all()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without raising the signal again once shut down: a clean stop exits 0."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def raise_open_file_limit() -> None:
    """Soft limit of open files up to the hard one: one socket per client in flight, past the usual 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
