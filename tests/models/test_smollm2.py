"""The real default model, SmolLM2-135M-Instruct Q4_1, against transformers' own GGUF loading.

Everything heavy is loaded once per module: our reader's output, transformers'
float32 model from the same file, and (when models.loader exists) our model.
Also pins down models.fetch's alias resolution.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.fetch import DEFAULT_MODEL, default_model_path, resolve_model_path
from models.gguf import load_gguf

PROMPT = "The quick brown fox jumps over the lazy dog. In 2024, paged attention"
TEXTS = [PROMPT, "x=3.14159 <|im_start|>user\nhi<|im_end|>\n", "  leading spaces\tand tabs\n\n", "Ünïcödé ✓ 日本語"]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf(gguf_path)  # (hf_config, weights, tokenizer, eos_token_ids)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


def require(module: str) -> None:
    """Fail, not skip: these tests are the acceptance check for the model layer."""
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} does not exist yet; the SmolLM2 end-to-end tests need it")


@pytest.fixture(scope="module")
def loaded(gguf_path):
    require("models.loader")
    from models.loader import load_model

    return load_model(str(gguf_path), dtype="float32")


def test_weights_equal_transformers_gguf_loading(ours, hf_model):
    _, weights, _, _ = ours
    reference = hf_model.state_dict()
    seen = set()
    for name, tensor in weights:  # one at a time: never two float copies of our side
        assert tensor.dtype in (torch.float32, torch.float16), name
        expected, tensor = reference[name], tensor.float()
        assert tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected) or (tensor - expected).abs().max().item() <= 1e-6, name
        seen.add(name)
    # Tied embeddings: transformers lists lm_head (sharing the embedding); the file has no output.weight.
    assert seen == set(reference) - {"lm_head.weight"}


def test_config_equals_transformers(ours, hf_model):
    config, _, _, _ = ours
    ref = hf_model.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "rope_parameters",
    ):
        assert getattr(config, key) == getattr(ref, key), key
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)


def test_tokenizer_equals_transformers_gguf_tokenizer(ours, gguf_path):
    _, _, tokenizer, eos = ours  # possibly the cached copy
    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in TEXTS:
        assert tokenizer(text).input_ids == reference(text).input_ids, text
        ids = reference(text).input_ids
        assert tokenizer.decode(ids) == reference.decode(ids)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert eos == (2,) and tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


def test_tokenizer_adds_no_bos_and_chat_template_frames_turns(ours):
    _, _, tokenizer, _ = ours
    assert tokenizer("Hello world").input_ids == [19556, 905]  # add_bos_token is false in the file
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@torch.inference_mode()
def test_logits_match_transformers(loaded, hf_model):
    from models.layers.attention import AttentionMetadata

    ids = loaded.tokenizer(PROMPT).input_ids
    n, block_size = len(ids), 16
    num_blocks = -(-n // block_size)
    kv_caches = loaded.model.kv_cache_spec(torch.float32).allocate(num_blocks, block_size, "cpu")
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size)
    hidden = loaded.model(torch.tensor(ids), torch.arange(n), kv_caches, meta)  # (n, hidden_size)
    logits = loaded.model.compute_logits(hidden)  # (n, vocab)
    reference = hf_model(torch.tensor([ids])).logits[0]
    diff = (logits - reference).abs().max().item()
    scale = reference.abs().max().item()
    # Served from the Q4_1 blocks with activations rounded to int16 (models/layers/quantization.py):
    # 5e-4 of the logit scale; the float-activation kernel is held to 1e-5 below.
    assert diff <= 5e-4 * scale, f"max |diff| {diff:.3g} vs logit scale {scale:.3g}"
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_chat_answer_names_paris(loaded):
    require("models.generate")
    from models.generate import generate_greedy

    tokenizer = loaded.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    [output] = generate_greedy(loaded, [prompt], max_tokens=24)
    answer = tokenizer.decode(output, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert loaded.config.eos_token_ids == (2,)


# models.fetch: no download here (the fixture above already did the only one); the rest of
# fetching is tests/models/test_fetch.py's.


def test_resolve_model_path_accepts_aliases_and_paths(gguf_path, tmp_path):
    for alias in (DEFAULT_MODEL, DEFAULT_MODEL.upper(), "smollm2", "SmolLM2"):
        assert resolve_model_path(alias) == gguf_path
    assert resolve_model_path(gguf_path) == gguf_path
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="not-a-model.*SmolLM2-135M-Instruct"):
        resolve_model_path(str(tmp_path / "not-a-model"))


# Quantized serving: the default GGUF runs from its Q4_1/Q8_0 blocks (models/layers/quantization.py).

PROMPT_SET = [
    PROMPT,
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def dequantized(gguf_path):
    from models.loader import load_model

    return load_model(str(gguf_path), dtype="float32", quantization="none")


@torch.inference_mode()
def _logits(loaded, ids):
    from models.layers.attention import AttentionMetadata

    n, block_size = len(ids), 16
    num_blocks = -(-n // block_size)
    kv_caches = loaded.model.kv_cache_spec(torch.float32).allocate(num_blocks, block_size, "cpu")
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size)
    return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(n), kv_caches, meta))


def test_default_gguf_is_served_from_its_quantized_blocks(loaded, dequantized):
    assert loaded.quantization == "int4 x 120, int8 x 1"  # 30 x (qkv, o, gate_up, down) Q4_1; embedding Q8_0
    assert dequantized.quantization == "dense x 121"
    assert loaded.weight_bytes < dequantized.weight_bytes / 4


@pytest.mark.parametrize("activations,tolerance", [("int16", 5e-4), ("float", 1e-5)])
def test_quantized_kernels_equal_the_dequantized_model_on_a_prompt_set(gguf_path, dequantized, activations, tolerance):
    """Same weights: logits within the stated bound of the logit scale (int16 activations, what
    serves; float activations: float32 summation order only), every greedy choice the same."""
    from models.layers.linear import Linear
    from models.layers.quantization import QuantMethod
    from models.loader import load_model

    loaded = load_model(str(gguf_path), dtype="float32")
    for m in loaded.model.modules():
        if isinstance(m, Linear) and isinstance(m.quant_method, QuantMethod):
            assert m.quant_method.quantize_input  # the default
            if activations == "float":
                m.quant_method = QuantMethod(m.quant_method.bits, m.quant_method.group_size, quantize_input=False)
    for text in PROMPT_SET:
        ids = loaded.tokenizer(text).input_ids
        ours, ref = _logits(loaded, ids), _logits(dequantized, ids)
        assert (ours - ref).abs().max().item() <= tolerance * ref.abs().max().item(), text
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), text
