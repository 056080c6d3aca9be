"""Qwen2-MoE / Qwen3-MoE specifics (their logits against transformers: tests/models/test_llama.py's
cases; their GGUF files: test_gguf_architectures.py): where the MoE layers go, and the router."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from models.layers.moe import MoE, Router, RouterConfig
from models.qwen_moe import QwenMoeForCausalLM

_TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=16,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
)


@pytest.mark.parametrize(
    "sparsity",
    [
        dict(decoder_sparse_step=1),
        dict(decoder_sparse_step=2),
        dict(decoder_sparse_step=1, mlp_only_layers=[0, 3]),
        dict(decoder_sparse_step=3, mlp_only_layers=[5]),
    ],
)
def test_moe_layers_are_where_transformers_puts_them(sparsity):
    config = Qwen3MoeConfig(**_TINY, **sparsity)
    with torch.device("meta"):
        ours = QwenMoeForCausalLM(config, 64)
        ref = Qwen3MoeForCausalLM(config)
    got = [isinstance(layer.mlp, MoE) for layer in ours.model.layers]
    assert got == [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in ref.model.layers]
    assert any(got) or sparsity.get("mlp_only_layers")


def test_qwen2_moe_layers_hold_a_gated_shared_expert():
    config = Qwen2MoeConfig(**_TINY, shared_expert_intermediate_size=24)
    with torch.device("meta"):
        mlp = QwenMoeForCausalLM(config, 64).model.layers[0].mlp
    assert mlp.shared_experts.down_proj.in_features == 24 and mlp.shared_expert_gate.out_features == 1


@pytest.mark.parametrize("top_k,norm_topk_prob", [(2, True), (3, False), (1, True)])
def test_router_picks_the_same_experts_and_weights_as_transformers(top_k, norm_topk_prob):
    """Softmax over all experts in float32, top-k, renormalised if asked (top 1 then weighs 1)."""
    config = Qwen3MoeConfig(**{**_TINY, "num_experts_per_tok": top_k}, norm_topk_prob=norm_topk_prob)
    hf_router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        hf_router.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    router = Router(RouterConfig.softmax_top_k(config.num_experts, top_k, norm_topk_prob), config.hidden_size)
    router.load_state_dict(hf_router.state_dict())
    x = torch.randn(200, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, want_weights, want_ids = hf_router(x)
        weights, ids = router(x)
    want_ids, order = want_ids.sort(dim=-1)
    ids, mine = ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, mine), want_weights.gather(1, order))
    assert len(set(map(tuple, ids.tolist()))) > min(10, config.num_experts - 1)  # routing depends on the token
