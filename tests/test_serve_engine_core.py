"""The server's engine in a process of its own (`pagedref.serve.engine_core`, `AsyncLLM`): what crosses the
pipe per step is each sequence's new tokens only, and they add up to `LLM.generate`'s tokens, logprobs and
texts; an abort frees the request's blocks before the next step; an engine error, or the engine's process
dying, ends every request in flight (an error chunk, 500s, /health 503); and the engine's process never
outlives the server, however the server ends."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra (pip install -e '.[serve]')")

from pagedref import DEFAULT_MODEL, LLM, SamplingParams  # noqa: E402
from pagedref.serve.async_engine import AsyncLLM  # noqa: E402
from pagedref.serve.engine_core import EngineCore  # noqa: E402
from serve_helpers import LiveServer, ServerProcess, engine_pid, failing_core, process_gone  # noqa: E402


def test_each_step_message_carries_only_the_new_tokens_which_add_up_to_generates():
    """The core run in a thread of this process, over the same pipes: n = 2 seeded samples with logprobs and a
    greedy request cut by a stop string; every step's delta holds one new token per sequence that advanced."""
    llm = LLM(DEFAULT_MODEL, device="cpu")
    ids = llm.get_tokenizer().encode("# Stage 5")
    sampled = SamplingParams(n=2, temperature=0.9, top_k=20, seed=7, max_tokens=24, logprobs=2)
    full = llm.generate("# Stage 6", SamplingParams(temperature=0, max_tokens=60))[0].outputs[0].text
    greedy = SamplingParams(temperature=0, max_tokens=60, stop=[full[12:16]])
    want = {"a": llm.generate({"prompt_token_ids": ids}, sampled)[0], "b": llm.generate("# Stage 6", greedy)[0]}
    assert want["b"].outputs[0].finish_reason == "stop"

    commands_out, commands_in = multiprocessing.Pipe(duplex=False)[::-1]
    outputs_in, outputs_out = multiprocessing.Pipe(duplex=False)
    core = EngineCore(commands_in, outputs_out)
    thread = threading.Thread(target=core.serve, args=(llm,), daemon=True)
    thread.start()
    try:
        assert outputs_in.recv()[0] == "ready"
        commands_out.send(("add", "a", {"prompt_token_ids": ids}, sampled))
        commands_out.send(("add", "b", {"prompt": "# Stage 6"}, greedy))
        tokens, logprobs, texts, reasons, finished = {}, {}, {}, {}, set()
        while finished != {"a", "b"}:
            kind, deltas = outputs_in.recv()
            assert kind == "step"
            for delta in deltas:
                for d in delta.seqs:
                    key = (delta.request_id, d.index)
                    assert len(d.new_token_ids) == 1  # only what this step made, not the list so far
                    tokens.setdefault(key, []).extend(d.new_token_ids)
                    logprobs.setdefault(key, []).extend(d.new_logprobs or [])
                    if d.finish_reason is not None:
                        texts[key], reasons[key] = d.text, d.finish_reason
                    else:
                        assert d.text is None
                if delta.finished:
                    finished.add(delta.request_id)
        for rid, out in want.items():
            for c in out.outputs:
                key = (rid, c.index)
                assert tokens[key] == c.token_ids and texts[key] == c.text and reasons[key] == c.finish_reason
                assert logprobs[key] == (c.logprobs or [])

        # an abort is run before the next step: a stats read sent after it finds the blocks free
        commands_out.send(("add", "c", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
        assert outputs_in.recv()[0] == "step"
        commands_out.send(("stats", 1))
        while (message := outputs_in.recv())[0] != "stats":
            pass
        assert message[2]["num_used_blocks"] > 0 and message[2]["running"] == 1
        commands_out.send(("abort", ["c"]))
        commands_out.send(("stats", 2))
        while (message := outputs_in.recv())[0] != "stats":
            assert message[0] == "step"  # made before the abort arrived
        assert (message[1], message[2]["num_used_blocks"], message[2]["running"]) == (2, 0, 0)
        commands_out.send(("shutdown",))
        while (message := outputs_in.recv())[0] != "stopped":
            pass
        assert message[1]["num_used_blocks"] == 0
        thread.join(10)
        assert not thread.is_alive()
    finally:
        commands_out.close()
        llm.close()


def test_an_abort_frees_the_blocks_and_stop_ends_the_process():
    """`AsyncLLM` with its spawned engine process: a request aborted after its first output holds no block at
    the next stats read, and stop() leaves the pool free and the process gone (exit status 0)."""
    async def main() -> tuple[dict, dict, dict]:
        engine = AsyncLLM({"model": str(DEFAULT_MODEL), "device": "cpu"})
        try:
            engine.start(asyncio.get_running_loop())
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            stream = engine.submit([("x-0", {"prompt": None, "prompt_token_ids": [5, 6, 7, 8]}, params)], time.monotonic())
            async for _, out in stream:
                assert len(out.outputs[0].token_ids) >= 1 and not out.finished
                break
            running = await engine.get_stats()
            stream.close()
            aborted = await engine.get_stats()
            return running, aborted, await engine.stop()
        finally:
            engine.shutdown()
            assert not engine.process.is_alive() and engine.process.exitcode == 0

    running, aborted, final = asyncio.run(main())
    assert running["num_used_blocks"] > 0 and running["running"] == 1
    assert aborted["num_used_blocks"] == 0 and aborted["running"] == 0 and aborted["waiting"] == 0
    assert final["num_used_blocks"] == 0


def read_stream(url: str, body: dict, after_first=None) -> list[str]:
    """The data lines of a streamed completion; `after_first()` is called once the first chunk arrived."""
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 1 and after_first is not None:
                    after_first()
    return lines


def assert_engine_dead(url: str, words: str) -> None:
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    late = httpx.post(f"{url}/v1/completions", json={"prompt": "# Stage 6", "max_tokens": 4}, timeout=30)
    assert late.status_code == 500 and words in late.json()["error"]["message"]
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200  # the server's own figures still


@pytest.mark.parametrize("how", ["the engine raises", "the engine process is killed"])
def test_an_engine_failure_ends_the_requests_in_flight_with_an_error(how):
    long = {"prompt": "# Stage 6", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    if how == "the engine raises":
        with LiveServer(DEFAULT_MODEL, name="default", core=failing_core) as s:
            lines = read_stream(s.url, long)
            words = "injected engine failure"
            assert_engine_dead(s.url, words)
    else:
        with LiveServer(DEFAULT_MODEL, name="default") as s:
            lines = read_stream(s.url, long, after_first=lambda: os.kill(s.engine.process.pid, signal.SIGKILL))
            words = "engine process exited unexpectedly"
            assert_engine_dead(s.url, words)
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["type"] == "internal_server_error" and words in error["message"]
    assert 1 <= len(lines) - 2 < 200  # some tokens came before the failure, never all of them


def test_a_killed_server_leaves_no_engine_process():
    server = ServerProcess("--device", "cpu")
    try:
        pid = engine_pid("".join(server.log))
        assert not process_gone(pid, timeout=0)
        server.proc.send_signal(signal.SIGKILL)  # no shutdown at all: the engine sees its command pipe end
        server.proc.wait(10)
        assert process_gone(pid), f"engine process {pid} outlived its server"
    finally:
        server.kill()


def test_a_stream_delivers_the_steps_queued_before_the_engine_stopped_then_the_error():
    """The core's step messages and its "dead" can land in one wakeup of the loop: the reader finds both in its
    queue at once. The outputs go out first (the client gets the tokens of the steps that ran), then the error;
    a disconnect is raised at once (nobody to write to)."""
    from types import SimpleNamespace

    from pagedref.serve.async_engine import Disconnected, EngineDead, RequestStream

    async def read(items):
        queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        engine = SimpleNamespace(num_open_streams=1, abort=lambda ids: None)
        got = []
        with pytest.raises(Exception) as raised:
            async for rid, out in RequestStream(engine, queue, {"a", "b"}):
                got.append((rid, out.n))
        return got, raised.value

    step = lambda n: SimpleNamespace(n=n, finished=False)  # noqa: E731  (a RequestOutput's part the stream reads)
    dead = EngineDead("the engine stopped: RuntimeError: injected")
    got, err = asyncio.run(read([("a", step(1)), ("b", step(1)), ("a", step(2)), ("a", dead), ("b", dead)]))
    assert got == [("a", 2), ("b", 1)] and err is dead, "the newest output of each request first, then the error"
    got, err = asyncio.run(read([("a", step(1)), (None, Disconnected("gone"))]))
    assert got == [] and isinstance(err, Disconnected), "a disconnect ends the stream at once"
