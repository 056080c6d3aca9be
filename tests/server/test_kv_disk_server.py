"""`python -m server --kv-cache-disk DIR` as real processes: a restarted server answers a long prompt
from the blocks its predecessor left on disk, as it answered it cold, and says so in /metrics; a
second server pointed at a directory in use is refused at start, with one line and status 2."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.models.conftest import make_hf_model, save_checkpoint
from tests.server.conftest import stop_server, wait_healthy
from tests.server.test_cli import REPO, start_tiny

PROMPT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The server tests' tiny Llama with room for 2048 positions."""
    return save_checkpoint(make_hf_model("llama", max_position_embeddings=2048), tmp_path_factory.mktemp("kv-disk"))


def complete(url: str) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


def test_a_restarted_server_starts_warm_from_disk_and_a_second_one_is_refused(long_model_dir, tmp_path):
    disk = str(tmp_path / "kv")
    flags = ("--served-model-name", "tiny", "--kv-cache-disk", disk, "--kv-cache-disk-size", "64M")
    proc, url = start_tiny(long_model_dir, *flags, "--num-kv-blocks", "128")
    try:
        wait_healthy(proc, url, timeout=180)
        cold = complete(url)
        assert metric(url, 'pagedserve:prefix_cache_hits_total{tier="disk"}') == 0
        # A second server on the same directory: refused before it binds its port.
        second = subprocess.run(
            [sys.executable, "-m", "server", "--model", str(long_model_dir), "--kv-cache-disk", disk, "--port", "1"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2
        assert f"--kv-cache-disk {disk} is in use by another server" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
    finally:
        stop_server(proc, lambda: proc.stdout.read())
    assert list((tmp_path / "kv").glob("*.kvb"))  # written at shutdown

    proc, url = start_tiny(long_model_dir, *flags, "--num-kv-blocks", "128")
    try:
        wait_healthy(proc, url, timeout=180)
        warm = complete(url)
        disk_hits = metric(url, 'pagedserve:prefix_cache_hits_total{tier="disk"}')
        read = metric(url, "pagedserve:kv_disk_read_bytes_total")
    finally:
        stop_server(proc, lambda: proc.stdout.read())
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        cold["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
    )
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert disk_hits == cached and cached >= warm["usage"]["prompt_tokens"] - 8 and read > 0
