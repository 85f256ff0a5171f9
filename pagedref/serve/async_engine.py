"""The async engine, the server's side of the engine core: requests go to the engine's process, each
step's new tokens come back, and each HTTP request reads its outputs from a queue of its own.

One idea: the event loop never waits on the engine, and the engine never waits on the loop. The engine
runs in its own process (`pagedref.serve.engine_core`, started here with multiprocessing's spawn
context), so the loop's work (HTTP, JSON, detokenization, socket writes) does not hold the GIL the
engine's host work needs. The loop sends commands down a pipe (add, abort, stats) and reads the core's
messages as the pipe becomes readable (`loop.add_reader`): one message per step, holding each advanced
request's new tokens. Here they are appended to the request's token lists (append-only, so an output
handed to a reader stays valid as the lists grow) and a `RequestOutput` of the tokens so far goes onto
the request's queue; a reader that falls behind takes the newest output only, so a slow client costs
the engine nothing.

The prompts and parameters are checked here, before anything is sent, by the engine's own checks
(`LLMEngine.process_prompt` and `check_params`, on the tokenizer and the `EngineFacts` the core reports):
a bad request is a 400 and never reaches the engine.

Invariant: every request added is answered: its queue gets its outputs, and ends with a finished
output, `Aborted` (shutdown), or the error that stopped the engine (`EngineDead`: the core raised, or its
process died); once it has ended, nothing of the request is left in the engine. Outputs are
`LLM.generate`'s, bit for bit (CPU): the engine's tokens do not depend on what else is in the batch,
and nothing here touches them. The core process never outlives `shutdown()` (nor this process).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pagedref import SamplingParams
from pagedref.engine.block_manager import ContiguousBlockManager
from pagedref.engine.llm import LLMEngine
from pagedref.engine.sequence import CompletionOutput, RequestOutput
from pagedref.serve.engine_core import EngineFacts, RequestDelta, run_engine_core
from pagedref.serve.metrics import ServerMetrics

log = logging.getLogger("pagedref.serve")

MAX_MESSAGES_PER_WAKEUP = 16  # an engine stepping faster than the loop writes cannot keep the loop from writing


class EngineStartError(RuntimeError):
    """The engine process could not load the engine (a bad flag or model): `kind` names the error's type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class EngineShuttingDown(RuntimeError):
    """The server is shutting down: it admits no new request (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine core stopped on an error, or its process died; every request in flight ends with it (HTTP 500)."""


class Aborted(Exception):
    """The request was aborted by the server (shutdown) before it finished."""


class Disconnected(Exception):
    """The client went away (put on a request's queue by the handler's watcher)."""


class _EngineChecks:
    """The engine's own input checks, run here on what the core reported: `LLMEngine.process_prompt` reads
    the tokenizer, max_model_len and vocab_size; `check_params` max_logprobs and the block manager's kind."""

    process_prompt = LLMEngine.process_prompt
    check_params = LLMEngine.check_params

    def __init__(self, tokenizer, facts: EngineFacts) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.max_logprobs = facts.max_logprobs
        # check_params asks only whether blocks can be shared (isinstance): an instance of the kind, never used
        self.block_manager = ContiguousBlockManager.__new__(ContiguousBlockManager) if facts.kv_cache == "contiguous" else None


@dataclass
class RequestState:
    """One engine request as the frontend tracks it (loop only): its queue and the tokens so far."""

    request_id: str
    queue: asyncio.Queue  # (request_id, RequestOutput | BaseException), shared by the prompts of one HTTP request
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # the newest, one per sample; their token_ids and logprobs lists grow in place
    arrival_time: float  # time.monotonic() when the HTTP request arrived
    last_output_time: float | None = None


class AsyncLLM:
    """The engine in its own process; `submit` returns an async iterator of each request's outputs.

    Made (and the engine loaded, in the child) before the event loop runs: a model or flag the engine
    refuses raises `EngineStartError` here. `start(loop)` attaches the core's pipe to the loop;
    `await stop()` aborts what is left and ends the core (its final stats: the pool should be free);
    `shutdown()` makes sure the process is gone whatever happened (call it last, in a `finally`).
    """

    def __init__(self, llm_kwargs: dict[str, Any], metrics: ServerMetrics | None = None,
                 start_timeout: float = 3600.0, log_level: int = logging.INFO, core: Callable = run_engine_core) -> None:
        """`llm_kwargs`: `LLM(...)`'s, for the engine's process; `core`: that process' entry point (a module-level
        function of run_engine_core's arguments; tests give one that wraps it)."""
        from pagedref.models import load_tokenizer

        ctx = multiprocessing.get_context("spawn")  # torch / CUDA start fresh in the child, never forked
        core_commands, self._commands = ctx.Pipe(duplex=False)  # (reader, writer): server -> core
        self._outputs, core_outputs = ctx.Pipe(duplex=False)  # core -> server
        self.process = ctx.Process(target=core, args=(llm_kwargs, core_commands, core_outputs, log_level),
                                   name="pagedref-engine-core")
        self.process.start()
        core_commands.close()  # the child's now: closed here, so that its exit reads as the pipe's end here
        core_outputs.close()
        self.metrics = metrics
        self.accepting = True  # False once shutdown begins: new requests get EngineShuttingDown
        self.error: BaseException | None = None  # what stopped the engine, if anything did
        self.num_open_streams = 0  # RequestStreams submitted and not yet closed: the shutdown waits on them
        self.final_stats: dict[str, Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests: dict[str, RequestState] = {}
        self._pending: dict[int | str, asyncio.Future] = {}  # stats reads by token, and "stopped"
        self._tokens = itertools.count()
        try:
            self.facts = self._wait_ready(start_timeout)
            self.tokenizer = load_tokenizer(llm_kwargs["model"])
        except BaseException:
            self.shutdown()
            raise
        self.checks = _EngineChecks(self.tokenizer, self.facts)

    def _wait_ready(self, timeout: float) -> EngineFacts:
        if not self._outputs.poll(timeout):
            raise RuntimeError(f"the engine process did not get ready within {timeout:.0f} s")
        try:
            message = self._outputs.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited (status {self.process.exitcode}) while loading") from None
        if message[0] == "failed":
            raise EngineStartError(message[1], message[2])
        return message[1]

    # --- life cycle (called on the loop) ------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._outputs.fileno(), self._on_readable)

    @property
    def is_running(self) -> bool:
        return self._loop is not None and self.error is None and self.process.is_alive()

    def abort_all(self) -> None:
        """Abort every request in flight; each one's queue gets `Aborted` (shutdown's last resort)."""
        states = list(self._requests.values())
        self._abort([s.request_id for s in states])
        for s in states:
            s.queue.put_nowait((s.request_id, Aborted("the server is shutting down")))

    async def stop(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """Abort what is left, stop the core, and return the engine's final stats (the pool should be free);
        None when the engine had stopped on an error already."""
        self.accepting = False
        self.abort_all()
        if self.error is None:
            stopped = self._ask(("shutdown",), key="stopped")
            try:
                self.final_stats = await asyncio.wait_for(stopped, timeout)
            except (asyncio.TimeoutError, EngineDead) as err:
                log.warning("the engine core did not stop cleanly: %s", err)
        self._detach()
        await asyncio.to_thread(self.shutdown, timeout)
        return self.final_stats

    def shutdown(self, timeout: float = 30.0) -> None:
        """Make sure the engine process is gone: it exits by itself after "shutdown" (or at the end of its
        command pipe, closed here); killed if it does not within `timeout` seconds (it ignores SIGTERM)."""
        for conn in (self._commands, self._outputs):
            conn.close()
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine process did not exit within %.0f s: killing it", timeout)
            self.process.kill()
            self.process.join()

    def _detach(self) -> None:
        if self._loop is not None and not self._outputs.closed:
            self._loop.remove_reader(self._outputs.fileno())

    # --- requests (called on the loop) --------------------------------------------------------------
    def submit(self, requests: list[tuple[str, dict[str, Any], SamplingParams]], arrival_time: float) -> "RequestStream":
        """Add requests (request_id, prompt, params), which one HTTP request makes (one per prompt), and return
        the stream of their outputs. Raises at once, adding nothing, when the server admits no request."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {self.error}")
        if not self.accepting:
            raise EngineShuttingDown("the server is shutting down")
        stream = RequestStream(self, asyncio.Queue(), {rid for rid, _, _ in requests})
        self.num_open_streams += 1
        for rid, prompt, params in requests:
            outputs = [CompletionOutput(i, [], None, [] if params.logprobs is not None else None) for i in range(params.n)]
            self._requests[rid] = RequestState(rid, stream.queue, prompt.get("prompt"), prompt["prompt_token_ids"], outputs,
                                               arrival_time)
            self._send(("add", rid, prompt, params))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (unknown or finished ids are ignored); the core frees their blocks before its next step."""
        self._abort([rid for rid in request_ids if rid in self._requests])

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            del self._requests[rid]
        if request_ids:
            self._send(("abort", request_ids))
            if self.metrics is not None:
                self.metrics.num_aborted_requests.inc(len(request_ids))

    async def get_stats(self) -> dict[str, Any]:
        """The engine's stats and request counts, read by the core between two steps ({} once the engine died:
        /metrics still shows the server's own figures)."""
        if self.final_stats is not None:
            return self.final_stats
        if self.error is not None:
            return {}
        try:
            return await self._ask(("stats",))
        except EngineDead:
            return {}

    def _ask(self, command: tuple, key: str = "stats") -> asyncio.Future:
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        self._pending[token if key == "stats" else key] = future
        self._send(command + ((token,) if key == "stats" else ()))
        return future

    def _send(self, command: tuple) -> None:
        if self.error is not None:
            return
        try:
            self._commands.send(command)
        except (BrokenPipeError, ConnectionResetError, OSError) as err:  # the core is gone: its EOF follows
            self._fail(f"the engine process is gone ({type(err).__name__})")

    # --- the core's messages (on the loop) ------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            for _ in range(MAX_MESSAGES_PER_WAKEUP):  # then the streams' writers run: the loop calls again if more came
                self._handle(self._outputs.recv())
                if not self._outputs.poll():
                    break
        except (EOFError, OSError):
            self._detach()
            if self.final_stats is None:  # not after "stopped": then the end of the pipe is the core's clean exit
                self.process.join(1)
                self._fail(f"the engine process exited unexpectedly (exit status {self.process.exitcode})")

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            self._hand_out(message[1])
        elif kind == "stats":
            future = self._pending.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "rejected":
            state = self._requests.pop(message[1], None)
            if state is not None:
                state.queue.put_nowait((state.request_id, ValueError(message[2])))
        elif kind == "stopped":
            self.final_stats = message[1]
            future = self._pending.pop("stopped", None)
            if future is not None and not future.done():
                future.set_result(message[1])
        elif kind == "dead":
            self._fail(message[1])

    def _fail(self, message: str) -> None:
        """The engine is gone: every request in flight ends with EngineDead, and none is admitted."""
        if self.error is not None:
            return
        log.error("the engine stopped: %s", message)
        self.error = EngineDead(message)
        dead = EngineDead(f"the engine stopped: {message}")
        for rid, state in self._requests.items():
            state.queue.put_nowait((rid, dead))
        self._requests.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(dead)
        self._pending.clear()

    def _hand_out(self, deltas: list[RequestDelta]) -> None:
        """One step's new tokens onto their requests (and their queues), and the latency figures."""
        now = time.monotonic()
        m = self.metrics
        for delta in deltas:
            state = self._requests.get(delta.request_id)
            if state is None:  # aborted here after the core made this step: nobody is reading it
                continue
            for d in delta.seqs:
                # The lists grow in place, so a step costs O(new tokens), and an output already queued stays valid: a
                # reader reads a list up to its length when it takes the output, and every token it finds is final.
                c = state.outputs[d.index]
                c.token_ids.extend(d.new_token_ids)
                if d.new_logprobs is not None:
                    c.logprobs.extend(d.new_logprobs)
                state.outputs[d.index] = CompletionOutput(d.index, c.token_ids, d.cumulative_logprob, c.logprobs,
                                                          d.finish_reason, d.stop_reason, _text=d.text)
            if m is not None:
                if state.last_output_time is None:
                    m.time_to_first_token.observe(now - state.arrival_time)
                else:
                    m.inter_token_latency.observe(now - state.last_output_time)
            state.last_output_time = now
            if delta.finished:
                del self._requests[delta.request_id]
                if m is not None:
                    m.e2e_request_latency.observe(now - state.arrival_time)
                    m.request_success.labels(state.outputs[0].finish_reason or "unknown").inc()
            out = RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, list(state.outputs), delta.finished)
            state.queue.put_nowait((state.request_id, out))


class RequestStream:
    """The outputs of one HTTP request's engine requests: `async for request_id, output in stream`.

    Each iteration yields the newest output of a request that advanced (a reader that fell behind skips
    the older ones: each output holds the whole token list so far), until every request has finished.
    An error that ends them (the engine stopped, a shutdown) is raised after the outputs queued before
    it: the tokens of the steps that ran still reach the client.
    `close()` aborts the unfinished ones: the handler calls it whatever way it ends, and so does the
    disconnect watcher the moment the client goes away (`disconnect()`), even while the handler waits
    elsewhere.
    """

    def __init__(self, engine: AsyncLLM, queue: asyncio.Queue, request_ids: set[str]) -> None:
        self.engine = engine
        self.queue = queue
        self.unfinished = set(request_ids)
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[tuple[str, RequestOutput]]:
        while self.unfinished:
            newest: dict[str, RequestOutput] = {}
            error: BaseException | None = None
            item = await self.queue.get()
            while True:  # everything there is now
                rid, out = item
                if isinstance(out, BaseException):
                    if isinstance(out, Disconnected) or not newest:
                        raise out  # (nobody to write to; or nothing came before it)
                    error = out  # the engine stopped after these steps: their tokens go out first, then the error
                    break
                newest[rid] = out
                if self.queue.empty():
                    break
                item = self.queue.get_nowait()
            for rid, out in newest.items():
                if out.finished:
                    self.unfinished.discard(rid)
                yield rid, out
            if error is not None:
                raise error

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
