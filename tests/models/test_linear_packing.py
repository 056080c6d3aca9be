"""bf16 linear weights packed in oneDNN's layout give bit-identical outputs, and the loader packs them on CPU."""

from __future__ import annotations

import pytest
import torch

from models.layers.linear import Embedding, Linear, MergedLinear, can_pack_weights, pack_linear_weights
from models.layers.step_kernels import StepKernels
from models.loader import load_model
from tests.models.conftest import paged_forward, shuffled_block_tables

pytestmark = pytest.mark.skipif(
    not can_pack_weights(torch.bfloat16, "cpu"), reason="this CPU / torch build has no oneDNN bf16"
)


@pytest.mark.parametrize("keep_plain", [False, True])
def test_packed_linears_are_bit_identical_for_every_row_count(keep_plain):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        Linear(64, 96, bias=True), MergedLinear(96, {"a": 40, "b": 24}, bias=False), torch.nn.Linear(64, 8)
    ).to(torch.bfloat16)
    xs = [torch.randn(rows, 64, dtype=torch.bfloat16) for rows in (1, 2, 7, 64, 300)]
    with torch.inference_mode():
        before = [layers(x) for x in xs]
        assert pack_linear_weights(layers, keep_plain) == 2  # a plain nn.Linear is left alone (its weight is read)
        for layer in layers[:2]:
            assert (layer.packed_weight is not None) == keep_plain and layer.weight.is_mkldnn != keep_plain
        assert not layers[2].weight.is_mkldnn
        assert pack_linear_weights(layers, keep_plain) == 0  # packing twice is a no-op
        after = [layers(x) for x in xs]
        torchs = StepKernels(onednn=False)  # what a single-token step runs with
        single_row = layers[2](layers[1](layers[0](xs[0], torchs), torchs))
        if keep_plain:  # the plain weight on torch's own gemv, with torch's switch left on
            with torch.backends.mkldnn.flags(enabled=False):
                gemv = torch.nn.functional.linear(xs[0], layers[0].weight, layers[0].bias)
            assert torch.backends.mkldnn.enabled and torch.equal(layers[0](xs[0], torchs), gemv)
    for b, a in zip(before, after):
        assert torch.equal(a, b)
    torch.testing.assert_close(single_row, before[0], rtol=1e-2, atol=1e-2)  # another kernel: rounding may differ


def test_loader_packs_bf16_cpu_models_and_logits_do_not_change(tiny_llama_dir):
    packed = load_model(tiny_llama_dir, dtype="bfloat16")
    linears = [m for m in packed.model.modules() if isinstance(m, Linear) and not isinstance(m, Embedding)]
    assert linears and all(m.packed_weight is not None for m in linears)  # a small model keeps both
    assert packed.model.model.embed_tokens.packed_weight is None  # looked up by row: stays plain
    assert load_model(tiny_llama_dir, dtype="float32").model.model.layers[0].mlp.down_proj.weight.is_mkldnn is False

    plain = load_model(tiny_llama_dir, dtype="bfloat16")
    for m in plain.model.modules():  # unpacked: the plain weights alone
        if isinstance(m, Linear):
            m.packed_weight = None
    lengths = [9, 17]
    tables, num_blocks = shuffled_block_tables([n + 1 for n in lengths], 4)
    results = []
    for loaded in (packed, plain):
        caches = loaded.model.kv_cache_spec(torch.bfloat16).allocate(num_blocks, 4, "cpu")
        prefill = paged_forward(
            loaded.model, caches, [(i, 0, list(range(3, 3 + n))) for i, n in enumerate(lengths)], tables, 4
        )
        decode = paged_forward(loaded.model, caches, [(i, n, [5]) for i, n in enumerate(lengths)], tables, 4)
        results.append(prefill + decode)
    for a, b in zip(*results):
        assert torch.equal(a, b)
