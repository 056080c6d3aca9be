"""Read a llama.cpp GGUF file as an HF Llama checkpoint: config, weights, tokenizer.

Parsing and dequantization are the `gguf` package's (GGUFReader, quants.dequantize);
this module only translates: llama.cpp metadata keys -> a transformers LlamaConfig,
llama.cpp tensor names -> HF names, and llama.cpp's Q/K row order -> HF's.

Weights are dequantized one tensor at a time as the loader iterates, so the float
model is never held twice. The tokenizer comes from transformers' GGUF support;
converting it takes seconds, so the result is saved under the cache directory,
keyed by the file's path, size and mtime, and later loads read the saved copy.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K, dequantize
from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerBase

from models.layers.quantization import QuantizedWeight, pack_int4

# GGUF `general.architecture` -> HF architecture name of the model class that reads it.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# GGUF types kept as stored (models/layers/quantization.py): -> (bits, group size, scale dtype).
# Q4_0/Q4_1/Q8_0 keep their fp16 factors; Q4_K's d * sc products need float32 to stay exact.
EXACT_FORMATS = {
    GGMLQuantizationType.Q4_0: (4, 32, torch.float16),
    GGMLQuantizationType.Q4_1: (4, 32, torch.float16),
    GGMLQuantizationType.Q4_K: (4, 32, torch.float32),
    GGMLQuantizationType.Q8_0: (8, 32, torch.float16),
}
_DENSE_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_REQUIRED = object()  # _field default: the key must be present


class GGUFError(ValueError):
    """A GGUF file this reader cannot turn into an HF Llama checkpoint."""


def load_gguf(
    path: str | os.PathLike, cache: Path | None = None, keep_quantized: bool = False
) -> tuple[LlamaConfig, GGUFWeights, PreTrainedTokenizerBase, tuple[int, ...]]:
    """-> (hf_config, weights, tokenizer, eos_token_ids) for a llama-architecture GGUF.

    `weights` is re-iterable and yields (HF name, float32 or float16 tensor) one tensor at
    a time; with `keep_quantized`, tensors of an EXACT_FORMATS type come as QuantizedWeight
    instead. `cache` is where the converted tokenizer is kept (default: models.fetch.cache_dir()).
    """
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except ValueError as exc:  # the package's messages ("GGUF magic invalid") name no file
        raise GGUFError(f"{path}: not a readable GGUF file: {exc}") from exc
    config = read_config(reader, path)
    weights = GGUFWeights(reader, config, path, keep_quantized)
    tokenizer = load_tokenizer(path, cache, reader)
    chat_template = _field(reader, "tokenizer.chat_template", None)
    if chat_template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    return config, weights, tokenizer, eos_token_ids(reader)


def read_config(reader: GGUFReader, path: Path) -> LlamaConfig:
    """Build the HF config from `{arch}.*` metadata, the token list and the tensor names."""
    arch = _field(reader, "general.architecture", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")

    def meta(key, default=_REQUIRED):
        return _field(reader, f"{arch}.{key}", default, path)

    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    rotary_dim = meta("rope.dimension_count", None)
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        raise GGUFError(f"{path}: partial rotary embeddings (rope.dimension_count={rotary_dim}, "
                        f"head_dim={head_dim}) are not supported for llama")

    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style scaling is stored as per-frequency factors, not as HF's rope parameters.
        raise GGUFError(f"{path}: rope_freqs.weight (llama3 rope scaling factors) is not supported")
    vocab_size = len(_field(reader, "tokenizer.ggml.tokens", _REQUIRED, path))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    if int(embed.shape[1]) != vocab_size:  # GGUF shapes are reversed: ne = (hidden, vocab)
        raise GGUFError(f"{path}: {vocab_size} tokens but token_embd.weight has {int(embed.shape[1])} rows")

    return LlamaConfig(
        architectures=[SUPPORTED_ARCHITECTURES[arch]],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length")),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_parameters=_rope_parameters(meta),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        hidden_act="silu",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", None),
    )


def _rope_parameters(meta) -> dict:
    params = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    scaling = meta("rope.scaling.type", None)
    factor = meta("rope.scaling.factor", None)
    if scaling is None and meta("rope.scale_linear", None) is not None:  # older files
        scaling, factor = "linear", meta("rope.scale_linear")
    if scaling in (None, "none"):
        return params
    if scaling not in ("linear", "yarn"):
        raise GGUFError(f"unsupported rope scaling type {scaling!r}")
    params.update(rope_type=scaling, factor=float(factor))
    original = meta("rope.scaling.original_context_length", None)
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    if scaling == "yarn":
        for gguf_key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                                 ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if (value := meta(gguf_key, None)) is not None:
                params[hf_key] = float(value)
    return params


def eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    """End-of-sequence ids: eos, then end-of-turn when the file names a different one."""
    ids = [_field(reader, f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> HF name; None for a name this reader does not know."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (weight or bias).

    llama.cpp rotates adjacent pairs within a head, HF rotates the two halves, so its
    converter reorders each head's rows. Within one head of d rows, GGUF row i*2 + j
    holds HF row j*(d/2) + i:

        GGUF rows  0  1  2  3  4  5        HF rows  0  3  1  4  2  5   (d = 6)
    """
    head_half = w.shape[0] // num_heads // 2
    # (num_heads, d/2, 2, ...) -> (num_heads, 2, d/2, ...) -> back to (rows, ...)
    return w.reshape(num_heads, head_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """(HF name, tensor) pairs of a GGUF file, read lazily as they are iterated: dequantized,
    or (`keep_quantized`) as QuantizedWeight where the type maps exactly onto one."""

    def __init__(self, reader: GGUFReader, config: LlamaConfig, path: Path, keep_quantized: bool = False):
        self._reader = reader
        self._config = config
        self.keep_quantized = keep_quantized
        self._names: list[tuple[int, str]] = []
        checked: set[GGMLQuantizationType] = set()
        for index, tensor in enumerate(reader.tensors):
            hf_name = hf_tensor_name(tensor.name)
            if hf_name is None:
                raise GGUFError(f"{path}: unexpected tensor {tensor.name!r} for a llama model")
            if tensor.tensor_type not in checked:
                _check_dequantizable(tensor.tensor_type, tensor.name, path)
                checked.add(tensor.tensor_type)
            self._names.append((index, hf_name))

    def __len__(self) -> int:
        return len(self._names)

    def stored_types(self) -> dict[str, GGMLQuantizationType]:
        """HF name -> the GGUF type the file stores it in."""
        return {hf_name: self._reader.tensors[index].tensor_type for index, hf_name in self._names}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, hf_name in self._names:
            yield hf_name, self._tensor(self._reader.tensors[index])

    def _tensor(self, tensor) -> torch.Tensor | QuantizedWeight:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        if self.keep_quantized and tensor.tensor_type in EXACT_FORMATS and len(shape) == 2:
            weight = quantized_weight(np.asarray(tensor.data), tensor.tensor_type, *shape)
            heads = self._qk_heads(tensor.name)
            if heads:
                weight = weight.rows(torch.from_numpy(unpermute_qk(np.arange(shape[0]), heads)))
            return weight
        if tensor.tensor_type == GGMLQuantizationType.F16:
            array = np.asarray(tensor.data).reshape(shape)  # stays float16: half the memory
        else:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if heads := self._qk_heads(tensor.name):
            array = unpermute_qk(array, heads)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array)  # still a view of the read-only memmap: copy it out
        return torch.from_numpy(array)


    def _qk_heads(self, name: str) -> int | None:
        """Heads of a Q or K projection, whose rows llama.cpp permutes (None for others)."""
        if ".attn_q." in name:
            return self._config.num_attention_heads
        if ".attn_k." in name:
            return self._config.num_key_value_heads
        return None


def serving_format(qtype: GGMLQuantizationType) -> tuple[int, int, torch.dtype] | None:
    """(bits, group size, scale dtype) that a tensor of this type is served in by `--quantization auto`
    (None: dense). Types with no exact mapping are requantized from their dequantized values:
    5 bits and more to int8, fewer to int4."""
    if qtype in EXACT_FORMATS:
        return EXACT_FORMATS[qtype]
    if qtype in _DENSE_TYPES:
        return None
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    return (8, 32, torch.float32) if block_bytes * 8 / block_values >= 5 else (4, 32, torch.float32)


def quantized_weight(data: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> QuantizedWeight:
    """Raw GGUF blocks (rows, bytes per row) uint8 of a Q4_0/Q4_1/Q4_K/Q8_0 tensor -> the same
    numbers as a QuantizedWeight (scales and mins multiplied out in float32, exactly).

        Q8_0  [d f16 | 32 x int8]                          w = d q
        Q4_0  [d f16 | 16 bytes]                           w = d q - 8 d
        Q4_1  [d f16 | m f16 | 16 bytes]                   w = d q + m
        Q4_K  [d f16 | dmin f16 | 12 bytes of 6-bit (sc, mn) x 8 | 128 bytes]
              8 sub-blocks of 32:                          w = d sc q - dmin mn
    Q4_0/Q4_1 pack a block as we do (low nibbles: values 0-15); Q4_K packs two sub-blocks per
    32 bytes (low nibbles: the first, high: the second) and is repacked.
    """
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(rows, cols // block_values, block_bytes)  # (rows, blocks, bytes)

    def f16(lo: int) -> np.ndarray:  # the fp16 factor at byte `lo` of every block, (rows, blocks) float16
        return np.ascontiguousarray(blocks[..., lo : lo + 2]).view(np.float16)[..., 0]

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    if qtype == GGMLQuantizationType.Q8_0:
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return QuantizedWeight(8, tensor(q), tensor(f16(0)), None, cols)
    if qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        d = f16(0)
        m = (d.astype(np.float32) * -8.0).astype(np.float16) if qtype == GGMLQuantizationType.Q4_0 else f16(2)
        qs = blocks[..., 2:] if qtype == GGMLQuantizationType.Q4_0 else blocks[..., 4:]
        return QuantizedWeight(4, tensor(qs.reshape(rows, cols // 2)), tensor(d), tensor(m), cols)
    if qtype == GGMLQuantizationType.Q4_K:
        d, dmin = f16(0).astype(np.float32)[..., None], f16(2).astype(np.float32)[..., None]  # (rows, sb, 1)
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        sc = sc.reshape(rows, -1, 8).astype(np.float32)
        mn = mn.reshape(rows, -1, 8).astype(np.float32)
        qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 pairs of sub-blocks of 32 bytes
        values = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # (rows, sb, 4, 2, 32)
        packed = pack_int4(torch.from_numpy(np.ascontiguousarray(values.reshape(rows, cols))))
        return QuantizedWeight(4, packed, tensor((d * sc).reshape(rows, -1)), tensor((-dmin * mn).reshape(rows, -1)), cols)
    raise GGUFError(f"GGUF type {qtype.name} is not kept quantized")


def _check_dequantizable(qtype: GGMLQuantizationType, name: str, path: Path) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    try:  # one zero block: cheap, and asks the gguf package itself what it supports
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:  # also integer tensors (I8, I32, ...), which are no weights
        raise GGUFError(f"{path}: tensor {name!r} has type {qtype.name}, which the installed "
                        "gguf package cannot dequantize") from None


def load_tokenizer(path: Path, cache: Path | None = None, reader: GGUFReader | None = None) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for a GGUF file, converted once and then read from the cache, where
    it is kept under a hash of the file's metadata (all that the conversion reads) and
    transformers' version: files with the same metadata share one conversion wherever they lie (it
    was keyed by path and mtime, and every GGUF a test wrote added ~0.5 MB to the cache for good).
    `reader`: the file's, where the caller has one (else one is made: ~1-2 s for a 49k-token vocabulary)."""
    if cache is None:
        from models.fetch import cache_dir
        cache = cache_dir()
    path = Path(path).resolve()
    if reader is None:
        reader = GGUFReader(path)
    saved = Path(cache) / "tokenizers" / f"gguf-{_metadata_key(reader)}"
    if (saved / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tmp = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=saved.parent, prefix=".tmp-"))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, saved)  # atomic; fails harmlessly if a concurrent load got there first
    except OSError:
        pass  # an unwritable cache only costs the conversion time on the next load
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _metadata_key(reader: GGUFReader) -> str:
    """A hash of every metadata field's bytes as the file holds them (not the tensors), and of
    transformers' version."""
    digest = hashlib.sha256(transformers.__version__.encode())
    for field in reader.fields.values():
        nbytes = sum(int(part.nbytes) for part in field.parts)
        digest.update(reader.data[field.offset : field.offset + nbytes])
    return digest.hexdigest()[:16]


def _field(reader: GGUFReader, key: str, default=_REQUIRED, path: Path | None = None):
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _REQUIRED:
        raise GGUFError(f"{path}: missing GGUF metadata key {key!r}")
    return default
