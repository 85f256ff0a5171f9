"""`python -m pagedref.serve` as a process: bad flags are usage errors before any weight is loaded, and
SIGTERM shuts it down cleanly (no new request admitted, the streams in flight ended with [DONE], the KV
pool free, the engine's process gone) with exit status 0. Also the `pagedref` console script's dispatch."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra (pip install -e '.[serve]')")

from pagedref import cli  # noqa: E402
from pagedref.bench.serve import random_model_dir  # noqa: E402
from pagedref.serve.__main__ import main as serve_main  # noqa: E402
from helpers import usage_error  # noqa: E402
from serve_helpers import ServerProcess, engine_pid, process_gone  # noqa: E402


@pytest.mark.parametrize("args, words", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks must be >= 1"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
    (["--model", "/no/such/dir"], "--model /no/such/dir"),
    (["--api-key", " "], "--api-key is empty"),
])
def test_bad_flags_are_usage_errors(capsys, args, words):
    assert words in usage_error(serve_main, capsys, *args)


def test_console_script_dispatches_to_the_modules(capsys):
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--served-model-name", "--api-key", "--max-num-seqs", "--enable-prefix-caching", "--tensor-parallel-size"):
        assert flag in out  # the server takes generate's engine flags


@pytest.mark.parametrize("to_group", [False, True], ids=["to the server", "to its process group"])
def test_sigterm_ends_the_streams_frees_the_pool_and_exits_0(tmp_path, to_group):
    """Sent to the whole group (systemd, `timeout`), the signal reaches the engine's process too: it ignores it
    and is stopped by the server in order, so the streams still end with "abort" and the pool is free."""
    model = random_model_dir("tiny", tmp_path, "cpu", log=lambda msg: None)
    server = ServerProcess("--model", str(model), "--device", "cpu", "--served-model-name", "tiny", "--shutdown-timeout", "2",
                           new_session=to_group)
    try:
        ends: list[tuple[str, str]] = []
        started = threading.Barrier(4)

        def stream() -> None:  # a request far longer than the shutdown's grace: it must be aborted
            body = {"model": "tiny", "prompt": "t5 t6 t7", "max_tokens": 16_000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                started.wait(30)
                last = [line for line in lines if line.startswith("data: ")]
            ends.append((last[-1], json.loads(last[-2][6:])["choices"][0]["finish_reason"]))

        clients = [threading.Thread(target=stream) for _ in range(3)]
        for t in clients:
            t.start()
        started.wait(30)
        if to_group:
            os.killpg(server.proc.pid, signal.SIGTERM)
        else:
            server.proc.send_signal(signal.SIGTERM)
        late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "t5"}, timeout=30)  # within the 2 s grace
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        assert server.proc.wait(timeout=15) == 0
        for t in clients:
            t.join(15)
        assert ends == [("data: [DONE]", "abort")] * 3
        log = server.output()
        assert "engine stopped: 0 requests left, 0 of" in log, log
        assert process_gone(engine_pid(log), timeout=5), "the engine process outlived its server"
    finally:
        server.kill()
