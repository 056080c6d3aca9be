"""DeepSeek V2/V3 (MLA + MoE) against transformers in float32, through the paged latent cache."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from models.deepseek import DeepseekV3ForCausalLM as OurDeepseekV3
from models.layers.moe import Router, RouterConfig
from models.loader import load_model
from tests.models.conftest import paged_forward, save_checkpoint, shuffled_block_tables, tiny_tokenizer

PROMPT_LENS = [7, 1, 12, 4]
TOLERANCE = 1e-4
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
_COMMON = dict(
    vocab_size=len(tiny_tokenizer()),
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=24,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    max_position_embeddings=64,
)
CASES = {
    "v2-greedy-no-q-lora": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5),
    ),
    "v2-group-limited-q-lora-yarn": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(
            q_lora_rank=20,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.0,
            rope_parameters=YARN,
        ),
    ),
    "v3-q-lora": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(q_lora_rank=20, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
    "v3-no-q-lora-yarn-halves": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            rope_parameters=YARN,
            rope_interleave=False,
            tie_word_embeddings=True,
        ),
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF's init (std 0.02, zero bias) gives near-uniform routing; spread weights so top-k varies by token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "rotary_emb" in name:
                continue
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def make_hf_deepseek(case: str, **overrides):
    """The tiny HF model of one case, its weights spread (_randomize)."""
    config_cls, model_cls, extra = CASES[case]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    _randomize(hf, seed=1)
    return hf


def save_quantizable_deepseek(case: str, path, **overrides):
    """A case's checkpoint with every linear layer's inputs a multiple of 32, so that `--quantization
    int8/int4` takes them all (the row-invariance and reproducibility tests); returns its directory."""
    dims = dict(
        q_lora_rank=32 if CASES[case][2].get("q_lora_rank") else None,
        kv_lora_rank=32,
        v_head_dim=8,
        moe_intermediate_size=32,
        intermediate_size=96,
    )
    return save_checkpoint(make_hf_deepseek(case, **{**dims, **overrides}), path)


def _make_checkpoint(case: str, tmp_path_factory):
    """(checkpoint dir, our model loaded from it, HF reference logits per prompt, prompts) for one tiny config."""
    hf = make_hf_deepseek(case)
    config = hf.config
    path = save_checkpoint(hf, tmp_path_factory.mktemp(case))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    with torch.no_grad():
        reference = [hf(input_ids=p[None]).logits[0].float() for p in prompts]
    return path, load_model(str(path), dtype="float32").model, reference, prompts


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    return _make_checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    return _make_checkpoint("v3-q-lora", tmp_path_factory)


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    scale = max(w.abs().max().item() for w in want)
    return max((g - w).abs().max().item() for g, w in zip(got, want)) / scale


def _run_steps(model, prompts, block_size: int, first_chunk: list[int]) -> list[torch.Tensor]:
    """Feed each prompt as first_chunk[i] tokens, then one token per step; logits of every token."""
    lens = [len(p) for p in prompts]
    tables, num_blocks = shuffled_block_tables(lens, block_size, seed=block_size)
    caches = model.kv_cache_spec(torch.float32).allocate(num_blocks, block_size, "cpu")
    done, outputs = [0] * len(prompts), [[] for _ in prompts]
    while any(d < n for d, n in zip(done, lens)):
        chunks = [
            (i, done[i], prompts[i][done[i] : done[i] + (first_chunk[i] if done[i] == 0 else 1)].tolist())
            for i in range(len(prompts))
            if done[i] < lens[i]
        ]
        for (i, start, ids), logits in zip(chunks, paged_forward(model, caches, chunks, tables, block_size)):
            outputs[i].append(logits)
            done[i] = start + len(ids)
    return [torch.cat(o) for o in outputs]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_prefill_matches_transformers(checkpoint, block_size):
    _, model, reference, prompts = checkpoint
    got = _run_steps(model, prompts, block_size, first_chunk=[len(p) for p in prompts])
    assert _relative_error(got, reference) < TOLERANCE


@pytest.mark.parametrize("block_size", [1, 5])
def test_token_by_token_decode_matches_transformers(checkpoint, block_size):
    _, model, reference, prompts = checkpoint
    # Step 0 mixes a prefill chunk (first prompt) with single-token sequences.
    got = _run_steps(model, prompts, block_size, first_chunk=[3] + [1] * (len(prompts) - 1))
    assert _relative_error(got, reference) < TOLERANCE


def test_cache_holds_only_the_latent(checkpoint):
    model = checkpoint[1]
    c = model.hf_config
    spec = model.kv_cache_spec(torch.bfloat16)
    assert spec.entry_shape == (c.kv_lora_rank + c.qk_rope_head_dim,)
    assert spec.bytes_per_token == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 2


def test_fused_expert_layout_loads_like_per_expert_names(v3_checkpoint):
    """HF's in-memory layout (experts.gate_up_proj / experts.down_proj) is accepted too;
    extra multi-token-prediction layers past num_hidden_layers are ignored."""
    path, _, reference, prompts = v3_checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    config = AutoConfig.from_pretrained(path)
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(config.n_routed_experts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]])
                for e in experts
            ]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in experts])
    fused[f"model.layers.{config.num_hidden_layers}.eh_proj.weight"] = torch.zeros(3, 3)  # an MTP layer
    model = OurDeepseekV3(config, max_model_len=64)
    loaded = model.load_weights(fused.items())
    assert loaded == {name for name, _ in model.named_parameters()}
    got = _run_steps(model.eval(), prompts, 4, first_chunk=[len(p) for p in prompts])
    assert _relative_error(got, reference) < TOLERANCE


def test_missing_expert_weight_is_reported(v3_checkpoint):
    path = v3_checkpoint[0]
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    model = OurDeepseekV3(AutoConfig.from_pretrained(path), max_model_len=64)
    loaded = model.load_weights(tensors.items())
    assert {name for name, _ in model.named_parameters()} - loaded == {"model.layers.2.mlp.experts.gate_up.5.weight"}


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_router_picks_the_same_experts_as_transformers(method):
    if method == "noaux_tc":
        config = DeepseekV3Config(**_COMMON, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
        hf_router, scoring = DeepseekV3TopkRouter(config), "sigmoid"
    else:
        config = DeepseekV2Config(**_COMMON, topk_method=method, n_group=4, topk_group=2, routed_scaling_factor=2.0)
        hf_router, scoring = DeepseekV2TopkRouter(config), "softmax"
    _randomize(hf_router, seed=3)
    router = Router(RouterConfig.from_hf(config, scoring, method), config.hidden_size)
    router.load_state_dict(hf_router.state_dict())
    x = torch.randn(200, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, want_weights, want_ids = hf_router(x)
        weights, ids = router(x)
    want_ids, order = want_ids.sort(dim=-1)
    ids, mine = ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, mine), want_weights.gather(1, order))
    assert len(set(map(tuple, ids.tolist()))) > 10  # routing really depends on the token


def test_correction_bias_stays_float32_in_bfloat16(v3_checkpoint):
    """bf16 would round the bias's small per-expert differences and change which experts win."""
    path = v3_checkpoint[0]
    want = load_file(str(path / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    gate = load_model(str(path), dtype="bfloat16").model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, want)
