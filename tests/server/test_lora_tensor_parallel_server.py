"""`python -m server --tensor-parallel-size 2 --enable-lora-runtime-updates`, over a real socket: an
adapter loaded while serving reaches rank 1 (its greedy completion is transformers + peft's), a bad
one is a 400 with the server still serving, and an unload frees the adapter on both ranks."""

from __future__ import annotations

import httpx
import pytest

from tests.models.conftest import tiny_tokenizer
from tests.models.test_lora import make_adapter, reference
from tests.server.conftest import stop_server, wait_healthy
from tests.server.test_cli import start_tiny

pytest.importorskip("peft")

PROMPT = [5, 17, 42, 9, 100, 33]


def test_runtime_loads_under_tensor_parallel(tiny_model_dir, tmp_path):
    adapter = make_adapter("llama", tmp_path / "tuned", seed=4)
    proc, url = start_tiny(
        tiny_model_dir,
        "--served-model-name",
        "tiny",
        "--tensor-parallel-size",
        "2",
        "--enable-lora-runtime-updates",
        "--max-loras",
        "2",
        "--shutdown-timeout",
        "10",
    )
    try:
        wait_healthy(proc, url, timeout=240)
        http = httpx.Client(base_url=url, timeout=120)

        def complete(model: str) -> str:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": adapter})
        assert loaded.status_code == 200, loaded.text
        decode = tiny_tokenizer().decode
        assert complete("tuned") == decode(reference("llama", adapter, PROMPT)[0])
        assert complete("tiny") == decode(reference("llama", None, PROMPT)[0])

        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "absent")})
        assert bad.status_code == 400 and "no such directory" in bad.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"}).status_code == 200
        assert http.post("/v1/completions", json={"model": "tuned", "prompt": PROMPT}).status_code == 404
        assert complete("tiny") == decode(reference("llama", None, PROMPT)[0])
    finally:
        stop_server(proc, lambda: proc.stdout.read())
