"""A model we do not serve is one line and exit status 2 before anything starts: `python -m server`
refuses before it binds its port (the model itself still loads in the background, behind /health
503), and `python -m models.generate` before it builds anything. Real processes, real files."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.server.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def write_gguf(path: Path, architecture: str, norm_dtype=np.float32) -> Path:
    """A well-formed GGUF file of `architecture`: llama-style metadata, a token list, two small
    tensors (the norm's stored as `norm_dtype`)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_context_length(64)
    writer.add_feed_forward_length(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros((8,), dtype=norm_dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    """name -> (a model path, what its one line must say)."""
    root = tmp_path_factory.mktemp("refused")
    mamba_dir = root / "mamba-checkpoint"
    mamba_dir.mkdir()
    (mamba_dir / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    (root / "garbage.gguf").write_bytes(b"not a gguf file, just text" * 10)
    return {
        "gguf architecture": (write_gguf(root / "mamba.gguf", "mamba"), ["'mamba'", "not supported", "llama"]),
        "tensor type": (
            write_gguf(root / "int-norm.gguf", "llama", np.int32),
            ["'blk.0.attn_norm.weight'", "type I32", "cannot dequantize"],
        ),
        "missing file": (root / "absent.gguf", ["no GGUF file at", "absent.gguf"]),
        "not a gguf": (root / "garbage.gguf", ["not a readable GGUF file", "garbage.gguf"]),
        "checkpoint architecture": (mamba_dir, ["MambaForCausalLM", "supported", "LlamaForCausalLM"]),
    }


class PortWatch:
    """Tries to connect to a port every few milliseconds until stopped; remembers any success."""

    def __init__(self, port: int):
        self.port, self.accepted, self.tries = port, False, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    self.accepted = True
            except OSError:
                pass
            self.tries += 1
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def assert_one_line_refusal(out: subprocess.CompletedProcess, says: list[str]) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedserve: error: "), lines
    for text in says:
        assert text in lines[0], (text, lines[0])


@pytest.mark.parametrize(
    "case", ["gguf architecture", "tensor type", "missing file", "not a gguf", "checkpoint architecture"]
)
def test_server_refuses_in_one_line_before_binding_its_port(refused, case):
    model, says = refused[case]
    port = free_port()
    watch = PortWatch(port)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "server", "--model", str(model), "--port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        watch.stop()
    assert_one_line_refusal(out, says)
    assert watch.tries > 0 and not watch.accepted, "the port accepted a connection before the refusal"


@pytest.mark.parametrize("case", ["gguf architecture", "missing file"])
def test_generate_refuses_in_one_line(refused, case):
    model, says = refused[case]
    out = subprocess.run(
        [sys.executable, "-m", "models.generate", "--model", str(model), "--prompt", "Hi"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_refusal(out, says)


def test_check_model_reads_headers_only(refused):
    """In-process: the same refusals as ValueError / FileNotFoundError, from models.loader.check_model."""
    from models.gguf import GGUFError
    from models.loader import check_model

    for case, error in [
        ("gguf architecture", GGUFError),
        ("tensor type", GGUFError),
        ("not a gguf", GGUFError),
        ("missing file", FileNotFoundError),
        ("checkpoint architecture", ValueError),
    ]:
        model, says = refused[case]
        with pytest.raises(error) as info:
            check_model(str(model))
        assert all(text in str(info.value) for text in says), (case, str(info.value))
