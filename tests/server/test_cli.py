"""`python -m server` as a real process: --help, the API key from the environment, SIGTERM drains and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.__main__ import build_parser
from tests.server.conftest import StreamReader, wait_healthy

REPO = Path(__file__).resolve().parents[2]
FLAGS = [
    "--model",
    "--host",
    "--port",
    "--dtype",
    "--served-model-name",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--kv-cache-memory",
    "--num-kv-blocks",
    "--max-waiting",
    "--api-key",
    "--log-level",
    "--shutdown-timeout",
    "--read-timeout",
    "--reasoning-parser",
    "--tensor-parallel-size",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_explains_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "server", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for flag in FLAGS:
        assert flag in out.stdout, flag
    assert "PAGEDSERVE_API_KEY" in out.stdout


def test_help_states_each_default_once():
    out = subprocess.run(
        [sys.executable, "-m", "server", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    ).stdout
    entries = re.split(r"\n  (?=-)", out)
    assert "(default: None)" not in out
    assert not [e for e in entries if e.count("default") > 1], "a flag's help names its default twice"


@pytest.mark.parametrize(
    "model,says",
    [
        ("/nonexistent/model", "no such checkpoint directory or .gguf file"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "not in the Hugging Face cache"),
    ],
)
def test_a_model_that_is_not_there_is_one_line_before_any_server_starts(model, says, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}  # an empty cache, no network
    out = subprocess.run(
        [sys.executable, "-m", "server", "--model", model, "--port", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and model in lines[0], lines
    assert "Traceback" not in out.stderr and "Uvicorn" not in out.stderr


def test_no_writable_temporary_directory_is_one_line_and_exit_2(tmp_path):
    # As under `docker run --read-only` without `--tmpfs /tmp`: tempfile finds no directory to write.
    (tmp_path / "sitecustomize.py").write_text("import tempfile\ntempfile._candidate_tempdir_list = lambda: []\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "server", "--port", "1"], cwd=REPO, capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 2
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "--tmpfs /tmp" in lines[0] and "TMPDIR" in lines[0], lines


def test_a_configuration_the_loader_refuses_exits_2_as_a_restart_would_fail_again(tiny_model_dir):
    proc, _ = start_tiny(tiny_model_dir, "--max-model-len", "100000")  # beyond the model's positions
    try:
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, output
    assert "max_model_len 100000" in output


def test_bad_flag_values_exit_with_usage_error():
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--dtype", "int3"])
    assert exc.value.code == 2
    out = subprocess.run(
        [sys.executable, "-m", "server", "--max-num-seqs", "0"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "max_num_seqs" in out.stderr


def start_tiny(model_dir: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m server` on the tiny checkpoint (float32, a 64-block pool), 127.0.0.1 on a free
    port, with `extra` flags; (its process, its URL). The caller stops it by that handle."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "64",
            "--block-size",
            "8",
            "--log-level",
            "warning",
            *extra,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def served_process(tiny_model_dir):
    env = {**os.environ, "PAGEDSERVE_API_KEY": "env-key"}
    proc, url = start_tiny(tiny_model_dir, "--served-model-name", "tiny", "--shutdown-timeout", "20", env=env)
    try:
        wait_healthy(proc, url, timeout=180)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_batch_invariant_server_repeats_a_seeded_request_alone_and_among_others(tiny_model_dir):
    # `--batch-invariant` on a dense float32 model (MKL rounds a row by its step's size without it,
    # and this test failed so): the same seeded completion, text and logprobs, alone and beside
    # three other requests.
    from concurrent.futures import ThreadPoolExecutor

    proc, url = start_tiny(tiny_model_dir, "--batch-invariant", "--served-model-name", "tiny")
    try:
        wait_healthy(proc, url, timeout=180)
        seeded = {
            "model": "tiny",
            "prompt": "The quick brown fox",
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 123,
            "logprobs": 2,
            "ignore_eos": True,
        }
        others = [{**seeded, "prompt": f"Other request {i} " * (i + 1), "seed": i} for i in range(3)]

        def complete(body):
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            return choice["text"], choice["logprobs"]

        alone = complete(seeded)
        with ThreadPoolExecutor(4) as pool:
            among = list(pool.map(complete, [others[0], seeded, others[1], others[2]]))[1]
        assert complete(seeded) == alone and among == alone
    finally:
        proc.terminate()
        proc.wait(60)


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(served_process):
    proc, url = served_process
    headers = {"Authorization": "Bearer env-key"}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401  # key read from the environment
    reader = StreamReader(f"{url}/v1/completions", body, headers=headers, timeout=120)
    assert reader.first.wait(60)
    os.kill(proc.pid, signal.SIGTERM)  # the server process's own pid
    reader.thread.join(120)
    assert proc.wait(60) == 0, proc.stdout.read()
    # Warmed up before /health turned 200, then one line saying where and what it serves.
    ready = [line for line in proc.stdout.read().splitlines() if line.startswith("pagedserve ready:")]
    assert len(ready) == 1 and f"{url}/v1  model tiny  (float32, weights dense" in ready[0], ready
    assert all(word in ready[0] for word in ("threads", "context", "sequences", "KV cache 512 tokens")), ready
    lines = reader.lines
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=5)


@pytest.mark.parametrize(
    "model,name",
    [
        ("/srv/secret/checkpoints/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
        ("/srv/secret/checkpoints/my-llama/", "my-llama"),
        ("/srv/secret/gguf/SmolLM2-135M-Instruct-Q8_0.gguf", "SmolLM2-135M-Instruct"),
        ("relative/dir/Qwen3-0.6B.GGUF", "Qwen3-0.6B"),
        ("~/models/tiny", "tiny"),
        ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
        ("smollm2", "SmolLM2-135M-Instruct"),
        (" SMOLLM2-135M-instruct ", "SmolLM2-135M-Instruct"),
    ],
)
def test_default_served_model_name_is_the_base_name_not_the_path(model, name):
    from server.__main__ import served_name

    assert served_name(model) == name


@pytest.mark.parametrize(
    "model,names",
    [
        ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1")),
        (
            "/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m"),
        ),
        ("/models/Llama-3.2-1B-Instruct-IQ4_XS.gguf", ("Llama-3.2-1B-Instruct", "Llama-3.2-1B-Instruct-IQ4_XS")),
        ("/models/tiny-f16.gguf", ("tiny", "tiny-f16")),
        ("/models/Qwen3-0.6B.gguf", ("Qwen3-0.6B",)),
        ("/models/Q4_0.gguf", ("Q4_0",)),
        ("/checkpoints/my-llama-Q4_0", ("my-llama-Q4_0",)),  # a directory keeps its whole name
    ],
)
def test_a_gguf_is_served_without_its_quantization_tag_and_still_by_its_file_name(model, names):
    from server.__main__ import served_names

    assert served_names(model) == names


def test_served_model_name_of_the_current_directory_is_its_name(tmp_path, monkeypatch):
    from server.__main__ import served_name

    monkeypatch.chdir(tmp_path)
    assert served_name(".") == tmp_path.name and served_name("./") == tmp_path.name


def test_ctrl_c_drains_and_exits_130_and_a_second_one_exits_at_once_quietly(served_process):
    proc, url = served_process
    headers = {"Authorization": "Bearer env-key"}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    reader = StreamReader(f"{url}/v1/completions", body, headers=headers, timeout=120)
    assert reader.first.wait(60)
    os.kill(proc.pid, signal.SIGINT)  # the server process's own pid
    reader.thread.join(120)
    assert reader.lines[-1] == "data: [DONE]"  # drained: the stream finished
    assert proc.wait(60) == 130
    out = proc.stdout.read()
    assert "Traceback" not in out and "CancelledError" not in out, out


def test_a_second_ctrl_c_exits_at_once_with_one_line(tiny_model_dir):
    proc, url = start_tiny(tiny_model_dir, "--shutdown-timeout", "60", "--max-num-seqs", "1")
    try:
        wait_healthy(proc, url, timeout=180)
        body = {
            "model": str(tiny_model_dir.name),
            "prompt": "Hello",
            "max_tokens": 100,
            "ignore_eos": True,
            "stream": True,
        }
        # One at a time, 40 x 100 tokens: a drain of seconds, which the second Ctrl-C cuts short.
        readers = [StreamReader(f"{url}/v1/completions", body, timeout=120) for _ in range(40)]
        assert readers[0].first.wait(60)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)  # the stream is still running: this one does not wait for it
        code = proc.wait(10)
        out = proc.stdout.read()
        assert code == 130, out
        assert "second interrupt" in out and "Traceback" not in out and "CancelledError" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_a_hub_id_loads_from_the_hugging_face_cache_offline(tiny_model_dir, tmp_path):
    """`--model org/name` goes through huggingface_hub: here a cache laid out as the hub's
    (models--org--name/snapshots/<revision>, refs/main) with HF_HUB_OFFLINE=1, so nothing is fetched."""
    import shutil

    repo = tmp_path / "hub" / "models--testorg--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    code = (
        "from models.loader import load_model; from server.__main__ import check_model_arg, served_name; "
        "loaded = load_model('testorg/tiny-llama', dtype='float32'); "
        "print(check_model_arg('testorg/tiny-llama'), served_name('testorg/tiny-llama'), loaded.config.path)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["None", "testorg/tiny-llama"] and str(snapshot) in out.stdout


def test_tensor_parallel_server_answers_as_one_rank_and_sigterm_stops_every_rank(tiny_model_dir):
    import psutil

    procs = [
        start_tiny(tiny_model_dir, "--served-model-name", "tiny"),
        start_tiny(
            tiny_model_dir, "--served-model-name", "tiny", "--tensor-parallel-size", "2", "--shutdown-timeout", "10"
        ),
    ]
    try:
        for proc, url in procs:
            wait_healthy(proc, url, timeout=180)
        (one, one_url), (two, two_url) = procs
        ranks = psutil.Process(two.pid).children(recursive=True)
        assert len(ranks) >= 1, "rank 1 runs in a child process"
        body = {
            "model": "tiny",
            "prompt": "Paged attention serves",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        texts = [
            httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            for url in (one_url, two_url)
        ]
        assert texts[0] == texts[1]
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
        }
        streamed = [StreamReader(f"{url}/v1/chat/completions", chat, timeout=60) for url in (one_url, two_url)]
        for reader in streamed:
            reader.thread.join(60)

        def content(lines: list[str]) -> str:
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

        assert content(streamed[0].lines) == content(streamed[1].lines) != ""
        os.kill(two.pid, signal.SIGTERM)
        assert two.wait(60) == 0, two.stdout.read()
        gone, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive, f"ranks left running after SIGTERM: {alive}"
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


@pytest.mark.parametrize("launcher", ["--nnodes", "torchrun"])
def test_ranks_on_two_nodes_answer_as_one_rank(tiny_model_dir, launcher):
    """Two "nodes" on this machine: node 1 runs no HTTP server and serves rank 0's steps; by the
    flags (one command per node) or by torchrun's environment (one process per rank)."""
    port, master = free_port(), free_port()
    common = [
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--num-kv-blocks",
        "64",
        "--block-size",
        "8",
        "--log-level",
        "warning",
        "--tensor-parallel-size",
        "2",
    ]
    if launcher == "--nnodes":
        cmds = [
            [
                sys.executable,
                "-m",
                "server",
                *common,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(master),
            ]
            for node in (1, 0)
        ]
        envs = [os.environ] * 2
    else:
        cmds = [[sys.executable, "-m", "server", *common]] * 2
        envs = [
            {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master),
            }
            for rank in (1, 0)
        ]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in zip(cmds, envs)
    ]
    node1, node0 = procs
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(node0, url, timeout=180)
        body = {
            "model": "tiny",
            "prompt": "Paged attention serves",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
        two = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert node1.poll() is None
        os.kill(node0.pid, signal.SIGTERM)
        assert node0.wait(60) == 0
        assert node1.wait(30) == 0, "rank 0's stop message ends the other node's rank"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
    from engine.llm import LLM
    from engine.request import SamplingParams

    one = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    expected = one.generate("Paged attention serves", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert two == expected[0].text


def test_a_dead_rank_turns_health_503_and_ends_the_stream_with_an_error_event(tiny_model_dir):
    import psutil

    proc, url = start_tiny(tiny_model_dir, "--served-model-name", "tiny", "--tensor-parallel-size", "2")
    try:
        wait_healthy(proc, url, timeout=240)
        rank1 = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())
        ]
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "stream": True}
        reader = StreamReader(f"{url}/v1/completions", body, timeout=60)
        assert reader.first.wait(60)
        for p in rank1:
            p.kill()
        reader.thread.join(30)
        assert not reader.thread.is_alive()
        events = [json.loads(line.removeprefix("data: ")) for line in reader.lines if line != "data: [DONE]"]
        assert "error" in events[-1] and "tensor-parallel" in events[-1]["error"]["message"], events[-1]
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health should turn 503"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log = proc.stdout.read()
        assert "tensor-parallel" in log  # the reason, in rank 0's log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
