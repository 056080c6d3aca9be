"""An int8 cache's calibrated keys (models/kv_int8.py) on tiny random checkpoints of every architecture:
offsets where k_proj has a bias, scales everywhere, and logits over the int8 cache as near a float32
cache's as with the rows stored plain. Random weights have no outlier channels for the scales to
even out (the real models' gains are in test_kv_int8_perplexity.py): here they must cost nothing."""

from __future__ import annotations

import pytest
import torch

from loadtest.perplexity import next_token_logits
from models.kv_int8 import calibrate_int8_keys
from models.llama import LlamaAttention
from models.loader import load_model
from tests.models.conftest import _ARCHS


@pytest.mark.parametrize("arch", sorted(_ARCHS))
def test_int8_keys_are_calibrated_and_logits_stay_near_float32(make_checkpoint, arch):
    path, hf_model = make_checkpoint(arch)
    config = hf_model.config
    loaded = load_model(str(path), dtype="float32", quantization="none")
    calibrate_int8_keys(loaded)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for layer in loaded.model.model.decoder_layers:
        attn = layer.self_attn
        assert attn.key_scale is not None and attn.key_scale.shape == (kv_heads, head_dim), arch
        assert attn.query_scale is not None and attn.query_scale.shape == (heads, head_dim), arch
        assert torch.isfinite(attn.key_scale).all() and (attn.key_scale > 0).all()
        has_bias = attn.qkv_proj.bias is not None
        assert (attn.key_offset is not None) == has_bias, arch
    ids = [(7 * i * i + 3 * i + 1) % 290 + 5 for i in range(60)]
    ref = next_token_logits(loaded, ids, kv_cache_dtype=torch.float32)

    def error() -> float:  # the mean over positions of the logits' relative error
        got = next_token_logits(loaded, ids, kv_cache_dtype=torch.int8)
        return ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()

    calibrated = error()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaAttention, "int8_keys", lambda self, kv_cache: (None, None, None))
        plain = error()
    assert calibrated < 4e-2 and calibrated < 1.15 * plain, (arch, calibrated, plain)


def test_a_channel_quiet_in_calibration_keeps_a_bounded_scale(make_checkpoint):
    """A channel near zero over the calibration text gets a scale from 1% of its head's widest, so a
    prompt that makes it wide cannot push a row's other channels off the int8 grid."""
    path, _ = make_checkpoint("llama")
    loaded = load_model(str(path), dtype="float32", quantization="none")
    calibrate_int8_keys(loaded)
    for layer in loaded.model.model.decoder_layers:
        s = layer.self_attn.query_scale  # s by query head; s = sqrt(channel's absmax), mean log 0
        assert (s.amax(dim=-1) / s.amin(dim=-1)).max().item() <= 10 * (1 + 1e-5)
