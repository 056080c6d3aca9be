"""LoRA adapters through the API: a request picks one by `model`, as vLLM's clients do; /v1/models
lists each with its base as `parent`; a bad adapter stops `python -m server` in one line."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from models.loader import load_model
from server.app import create_app
from tests.models.conftest import tiny_tokenizer
from tests.models.test_lora import make_adapter, reference
from tests.server.conftest import ENGINE_DEFAULTS, MODEL_NAME, LiveServer
from tests.server.test_model_refusals import REPO, assert_one_line_refusal

PROMPT = [5, 17, 42, 9, 100, 33]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    return make_adapter("llama", tmp_path_factory.mktemp("lora-api") / "tuned", seed=1)


@pytest.fixture(scope="module")
def lora_live(tiny_model_dir, adapter):
    # Its own model: adapters attach to the layers of the model they are served with.
    loaded = load_model(tiny_model_dir, dtype="float32", device="cpu")
    engine = AsyncEngine(loaded, EngineConfig(**ENGINE_DEFAULTS, lora_modules=(("tuned", adapter),)))
    server = LiveServer(create_app(engine, served_model_name=MODEL_NAME), engine).start()
    yield server
    server.stop()


def test_models_lists_the_adapter_with_its_parent(lora_live):
    cards = {card.id: card for card in lora_live.client().models.list().data}
    assert set(cards) == {MODEL_NAME, "tuned"}
    assert cards["tuned"].model_extra["parent"] == MODEL_NAME
    assert lora_live.http.get("/v1/models/tuned").json()["parent"] == MODEL_NAME


def test_the_model_field_picks_the_adapter(lora_live, adapter):
    client = lora_live.client()

    def complete(model: str) -> str:
        return (
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    decode = tiny_tokenizer().decode
    tuned, base = complete("tuned"), complete(MODEL_NAME)
    assert tuned == decode(reference("llama", adapter, PROMPT)[0])
    assert base == decode(reference("llama", None, PROMPT)[0])
    assert tuned != base
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete("tuned-v2")


def test_responses_name_the_adapter_they_ran_with(lora_live):
    client = lora_live.client()
    chat = client.chat.completions.create(model="tuned", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == "tuned"
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).model == MODEL_NAME
    stream = client.completions.create(model="tuned", prompt=PROMPT, max_tokens=3, stream=True)
    assert {chunk.model for chunk in stream} == {"tuned"}
    assert client.responses.create(model="tuned", input="hi", max_output_tokens=2).model == "tuned"


def test_runtime_updates_are_off_unless_enabled(lora_live, adapter):
    for route, body in (
        ("load_lora_adapter", {"lora_name": "more", "lora_path": adapter}),
        ("unload_lora_adapter", {"lora_name": "tuned"}),
    ):
        response = lora_live.http.post(f"/v1/{route}", json=body)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "lora_updates_disabled"
        assert "--enable-lora-runtime-updates" in response.json()["error"]["message"]
    assert {card.id for card in lora_live.client().models.list().data} == {MODEL_NAME, "tuned"}


def test_a_bad_adapter_stops_the_server_in_one_line(tiny_model_dir, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(tiny_model_dir),
            "--port",
            "1",
            "--lora-modules",
            f"gone={tmp_path / 'absent'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_refusal(out, ["LoRA adapter 'gone'", "no such directory"])


def test_an_adapter_outside_the_lora_root_stops_the_server(tiny_model_dir, adapter, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(tiny_model_dir),
            "--port",
            "1",
            "--lora-root",
            str(tmp_path),
            "--lora-modules",
            f"tuned={adapter}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_refusal(out, ["LoRA adapter 'tuned'", "outside --lora-root"])


@pytest.mark.parametrize(
    ("flags", "max_loras"),
    [
        ([], 0),
        (["--enable-lora-runtime-updates"], 1),
        (["--lora-modules", "a=x", "b=y"], 2),
        (["--enable-lora-runtime-updates", "--max-loras", "4"], 4),
    ],
)
def test_max_loras_defaults_to_the_adapters_given(flags, max_loras):
    from server.__main__ import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--model", "m", *flags])).max_loras == max_loras


@pytest.mark.parametrize(("flags", "lora_dtype"), [([], "auto"), (["--lora-dtype", "bfloat16"], "bfloat16")])
def test_the_lora_dtype_flag_reaches_the_engine_config(flags, lora_dtype):
    from server.__main__ import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--model", "m", *flags])).lora_dtype == lora_dtype
