"""A LoRA GGUF served by `python -m server --lora-modules name=file.gguf`, over a real socket: its
greedy completion is its PEFT twin's (served beside it from the directory the GGUF was written from)
and transformers + peft's on that directory, and not the base model's."""

from __future__ import annotations

import openai
import pytest

from tests.models.conftest import make_hf_model, tiny_tokenizer
from tests.models.test_lora import make_adapter, reference
from tests.server.conftest import stop_server, wait_healthy
from tests.server.test_cli import start_tiny

pytest.importorskip("peft")

PROMPT = [5, 17, 42, 9, 100, 33]


def test_a_gguf_adapter_serves_what_its_peft_twin_does(tiny_model_dir, tmp_path):
    from tests.models.test_lora_gguf import write_lora_gguf

    peft_dir = make_adapter("llama", tmp_path / "peft", seed=3)
    gguf = write_lora_gguf(peft_dir, tmp_path / "tuned.gguf", "llama", make_hf_model("llama").config)
    proc, url = start_tiny(
        tiny_model_dir, "--served-model-name", "tiny", "--lora-modules", f"gguf={gguf}", f"peft={peft_dir}"
    )
    try:
        wait_healthy(proc, url, timeout=180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert {card.id for card in client.models.list().data} == {"tiny", "gguf", "peft"}

        def complete(model: str):
            return client.completions.create(
                model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
            ).choices[0]

        from_gguf, from_peft, base = complete("gguf"), complete("peft"), complete("tiny")
        decode = tiny_tokenizer().decode
        assert from_gguf.text == from_peft.text == decode(reference("llama", peft_dir, PROMPT)[0])
        assert from_gguf.logprobs.token_logprobs == pytest.approx(from_peft.logprobs.token_logprobs, abs=1e-5)
        assert base.text == decode(reference("llama", None, PROMPT)[0])
        assert from_gguf.text != base.text
    finally:
        stop_server(proc, lambda: proc.stdout.read())
