"""Gemma 2 / Gemma 3 (and Mistral, Qwen2 with a real sliding window) through our loader and the paged
cache reproduce transformers' eager logits (float32) on prompts several windows long: sliding-window
layers interleaved with global ones, soft-capped scores and logits, Gemma 3's per-layer-type RoPE."""

from __future__ import annotations


import pytest
import torch

from models.loader import load_model
from tests.models.conftest import assert_logits_close, model_cases, paged_forward

WINDOW = 8
GEMMA = dict(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh")
CASES = {
    # Alternating local / global layers, both soft-cappings small enough to bite, tied embeddings.
    "gemma2": (
        "gemma2",
        {
            **GEMMA,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
        },
    ),
    # q/k norms; two local layers, a global one, a local one; local RoPE base and linear scaling on
    # the global layer only (transformers 5's per-layer-type rope_parameters).
    "gemma3": (
        "gemma3",
        {
            **GEMMA,
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": 5.0,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
    ),
    "mistral": ("mistral", {"sliding_window": WINDOW}),  # every layer windowed
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
}
PROMPT_LENS = [1, 9, 23, 41]  # 41 tokens: five windows


pytestmark = pytest.mark.usefixtures("attention_path")  # every test: C++ kernels, then PyTorch paths


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return model_cases(CASES, PROMPT_LENS, tmp_path_factory)


def test_config_windows_and_max_model_len(cases):
    """Windows are served, so max_model_len is not capped to them; the layers carry them."""
    gemma2, gemma3, mistral = cases("gemma2"), cases("gemma3"), cases("mistral")
    for case in (gemma2, gemma3, mistral):
        assert case.loaded.config.max_model_len == 128  # max_position_embeddings, past the window
    assert [layer.self_attn.window for layer in gemma2.loaded.model.model.layers] == [WINDOW, None, WINDOW, None]
    assert [layer.self_attn.window for layer in gemma3.loaded.model.model.layers] == [WINDOW, WINDOW, None, WINDOW]
    assert [layer.self_attn.window for layer in mistral.loaded.model.model.layers] == [WINDOW, WINDOW]
    assert [layer.self_attn.window for layer in cases("qwen2").loaded.model.model.layers] == [None, WINDOW]
    assert gemma2.loaded.model.model.layers[0].self_attn.softcap == 3.0


@pytest.mark.parametrize("name", CASES)
def test_ragged_prefill_matches_hf(cases, name):
    case = cases(name)
    caches, tables = case.new_cache(PROMPT_LENS, block_size=4)
    chunks = [(i, 0, p) for i, p in enumerate(case.prompts)]
    for logits, ref in zip(paged_forward(case.loaded.model, caches, chunks, tables, 4), case.ref):
        assert_logits_close(logits, ref)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_and_decode_match_hf(cases, name, block_size):
    """A first chunk, then decodes and small chunks over cached context in shuffled blocks, the
    batch order reversed every other step: each token's logits equal transformers'."""
    case = cases(name)
    caches, tables = case.new_cache(PROMPT_LENS, block_size, seed=block_size)
    done = [0] * len(case.prompts)
    step_sizes = [1, 1, 3, 1, 2]
    step = 0
    while any(d < len(p) for d, p in zip(done, case.prompts)):
        chunks = []
        for i, p in enumerate(case.prompts):
            if done[i] < len(p):
                n = max(1, len(p) // 3) if done[i] == 0 else step_sizes[(step + i) % len(step_sizes)]
                chunks.append((i, done[i], p[done[i] : done[i] + n]))
        if step % 2:
            chunks.reverse()
        for (i, start, ids), logits in zip(
            chunks, paged_forward(case.loaded.model, caches, chunks, tables, block_size)
        ):
            assert_logits_close(logits, case.ref[i][start : start + len(ids)])
            done[i] += len(ids)
        step += 1


@pytest.mark.parametrize("name", CASES)
def test_greedy_decode_matches_hf_generate(cases, name):
    """Prefill a 41-token prompt, then 12 greedy decode steps: the same tokens as transformers'."""
    case = cases(name)
    prompt, new = case.prompts[-1], 12
    caches, tables = case.new_cache([len(prompt) + new], block_size=4, seed=3)
    logits = paged_forward(case.loaded.model, caches, [(0, 0, prompt)], tables, 4)[0]
    ours = [int(logits[-1].argmax())]
    while len(ours) < new:
        logits = paged_forward(case.loaded.model, caches, [(0, len(prompt) + len(ours) - 1, ours[-1:])], tables, 4)[0]
        ours.append(int(logits[-1].argmax()))
    with torch.no_grad():
        ref = case.hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt) :].tolist()
    assert ours == ref


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_bfloat16_serving_is_as_close_to_float32_as_transformers(cases, name):
    """Random weights make bfloat16 drift (transformers' own bfloat16 Gemma 3 is ~15% off its float32
    on the longest prompt): ours may drift as far as transformers' does, with a margin."""
    import copy

    case = cases(name)
    loaded = load_model(str(case.dir), dtype="bfloat16")
    hf_bf16 = copy.deepcopy(case.hf_model).to(torch.bfloat16)
    caches, tables = case.new_cache(PROMPT_LENS, 16)
    caches = [c.to(torch.bfloat16) for c in caches]
    chunks = [(i, 0, p) for i, p in enumerate(case.prompts)]
    for logits, ref, p in zip(paged_forward(loaded.model, caches, chunks, tables, 16), case.ref, case.prompts):
        assert logits.dtype == torch.float32
        with torch.no_grad():
            theirs = hf_bf16(input_ids=torch.tensor([p])).logits[0].float()
        scale = ref.abs().max()
        assert (logits - ref).abs().max() / scale < 2 * (theirs - ref).abs().max() / scale + 0.02
