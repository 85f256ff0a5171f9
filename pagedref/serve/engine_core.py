"""The engine core: `LLMEngine` in a process of its own, stepping in a busy loop (vLLM v1's EngineCore).

One idea: the HTTP server's event loop (JSON, detokenization, one socket write per stream per step) and
the engine's host work (schedule, prepare, update) must not share one GIL, or every token the server
writes delays the next step. So the server (the frontend, `pagedref.serve.async_engine`) starts this
process (multiprocessing's spawn context: torch and CUDA are initialized here only) and talks to it over
two pipes:

    frontend -> core   ("add", request_id, prompt, params) | ("abort", [request_id, ...])
                       | ("stats", token) | ("shutdown",)
    core -> frontend   ("ready", EngineFacts) | ("failed", error type, message)   once, at start-up
                       ("step", [RequestDelta, ...])   one message per step that made tokens
                       ("stats", token, stats) | ("rejected", request_id, message) | ("dead", message)
                       ("stopped", stats)   the answer to "shutdown", the last message

A `RequestDelta` carries, per sequence that advanced, only the tokens new since the last message (and
their logprobs, if asked), plus the finish reason and the final text once it finishes: what crosses the
pipe per step is O(new tokens), however long the completions grow.

Commands are read by a thread of this process and run by the loop between two steps, so requests join
and leave the batch only between steps, and an abort frees its blocks before the next step. Messages
are pickled and written by another thread, in order, so the loop never waits on the pipe (a frontend
busy for a moment does not stall the engine) and the pickling overlaps the step's wait for the GPU.

Invariant: every request added is answered, by deltas ending in a finished one, a "rejected", or the
"dead" that stopped the core; after "stopped" (or "dead") nothing of any request is left in the engine.
The core never outlives the frontend: the command pipe's end of file (the frontend died) ends it. It
ignores SIGINT and SIGTERM (a signal to the process group reaches it too): the frontend stops it.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pagedref.serve")


@dataclass(frozen=True)
class EngineFacts:
    """What the frontend needs to know of the engine to check requests itself (the engine's own checks,
    `LLMEngine.process_prompt` and `check_params`, read only these) and to describe it."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    kv_cache: str  # "paged" or "contiguous"
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    pid: int  # the engine core's process id


@dataclass
class SeqDelta:
    """One sequence's progress since the last message."""

    index: int  # which of the request's n samples
    new_token_ids: list[int]
    new_logprobs: list[dict] | None  # the new tokens' {token_id: Logprob}, when logprobs were asked
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # the final text (the engine's, stop strings cut), once finished


@dataclass
class RequestDelta:
    request_id: str
    seqs: list[SeqDelta]
    finished: bool


def run_engine_core(llm_kwargs: dict[str, Any], commands, outputs, log_level: int = logging.INFO) -> None:
    """The process' entry point: load the engine, say "ready" (or "failed"), then serve commands and step."""
    # A Ctrl-C, or a SIGTERM sent to the whole process group (systemd, `timeout`), reaches this process too: the
    # frontend decides, and stops this one in order ("shutdown") after its in-flight requests had their chance.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    core = EngineCore(commands, outputs, own_process=True)  # reads commands from now on: a dead frontend ends loading
    try:
        from pagedref import LLM

        llm = LLM(**llm_kwargs)
    except BaseException as err:  # the frontend reports it (a bad flag or model is a usage error there)
        core.send(("failed", type(err).__name__, str(err)))
        core.close()
        return
    try:
        core.serve(llm)
    finally:
        llm.close()


class EngineCore:
    """The loop: commands between steps, one "step" message per step that made tokens."""

    def __init__(self, commands, outputs, own_process: bool = False) -> None:
        """own_process: this process is the core's alone, and ends at once if the frontend dies while the
        engine still loads (nothing else would notice: loading is not a loop)."""
        self.own_process = own_process
        self.commands_in = commands
        self.outputs = outputs
        self.engine = None
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()  # None: no more messages
        self._commands: deque[tuple | None] = deque()  # None: the frontend is gone
        self._wake = threading.Condition()
        self._serving = False
        self._sent: dict[str, list[list]] = {}  # request id -> per sequence index [tokens sent, finished sent]
        threading.Thread(target=self._read, name="pagedref-engine-commands", daemon=True).start()
        self._writer = threading.Thread(target=self._write, name="pagedref-engine-outputs", daemon=True)
        self._writer.start()

    def send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.outputs.send(message)
            except (BrokenPipeError, ConnectionResetError, OSError):  # the frontend is gone: nobody to tell
                return

    def close(self) -> None:
        """Every message sent so far written, then the writer stopped."""
        self._outbox.put(None)
        self._writer.join()

    def _read(self) -> None:
        """Commands into the queue as they come, so the frontend's sends never wait on a step."""
        while True:
            try:
                command = self.commands_in.recv()
            except (EOFError, OSError):
                command = None
            if command is None and not self._serving and self.own_process:  # the frontend died while the engine loads
                os._exit(1)
            with self._wake:
                self._commands.append(command)
                self._wake.notify()
            if command is None or command[0] == "shutdown":
                return

    def serve(self, llm) -> None:
        """Say "ready", then run commands and steps until "shutdown" or the frontend's end; every message is
        written when this returns."""
        try:
            self._serve(llm)
        finally:
            self.close()

    def _serve(self, llm) -> None:
        engine = self.engine = llm.llm_engine
        stats = engine.get_stats()
        cache = engine.config.cache
        self._serving = True
        self.send(("ready", EngineFacts(engine.max_model_len, engine.vocab_size, engine.max_logprobs, cache.kv_cache,
                                            stats["num_blocks"], stats["block_size"], stats["device"], stats["dtype"],
                                            os.getpid())))
        busy = False
        try:
            while True:
                with self._wake:
                    while not self._commands and not busy:
                        self._wake.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:  # between two steps: joins, aborts, stats reads
                    if command is None:  # the frontend is gone: nobody to answer
                        return
                    if command[0] == "shutdown":
                        engine.abort_request(list(self._sent))
                        self._sent.clear()
                        self.send(("stopped", self._stats()))
                        return
                    self._run(command)
                busy = engine.has_unfinished_requests()
                if busy:
                    deltas = self._deltas(engine.step())
                    if deltas:
                        self.send(("step", deltas))
                    busy = engine.has_unfinished_requests()
        except BaseException as err:  # the engine is in an unknown state: every request ends with this
            log.exception("the engine core stopped on an error")
            self.send(("dead", f"{type(err).__name__}: {err}"))

    def _run(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params = command
            try:
                self.engine.add_request(request_id, prompt, params)
            except (TypeError, ValueError) as err:  # the frontend checked it already; a late refusal still answers
                self.send(("rejected", request_id, f"{type(err).__name__}: {err}"))
                return
            self._sent[request_id] = [[0, False] for _ in range(params.n)]
        elif kind == "abort":
            ids = [rid for rid in command[1] if self._sent.pop(rid, None) is not None]
            self.engine.abort_request(ids)  # frees their blocks now, before the next step
        elif kind == "stats":
            self.send(("stats", command[1], self._stats()))
        else:
            raise ValueError(f"unknown engine core command {kind!r}")

    def _stats(self) -> dict[str, Any]:
        return {**self.engine.get_stats(), **self.engine.get_num_requests_by_state()}

    def _deltas(self, outputs) -> list[RequestDelta]:
        """Each advanced request's new tokens since the last message (only those: the output lists are whole)."""
        deltas = []
        for out in outputs:
            sent = self._sent.get(out.request_id)
            if sent is None:  # aborted by a command of this step's batch: nobody is reading it
                continue
            seqs = []
            for c in out.outputs:
                mark = sent[c.index]
                num, finished = len(c.token_ids), c.finish_reason is not None
                if num == mark[0] and (mark[1] or not finished):
                    continue
                seqs.append(SeqDelta(c.index, c.token_ids[mark[0]:], c.logprobs[mark[0]:] if c.logprobs is not None else None,
                                     c.cumulative_logprob, c.finish_reason, c.stop_reason, c.text if finished else None))
                mark[0], mark[1] = num, finished
            if out.finished:
                del self._sent[out.request_id]
            if seqs or out.finished:
                deltas.append(RequestDelta(out.request_id, seqs, out.finished))
        return deltas
