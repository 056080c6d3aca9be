"""Multi-head latent attention (DeepSeek V2/V3) over a paged cache of compressed latents.

Per token the cache holds one entry shared by all heads (L = kv_lora_rank, R = qk_rope_head_dim):

    entry = [ c_kv (L) | k_pe (R) ]    c_kv = kv_a_layernorm(latent), k_pe already rotated

Per head h, keys and values are never materialised. With kv_b_proj's weight split into
W_UK[h] (nope, L) and W_UV[h] (v, L), the reference computes

    k_nope = W_UK[h] c_kv,   v = W_UV[h] c_kv,   score = q_nope . k_nope + q_pe . k_pe

and since q_nope . (W_UK[h] c_kv) = (W_UK[h]^T q_nope) . c_kv, we "absorb" W_UK into the
query instead (the absorbed form):

    q_latent = W_UK[h]^T q_nope                    (L,)
    score    = [q_latent | q_pe] . entry           one dot product with the cached entry
    out      = W_UV[h] (sum_j p_j c_kv_j)          W_UV applied once after the weighted sum

so attention reads L + R numbers per cached token for all heads together, prefill and
decode alike: multi-query attention with keys of L + R numbers and values their first L, which
is how the CPU kernel (csrc/paged_attention.cpp) takes it; the eager `_attend` is the reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from models.layers import cpu_kernels
from models.layers import parallel as tp_state
from models.layers.attention import (
    AttentionMetadata,
    gather_kv,
    kernel_serves,
    pad_queries,
    unpad_into,
    write_kv,
)
from models.layers.linear import Linear
from models.layers.norm import RMSNorm
from models.layers.rope import RotaryEmbedding
from models.layers.step_kernels import StepKernels


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's YaRN attention temperature (transformers' yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(hf_config: PretrainedConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN-style scaling.

    RoPE's own attention factor (mscale / mscale_all_dim) already scales q_pe and k_pe;
    this second factor reaches the nope part of the scores too, as in the reference.
    """
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = hf_config.rope_parameters or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * m * m
    return scale


def head_products(x: torch.Tensor, w: torch.Tensor, kn: bool, kernels: StepKernels) -> torch.Tensor:
    """x (T, H, K) by each head's weights, w (H, K, N) where `kn` (W_UK) else (H, N, K) (W_UV)
    -> (T, H, N) in x's dtype. On CPU our kernel, which sums each row in an order of its own
    (CausalLM.row_invariant; torch's batched matmuls round a row by the step's row count);
    elsewhere torch's."""
    if x.device.type == "cpu" and cpu_kernels.available():
        out = cpu_kernels.rows_matmul(x, w, kn)
        return out if out.dtype == x.dtype else out.to(x.dtype)
    return kernels.matmul(torch.einsum, "thk,hkn->thn" if kn else "thk,hnk->thn", x, w)


class MLAttention(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, rotary_emb: RotaryEmbedding):
        """Tensor parallel (models/layers/parallel.py): the latent projections (q_a, kv_a) and the
        cache entry are replicated; a rank holds num_heads / N heads of q, W_UK, W_UV and o_proj."""
        super().__init__()
        c = hf_config
        self.heads = tp_state.current().split(c.num_attention_heads, "num_attention_heads")
        self.num_heads = self.heads.stop - self.heads.start  # this rank's
        self.num_heads_total = c.num_attention_heads
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        bias = c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, c.num_attention_heads * qk_head_dim, bias=False, parallel="column")
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = Linear(c.q_lora_rank, c.num_attention_heads * qk_head_dim, bias=False, parallel="column")
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        # kv_b_proj (num_heads * (nope + v), L) is only ever used split in two, so it is
        # stored split: load_kv_b_proj fills these from the checkpoint's kv_b_proj.weight.
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, c.qk_nope_head_dim, c.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, c.v_head_dim, c.kv_lora_rank))
        self.o_proj = Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=bias, parallel="row")
        self.rotary_emb = rotary_emb  # shared by all layers: one cos/sin table
        self.scale = mla_softmax_scale(c)

    @property
    def kv_entry_shape(self) -> tuple[int, ...]:
        """What one token stores in this layer's cache: a latent shared by all heads."""
        return (self.kv_lora_rank + self.qk_rope_head_dim,)

    @torch.no_grad()
    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        """Split kv_b_proj.weight (num_heads * (nope + v), L) into W_UK and W_UV (this rank's heads)."""
        all_heads = self.num_heads_total
        expected = (all_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        if tuple(weight.shape) != expected:
            raise ValueError(f"kv_b_proj.weight: checkpoint shape {tuple(weight.shape)} != {expected}")
        per_head = weight.view(all_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)[self.heads]
        w_uk, w_uv = per_head.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # (H, nope, L), (H, v, L)
        self.w_uk.copy_(w_uk)
        self.w_uv.copy_(w_uv)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). kv_cache: (num_blocks, block_size, L + R); rope:
        (cos, sin) of the step's positions from RotaryEmbedding.cos_sin, shared by all layers."""
        num_tokens = x.shape[0]
        H, L = self.num_heads, self.kv_lora_rank
        kernels = meta.kernels
        if self.q_lora_rank is None:
            q = self.q_proj(x, kernels)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, kernels)), kernels)
        q = q.view(num_tokens, H, self.qk_nope_head_dim + self.qk_rope_head_dim)  # (T, H, nope + R)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        latent, k_pe = self.kv_a_proj_with_mqa(x, kernels).split([L, self.qk_rope_head_dim], dim=-1)  # (T, L), (T, R)
        latent = self.kv_a_layernorm(latent)
        # k_pe is one rotary "head" shared by all query heads.
        q_pe = self.rotary_emb.rotate(q_pe, *rope)  # (T, H, R)
        k_pe = self.rotary_emb.rotate(k_pe.unsqueeze(1), *rope)  # (T, 1, R)
        write_kv(kv_cache, torch.cat([latent, k_pe.squeeze(1)], dim=-1), meta.slot_mapping)  # entries (T, L + R)

        q_latent = head_products(q_nope, self.w_uk, True, kernels)  # (T, H, L)
        query = torch.cat([q_latent, q_pe], dim=-1)  # (T, H, L + R), laid out like a cache entry
        if kernel_serves(query, kv_cache):  # CPU: each row alone, the same in any step (attention.py)
            out_latent = cpu_kernels.paged_attention(
                query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start, self.scale, L
            )  # (T, H, L): values are the first L numbers of each entry
        else:
            out_latent = query.new_empty(num_tokens, H, L)
            for group in meta.groups:
                entries = gather_kv(kv_cache, group, query.dtype)
                out = self._attend(pad_queries(query, group), entries, group.mask, kernels)
                unpad_into(out_latent, out, group)
        out = head_products(out_latent, self.w_uv, False, kernels)  # (T, H, v)
        return self.o_proj(out.reshape(num_tokens, H * self.v_head_dim), kernels)  # (T, H * v) -> (T, hidden)

    def _attend(
        self, queries: torch.Tensor, entries: torch.Tensor, mask: torch.Tensor, kernels: StepKernels
    ) -> torch.Tensor:
        """queries (n, max_q, H, L + R), entries (n, max_kv, L + R), mask (n, 1, max_q, max_kv)
        -> out_latent (n, max_q, H, L).

        All heads share one key per position, so (query, head) rows fold into a single
        matrix per sequence and one bmm scores them without copying the keys per head.
        """
        n, max_q, H, D = queries.shape
        rows = queries.reshape(n, max_q * H, D)  # (n, max_q * H, L + R)
        scores = kernels.matmul(torch.bmm, rows, entries.transpose(1, 2)) * self.scale  # (n, max_q * H, max_kv)
        scores = scores.view(n, max_q, H, -1)  # (n, max_q, H, max_kv)
        scores = scores.masked_fill(~mask.transpose(1, 2), float("-inf"))  # mask as (n, max_q, 1, max_kv)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(queries.dtype)
        c_kv = entries[..., : self.kv_lora_rank]  # (n, max_kv, L): the latent is also the value
        out = kernels.matmul(torch.bmm, probs.view(n, max_q * H, -1), c_kv)  # (n, max_q * H, L)
        return out.view(n, max_q, H, self.kv_lora_rank)  # (n, max_q, H, L)
