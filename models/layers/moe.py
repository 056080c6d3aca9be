"""Mixture of experts (DeepSeek V2/V3, Qwen2-MoE, Qwen3-MoE): a router sends each token to
its top-k routed experts, and shared experts (if any) see every token.

Routing, computed in float32 like the reference:

    V2  scores = softmax(logits)   (Qwen2-MoE, Qwen3-MoE: the same, "greedy")
        "greedy":               top-k over all experts
        "group_limited_greedy": keep the topk_group groups with the best single score,
                                then top-k among their experts
    V3  scores = sigmoid(logits); choice = scores + e_score_correction_bias
        ("noaux_tc"): keep the topk_group groups with the best sum of their top-2
        choice values, then top-k of choice among their experts. The bias only steers
        selection (load balancing); the weights are the unbiased scores.

The chosen weights are optionally renormalised to sum to 1 (norm_topk_prob) and then
multiplied by routed_scaling_factor (Qwen: 1). Qwen2-MoE scales its shared expert's output
per token by sigmoid(shared_expert_gate(x)).

LoRA adapters (models/layers/lora.py) reach each routed expert's layers by PEFT's per-expert names
(`mlp.experts.17.gate_proj`, transformers 4's modules; `lora_layers`) or as peft's LoRA on the fused
parameters (transformers 5's `mlp.experts.gate_up_proj`: `split_fused_expert_lora`). An expert runs
on the (token, expert) pairs routed to it, not on the step's rows: its layers get a LoRABatch of
those pairs, each taking its token's adapter:

    step rows (slots)   t0:a  t1:a  t2:-  t3:b        top_k 2, pairs sorted by expert
    expert 5's pairs    t0    t3                 ->   its LoRABatch: (a, row 0), (b, row 1)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from models.layers import cpu_kernels
from models.layers.linear import Linear, MergedLinear
from models.layers.lora_weights import LoRABatch
from models.layers.mlp import GatedMLP, gated
from models.layers.parallel import TensorParallel
from models.layers.quantization import QuantizedWeight
from models.layers.step_kernels import StepKernels

_TOPK_METHODS = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
# Per-expert checkpoint names (what save_pretrained writes):
#   model.layers.3.mlp.experts.17.gate_proj.weight -> ("model.layers.3.mlp.experts", "17", "gate_proj")
_EXPERT_WEIGHT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# HF's in-memory (fused) layout: model.layers.3.mlp.experts.gate_up_proj (E, 2 * inter, hidden)
_FUSED_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str  # "softmax" (V2, Qwen) | "sigmoid" (V3)
    topk_method: str  # "greedy" | "group_limited_greedy" (softmax) | "noaux_tc" (sigmoid)
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def __post_init__(self) -> None:
        if self.scoring not in _TOPK_METHODS:
            raise ValueError(f"unsupported scoring function {self.scoring!r}")
        if self.topk_method not in _TOPK_METHODS[self.scoring]:
            raise ValueError(f"topk_method {self.topk_method!r} does not go with {self.scoring} scoring")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"n_group={self.num_groups} must divide n_routed_experts={self.num_experts}")
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_groups} must be in [1, n_group={self.num_groups}]")

    @property
    def group_limited(self) -> bool:
        return self.topk_method != "greedy"

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig, scoring: str, topk_method: str) -> "RouterConfig":
        """scoring/topk_method: the architecture's defaults, overridden by the config when it names them."""
        method = getattr(hf_config, "topk_method", None) or topk_method
        grouped = method != "greedy"
        return cls(
            num_experts=hf_config.n_routed_experts,
            top_k=hf_config.num_experts_per_tok,
            scoring=getattr(hf_config, "scoring_func", None) or scoring,
            topk_method=method,
            num_groups=(hf_config.n_group or 1) if grouped else 1,
            topk_groups=(hf_config.topk_group or 1) if grouped else 1,
            norm_topk_prob=bool(hf_config.norm_topk_prob),
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
        )

    @classmethod
    def softmax_top_k(cls, num_experts: int, top_k: int, norm_topk_prob: bool) -> "RouterConfig":
        """Plain softmax over all experts, then top-k (Qwen2-MoE, Qwen3-MoE): no groups, no scaling."""
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            scoring="softmax",
            topk_method="greedy",
            num_groups=1,
            topk_groups=1,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=1.0,
        )


class Router(nn.Module):
    def __init__(self, config: RouterConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        # A (frozen) parameter rather than a buffer so that the loader's every-parameter-
        # filled check covers it.
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False)
            if config.scoring == "sigmoid"
            else None
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Router:
        # The correction bias stays float32 whatever dtype the model is cast to (HF keeps
        # it in fp32 too): bf16 cannot resolve the small bias differences between experts
        # near the sigmoid scores they are added to, and rounding them changes which
        # experts win. Device moves (and the loader's meta -> to_empty) still apply.
        bias = self._parameters.pop("e_score_correction_bias", None)
        try:
            super()._apply(fn, recurse)
        finally:
            if bias is not None:
                moved = fn(bias.detach())
                if moved.dtype != torch.float32:
                    moved = moved.float() if bias.is_meta else bias.detach().to(moved.device)
                self._parameters["e_score_correction_bias"] = nn.Parameter(moved, requires_grad=False)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, top_k) float32, expert ids (T, top_k) int64)."""
        cfg = self.config
        if x.device.type == "cpu" and cpu_kernels.available():
            # float32 logits and scores with each row's bits its own, whatever the step (torch's GEMM
            # rounds a row by the step's row count, and its sigmoid by where an element falls):
            # the experts chosen, and their weights, follow the token alone (CausalLM.row_invariant).
            logits = cpu_kernels.rows_matmul(x.float(), self.weight, kn=False)  # (T, num_experts)
            scores = cpu_kernels.softmax_rows(logits) if cfg.scoring == "softmax" else cpu_kernels.sigmoid(logits)
        else:
            logits = F.linear(x.float(), self.weight.float())
            scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
        bias = self.e_score_correction_bias  # sigmoid scoring's; None for softmax
        choice = scores if bias is None else scores + bias
        if cfg.group_limited:
            choice = self._mask_groups(choice)
        expert_ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]  # (T, top_k)
        weights = scores.gather(1, expert_ids)
        if cfg.norm_topk_prob:  # top_k 1: weight 1, as transformers' Qwen and DeepSeek V3 routers give
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, expert_ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Hide the experts of every group outside the topk_groups best groups of each token."""
        cfg = self.config
        grouped = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)  # (T, groups, per_group)
        if cfg.scoring == "softmax":
            group_scores = grouped.max(dim=-1).values  # (T, groups)
            hidden = 0.0  # softmax scores are positive, so 0 never beats a real expert
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            hidden = float("-inf")  # biased sigmoid scores may be negative
        best = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]  # (T, topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (T, groups)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice)  # (T, num_experts)
        return choice.masked_fill(~keep, hidden)


class Experts(nn.Module):
    """The routed experts' SwiGLU weights: per expert one MergedLinear (gate | up) and one Linear
    (down), so each gets its quantization method at load like any other linear layer.

    gate_up[e]  (2 * inter, hidden): rows [0, inter) gate, [inter, 2 * inter) up
    down[e]     (hidden, inter)
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # Tensor parallel: every rank holds every expert, split along its intermediate size;
        # MoE.forward adds the ranks' partial sums once, for all experts and the shared ones.
        self.gate_up = nn.ModuleList(
            MergedLinear(
                hidden_size,
                {"gate_proj": intermediate_size, "up_proj": intermediate_size},
                bias=False,
                parallel="column",
            )
            for _ in range(num_experts)
        )
        self.down = nn.ModuleList(
            Linear(intermediate_size, hidden_size, parallel="row", reduce=False) for _ in range(num_experts)
        )
        self.act_fn = ACT2FN[hidden_act]
        self.is_silu = hidden_act == "silu"
        self._pieces: dict[int, set[str]] = {}  # expert -> gate/up pieces loaded so far

    @property
    def gate_up_layers(self) -> Sequence[MergedLinear]:
        return cast("Sequence[MergedLinear]", self.gate_up)  # an nn.ModuleList's items are typed nn.Module

    @property
    def down_layers(self) -> Sequence[Linear]:
        return cast("Sequence[Linear]", self.down)

    def lora_layers(self, prefix: str) -> dict[str, tuple[Linear, str | None]]:
        """PEFT's module path of each expert's projections -> (our layer, its shard in it)."""
        found: dict[str, tuple[Linear, str | None]] = {}
        for expert, (gate_up, down) in enumerate(zip(self.gate_up_layers, self.down_layers)):
            found[f"{prefix}.{expert}.gate_proj"] = (gate_up, "gate_proj")
            found[f"{prefix}.{expert}.up_proj"] = (gate_up, "up_proj")
            found[f"{prefix}.{expert}.down_proj"] = (down, None)
        return found

    def load_expert(self, expert: int, proj: str, weight: torch.Tensor | QuantizedWeight, name: str) -> list[str]:
        """One expert's weight from a per-expert checkpoint (`experts.N.{gate,up,down}_proj.weight`);
        returns the parameter names (relative to this module) now fully loaded."""
        if proj == "down_proj":
            down = self.down_layers[expert]
            down.load_weight(weight, name)
            return [f"down.{expert}.{n}" for n in down.weight_param_names()]
        if proj not in ("gate_proj", "up_proj"):
            raise ValueError(f"unknown expert projection {proj!r}")
        layer = self.gate_up_layers[expert]
        layer.load_shard(proj, weight, name)
        pieces = self._pieces.setdefault(expert, set())
        pieces.add(proj)
        return [f"gate_up.{expert}.{n}" for n in layer.weight_param_names()] if len(pieces) == 2 else []

    def load_fused(self, proj: str, weight: torch.Tensor, name: str) -> list[str]:
        """HF's in-memory layout: `experts.gate_up_proj` (E, 2 * inter, hidden) or `experts.down_proj`
        (E, hidden, inter); returns the parameter names now fully loaded."""
        layers = self.gate_up_layers if proj == "gate_up_proj" else self.down_layers
        if weight.shape[0] != len(layers):
            raise ValueError(f"tensor {name!r}: {weight.shape[0]} experts, the model has {len(layers)}")
        loaded: list[str] = []
        for expert, layer in enumerate(layers):
            if isinstance(layer, MergedLinear):  # (2 * inter, hidden): gate rows, then up rows
                gate, up = weight[expert].chunk(2)
                layer.load_shard("gate_proj", gate, name)
                layer.load_shard("up_proj", up, name)
            else:
                layer.load_weight(weight[expert], name)
            loaded += [
                f"{'gate_up' if proj == 'gate_up_proj' else 'down'}.{expert}.{n}" for n in layer.weight_param_names()
            ]
        return loaded

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, kernels: StepKernels
    ) -> torch.Tensor:
        """x (T, hidden), weights/expert_ids (T, top_k) -> weighted sum of the chosen experts (T, hidden).

        The T * top_k (token, expert) pairs are sorted by expert so that each expert runs
        one matmul over a contiguous slice, and only experts that got tokens run at all:

            expert_ids  [[3, 0], [0, 2]]  -> flat [3, 0, 0, 2] -> sorted by expert: [0, 0, 2, 3]
            token of each sorted pair:  [0, 1, 1, 0]       counts per expert: [2, 0, 1, 1]
        """
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()  # (T * top_k,)
        order = flat_ids.argsort(stable=True)  # pair index, grouped by expert
        token_of_pair = order // top_k  # (T * top_k,)
        gate_up, down = self.gate_up_layers, self.down_layers
        counts = torch.bincount(flat_ids, minlength=len(gate_up)).tolist()
        pairs_in = x[token_of_pair]  # (T * top_k, hidden)
        pairs_out = torch.empty_like(pairs_in)
        # LoRA: each pair's adapter slot, its token's (0: none); an expert's layers see its pairs only.
        slot_of_pair = None if kernels.lora is None else kernels.lora.row_slots(x.shape[0], x.device)[token_of_pair]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            expert_kernels = kernels
            if slot_of_pair is not None:
                adapted = gate_up[expert].lora is not None or down[expert].lora is not None
                expert_kernels = replace(kernels, lora=LoRABatch.of_rows(slot_of_pair[rows]) if adapted else None)
            pairs_out[rows] = gated(
                gate_up[expert], down[expert], self.act_fn, self.is_silu, pairs_in[rows], expert_kernels
            )
            start += count
        pairs_out *= weights.flatten()[order, None].to(pairs_out.dtype)
        return torch.zeros_like(x).index_add_(0, token_of_pair, pairs_out)


class MoE(nn.Module):
    """Routed experts plus (optionally) always-on shared experts, fed the same tokens. The shared
    experts are stored as one MLP whose intermediate size is their sum (`shared_intermediate_size`);
    with `shared_gate` (Qwen2-MoE) its output is scaled per token by sigmoid(shared_expert_gate(x))."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        router_config: RouterConfig,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        mlp_bias: bool = False,
        shared_name: str = "shared_experts",
    ) -> None:
        """`shared_name`: the checkpoint's name of the shared experts (Qwen2-MoE: shared_expert),
        under which PEFT adapters name their layers."""
        super().__init__()
        self.shared_name = shared_name
        self.gate = Router(router_config, hidden_size)
        self.experts = Experts(router_config.num_experts, hidden_size, intermediate_size, hidden_act)
        self.shared_experts = (
            GatedMLP(hidden_size, shared_intermediate_size, hidden_act, bias=mlp_bias, reduce=False)
            if shared_intermediate_size
            else None
        )
        # Replicated under tensor parallel: each rank scales its partial sum by the same gate.
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared_gate else None
        self.tp: TensorParallel | None = self.experts.down_layers[0].tp if router_config.num_experts else None

    def lora_layers(self, prefix: str) -> dict[str, tuple[Linear, str | None]]:
        """PEFT's module paths of the experts' and the shared experts' projections -> (our layer, its shard)."""
        found = self.experts.lora_layers(f"{prefix}.experts")
        if self.shared_experts is not None:
            shared = f"{prefix}.{self.shared_name}"
            for shard in ("gate_proj", "up_proj"):
                found[f"{shared}.{shard}"] = (self.shared_experts.gate_up_proj, shard)
            found[f"{shared}.down_proj"] = (self.shared_experts.down_proj, None)
        return found

    def forward(self, x: torch.Tensor, kernels: StepKernels) -> torch.Tensor:
        weights, expert_ids = self.gate(x)  # float32 logits: no reduced-precision matmul to choose for
        out = self.experts(x, weights, expert_ids, kernels)
        if self.shared_experts is not None:
            shared = self.shared_experts(x, kernels)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x, kernels)) * shared  # (T, 1) * (T, hidden)
            out = out + shared
        # Tensor parallel: the ranks' partial sums, added once.
        return out if self.tp is None else self.tp.all_reduce(out)


def load_expert_weight(model: nn.Module, name: str, tensor: torch.Tensor | QuantizedWeight) -> list[str] | None:
    """Copy `name` in if it is a routed expert's weight, per expert (`experts.N.gate_proj.weight`: what
    save_pretrained and DeepSeek's releases write) or fused (`experts.gate_up_proj`, `experts.down_proj`:
    HF's in-memory layout); returns the parameter names now fully loaded, None for any other tensor."""
    m = _EXPERT_WEIGHT.match(name) or _FUSED_EXPERTS.match(name)
    if m is None:
        return None
    prefix = m[1]
    try:
        experts = model.get_submodule(prefix)
    except AttributeError:
        experts = None
    if not isinstance(experts, Experts):
        raise ValueError(f"tensor {name!r} does not belong to this model")
    if m.re is _FUSED_EXPERTS:
        if isinstance(tensor, QuantizedWeight):
            raise ValueError(f"tensor {name!r}: fused experts are read dense, not quantized")
        return [f"{prefix}.{n}" for n in experts.load_fused(m[2], tensor, name)]
    expert, proj = int(m[2]), m[3]
    if not 0 <= expert < len(experts.gate_up):
        raise ValueError(f"tensor {name!r}: expert index out of range (the model has {len(experts.gate_up)} experts)")
    return [f"{prefix}.{n}" for n in experts.load_expert(expert, proj, tensor, name)]


# peft's LoRA on transformers 5's fused expert parameters (LoraConfig.target_parameters), one (A, B)
# per parameter for all E experts, expert e's rank-r part as peft's ParamWrapper.get_delta_weight
# reads it (its delta is B_e A_e, of the parameter's (out, in) matrix of expert e):
#
#     A (E * r, in)    expert e: rows e*r .. e*r + r - 1
#     B (out, r * E)   expert e: columns e, E + e, 2E + e, ...   (B viewed as (out, r, E))
#
# peft nests one wrapper per parameter in the module's parameter order, the first innermost: with
# both targeted, gate_up_proj's weights are saved under `experts.base_layer.lora_A`, down_proj's under
# `experts.lora_A`. gate_up_proj's rows are [gate | up]: each half is that projection's B, with A shared.
FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def fused_expert_param(module_path: str, targeted: Sequence[str]) -> tuple[str, str] | None:
    """(the experts' module path, which fused parameter) of a peft weight's module path
    (`...mlp.experts` or `...mlp.experts.base_layer`), given the parameters the adapter targets;
    None for any other module."""
    depth = 0
    while module_path.endswith(".base_layer"):
        module_path, depth = module_path.removesuffix(".base_layer"), depth + 1
    wrapped = [p for p in FUSED_EXPERT_PARAMS if p in targeted]  # innermost first
    if not module_path.endswith(".experts") or depth >= len(wrapped):
        return None
    return module_path, wrapped[len(wrapped) - 1 - depth]


def is_fused_expert_path(path: str) -> bool:
    """`...mlp.experts.gate_up_proj` or `...mlp.experts.down_proj` (not a shared expert's down_proj)."""
    parent, _, param = path.rpartition(".")
    return param in FUSED_EXPERT_PARAMS and parent.endswith(".experts")


def split_fused_expert_lora(
    experts_path: str, param: str, a: torch.Tensor, b: torch.Tensor, rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One fused parameter's (A, B) as per-expert (A_e, B_e) under PEFT's per-expert module paths
    (`experts.7.gate_proj`), as Experts.lora_layers names them; a ValueError names a shape that
    is not E experts of rank `rank`."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % rank or b.shape[1] != a.shape[0]:
        raise ValueError(
            f"{experts_path}.{param}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
            f"experts of rank {rank}"
        )
    num_experts = a.shape[0] // rank
    if param == "gate_up_proj" and b.shape[0] % 2:
        raise ValueError(f"{experts_path}.gate_up_proj: lora_B {tuple(b.shape)} has an odd number of rows")
    a_e = a.view(num_experts, rank, a.shape[1])  # (E, r, in)
    b_e = b.view(b.shape[0], rank, num_experts).permute(2, 0, 1)  # (E, out, r)
    found = {}
    for expert in range(num_experts):
        if param == "down_proj":
            found[f"{experts_path}.{expert}.down_proj"] = (a_e[expert], b_e[expert])
            continue
        gate, up = b_e[expert].chunk(2)
        found[f"{experts_path}.{expert}.gate_proj"] = (a_e[expert], gate)
        found[f"{experts_path}.{expert}.up_proj"] = (a_e[expert], up)
    return found
