"""GGUF files of every architecture we serve, written by llama.cpp's own converter from tiny random
HF checkpoints, served by our loader and compared with transformers on the HF checkpoint.

    HF checkpoint (transformers, float32) --convert_hf_to_gguf.py--> .gguf --models.loader--> our model

F32 files must give transformers' logits within float32 tolerance through the paged cache
(chunked prefill, decode, shuffled blocks); a Q8_0 file is served from its stored blocks (the
quantized path, llama's Q/K row order applied to whole blocks) and compared with transformers
on the same file's dequantized weights.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open

from models.gguf import GGUFError, load_gguf, supported_architectures
from models.loader import load_model
from tests.models.conftest import (
    assert_logits_close,
    make_hf_model,
    paged_forward,
    save_checkpoint,
    shuffled_block_tables,
    tiny_tokenizer,
)
from tests.models.llama_cpp import convert
from tests.models.test_deepseek import CASES as DEEPSEEK, YARN, make_hf_deepseek

CASES = {
    "llama": ("llama", {}),
    "llama_tied_mqa": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama3_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "rope_theta": 500000.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "phi3": ("phi3", {}),
    # Gemma ties its embeddings (llama.cpp's converter writes no output.weight) and scales queries by
    # head_dim as the released 2B/9B/4B/12B configs do.
    "gemma2": (
        "gemma2",
        {
            "sliding_window": 8,
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 15.0,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True,
        },
    ),
    # GGUF keeps no layer pattern: llama.cpp and transformers both take Gemma 3's five sliding
    # layers to one global, and 10000 as the sliding layers' RoPE base.
    "gemma3": (
        "gemma3",
        {
            "sliding_window": 8,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True,
            "num_hidden_layers": 6,
        },
    ),
    # DeepSeek (llama.cpp's `deepseek2`): test_deepseek's tiny models, whose per-expert tensors are what the
    # converter reads. V3's config.json names its gating function (as DeepSeek's does; transformers'
    # config does not), else the converter writes none and llama.cpp takes softmax; its KV head count is
    # the head count (transformers' default is V3's 128), by which the converter splits kv_b_proj.
    "deepseek_v2": ("v2-greedy-no-q-lora", {}),
    # GGUF keeps one YaRN mscale (as 0.1 * mscale_all_dim): DeepSeek's releases set mscale to the same.
    "deepseek_v2_group_limited_yarn": (
        "v2-group-limited-q-lora-yarn",
        {"rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}},
    ),
    "deepseek_v3": ("v3-q-lora", {"scoring_func": "sigmoid", "num_key_value_heads": 4}),
    # Qwen MoE: llama.cpp puts the MoE on every layer (GGUF keeps no decoder_sparse_step or mlp_only_layers)
    # and renormalises the top-k weights for qwen3moe only, as the released configs' norm_topk_prob says.
    "qwen3_moe": (
        "qwen3_moe",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        },
    ),
}
QWEN_MOE = [n for n, (arch, _) in CASES.items() if arch in ("qwen2_moe", "qwen3_moe")]
PROMPT_LENS = [1, 9, 23, 41]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF model, GGUF path), converted once per module."""
    built = {}

    def get(name, outtype="f32"):
        key = (name, outtype)
        if key not in built:
            arch, overrides = CASES[name]
            hf_model = make_hf_deepseek(arch, **overrides) if arch in DEEPSEEK else make_hf_model(arch, **overrides)
            root = tmp_path_factory.mktemp(name)
            checkpoint = save_checkpoint(hf_model, root / "hf")
            built[key] = hf_model, convert(checkpoint, root / f"{name}-{outtype}.gguf", outtype)
        return built[key]

    return get


def run_steps(model, prompts, block_size=5):
    """Prefill a third of each prompt, then 1-3 tokens a step: every row's logits, per prompt."""
    tables, num_blocks = shuffled_block_tables([len(p) for p in prompts], block_size)
    caches = model.kv_cache_spec(torch.float32).allocate(num_blocks, block_size, "cpu")
    done, out, step = [0] * len(prompts), [[] for _ in prompts], 0
    while any(d < len(p) for d, p in zip(done, prompts)):
        chunks = []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = max(1, len(p) // 3) if done[i] == 0 else 1 + (step + i) % 3
                chunks.append((i, done[i], p[done[i] : done[i] + n]))
        for (i, _, ids), logits in zip(chunks, paged_forward(model, caches, chunks, tables, block_size)):
            out[i].append(logits)
            done[i] += len(ids)
        step += 1
    return [torch.cat(rows) for rows in out]


def prompts_for(vocab_size, seed=0):
    gen = random.Random(seed)
    return [[gen.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def greedy(logits_of, prompt, steps=8):
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(logits_of(ids)[-1].argmax()))
    return ids[len(prompt) :]


def paged_greedy(model, prompt, steps=8, block_size=5):
    """Greedy tokens as the engine makes them: the prompt in one step, then a decode step a token
    through the same paged cache."""
    tables, num_blocks = shuffled_block_tables([len(prompt) + steps], block_size)
    caches = model.kv_cache_spec(torch.float32).allocate(num_blocks, block_size, "cpu")
    ids = list(prompt)
    logits = paged_forward(model, caches, [(0, 0, ids)], tables, block_size)[0]
    ids.append(int(logits[-1].argmax()))
    while len(ids) < len(prompt) + steps:
        logits = paged_forward(model, caches, [(0, len(ids) - 1, ids[-1:])], tables, block_size)[0]
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", CASES)
def test_f32_file_serves_transformers_logits(converted, name):
    hf_model, path = converted(name)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config.architecture == hf_model.config.architectures[0] or (
        name == "mistral" and loaded.config.architecture == "LlamaForCausalLM"
    )  # llama.cpp writes Mistral as llama
    prompts = prompts_for(loaded.config.vocab_size)
    with torch.no_grad():
        refs = [hf_model(input_ids=torch.tensor([p])).logits[0] for p in prompts]
    for ours, ref in zip(run_steps(loaded.model, prompts), refs):
        assert_logits_close(ours, ref)

    def hf_logits(ids):
        with torch.no_grad():
            return hf_model(input_ids=torch.tensor([ids])).logits[0]

    assert paged_greedy(loaded.model, prompts[2]) == greedy(hf_logits, prompts[2])


@pytest.mark.parametrize("name", CASES)
def test_config_from_metadata_equals_the_checkpoints(converted, name, tmp_path):
    hf_model, path = converted(name)
    config, weights, _, eos = load_gguf(path, cache=tmp_path)
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
        "tie_word_embeddings",
    ):
        expected = getattr(ref, key, None)
        if key == "head_dim" and expected is None:  # Qwen2's config derives it
            expected = ref.hidden_size // ref.num_attention_heads
        assert getattr(config, key) == expected, key
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert eos == (tiny_tokenizer().eos_token_id,)
    expected = {n for n in hf_model.state_dict() if not (config.tie_word_embeddings and n == "lm_head.weight")}
    if CASES[name][0] in DEEPSEEK or name in QWEN_MOE:  # routed experts per expert, as the checkpoint stores them
        with safe_open(path.parent / "hf" / "model.safetensors", "pt") as f:
            expected = set(f.keys())
    assert {n for n, _ in weights} == expected


@pytest.mark.parametrize("name", [n for n, (arch, _) in CASES.items() if arch in DEEPSEEK])
def test_deepseek2_file_gives_back_the_checkpoints_config_and_tensors(converted, name, tmp_path):
    """MLA / MoE fields from `deepseek2.*` metadata; kv_b_proj rebuilt from k_b and v_b and the stacked
    experts split, bit for bit."""
    hf_model, path = converted(name)
    config, weights, *_ = load_gguf(path, cache=tmp_path)
    ref = hf_model.config
    assert config.architectures == ref.architectures
    for key in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "norm_topk_prob",
        "routed_scaling_factor",
    ):
        assert getattr(config, key) == getattr(ref, key), key
    if ref.model_type == "deepseek_v2":
        assert config.topk_method == ref.topk_method
    if config.topk_method != "greedy":
        assert (config.n_group, config.topk_group) == (ref.n_group, ref.topk_group)
    want = ref.rope_parameters
    got = {k: v for k, v in config.rope_parameters.items() if k in want}
    assert got == pytest.approx(want)
    with safe_open(path.parent / "hf" / "model.safetensors", "pt") as f:
        for hf_name, tensor in weights:
            assert torch.equal(tensor, f.get_tensor(hf_name)), hf_name


@pytest.mark.parametrize("name", QWEN_MOE)
def test_qwen_moe_file_gives_back_the_checkpoints_experts(converted, name, tmp_path):
    """Expert sizes from the `{arch}.expert_*` keys transformers' map leaves out; the stacked experts
    split back into the checkpoint's per-expert tensors, bit for bit."""
    hf_model, path = converted(name)
    config, weights, *_ = load_gguf(path, cache=tmp_path)
    ref = hf_model.config
    assert config.architectures == ref.architectures
    for key in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "shared_expert_intermediate_size",
    ):
        assert getattr(config, key, None) == getattr(ref, key, None), key
    types = weights.stored_types()
    with safe_open(path.parent / "hf" / "model.safetensors", "pt") as f:
        for hf_name, tensor in weights:
            assert torch.equal(tensor, f.get_tensor(hf_name)), hf_name
            assert hf_name in types


def test_llama3_rope_factors_reproduce_hf_frequencies(converted, tmp_path):
    """Llama 3.x files keep their scaling only as rope_freqs.weight: divisors that must give HF's llama3
    frequencies (the context beyond the original length is where they differ from plain RoPE)."""
    from models.layers.rope import rope_frequencies
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_model, path = converted("llama3_rope")
    config, *_ = load_gguf(path, cache=tmp_path)
    assert config.rope_parameters["rope_type"] == "default" and len(config.rope_freq_factors) == 16 // 2
    ours, _ = rope_frequencies(config, 128)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_model.config, None)
    torch.testing.assert_close(ours, ref, rtol=2e-7, atol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_q8_0_file_is_served_from_its_blocks(converted, name, tmp_path):
    """Q8_0 weights stay 8-bit (llama's permuted Q/K rows reordered as whole blocks) and give what
    transformers computes from the same file's dequantized weights, within the int8 kernel's error."""
    from transformers import AutoModelForCausalLM

    _, path = converted(name, "q8_0")
    loaded = load_model(str(path), dtype="float32")
    assert "int8" in loaded.quantization
    ref_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = prompts_for(loaded.config.vocab_size, seed=1)
    with torch.no_grad():
        refs = [ref_model(input_ids=torch.tensor([p])).logits[0] for p in prompts]
    for ours, ref in zip(run_steps(loaded.model, prompts), refs):
        assert_logits_close(ours, ref, tol=2e-2)  # int16-rounded activations against float32 ones


def test_every_registered_llama_family_is_supported():
    assert {"llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "deepseek2"} <= set(supported_architectures())


def test_unsupported_architecture_is_one_line_naming_it_and_the_supported(converted, tmp_path):
    from gguf import GGUFReader, GGUFWriter

    _, path = converted("llama")
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError) as info:
        load_gguf(tmp_path / "m.gguf", cache=tmp_path)
    message = str(info.value)
    assert "\n" not in message and "'mamba'" in message and "qwen2" in message and "llama" in message
    assert GGUFReader(path)  # the converted file itself is fine
