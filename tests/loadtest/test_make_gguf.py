"""loadtest.make_gguf: synthetic GGUFs load with our loader, as stored, and generate.

The tiny shape keeps SmolLM2's whole vocabulary, so every file here costs a few seconds of
metadata parsing (49k tokens and merges) whoever reads it: the three files are written once,
with the real file's tokenizer read once, and each is loaded once.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.llm import LLM
from engine.request import SamplingParams
from loadtest.make_gguf import SHAPES, TYPES, parse_shortcut, tensor_plan, tokenizer_fields, write_gguf
from models.fetch import cache_dir, default_model_path
from models.gguf import load_tokenizer
from models.loader import load_model

TEXTS = ["The quick brown fox, in 2024: paged attention!", "<|im_start|>user\nhi<|im_end|>\n", "Ünïcödé ✓ 日本語"]


def num_parameters(shape_name: str) -> int:
    return sum(math.prod(dims) for _, dims, _ in tensor_plan(SHAPES[shape_name], TYPES["q4_0"]))


def test_named_shapes_have_their_models_parameter_counts():
    assert num_parameters("smollm2-135m") == 134_515_008
    assert num_parameters("smollm2-360m") == 361_821_120
    assert num_parameters("smollm2-1.7b") == 1_711_376_384


def test_shortcut_names_a_shape_and_type_and_nothing_else():
    assert parse_shortcut("smollm2-1.7b:q4_0") == ("smollm2-1.7b", "q4_0")
    assert parse_shortcut("SmolLM2-360M:Q8_0") == ("smollm2-360m", "q8_0")
    assert parse_shortcut("smollm2-1.7b:q5_0") is None
    assert parse_shortcut("/tmp/model.gguf") is None


@pytest.fixture(scope="module")
def real_gguf():
    return default_model_path()


@pytest.fixture(scope="module")
def real_tokenizer(real_gguf):
    return tokenizer_fields(real_gguf)


@pytest.fixture(scope="module")
def files(real_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic")
    return {t: write_gguf(folder / f"tiny-{t}.gguf", "tiny", t, seed=1, tokenizer=real_tokenizer) for t in TYPES}


@pytest.fixture(scope="module")
def loaded(files, tmp_path_factory):
    """Each file through load_model, its converted tokenizer cached in a temporary directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return {t: load_model(path, dtype="float32") for t, path in files.items()}


def test_file_holds_llama_cpp_tensor_types_weights_of_std_002_and_the_real_tokenizer(files, real_tokenizer):
    reader = GGUFReader(files["q4_0"])
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.1.ffn_down.weight"] == types["blk.0.attn_q.weight"] == "Q4_0"
    assert types["output_norm.weight"] == types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in types  # tied
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert [int(d) for d in embedding.shape] == [64, 49152]  # GGUF order: (hidden, vocab)
    assert abs(float(dequantize(embedding.data, embedding.tensor_type).std()) - 0.02) < 0.001
    ours = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    assert ours == {key: value for key, value, *_ in real_tokenizer}


def test_same_seed_same_bytes_other_seed_other_bytes(files, real_tokenizer, tmp_path):
    again = write_gguf(tmp_path / "again.gguf", "tiny", "q4_0", seed=1, tokenizer=real_tokenizer)
    assert again.read_bytes() == files["q4_0"].read_bytes()
    # Tensors made by worker processes, in whatever order they finish, land in the same bytes.
    pooled = write_gguf(tmp_path / "pooled.gguf", "tiny", "q4_0", seed=1, tokenizer=real_tokenizer, jobs=3)
    assert pooled.read_bytes() == files["q4_0"].read_bytes()
    other = write_gguf(tmp_path / "other.gguf", "tiny", "q4_0", seed=2, tokenizer=real_tokenizer)
    assert other.read_bytes() != files["q4_0"].read_bytes()


@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_loader_serves_the_stored_types_and_greedy_tokens_stay_finite(loaded, qtype):
    model = loaded[qtype]
    hf = model.config.hf_config
    assert (hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers) == (64, 128, 2)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.vocab_size) == (4, 2, 49152)
    assert hf.tie_word_embeddings and hf.rope_parameters["rope_theta"] == 100000.0
    assert model.config.max_model_len == 8192
    # 2 layers x (qkv, o, gate_up, down) in the file's type; the tied embedding/lm_head in int8
    assert model.quantization == ("int8 x 9" if qtype == "q8_0" else "int4 x 8, int8 x 1")

    llm = LLM.from_loaded(model, num_kv_blocks=8, num_threads=1)
    result = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))[0]
    assert len(result.token_ids) == 6
    assert all(np.isfinite(lp.logprob) for lp in result.logprobs)


def test_tokenizer_round_trips_as_the_real_files(loaded, real_gguf):
    real = load_tokenizer(real_gguf, cache_dir())
    ours = loaded["q4_1"].tokenizer
    for text in TEXTS:
        ids = real(text).input_ids
        assert ours(text).input_ids == ids
        assert ours.decode(ids) == real.decode(ids)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == real.apply_chat_template(messages, tokenize=False)
