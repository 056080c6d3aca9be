"""loadtest's multi-turn workload and its restart scenario against the real server (a real engine on a
tiny float32 Llama, real uvicorn, a real socket), and its command line against the protocol stand-in."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from loadtest.__main__ import main
from loadtest.config import BenchmarkConfig
from loadtest.multi_turn import run_multi_turn
from models.loader import load_model
from server.app import create_app
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.server.conftest import ENGINE_DEFAULTS, MODEL_NAME, LiveServer

SHAPE = dict(
    workload="multi-turn",
    conversations=3,
    turns=3,
    system_prompt_tokens=40,
    input_len=6,
    output_len=3,
    ignore_eos=True,
)


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    return load_model(save_checkpoint(make_hf_model("llama"), tmp_path_factory.mktemp("multi-turn")), dtype="float32")


class PortServer(LiveServer):
    """LiveServer (max_model_len 128) on a given port (SO_REUSEADDR): a restarted server answers at the same URL."""

    def __init__(self, app, engine, port: int):
        super().__init__(app, engine)
        self._socket.close()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self.http.close()
        self.http = type(self.http)(base_url=self.url, timeout=60)


def serve(loaded, port: int = 0, **engine_kwargs) -> LiveServer:
    engine = AsyncEngine(loaded, EngineConfig(**{**ENGINE_DEFAULTS, "num_kv_blocks": 256, **engine_kwargs}))
    app = create_app(engine, served_model_name=MODEL_NAME)
    return (PortServer(app, engine, port) if port else LiveServer(app, engine)).start()


def test_turns_grow_their_history_and_later_turns_hit_the_prefix_cache(tiny_loaded):
    live = serve(tiny_loaded)
    try:
        result = asyncio.run(run_multi_turn(BenchmarkConfig(url=live.url, model=MODEL_NAME, replay=True, **SHAPE)))
        stats = live.engine.stats()
    finally:
        live.stop()
    assert result["summary"]["completed"] == 9 and result["summary"]["failed"] == 0
    turns = result["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["completed"] == 3 for t in turns)
    # Each turn repeats the last one's prompt and reply (3 tokens) and adds a user message (6 tokens).
    prompts = [t["mean_prompt_tokens"] for t in turns]
    assert 40 + 6 <= prompts[0] < prompts[1] < prompts[2]
    assert prompts[1] - prompts[0] >= 3 + 6
    by_request = {(r["conversation"], r["turn"]): r for r in result["requests"]}
    assert len(by_request) == 9 and all(r["ttft_ms"] > 0 for r in by_request.values())
    # The replay sends the first pass's requests again, token for token.
    replayed = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in result["replay"]["requests"]}
    assert replayed == {key: r["prompt_tokens"] for key, r in by_request.items()}
    # The replay's prompts were all computed before: each hits the cache but for its last block (8 tokens)
    # and the token the model must run; the first pass's later turns hit too.
    assert stats.prefix_cache_hits >= sum(replayed.values()) - 9 * 9


def test_the_replay_after_a_restart_reads_its_prefixes_from_the_disk_tier(tiny_loaded, tmp_path):
    """--restart-cmd: the command asks the test to restart the server (a new engine on the same port and
    disk directory) and returns once it is up; the replay's prompts are then read back from disk."""
    disk = str(tmp_path / "kv")
    servers = [serve(tiny_loaded, kv_cache_disk=disk)]
    port = servers[0].port
    asked, done = tmp_path / "asked", tmp_path / "done"

    def restart() -> None:
        while not asked.exists():
            time.sleep(0.02)
        servers[0].stop()
        servers[0].engine.shutdown()
        servers.append(serve(tiny_loaded, port, kv_cache_disk=disk))
        done.touch()

    restarter = threading.Thread(target=restart, daemon=True)
    restarter.start()
    wait = f"{sys.executable} -c \"import pathlib, time; p = pathlib.Path('{done}')\nwhile not p.exists(): time.sleep(0.02)\""
    config = BenchmarkConfig(
        url=servers[0].url, model=MODEL_NAME, restart_cmd=f"touch {asked} && {wait}", restart_timeout=60, **SHAPE
    )
    try:
        result = asyncio.run(run_multi_turn(config))
        restarter.join(60)
        stats = servers[-1].engine.stats()
    finally:
        for live in servers[1:] if len(servers) > 1 else servers:
            live.stop()
    assert len(servers) == 2 and result["replay"] is not None
    assert result["replay"]["summary"]["completed"] == 9
    assert [t["completed"] for t in result["replay"]["turns"]] == [3, 3, 3]
    # The new engine saw only the replay: its first requests found their prompts on disk.
    assert stats.prefix_cache_disk_hits > 0


def test_command_line_prints_ttft_by_turn(standin, capsys):
    server = standin()
    argv = ["--url", server.url, "--model", "standin", "--endpoint", "chat", "--workload", "multi-turn"]
    argv += ["--conversations", "2", "--turns", "3", "--system-prompt-tokens", "50", "--input-len", "6"]
    argv += ["--output-len", "3", "--replay", "--quiet", "--no-server-metrics"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "TTFT by turn" in printed and "replay/first" in printed
    rows = [line.split() for line in printed.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert [row[:2] for row in rows] == [["1", "2"], ["2", "2"], ["3", "2"]]
    # The stand-in counts a chat prompt's words: each turn adds a user message and a 3-token reply.
    assert int(rows[0][2]) < int(rows[1][2]) < int(rows[2][2])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(replay=True), "need --workload multi-turn"),
        (dict(workload="multi-turn", turns=0), "--turns must be >= 1"),
        (dict(workload="multi-turn", prefix_len=8), "no --dataset, --prefix-len"),
        (dict(workload="chat"), "--workload must be one of"),
    ],
)
def test_multi_turn_options_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        BenchmarkConfig(url="http://127.0.0.1:9", model="m", **overrides)
