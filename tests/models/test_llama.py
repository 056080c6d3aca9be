"""Our loader + LlamaForCausalLM (and the Qwen MoE models built on its attention) reproduce
transformers' logits (float32) through the paged cache."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from models.loader import load_model
from tests.models.conftest import assert_logits_close, model_cases, paged_forward

CASES = {
    "llama_mha": ("llama", {"num_key_value_heads": 4}),
    "llama_gqa": ("llama", {}),
    "llama_mqa": ("llama", {"num_key_value_heads": 1}),
    "llama_tied_biases": ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {}),  # default sliding_window 4096 > max_model_len: plain causal attention
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),  # q/k norms, head_dim != hidden/heads
    # models/qwen_moe.py: this attention with a MoE of 8 experts (top 2-3) on the sparse layers, dense
    # MLPs on the others (mlp_only_layers, decoder_sparse_step); Qwen2-MoE adds its gated shared expert.
    "qwen3_moe": (
        "qwen3_moe",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_hidden_layers": 3,
            "decoder_sparse_step": 2,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "tie_word_embeddings": True,
        },
    ),
    "phi3": ("phi3", {"sliding_window": 16}),  # fused qkv_proj / gate_up_proj in the checkpoint; windowed
    "rope_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "rope_dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "rope_yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "rope_llama3": (
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
}
PROMPT_LENS = [1, 9, 23, 41]  # ragged; 41 spans several blocks of every size tested
WORST = {"relative": 0.0}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    get = model_cases(CASES, PROMPT_LENS, tmp_path_factory)
    yield get
    print(f"\nworst relative logits diff vs transformers: {WORST['relative']:.2e}")  # shown with -s


def check(ours, ref):
    WORST["relative"] = max(WORST["relative"], assert_logits_close(ours, ref))


@pytest.mark.parametrize("name", CASES)
def test_ragged_prefill_matches_hf(cases, name):
    case = cases(name)
    caches, tables = case.new_cache(PROMPT_LENS, block_size=16)
    chunks = [(i, 0, p) for i, p in enumerate(case.prompts)]
    for logits, ref in zip(paged_forward(case.loaded.model, caches, chunks, tables, 16), case.ref):
        check(logits, ref)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_and_decode_match_hf(cases, name, block_size):
    """Each sequence prefills a first chunk, then advances by 1 (decode) or a few tokens per
    step, so steps mix decodes and prefill chunks over cached context in shuffled blocks."""
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
            chunks.reverse()  # batch order must not matter
        for (i, start, ids), logits in zip(
            chunks, paged_forward(case.loaded.model, caches, chunks, tables, block_size)
        ):
            check(logits, case.ref[i][start : start + len(ids)])
            done[i] += len(ids)
        step += 1


def test_old_rope_scaling_spelling_loads_the_same(cases, tmp_path):
    """config.json with classic `rope_theta` + `rope_scaling` {"type": ...} == `rope_parameters`."""
    case = cases("rope_linear")
    old = tmp_path / "old"
    old.mkdir()
    for f in case.dir.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    raw = json.loads((case.dir / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params["rope_theta"]
    raw["rope_scaling"] = {"type": "linear", "factor": params["factor"]}
    (old / "config.json").write_text(json.dumps(raw))
    loaded = load_model(str(old), dtype="float32")
    rope = loaded.config.hf_config.rope_parameters
    assert rope["rope_type"] == "linear" and rope["factor"] == 2.0 and rope["rope_theta"] == 10000.0
    caches, tables = case.new_cache(PROMPT_LENS, 16)
    chunks = [(i, 0, p) for i, p in enumerate(case.prompts)]
    for logits, ref in zip(paged_forward(loaded.model, caches, chunks, tables, 16), case.ref):
        check(logits, ref)


def test_sliding_window_is_served_past_the_window_and_capped_where_not(make_checkpoint, caplog):
    """LlamaForCausalLM attends within Mistral's window: max_model_len stays max_position_embeddings.
    A class without windows in its attention is capped to the window (full attention equals it up to there)."""
    from models.config import resolve_max_model_len

    path, hf_model = make_checkpoint("mistral", sliding_window=16)
    with caplog.at_level(logging.WARNING, logger="models.config"):
        loaded = load_model(str(path), dtype="float32")
    assert loaded.config.max_model_len == 128 and "sliding_window" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="models.config"):
        assert resolve_max_model_len(hf_model.config, None, serves_windows=False) == 16
    assert "sliding_window 16" in caplog.text
    prompts = [[5, 6, 7], list(range(10, 40))]  # the longest is past the window
    caches = loaded.model.kv_cache_spec(torch.float32).allocate(12, 4, "cpu")
    tables = [[3, 0], [6, 1, 7, 2, 11, 4, 9, 8]]
    out = paged_forward(loaded.model, caches, [(0, 0, prompts[0]), (1, 0, prompts[1])], tables, 4)
    with torch.no_grad():
        for logits, p in zip(out, prompts):
            check(logits, hf_model(input_ids=torch.tensor([p])).logits[0])


def test_bfloat16_serving_is_close_to_float32(cases, tiny_llama_dir):
    case = cases("llama_gqa")
    loaded = load_model(str(case.dir), dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    caches, tables = case.new_cache(PROMPT_LENS, 16)
    caches = [c.to(torch.bfloat16) for c in caches]
    chunks = [(i, 0, p) for i, p in enumerate(case.prompts)]
    for logits, ref in zip(paged_forward(loaded.model, caches, chunks, tables, 16), case.ref):
        assert logits.dtype == torch.float32
        assert (logits - ref).abs().max() / ref.abs().max() < 0.1


def test_greedy_generate_cli_matches_hf_generate(cases, capsys):
    from models.generate import main

    case = cases("llama_gqa")
    tok = case.loaded.tokenizer
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog. Paged"]
    main(
        ["--model", str(case.dir), "--dtype", "float32", "--max-tokens", "12", "--ignore-eos"]
        + [a for p in prompts for a in ("--prompt", p)]
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == prompts
    for line, prompt in zip(lines, prompts):
        ids = tok(prompt).input_ids
        with torch.no_grad():
            ref = case.hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )[0, len(ids) :].tolist()
        assert line["token_ids"] == ref
        assert line["text"] == tok.decode(ref, skip_special_tokens=True)
