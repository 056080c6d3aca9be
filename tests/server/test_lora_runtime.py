"""LoRA adapters loaded and unloaded while serving (--enable-lora-runtime-updates), over a real socket:
what a loaded adapter generates, what every bad load answers, and that running streams never notice."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import httpx
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from engine.async_engine import AsyncEngine
from loadtest import BenchmarkConfig, run_benchmark
from engine.config import EngineConfig
from models.loader import load_model
from server.app import create_app
from tests.models.conftest import make_hf_model, tiny_tokenizer
from tests.models.test_lora import make_adapter, reference
from tests.server.conftest import ENGINE_DEFAULTS, MODEL_NAME, LiveServer

peft = pytest.importorskip("peft")

PROMPT = [5, 17, 42, 9, 100, 33]
KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """--lora-root: the adapters the tests load, and ones that are wrong in a single way."""
    root = tmp_path_factory.mktemp("lora-root")
    make_adapter("llama", root / "tuned", seed=1)
    make_adapter("llama", root / "other", seed=2, targets=["q_proj", "v_proj"])
    make_adapter("llama", root / "resident", seed=3)
    make_adapter("llama", root / "rank8", seed=4, r=8)
    make_adapter("gemma3", root / "gemma", seed=5)  # another architecture: its layers have other shapes
    _peft_adapter(make_hf_model("llama", num_hidden_layers=3), root / "deeper")  # a layer the base lacks
    make_adapter("llama", root / "saves_head", seed=6, modules_to_save=["lm_head"])
    shutil.copytree(root / "tuned", root / "bad_json")
    (root / "bad_json" / "adapter_config.json").write_text("{not json")
    return root


def _peft_adapter(model, path) -> None:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(path)


@pytest.fixture(scope="module")
def server(tiny_model_dir, root):
    # Its own model: adapters attach to the layers of the model they are served with.
    loaded = load_model(tiny_model_dir, dtype="float32", device="cpu")
    config = EngineConfig(
        **ENGINE_DEFAULTS, lora_modules=(("resident", str(root / "resident")),), max_loras=3, max_lora_rank=4
    )
    engine = AsyncEngine(loaded, config)
    app = create_app(
        engine, served_model_name=MODEL_NAME, api_key=KEY, enable_lora_runtime_updates=True, lora_root=str(root)
    )
    live = LiveServer(app, engine).start()
    live.http.headers.update(AUTH)
    yield live
    live.stop()


def load(server, name: str, path) -> httpx.Response:
    return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def unload(server, name: str) -> httpx.Response:
    return server.http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def complete(server, model: str, max_tokens: int = 6) -> httpx.Response:
    return server.http.post(
        "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )


def test_a_loaded_adapter_serves_as_peft_computes_it_and_unloads(server, root):
    assert load(server, "tuned", root / "tuned").text == "Success: LoRA adapter 'tuned' added successfully."
    cards = {card["id"]: card for card in server.http.get("/v1/models").json()["data"]}
    assert cards["tuned"]["parent"] == MODEL_NAME and cards["resident"]["parent"] == MODEL_NAME
    body = complete(server, "tuned").json()
    assert body["model"] == "tuned"  # the adapter's name is echoed, as vLLM does
    assert body["choices"][0]["text"] == tiny_tokenizer().decode(reference("llama", str(root / "tuned"), PROMPT)[0])
    chunks = server.http.post(
        "/v1/chat/completions",
        json={"model": "tuned", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    models = {json.loads(line[6:])["model"] for line in chunks.text.splitlines() if line.startswith("data: {")}
    assert models == {"tuned"}
    assert complete(server, MODEL_NAME).json()["model"] == MODEL_NAME

    assert unload(server, "tuned").text == "Success: LoRA adapter 'tuned' removed successfully."
    gone = complete(server, "tuned")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert "tuned" not in {card["id"] for card in server.http.get("/v1/models").json()["data"]}
    assert unload(server, "tuned").status_code == 404


def test_the_same_name_loaded_again_from_other_weights_shares_no_cache(server, root):
    first = load(server, "swap", root / "tuned"), complete(server, "swap").json(), unload(server, "swap")
    second = load(server, "swap", root / "other"), complete(server, "swap").json(), unload(server, "swap")
    assert all(r.status_code == 200 for r in (*first[::2], *second[::2]))
    assert second[1]["choices"][0]["text"] == tiny_tokenizer().decode(
        reference("llama", str(root / "other"), PROMPT)[0]
    )
    assert first[1]["choices"][0]["text"] != second[1]["choices"][0]["text"]


@pytest.mark.parametrize(
    ("name", "path", "status", "words"),
    [
        ("x", "absent", 400, "no such directory"),
        ("x", "bad_json", 400, "not valid JSON"),
        ("x", "rank8", 400, "above --max-lora-rank 4"),
        ("x", "gemma", 400, "do not fit the layer"),
        ("x", "deeper", 400, "the model has no layer model.layers.2"),
        ("x", "saves_head", 400, "modules_to_save"),
        ("resident", "tuned", 409, "already loaded"),
        (MODEL_NAME, "tuned", 400, "names the base model"),
        ("x", "/etc", 400, "outside --lora-root"),
        ("x", "../", 400, "outside --lora-root"),
    ],
)
def test_a_bad_load_is_refused_naming_the_problem(server, root, name, path, status, words):
    response = load(server, name, path if path.startswith("/") else root / path)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]
    assert complete(server, "resident").status_code == 200  # still serving, the adapter still there


def test_requests_refused_before_the_engine(server, root):
    no_key = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root)})
    assert no_key.status_code == 401
    for body in ({"lora_name": "x"}, {"lora_path": str(root / "tuned")}, [], {"lora_name": 3, "lora_path": "a"}):
        response = server.http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == 400 and "error" in response.json()


def test_a_symlink_out_of_the_root_is_refused(server, root, tmp_path):
    shutil.copytree(root / "tuned", tmp_path / "outside")
    (root / "link").symlink_to(tmp_path / "outside")
    response = load(server, "linked", root / "link")
    assert response.status_code == 400 and "outside --lora-root" in response.json()["error"]["message"]
    (root / "inner_link").mkdir()  # a directory inside whose files lead out
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "inner_link" / name).symlink_to(tmp_path / "outside" / name)
    response = load(server, "linked", root / "inner_link")
    assert response.status_code == 400 and "outside --lora-root" in response.json()["error"]["message"]


def test_loads_beyond_max_loras_are_refused(server, root):
    assert load(server, "a", root / "tuned").status_code == 200
    assert load(server, "b", root / "other").status_code == 200  # with resident: 3 of 3
    full = load(server, "c", root / "tuned")
    assert full.status_code == 400 and "--max-loras 3" in full.json()["error"]["message"]
    assert unload(server, "a").status_code == 200 and unload(server, "b").status_code == 200


def test_streams_run_through_loads_and_unloads_unchanged(server, root):
    """A stream on the base model and one on an adapter, each read while another adapter is loaded
    and unloaded twice, get the tokens they get alone; an adapter in use is not unloaded (409)."""
    alone = {model: complete(server, model, 64).json()["choices"][0]["text"] for model in (MODEL_NAME, "resident")}
    got: dict[str, str] = {}
    started = threading.Barrier(3)

    def stream(model: str) -> None:
        with server.http.stream(
            "POST",
            "/v1/completions",
            json={
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response:
            text = []
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    if not text:
                        started.wait(30)
                    text.append(json.loads(line[6:])["choices"][0]["text"])
            got[model] = "".join(text)

    threads = [threading.Thread(target=stream, args=(model,)) for model in alone]
    for t in threads:
        t.start()
    started.wait(30)
    in_use = unload(server, "resident")
    for _ in range(2):
        assert load(server, "during", root / "tuned").status_code == 200
        assert unload(server, "during").status_code == 200
    for t in threads:
        t.join(60)
    assert got == alone
    assert in_use.status_code == 409 and in_use.json()["error"]["code"] == "lora_in_use"


def test_loadtest_spreads_its_requests_over_the_adapters(server):
    before = server.metric("pagedserve:lora_requests_total", 'lora_name="resident"')
    config = BenchmarkConfig(
        url=server.url,
        model="",
        models=(MODEL_NAME, "resident"),
        num_requests=6,
        concurrency=3,
        input_len=8,
        output_len=4,
        ignore_eos=True,
        api_key=KEY,
        idle_timeout=10.0,
    )
    summary = asyncio.run(run_benchmark(config))["summary"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert server.metric("pagedserve:lora_requests_total", 'lora_name="resident"') - before == 3


def test_metrics_show_the_adapters(server):
    assert complete(server, "resident").status_code == 200
    text = server.http.get("/metrics").text
    assert (
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="",waiting_lora_adapters=""}' in text
        or 'vllm:lora_requests_info{max_lora="3",waiting_lora_adapters="",running_lora_adapters=""}' in text
    )
    assert server.metric("pagedserve:lora_requests_total", 'lora_name="resident"') >= 1


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
_FIELDS = [
    "r",
    "lora_alpha",
    "target_modules",
    "peft_type",
    "use_rslora",
    "bias",
    "modules_to_save",
    "use_dora",
    "rank_pattern",
    "fan_in_fan_out",
    "base_model_name_or_path",
]


@st.composite
def corruption(draw):
    """One way to spoil a good adapter: a config field, the config, or the tensors file."""
    kind = draw(st.sampled_from(["field", "config", "truncate", "shape", "dtype", "drop", "garbage"]))
    if kind == "field":
        return kind, (draw(st.sampled_from(_FIELDS)), draw(_JSON))
    if kind == "config":
        return kind, draw(_JSON)
    if kind in ("truncate", "garbage"):
        return kind, draw(st.integers(0, 4000))
    if kind == "shape":
        return kind, (draw(st.integers(0, 50)), draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    if kind == "dtype":
        return kind, (
            draw(st.integers(0, 50)),
            draw(st.sampled_from(["float16", "bfloat16", "int8", "int64", "bool", "float64"])),
        )
    return kind, draw(st.integers(0, 50))


def spoil(directory, kind: str, arg) -> None:
    config_file, tensors_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if kind == "field":
        config = json.loads(config_file.read_text())
        config[arg[0]] = arg[1]
        config_file.write_text(json.dumps(config))
    elif kind == "config":
        config_file.write_text(json.dumps(arg))
    elif kind == "truncate":
        tensors_file.write_bytes(tensors_file.read_bytes()[:arg])
    elif kind == "garbage":
        data = bytearray(tensors_file.read_bytes())
        data[arg % len(data)] ^= 0xA5
        data[(arg * 7) % 64] ^= 0x5A  # in the header too
        tensors_file.write_bytes(bytes(data))
    else:
        tensors = load_file(str(tensors_file))
        key = sorted(tensors)[arg[0] % len(tensors) if kind != "drop" else arg % len(tensors)]
        if kind == "shape":
            tensors[key] = torch.ones(arg[1])
        elif kind == "dtype":
            tensors[key] = tensors[key].to(getattr(torch, arg[1]))
        else:
            del tensors[key]
        save_file(tensors, str(tensors_file))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spoiled=corruption())
def test_a_spoiled_adapter_never_gets_a_server_error(server, root, spoiled):
    target = root / "spoiled"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(root / "tuned", target)
    spoil(target, *spoiled)
    response = load(server, "spoiled", target)
    event(f"{spoiled[0]}: {response.status_code}")
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["message"]
    else:  # e.g. another lora_alpha or a dtype: still an adapter
        assert unload(server, "spoiled").status_code == 200
    assert complete(server, MODEL_NAME, 2).status_code == 200
