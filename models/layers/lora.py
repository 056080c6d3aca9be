"""LoRA adapters: PEFT directories (or llama.cpp LoRA GGUF files) read once, applied unmerged, a
different adapter per row.

    y = base(x) + scale * B (A x)        A: (r, in), B: (out, r), scale = alpha / r (rsLoRA: alpha / sqrt(r))

The base weights stay as stored (dense or quantized); each adapted Linear holds a `LoRAWeights`
(`Linear.lora`, None when no adapter touches the layer: the base path then pays one None check).
An adapter gets a slot (1, 2, ...; 0 is the base model); the runner gives each step a `LoRABatch`,
its rows grouped by slot (`StepKernels.lora`, None when no row of the step uses an adapter), and
every adapted layer adds, per slot present, two small matmuls over that slot's rows:

    rows of the step   [ a a a | - | b | a ]      a, b: slots 1, 2; -: the base model
    LoRABatch.groups   (1, rows [0 1 2 4]), (2, rows 3..3)

Our q/k/v (gate/up) are one MergedLinear (models/layers/linear.py); PEFT trains them apart. An
adapter's per-projection A's are stacked, and its B's laid out block by block on the merged
output's rows, zeros where a projection is not adapted, so a merged layer is still two matmuls:

    A_cat = [ A_q ; A_v ]              (r_q + r_v, in)
    B_cat = [ B_q   0  ]   q rows      (out, r_q + r_v)
            [ 0     0  ]   k rows (not adapted)
            [ 0    B_v ]   v rows

B_cat is held transposed, with the blocks of it that are not zero (AdapterWeights): on CPU one op
a layer (csrc/lora_ops.cpp) multiplies by A_cat and then by those blocks only, and a Llama layer
runs as one op with the adapters of its step's rows (models/llama.py one_op_lora).

A LoRA GGUF (convert_lora_to_gguf.py's output) names its weights as the base model's GGUF does
(blk.0.attn_q.weight.lora_a); they are renamed to the model's module paths by gguf-py's table when
attached, and scaled as llama.cpp does: alpha / r (1 when alpha is 0).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.layers.linear import Embedding, Linear, MergedLinear
from models.layers.lora_weights import AdapterWeights, LoRAWeights
from models.layers.moe import FUSED_EXPERT_PARAMS, fused_expert_param, is_fused_expert_path, split_fused_expert_lora
from models.layers.quantization import DenseMethod

# DeepSeek's MLA adds q_a_proj/q_b_proj (q through a low rank) and kv_a_proj_with_mqa (the latent and
# the rope key); its kv_b_proj is never run as a layer (absorbed into the query and the output: mla.py).
TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
)
_REFUSED_MODULES = {
    "kv_b_proj": "MLA's kv_b_proj is absorbed into the query and output projections",
    "k_b_proj": "MLA's k_b is absorbed into the query",
    "v_b_proj": "MLA's v_b is absorbed into the output",
}
# PEFT options that change what an adapter computes: refused by name unless left at their defaults.
_UNSUPPORTED_OPTIONS = (
    "modules_to_save",
    "use_dora",
    "fan_in_fan_out",
    "lora_bias",
    "layers_to_transform",
    "layer_replication",
    "trainable_token_indices",
    "megatron_config",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
)
_Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path (or GGUF weight name) -> (A, B)
_PREFIX = "base_model.model."  # PEFT's names: base_model.model.<the HF model's module path>.lora_A.weight


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter as read: per HF module path (a GGUF's: per GGUF weight name, `gguf_arch` its
    architecture), (A, B)."""

    name: str
    path: str
    rank: int
    scale: float
    weights: _Pairs
    gguf_arch: str | None = None


def read_peft_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), or a
    LoRA GGUF file (read_gguf_adapter); every problem is a ValueError naming the adapter and what is wrong."""
    from safetensors.torch import load_file

    where = f"LoRA adapter {name!r} ({path})"
    directory = Path(path)
    if directory.is_file():
        return read_gguf_adapter(name, path, max_rank)
    config_file, tensors_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not directory.is_dir():
        raise ValueError(f"{where}: no such directory")
    if not config_file.is_file():
        raise ValueError(f"{where}: no adapter_config.json")
    if not tensors_file.is_file():
        raise ValueError(f"{where}: no adapter_model.safetensors (adapter_model.bin is not read)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    # peft's LoRA on transformers 5's fused MoE experts: read as per-expert weights (models/layers/moe.py)
    parameters = config.get("target_parameters") or []
    fused = [p.rpartition(".")[2] for p in parameters] if isinstance(parameters, list) else None
    if fused is None or any(  # peft's own conversion adds bare names
        p not in FUSED_EXPERT_PARAMS or ("." in q and ".experts." not in f".{q}") for p, q in zip(fused, parameters)
    ):
        raise ValueError(
            f"{where}: target_parameters={parameters!r} is not supported "
            f"(only MoE experts' fused {' and '.join(FUSED_EXPERT_PARAMS)})"
        )
    for option in _UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise ValueError(f"{where}: {option}={config[option]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    target_list = [targets] if isinstance(targets, str) else targets or ([] if fused else None)
    if not isinstance(target_list, list) or not (target_list or fused):
        raise ValueError(f"{where}: target_modules must name modules, got {targets!r}")
    refused = [t for t in target_list if t in _REFUSED_MODULES]
    if refused:
        raise ValueError(f"{where}: target module {refused[0]!r} is not supported ({_REFUSED_MODULES[refused[0]]})")
    unknown = [t for t in target_list if t not in TARGET_MODULES]
    if unknown:
        raise ValueError(
            f"{where}: target module(s) {', '.join(map(repr, unknown))} are not supported "
            f"(supported: {', '.join(TARGET_MODULES)})"
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(tensors_file))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad file
        raise ValueError(f"{where}: cannot read adapter_model.safetensors: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        param = fused_expert_param(module, fused)
        if param is not None:
            module = ".".join(param)  # ...mlp.experts.gate_up_proj
        if kind not in ("A.weight", "B.weight") or (param is None and module.rpartition(".")[2] not in target_list):
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight of its target_modules")
        pairs.setdefault(module, {})[kind[0]] = tensor
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has lora_{next(iter(pair))} but not its pair")
        a, b = pair["A"], pair["B"]
        if is_fused_expert_path(module):  # split per expert once the model is known
            # peft's own conversion of gate_proj + up_proj targets fuses them at rank 2r, alpha 2 alpha
            # (rank_pattern, alpha_pattern on gate_up_proj): the same scale, which is all we serve.
            fused_rank = _pattern_value(config.get("rank_pattern"), module, rank)
            fused_alpha = _pattern_value(config.get("alpha_pattern"), module, alpha)
            root = math.sqrt(fused_rank) if config.get("use_rslora") else fused_rank
            if not isinstance(fused_rank, int) or not math.isclose(fused_alpha / root, scale):
                raise ValueError(
                    f"{where}: {module}: rank {fused_rank} and alpha {fused_alpha} (rank_pattern, alpha_pattern) "
                    "are not supported: one scale for every layer"
                )
            weights[module] = (a, b)
            continue
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have rank {rank}"
            )
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    for option in ("rank_pattern", "alpha_pattern"):  # peft adds patterns for layers an adapter may not have
        patterns = config.get(option) or {}
        if not isinstance(patterns, dict):
            raise ValueError(f"{where}: {option} must be an object, got {patterns!r}")
        for pattern in patterns:  # matched as peft's get_pattern_key does
            try:
                hit = next(
                    (m for m in weights if not is_fused_expert_path(m) and re.match(rf"(.*\.)?({pattern})$", m)),
                    None,
                )
            except re.error as e:
                raise ValueError(f"{where}: {option} {pattern!r} is not a regular expression: {e}") from None
            if hit is not None:
                raise ValueError(
                    f"{where}: {option} {pattern!r} (matching {hit}) is not supported: "
                    "one rank and alpha for every layer"
                )
    return LoRAAdapter(name, str(path), rank, float(scale), weights)


def _pattern_value(patterns: object, module: str, default: float) -> float:
    """A rank_pattern / alpha_pattern's value for `module` (matched as peft's get_pattern_key does)."""
    for pattern, value in (patterns or {}).items() if isinstance(patterns, dict) else ():
        try:
            if re.match(rf"(.*\.)?({pattern})$", module):
                return value
        except re.error:
            pass  # reported by the check of every pattern
    return default


def read_gguf_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read and check a llama.cpp LoRA GGUF (models/gguf.py read_lora_gguf): one rank for every
    weight, only weights of the layers TARGET_MODULES names; ValueErrors as read_peft_adapter's."""
    from models.gguf import GGUFError, read_lora_gguf

    where = f"LoRA adapter {name!r} ({path})"
    try:
        arch, alpha, pairs = read_lora_gguf(path)
    except GGUFError as e:
        raise ValueError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged file fails inside gguf-py or numpy in many ways
        raise ValueError(f"{where}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    ranks = set()
    for weight, (a, b) in pairs.items():
        kind = weight.rpartition(".weight")[0].partition(".")[2].partition(".")[2]  # blk.N.<kind>.weight
        if not weight.startswith("blk.") or kind not in _GGUF_TARGETS:
            why = _GGUF_REFUSED.get(kind, f"supported: {', '.join(sorted(_GGUF_TARGETS))} of each blk.N")
            raise ValueError(f"{where}: tensor {weight!r}: no LoRA on this weight ({why})")
        # The routed experts' (ffn_*_exps) come stacked: lora_a (E, r, in), lora_b (E, out, r).
        stacked = kind.endswith("_exps") and a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0]
        if not stacked and (a.dim() != 2 or b.dim() != 2):
            raise ValueError(f"{where}: {weight}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} are not matrices")
        if a.shape[-2] != b.shape[-1]:
            raise ValueError(
                f"{where}: {weight}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} do not share a rank"
            )
        ranks.add(a.shape[-2])
    if len(ranks) != 1:
        raise ValueError(f"{where}: weights of different ranks {sorted(ranks)} are not supported")
    rank = ranks.pop()
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    scale = alpha / rank if alpha else 1.0  # llama.cpp's: no alpha, no scaling
    return LoRAAdapter(name, str(path), rank, float(scale), pairs, gguf_arch=arch)


# GGUF names (gguf-py's TENSOR_NAMES) of the layers TARGET_MODULES names, and of those refused.
_GGUF_TARGETS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "attn_q_a",
    "attn_q_b",
    "attn_kv_a_mqa",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
)
_GGUF_REFUSED = {
    "attn_kv_b": _REFUSED_MODULES["kv_b_proj"],
    "attn_k_b": _REFUSED_MODULES["k_b_proj"],
    "attn_v_b": _REFUSED_MODULES["v_b_proj"],
}
_EXPERT_PATH = re.compile(r"(.+\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$")  # one expert's layer


def _from_gguf(adapter: LoRAAdapter, model: nn.Module, module_paths: list[str]) -> _Pairs:
    """A GGUF adapter's weights under the model's module paths, B in the model's row order."""
    from models.gguf import gguf_architecture, lora_b_rows, lora_target_names

    where = f"LoRA adapter {adapter.name!r} ({adapter.path})"
    config = getattr(model, "hf_config", None)
    base_arch = None if config is None else gguf_architecture(config)
    if adapter.gguf_arch != base_arch:
        raise ValueError(
            f"{where}: the adapter is for architecture {adapter.gguf_arch!r}, "
            f"the model is {base_arch or getattr(config, 'model_type', None)!r}"
        )
    assert adapter.gguf_arch is not None and config is not None  # a GGUF adapter, of the model's architecture
    # gguf-py names the experts' layers all at once (mlp.experts.gate_proj -> ffn_gate_exps)
    experts = {f"{m[1]}.{m[2]}": m[1] for m in map(_EXPERT_PATH.match, module_paths) if m is not None}
    names = lora_target_names(adapter.gguf_arch, [*module_paths, *experts], config.num_hidden_layers)
    weights = {}
    for weight, (a, b) in adapter.weights.items():
        if weight not in names:
            raise ValueError(f"{where}: the model has no layer for tensor {weight!r}")
        module = names[weight]
        if module not in experts:
            weights[module] = (a, lora_b_rows(adapter.gguf_arch, config, weight, b))
            continue
        if a.dim() != 3:
            raise ValueError(f"{where}: {weight}: lora_a {tuple(a.shape)} is not stacked by expert")
        projection = module.rpartition(".")[2]
        for index in range(a.shape[0]):  # the experts' FFN rows are as stored: nothing to reorder
            weights[f"{experts[module]}.{index}.{projection}"] = (a[index], b[index])
    return weights


def add_lora_adapters(
    model: nn.Module, modules: dict[str, str], max_rank: int, dtype: torch.dtype = torch.float32
) -> dict[str, int]:
    """Read each adapter (name -> PEFT directory or LoRA GGUF file) and attach it to the model's
    Linear layers, in `dtype` (float32, or the model's dtype). Returns name -> slot. Everything is
    read and checked before any layer changes: a bad adapter leaves the model as it was."""
    prepared = [
        prepare_lora_adapter(model, read_peft_adapter(name, path, max_rank), dtype) for name, path in modules.items()
    ]
    slots = {}
    for slot, adapter in enumerate(prepared, start=1):
        adapter.install(slot)
        slots[adapter.name] = slot
    return slots


@dataclass(frozen=True)
class PreparedLoRA:
    """An adapter checked against one model, its weights stacked per layer: installing it only
    assigns, so a server may prepare it beside running steps and install it between two."""

    name: str
    layers: tuple[tuple[Linear, AdapterWeights], ...]
    path: str = ""  # where it was read (tensor-parallel workers read it there too: engine/parallel.py)

    def install(self, slot: int) -> None:
        for layer, weights in self.layers:
            if layer.lora is None:
                method = layer.quant_method  # rows alone where the base layer's are (CausalLM.row_invariant)
                layer.lora = LoRAWeights(getattr(method, "row_invariant", not isinstance(method, DenseMethod)))
            layer.lora.slots[slot] = weights


def prepare_lora_adapter(model: nn.Module, adapter: LoRAAdapter, dtype: torch.dtype = torch.float32) -> PreparedLoRA:
    """Check that `adapter` fits the model's layers and stack its weights (module docstring);
    a ValueError names what does not fit. Reads the model, changes nothing."""
    linears: dict[str, tuple[Linear, str | None]] = {}  # HF module path -> (our layer, its shard)
    named: set[int] = set()  # layers a module named by PEFT's paths (MoE.lora_layers: the experts)
    for path, module in model.named_modules():
        lora_layers = getattr(module, "lora_layers", None)
        if callable(lora_layers):
            for hf_path, (layer, shard) in lora_layers(path).items():
                linears[hf_path] = (layer, shard)
                named.add(id(layer))
        elif id(module) in named:
            continue
        elif isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            for shard in module.shard_sizes:
                linears[f"{parent}.{shard}" if parent else shard] = (module, shard)
        elif isinstance(module, Linear) and not isinstance(module, Embedding):
            linears[path] = (module, None)
    name, path = adapter.name, adapter.path
    weights = adapter.weights if adapter.gguf_arch is None else _from_gguf(adapter, model, list(linears))
    weights = _split_fused_experts(adapter, weights, linears)
    per_layer: dict[int, tuple[Linear, list[tuple[str | None, torch.Tensor, torch.Tensor]]]] = {}
    for module_path, (a, b) in weights.items():
        if module_path not in linears:
            raise ValueError(f"LoRA adapter {name!r} ({path}): the model has no layer {module_path}")
        layer, shard = linears[module_path]
        merged = layer if isinstance(layer, MergedLinear) else None
        out = layer.checkpoint_out_features if merged is None or shard is None else merged.checkpoint_shard_sizes[shard]
        if a.shape[1] != layer.checkpoint_in_features or b.shape[0] != out:
            raise ValueError(
                f"LoRA adapter {name!r} ({path}): {module_path}: lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)} do not fit the layer ({out} x {layer.checkpoint_in_features})"
            )
        a, b = _rank_part(layer, shard, a, b)
        per_layer.setdefault(id(layer), (layer, []))[1].append((shard, a, b))
    return PreparedLoRA(
        name, tuple((layer, _stack(layer, parts, adapter.scale, dtype)) for layer, parts in per_layer.values()), path
    )


def _split_fused_experts(
    adapter: LoRAAdapter, weights: _Pairs, linears: dict[str, tuple[Linear, str | None]]
) -> _Pairs:
    """peft's (A, B) of a fused expert parameter (`mlp.experts.gate_up_proj`) as per-expert pairs
    (models/layers/moe.py split_fused_expert_lora), its rank by the model's number of experts."""
    where = f"LoRA adapter {adapter.name!r} ({adapter.path})"
    found = {}
    for module, (a, b) in weights.items():
        experts, _, param = module.rpartition(".")
        if not is_fused_expert_path(module):
            found[module] = (a, b)
            continue
        num_experts = sum(p.startswith(f"{experts}.") and p.endswith(".down_proj") for p in linears)
        if not num_experts:
            raise ValueError(f"{where}: the model has no layer {module}")
        if a.dim() != 2 or a.shape[0] % num_experts or not 0 < a.shape[0] // num_experts <= 2 * adapter.rank:
            raise ValueError(
                f"{where}: {module}: lora_A {tuple(a.shape)} is not {num_experts} experts of rank {adapter.rank}"
            )
        try:
            found.update(split_fused_expert_lora(experts, param, a, b, a.shape[0] // num_experts))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return found


def _rank_part(layer: Linear, shard: str | None, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of (A, B): a column-parallel layer's rows of B, as of its
    weight; a row-parallel layer's columns of A, B whole (each rank adds its share of B(A x) to its
    partial sum, which the all-reduce adds up). The whole of both without tensor parallelism."""
    if layer.parallel == "row":
        return a[:, layer.in_part], b
    if isinstance(layer, MergedLinear) and shard is not None:
        return a, b[layer.shard_parts[shard]]
    return a, b[layer.out_part]


def remove_lora_adapter(model: nn.Module, slot: int) -> None:
    """Drop the adapter in `slot` from every layer (its weights are freed with the last step that
    used them); a layer left with no adapter is back on the base path (`Linear.lora` None)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.lora is not None and slot in module.lora.slots:
            del module.lora.slots[slot]
            if not module.lora.slots:
                module.lora = None


def _stack(
    layer: Linear, parts: list[tuple[str | None, torch.Tensor, torch.Tensor]], scale: float, dtype: torch.dtype
) -> AdapterWeights:
    """One layer's A_cat and B_cat (see the module docstring), B_cat held transposed, on the layer's
    device, with the blocks of it that are not zero."""
    device = next(t for t in (layer.bias, getattr(layer, layer.weight_param_names()[0])) if t is not None).device
    a_cat = torch.cat([a for _, a, _ in parts]).to(device=device, dtype=dtype)  # (R, in)
    bt_cat = torch.zeros(a_cat.shape[0], layer.out_features, dtype=dtype, device=device)  # (R, out)
    blocks: list[int] = []
    col = 0
    for shard, a, b in parts:
        rows = layer.shard_rows(shard) if isinstance(layer, MergedLinear) and shard is not None else slice(None)
        first, stop, _ = rows.indices(layer.out_features)
        bt_cat[col : col + a.shape[0], first:stop] = b.t().to(dtype)
        blocks += [first, stop - first, col, a.shape[0]]
        col += a.shape[0]
    return AdapterWeights(a_cat, bt_cat, scale, tuple(blocks))
