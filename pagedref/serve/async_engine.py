"""The async engine: one thread steps the `LLMEngine` while requests are pending; the HTTP handlers, on
the asyncio loop, add requests, read each one's outputs from a queue of its own, and abort them.

One idea: the engine has one caller. Every call into `LLMEngine` (`add_request`, `step`,
`abort_request`, `get_stats`) is made by the engine thread; a handler hands it a command, which the
thread runs between two steps. So requests join and leave the running batch only between steps
(continuous batching across HTTP requests), and a request aborted because its client went away has
its blocks freed before the next step is scheduled. Each step's outputs go to the loop in one
`call_soon_threadsafe`, each onto its request's queue; a reader that falls behind takes the newest
output only (each carries the whole token list so far), so a slow client costs the engine nothing.

Invariant: every request added is answered: its queue gets the engine's outputs for it, and ends with
a finished output, `Aborted` (shutdown), or the error that stopped the engine; once it has ended,
nothing of the request is left in the engine. Outputs are `LLM.generate`'s, bit for bit (CPU): the
engine's tokens do not depend on what else is in the batch, and nothing here touches them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pagedref import LLM, SamplingParams
from pagedref.engine.sequence import RequestOutput
from pagedref.serve.metrics import ServerMetrics

log = logging.getLogger("pagedref.serve")


class EngineShuttingDown(RuntimeError):
    """The server is shutting down: it admits no new request (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine thread stopped on an error; every request in flight ends with it (HTTP 500)."""


class Aborted(Exception):
    """The request was aborted by the server (shutdown) before it finished."""


class Disconnected(Exception):
    """The client went away (put on a request's queue by the handler's watcher)."""


@dataclass
class RequestState:
    """One engine request as the engine thread tracks it (engine-thread state only)."""

    request_id: str
    queue: asyncio.Queue  # (request_id, RequestOutput | BaseException), shared by the prompts of one HTTP request
    arrival_time: float  # time.monotonic() when the HTTP request arrived
    last_output_time: float | None = None
    finished: bool = False


class AsyncLLMEngine:
    """`LLM`'s engine driven by a background thread; `generate` is an async iterator of outputs."""

    def __init__(self, llm: LLM, metrics: ServerMetrics | None = None) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.metrics = metrics
        self.accepting = True  # False once shutdown begins: new requests get EngineShuttingDown
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._requests: dict[str, RequestState] = {}  # engine thread only
        self.num_open_streams = 0  # RequestStreams submitted and not yet closed (loop only): the shutdown waits on them
        self._thread = threading.Thread(target=self._run, name="pagedref-engine", daemon=True)

    # --- life cycle (called on the loop) ------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def abort_all(self) -> None:
        """Abort every request in flight; each one's queue gets `Aborted` (shutdown's last resort)."""
        self._submit(self._abort_all)

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """Abort what is left, stop the thread, and return the engine's final stats (the pool should be free)."""
        self.accepting = False
        self._submit(self._abort_all)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine thread did not stop within {timeout} s")
        return {**self.engine.get_stats(), **self.engine.get_num_requests_by_state()}

    # --- requests (called on the loop) --------------------------------------------------------------
    def submit(self, requests: list[tuple[str, dict[str, Any], SamplingParams]], arrival_time: float) -> "RequestStream":
        """Add requests (request_id, prompt, params), which one HTTP request makes (one per prompt), and return
        the stream of their outputs. Raises at once, adding nothing, when the server admits no request."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {type(self.error).__name__}: {self.error}")
        if not self.accepting:
            raise EngineShuttingDown("the server is shutting down")
        stream = RequestStream(self, asyncio.Queue(), {rid for rid, _, _ in requests})
        self.num_open_streams += 1
        for rid, prompt, params in requests:
            state = RequestState(rid, stream.queue, arrival_time)
            self._submit(lambda state=state, prompt=prompt, params=params: self._add(state, prompt, params))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests between two steps (unknown or finished ids are ignored)."""
        if request_ids:
            self._submit(lambda: self._abort(request_ids))

    async def get_stats(self) -> dict[str, Any]:
        """The engine's stats and request counts, read on the engine thread between two steps."""
        if not self._thread.is_alive():  # stopped (or never started): nobody else touches the engine
            return {**self.engine.get_stats(), **self.engine.get_num_requests_by_state()}
        future: concurrent.futures.Future = concurrent.futures.Future()

        def read() -> None:
            try:
                future.set_result({**self.engine.get_stats(), **self.engine.get_num_requests_by_state()})
            except BaseException as err:  # handed to the reader, not raised on the engine thread
                future.set_exception(err)

        self._submit(read)
        return await asyncio.wrap_future(future)

    # --- the engine thread ---------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _run(self) -> None:
        busy = False
        try:
            while True:
                with self._wake:
                    while not self._commands and not busy and not self._stopping:
                        self._wake.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                for command in commands:  # between two steps: joins, aborts, stats reads
                    command()
                if stopping and not self._commands:
                    return
                busy = self.engine.has_unfinished_requests()
                if busy:
                    self._hand_out(self.engine.step())
                    busy = self.engine.has_unfinished_requests()
        except BaseException as err:  # the engine is in an unknown state: fail every request, admit no more
            log.exception("the engine thread stopped on an error")
            self.error = err
            dead = EngineDead(f"the engine stopped: {type(err).__name__}: {err}")
            self._post([(s.queue, (rid, dead)) for rid, s in self._requests.items()])
            self._requests.clear()

    def _add(self, state: RequestState, prompt: dict[str, Any], params: SamplingParams) -> None:
        try:
            self.engine.add_request(state.request_id, prompt, params)
        except (TypeError, ValueError) as err:  # checked by the handler already; a late refusal still answers
            self._post([(state.queue, (state.request_id, err))])
            return
        self._requests[state.request_id] = state

    def _abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._requests]
        for rid in ids:
            del self._requests[rid]
        self.engine.abort_request(ids)  # frees their blocks now, before the next step
        if self.metrics is not None and ids:
            self.metrics.num_aborted_requests.inc(len(ids))

    def _abort_all(self) -> None:
        states = list(self._requests.items())
        self._abort([rid for rid, _ in states])
        self._post([(s.queue, (rid, Aborted("the server is shutting down"))) for rid, s in states])

    def _hand_out(self, outputs: list[RequestOutput]) -> None:
        """This step's outputs onto their queues (one wake-up of the loop), and the latency figures."""
        now = time.monotonic()
        items = []
        m = self.metrics
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:  # aborted by a command of this step's batch: nobody is reading it
                continue
            if m is not None:
                if state.last_output_time is None:
                    m.time_to_first_token.observe(now - state.arrival_time)
                else:
                    m.inter_token_latency.observe(now - state.last_output_time)
            state.last_output_time = now
            if out.finished:
                del self._requests[out.request_id]
                if m is not None:
                    m.e2e_request_latency.observe(now - state.arrival_time)
                    m.request_success.labels(out.outputs[0].finish_reason or "unknown").inc()
            items.append((state.queue, (out.request_id, out)))
        self._post(items)

    def _post(self, items: list[tuple[asyncio.Queue, Any]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class RequestStream:
    """The outputs of one HTTP request's engine requests: `async for request_id, output in stream`.

    Each iteration yields the newest output of a request that advanced (a reader that fell behind skips
    the older ones: each output holds the whole token list so far), until every request has finished.
    `close()` aborts the unfinished ones: the handler calls it whatever way it ends, and so does the
    disconnect watcher the moment the client goes away (`disconnect()`), even while the handler waits
    elsewhere.
    """

    def __init__(self, engine: AsyncLLMEngine, queue: asyncio.Queue, request_ids: set[str]) -> None:
        self.engine = engine
        self.queue = queue
        self.unfinished = set(request_ids)
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[tuple[str, RequestOutput]]:
        while self.unfinished:
            newest: dict[str, RequestOutput] = {}
            item = await self.queue.get()
            while True:  # everything there is now
                rid, out = item
                if isinstance(out, BaseException):
                    raise out
                newest[rid] = out
                if self.queue.empty():
                    break
                item = self.queue.get_nowait()
            for rid, out in newest.items():
                if out.finished:
                    self.unfinished.discard(rid)
                yield rid, out

    def close(self) -> None:
        """Abort the requests that have not finished (nothing if all have). Idempotent."""
        ids, self.unfinished = sorted(self.unfinished), set()
        self.engine.abort(ids)
        if not self.closed:
            self.closed = True
            self.engine.num_open_streams -= 1

    def disconnect(self) -> None:
        """The client went away: abort now, and wake the reader with `Disconnected`."""
        self.close()
        self.queue.put_nowait((None, Disconnected("the client disconnected")))
