"""Test-only helpers for the server tests: a live server on 127.0.0.1 (in this process, or as a
subprocess), and /metrics read back as numbers."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from helpers import REPO_ROOT

HOST = "127.0.0.1"  # the tests' servers listen on the loopback address only


class LiveServer:
    """`build_app(AsyncLLM(engine kwargs), config)` served by uvicorn on a free port of 127.0.0.1, in a thread of
    this process; the engine runs in its own process, as the server's does (`engine` is the frontend)."""

    def __init__(self, model_dir: Path, name: str = "test-model", api_key: str | None = None,
                 shutdown_timeout: float = 1.0, core=None, **engine_kwargs) -> None:
        import uvicorn

        from pagedref.serve.api import ServerConfig, build_app
        from pagedref.serve.async_engine import AsyncLLM
        from pagedref.serve.server import Server

        self.engine = AsyncLLM({"model": str(model_dir), "device": "cpu", **engine_kwargs}, **({"core": core} if core else {}))
        try:
            self.app = build_app(self.engine, ServerConfig(name, Path(model_dir), api_key))
            config = uvicorn.Config(self.app, host=HOST, port=0, log_level="warning", lifespan="on")
            self.server = Server(config, self.engine, shutdown_timeout)
        except BaseException:
            self.engine.shutdown()
            raise
        self.thread = threading.Thread(target=self.server.run, name="test-server", daemon=True)
        self.name = name
        self.url = ""

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.engine.shutdown()
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.url = f"http://{HOST}:{self.server.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()
        assert not self.thread.is_alive(), "the test server did not stop"
        assert not self.engine.process.is_alive(), "the engine process did not stop"


class ServerProcess:
    """`python -m pagedref.serve ARGS --host 127.0.0.1 --port 0` as a subprocess; `url` once it is ready."""

    def __init__(self, *args: str, new_session: bool = False) -> None:
        """new_session: in a process group of its own (the engine's process joins it), for signals to the group."""
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedref.serve", *args, "--host", HOST, "--port", "0"],
                                     cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=new_session)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_ready(timeout=60)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if line is None:
                break
            self.log.append(line)
            m = re.search(r"pagedref\.serve: ready on (http://\S+)", line)
            if m:
                return m.group(1)
        self.kill()
        raise RuntimeError("the server did not get ready:\n" + "".join(self.log))

    def output(self) -> str:
        """Everything it printed (call once it has exited)."""
        while True:
            try:
                line = self.lines.get(timeout=5)
            except queue.Empty:
                break
            if line is None:
                break
            self.log.append(line)
        return "".join(self.log)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def read_metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {sample name (with its labels, as printed): value}."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    """/metrics once no request is running or waiting (polled, at most `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url)
        if (m["pagedref:num_requests_running"] == 0 and m["pagedref:num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def failing_core(llm_kwargs, commands, outputs, log_level, fail_after: int = 3) -> None:
    """The engine core, whose engine raises on its step after `fail_after` steps (an engine error, injected:
    a module-level function, so the spawned engine process can import it; the patch lives in that process)."""
    from pagedref.engine.llm import LLMEngine
    from pagedref.serve.engine_core import run_engine_core

    step, count = LLMEngine.step, [0]

    def failing_step(self, *args, **kwargs):
        count[0] += 1
        if count[0] > fail_after:
            raise RuntimeError("injected engine failure")
        return step(self, *args, **kwargs)

    LLMEngine.step = failing_step
    run_engine_core(llm_kwargs, commands, outputs, log_level)


def engine_pid(log: str) -> int:
    """The engine process' id, from the server's "serving ..." line."""
    m = re.search(r"engine process (\d+)", log)
    assert m, log
    return int(m.group(1))


def process_gone(pid: int, timeout: float = 15.0) -> bool:
    """True once no process `pid` is left (or only its zombie, which its new parent reaps), polled."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
