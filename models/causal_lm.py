"""The one interface of every model class, and the decoder stack they share.

    model(input_ids, positions, kv_caches, attn_metadata) -> hidden (num_tokens, hidden_size)
    compute_logits(hidden, kernels) -> (num_rows, vocab_size) float32
    kv_cache_spec(dtype) -> KVCacheSpec           what one token stores per layer
    load_weights(weights) -> set of parameter names filled
    row_invariant() -> bool                      whether every product ignores the rest of the step

The runner calls nothing else; the loader builds a model as `cls(hf_config, max_model_len)`
and fills it through load_weights. A model class says only how to build one decoder layer
(and, if its checkpoints need it, how to load their special tensors); the rest is here:

    model.embed_tokens -> [ layer(rope, x, kv_cache, attn_metadata) ] * num_layers -> model.norm
    lm_head, or the embedding when the checkpoint ties them

Every decoder layer takes the same arguments: `rope` is the (cos, sin) of the step's
positions, gathered once per step for all layers (RotaryEmbedding.cos_sin; one table per
layer type where `rotary_emb` is a ModuleDict keyed by the layers' `layer_type`, Gemma 3);
each layer's attention (`self_attn`) declares what it stores per token (`kv_entry_shape`).
Gemma's differences live here as switches its classes set: sandwich norms in the layer
(`sandwich_norms`), a scaled embedding (`embed_scale`), soft-capped logits
(`final_logit_softcapping` in the config).
The embedding and lm_head are Linear layers underneath, so a quantized checkpoint's
embedding and logits run through the same per-layer method as every other projection
(models/layers/quantization.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from models.layers.attention import AttentionMetadata, KVCacheSpec
from models.layers.linear import Embedding, Linear, load_hf_weights
from models.layers.norm import RMSNorm
from models.layers.quantization import DenseMethod, QuantizedWeight
from models.layers.rope import RotaryEmbedding
from models.layers.step_kernels import DEFAULT_KERNELS, StepKernels


class LayerAttention(Protocol):
    """A decoder layer's attention module (`self_attn`), as the layer and the model use it."""

    @property
    def kv_entry_shape(self) -> tuple[int, ...]: ...

    def __call__(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    """Pre-norm: x += self_attn(norm(x)); x += mlp(norm(x)). A model's layer class builds
    these four modules; its attention and MLP read the step's kernels from attn_metadata.

    With `sandwich_norms` (Gemma) each block's output is normed too, and the names shift as in
    HF's checkpoints: x += post_attention_layernorm(self_attn(input_layernorm(x)));
    x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))."""

    input_layernorm: nn.Module
    self_attn: LayerAttention
    post_attention_layernorm: nn.Module
    mlp: nn.Module
    pre_feedforward_layernorm: nn.Module  # with sandwich_norms only
    post_feedforward_layernorm: nn.Module
    sandwich_norms: bool = False
    layer_type: str | None = None  # the key of its RoPE table when the model keeps one per layer type

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        whole = self.as_one_op(rope, x, kv_cache, attn_metadata)
        if whole is not None:
            return whole
        if self.sandwich_norms:
            x = x + self.post_attention_layernorm(
                self.self_attn(rope, self.input_layernorm(x), kv_cache, attn_metadata)
            )
            h = self.mlp(self.pre_feedforward_layernorm(x), attn_metadata.kernels)
            return x + self.post_feedforward_layernorm(h)
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x), attn_metadata.kernels)

    def as_one_op(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The layer's output from one kernel call, where a model class has one for this step and
        it gives the same bits as the modules; None: module by module."""
        # One op holds the base weights alone: a step with LoRA rows goes module by module.
        args = None if attn_metadata.kernels.lora is not None else self.one_op_args(x, kv_cache)
        return None if args is None else self.call_one_op(x, args, rope, kv_cache, attn_metadata)

    def one_op_args(self, x: torch.Tensor, kv_cache: torch.Tensor) -> tuple | None:
        """What `call_one_op` needs besides the step's tensors, when this step can run the layer as
        one kernel call (the model class has one, and this step's dtype, device and cache suit it);
        None: module by module. A model class with a one-op form overrides both."""
        return None

    def one_op_lora(self, slot: int) -> tuple | None:
        """The adapter in `slot` as `call_one_op` adds it (its `lora`, less the rows), where this
        layer's one-op form has adapters; None: module by module."""
        return None

    @staticmethod
    def call_one_op(
        x: torch.Tensor,
        args: tuple,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        lora: tuple | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError


class DecoderModel(nn.Module):
    """The stack under HF's `model.` prefix: embedding, decoder layers, final norm."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        rotary_emb: RotaryEmbedding | nn.ModuleDict,
        make_layer: Callable[[int], DecoderLayer],
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(hf_config.vocab_size, hf_config.hidden_size, parallel="column")
        # One cos/sin table (the layers' attention holds it too), or one per layer type.
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(make_layer(i) for i in range(hf_config.num_hidden_layers))
        self.norm: nn.Module = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)  # Gemma's: GemmaRMSNorm
        self.embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
        self._one_op_stack: list[tuple] | None = None  # every layer's one-op arguments, once gathered

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers`, typed: the DecoderLayers make_layer built (an nn.ModuleList's items are nn.Module)."""
        return cast("Sequence[DecoderLayer]", self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (num_tokens, hidden_size)
        if self.embed_scale is not None:  # transformers keeps it a float32 tensor, cast to the weights' dtype
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        # Each layer's metadata: its KV cache group's block tables (one group: the same for all).
        layers = self.decoder_layers
        metas = attn_metadata.by_layer or [attn_metadata] * len(layers)
        if isinstance(self.rotary_emb, nn.ModuleDict):
            tables = cast("Mapping[str, RotaryEmbedding]", self.rotary_emb)  # an nn.ModuleDict's items are nn.Module
            ropes: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {
                kind: emb.cos_sin(positions, x.dtype) for kind, emb in tables.items()
            }
            for layer, kv_cache, meta in zip(layers, kv_caches, metas, strict=True):
                x = layer(ropes[layer.layer_type], x, kv_cache, meta)
            return self.norm(x)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)  # once per step, not once per layer
        lora = attn_metadata.kernels.lora  # steps with adapters' rows (and the base's) take the one op too
        stack = self._one_ops(x, kv_caches)
        if stack is not None:  # every layer one kernel call, without the modules' Python between them
            call = type(layers[0]).call_one_op
            if lora is None:
                for args, kv_cache, meta in zip(stack, kv_caches, metas, strict=True):
                    x = call(x, args, rope, kv_cache, meta)
                return self.norm(x)
            picked: list[torch.Tensor | None] = []  # per adapter, its rows: a row list, or None for all of them
            for _, rows in lora.groups:
                if not isinstance(rows, slice):
                    picked.append(rows)
                elif rows.indices(x.shape[0])[:2] != (0, x.shape[0]):
                    picked.append(torch.arange(x.shape[0])[rows])
                else:
                    picked.append(None)
            for layer, args, kv_cache, meta in zip(layers, stack, kv_caches, metas, strict=True):
                adapters = [layer.one_op_lora(slot) for slot, _ in lora.groups]
                x = (
                    layer(rope, x, kv_cache, meta)
                    if any(adapter is None for adapter in adapters)
                    else call(x, args, rope, kv_cache, meta, (*_concat_lora(adapters), picked))
                )
            return self.norm(x)
        for layer, kv_cache, meta in zip(layers, kv_caches, metas, strict=True):
            x = layer(rope, x, kv_cache, meta)
        return self.norm(x)

    def _one_ops(self, x: torch.Tensor, kv_caches: list[torch.Tensor]) -> list[tuple] | None:
        """Each layer's one-op arguments for this step, or None (then layer by layer, where each
        may still run as one op). Whether the step suits the one-op form (dtype, device, cache) is
        the same for every layer: asked of the first at every step; the arguments, which do not
        change, are gathered once. Calling the op in this loop rather than through each module
        saves ~8 us a layer: 360M's decode forward and logits 7.26 -> 7.00 ms, 135M's 3.72 -> 3.49
        (medians, the two forms interleaved in one process; Zen 5, 2 threads; the same bits)."""
        layers = self.decoder_layers
        if not layers or layers[0].one_op_args(x, kv_caches[0]) is None:
            return None
        if self._one_op_stack is None:
            stack = [layer.one_op_args(x, kv_cache) for layer, kv_cache in zip(layers, kv_caches, strict=True)]
            same_kind = len({type(layer) for layer in layers}) == 1
            complete = [args for args in stack if args is not None]
            self._one_op_stack = complete if same_kind and len(complete) == len(stack) else []
        return self._one_op_stack or None


def _concat_lora(adapters: list[tuple | None]) -> tuple[list[torch.Tensor | None], list[int], list[float]]:
    """Each adapter's `one_op_lora` (tensors, blocks, scales) in one list of each, in step order."""
    tensors: list[torch.Tensor | None] = []
    blocks: list[int] = []
    scales: list[float] = []
    for adapter in adapters:
        assert adapter is not None
        t, b, s = adapter
        tensors += t
        blocks += b
        scales += s
    return tensors, blocks, scales


class CausalLM(nn.Module):
    model: DecoderModel
    lm_head: Linear | None
    # Whether every sliding-window layer attends within its window (models/config.py then serves
    # past the window; otherwise max_model_len is capped to it).
    serves_sliding_window: bool = False

    def __init__(
        self,
        hf_config: PretrainedConfig,
        rotary_emb: RotaryEmbedding | nn.ModuleDict,
        make_layer: Callable[[int], DecoderLayer],
    ) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.model = DecoderModel(hf_config, rotary_emb, make_layer)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Tied: logits reuse the embedding's storage; a second Parameter sharing it would
        # come apart when the loader moves the model off the meta device.
        self.lm_head = (
            None if self.tie_word_embeddings else Linear(hf_config.hidden_size, hf_config.vocab_size, parallel="column")
        )
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None) or None  # Gemma

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> hidden states (num_tokens, hidden_size)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, kernels: StepKernels = DEFAULT_KERNELS) -> torch.Tensor:
        """hidden (num_rows, hidden_size), on the step's kernels -> float32 logits. Tensor
        parallel: each rank's slice of the vocabulary, gathered on rank 0 (others: their slice)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.tp.gather_last_dim(head.linear(hidden, kernels)).float()  # (num_rows, vocab_size)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def row_invariant(self) -> bool:
        """Whether every product of the forward pass computes a token's row from that row alone, in
        an order of sums that nothing else in the step changes: then (with our CPU kernels for
        attention and the rest) a token's logits do not depend on its neighbours, on prefix-cache
        hits or on the thread count. Quantized Linear methods run our kernel, which splits work
        over output rows and columns, never over a sum; dense ones run torch's GEMMs (MKL, oneDNN),
        whose rounding of a row changes with the step's number of rows, and for some with the
        thread count. (A method may say which it is with a `row_invariant` attribute.) Modules
        that multiply by dense weights outside a Linear on torch's GEMMs say so with
        `dense_products = True` (none does now: DeepSeek's absorbed attention and its router run
        csrc/rows_matmul.cpp on CPU, each output summed in an order of its row alone)."""
        products = [m for m in self.modules() if isinstance(m, Linear) and not isinstance(m, Embedding)]
        if self.lm_head is None:  # tied: the embedding multiplies too
            products.append(self.model.embed_tokens)
        methods = {m.quant_method for m in products}
        return all(getattr(m, "row_invariant", not isinstance(m, DenseMethod)) for m in methods) and not any(
            getattr(m, "dense_products", False) for m in self.modules()
        )

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        """What one token stores per layer, as the layers' attention declares it."""
        layers = self.model.decoder_layers
        windows = tuple(getattr(layer.self_attn, "window", None) for layer in layers)
        return KVCacheSpec(
            len(layers),
            layers[0].self_attn.kv_entry_shape,
            dtype,
            windows if any(w is not None for w in windows) else (),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> set[str]:
        """Copy HF-named tensors in; returns the parameter names fully loaded."""
        return load_hf_weights(self, weights, self.skips_weight)

    def skips_weight(self, name: str) -> bool:
        """Checkpoint tensors that are not parameters: old checkpoints store RoPE's inv_freq;
        tied ones sometimes still carry lm_head."""
        return name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")
