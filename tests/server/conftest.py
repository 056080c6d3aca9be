"""Live servers for the server tests: a real engine on a tiny float32 Llama, real uvicorn, real sockets.

    live = start_server(engine_kwargs={...}, app_kwargs={...})   # -> LiveServer
    live.url, live.engine, live.client() (openai), live.http (httpx)

Each server binds 127.0.0.1 on a free port in a thread of the test process and
is stopped through its own handle (never by a signal to the test process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from models.loader import load_model
from server.app import create_app
from server.http_server import make_server
from tests.models.conftest import make_hf_model, save_checkpoint

MODEL_NAME = "tiny-llama"
# Small enough that pool, context and queue limits are reachable in a test.
ENGINE_DEFAULTS = dict(num_kv_blocks=128, block_size=8, max_num_seqs=16, max_num_batched_tokens=256)


class LiveServer:
    """The server `python -m server` runs (make_server), on a socket of our own."""

    def __init__(self, app, engine=None, shutdown_timeout: float = 5, read_timeout: float = 30):
        self.app, self.engine = app, engine
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(
            app, log_level="warning", shutdown_timeout=shutdown_timeout, read_timeout=read_timeout
        )
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self._thread.join(30)
        self._socket.close()

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=120, **kwargs)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample's value in /metrics: metric("pagedserve:request_success_total", 'finish_reason="abort"')."""
        key = f"{name}{{{labels}}}" if labels else name
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(key + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and no KV block (aborts are asynchronous)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.num_kv_blocks_used == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout}s: {self.engine.stats()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen, output) -> None:
    """SIGTERM to the server this test started (by its own PID); it must exit 0 within 60 s, else it
    is killed and the test fails with `output()`."""
    os.kill(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert code == 0, output()


def wait_healthy(proc, url: str, timeout: float, output=None) -> None:
    """Until `python -m server` in `proc` answers 200 on /health; fails if it exits first, or is
    still starting after `timeout` seconds (then killed), with the end of what it printed
    (`output()`: its log's text, where it writes to a file; else its stdout)."""
    output = output or (lambda: proc.stdout.read())
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, output()
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            for child in psutil.Process(proc.pid).children(recursive=True):  # its ranks hold the output pipe too
                child.kill()
            proc.kill()
            proc.wait(30)
            raise AssertionError(f"{url} did not become healthy in {timeout}s; it printed:\n{output()[-4000:]}")
        time.sleep(0.1)


@contextlib.contextmanager
def served(*args: str, timeout: float = 600) -> Iterator[str]:
    """`python -m server ARGS` on a free 127.0.0.1 port, from the repository root: its URL once
    /health answers, stopped by its own PID (`stop_server`) when the block ends."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--port", str(port), *args],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=timeout)
        yield url
    finally:
        stop_server(proc, proc.stdout.read)


class StreamReader:
    """POST a streaming request from a thread, keeping its non-empty SSE lines as they arrive and
    the response's status. A stream the other side cuts ends the read with its lines kept and the
    error in `error` (not raised in the thread, which pytest reported as an unhandled exception).
    `first` is set on the first line, or when the stream ends without one."""

    def __init__(self, url: str, body: dict, headers: dict | None = None, timeout: float = 60):
        self.lines: list[str] = []
        self.status: int | None = None
        self.error: httpx.HTTPError | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, body, headers, timeout), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict, headers: dict | None, timeout: float) -> None:
        try:
            with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.first.set()

    @property
    def done(self) -> bool:
        """The stream ended with its [DONE] line."""
        return bool(self.lines) and self.lines[-1] == "data: [DONE]"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_checkpoint(make_hf_model("llama"), tmp_path_factory.mktemp("server-tiny-llama"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    # Weights are only read, so one loaded model can back several engines (each has its own KV pool).
    return load_model(tiny_model_dir, dtype="float32", device="cpu")


@pytest.fixture
def start_server(tiny_loaded):
    started: list[LiveServer] = []

    def start(
        engine_kwargs: dict | None = None, app_kwargs: dict | None = None, server_kwargs: dict | None = None
    ) -> LiveServer:
        engine = AsyncEngine(tiny_loaded, EngineConfig(**{**ENGINE_DEFAULTS, **(engine_kwargs or {})}))
        app = create_app(engine, **{"served_model_name": MODEL_NAME, **(app_kwargs or {})})
        live = LiveServer(app, engine, **(server_kwargs or {})).start()
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture(scope="module")
def live(tiny_loaded):
    """One shared server for tests that do not change its configuration."""
    engine = AsyncEngine(tiny_loaded, EngineConfig(**ENGINE_DEFAULTS, max_waiting=64))
    server = LiveServer(create_app(engine, served_model_name=MODEL_NAME), engine).start()
    yield server
    server.stop()
