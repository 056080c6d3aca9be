"""An adapter's products on our CPU kernels (csrc/lora_ops.cpp): `lora_add`, one op a linear layer
(shrink by A_cat, expand by the blocks of B that are not zero), and a Llama layer with its step's
adapters as one op (`llama_decoder_layer_lora`). lora_add must give B(A x) * scale within float32
rounding, never read B's zero blocks, and give a row the same bits whatever rows come with it;
the one-op layer must give the module-by-module path's bits, and the step must really take it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from loadtest.bench_lora import ALL_LINEAR, random_adapter
from models.fetch import default_model_path
from models.layers.attention import AttentionMetadata
from models.layers import cpu_kernels
from models.layers.lora import prepare_lora_adapter
from models.layers.lora_weights import LoRABatch
from models.llama import LlamaDecoderLayer
from models.loader import load_model
from tests.models.conftest import shuffled_block_tables
from tests.models.test_decoder_layer_op import BLOCK_SIZE


@pytest.fixture(autouse=True)
def kernels():
    if not cpu_kernels.available() or not hasattr(torch.ops.pagedserve, "lora_add"):
        pytest.skip("CPU kernels unavailable")


def reference(out, x, a, bt, blocks, scale) -> torch.Tensor:
    """out + scale * B (A x) block by block, in float64."""
    expected = out.double().clone()
    hidden = x.double() @ a.double().t()
    for o, n, c, r in zip(*[iter(blocks)] * 4, strict=True):
        expected[:, o : o + n] += scale * (hidden[:, c : c + r] @ bt.double()[c : c + r, o : o + n])
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lora_add_is_the_products_and_never_reads_a_zero_block(dtype):
    gen = torch.Generator().manual_seed(0)
    num_rows, hidden_size, out_features = 5, 70, 150
    a = torch.randn(12, hidden_size, generator=gen).to(dtype)
    bt = torch.randn(12, out_features, generator=gen).to(dtype)
    blocks = (0, 70, 0, 5, 90, 60, 5, 7)  # outputs 70..89 and the other ranks' columns: B_cat's zeros
    poisoned = torch.full_like(bt, float("nan"))
    for o, n, c, r in zip(*[iter(blocks)] * 4, strict=True):
        poisoned[c : c + r, o : o + n] = bt[c : c + r, o : o + n]
    x, out = torch.randn(num_rows, hidden_size, generator=gen), torch.randn(num_rows, out_features, generator=gen)
    got = out.clone()
    torch.ops.pagedserve.lora_add(got, x, None, a, poisoned, blocks, 2.5)
    assert torch.equal(got[:, 70:90], out[:, 70:90])
    torch.testing.assert_close(got.double(), reference(out, x, a, bt, blocks, 2.5), rtol=1e-5, atol=1e-5)


def test_a_row_gets_the_same_bits_alone_picked_or_among_others():
    gen = torch.Generator().manual_seed(1)
    a, bt = torch.randn(16, 300, generator=gen), torch.randn(16, 200, generator=gen)
    blocks = (0, 200, 0, 16)
    x, out = torch.randn(9, 300, generator=gen), torch.randn(9, 200, generator=gen)
    together = out.clone()
    torch.ops.pagedserve.lora_add(together, x, None, a, bt, blocks, 0.5)
    picked = out.clone()
    rows = torch.tensor([7, 2, 4])
    torch.ops.pagedserve.lora_add(picked, x, rows, a, bt, blocks, 0.5)
    assert torch.equal(picked[rows], together[rows])
    others = [i for i in range(9) if i not in rows.tolist()]
    assert torch.equal(picked[others], out[others])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(9):
            alone = out[i : i + 1].clone()
            torch.ops.pagedserve.lora_add(alone, x[i : i + 1], None, a, bt, blocks, 0.5)
            assert torch.equal(alone, together[i : i + 1])
    finally:
        torch.set_num_threads(threads)


def steps(model, slots_of: list[int]) -> list[torch.Tensor]:
    """Prompts of three requests, then their decodes with a chunk, each request under its slot."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (21, 9, 30)]
    tables, num_blocks = shuffled_block_tables([40, 24, 48], BLOCK_SIZE)
    kv_caches = model.kv_cache_spec(torch.float32).allocate(num_blocks, BLOCK_SIZE, "cpu")
    logits = []
    for step in ([(0, 0, ids[0]), (1, 0, ids[1])], [(0, 21, [5]), (1, 9, [6]), (2, 0, ids[2])], [(2, 30, [7])]):
        query_lens = [len(t) for _, _, t in step]
        meta = AttentionMetadata.build(
            query_lens, [s + len(t) for _, s, t in step], [tables[i] for i, _, _ in step], BLOCK_SIZE
        )
        batch = LoRABatch.build(query_lens, [slots_of[i] for i, _, _ in step], torch.device("cpu"))
        meta = replace(meta, kernels=replace(meta.kernels, lora=batch))
        input_ids = torch.tensor([t for _, _, toks in step for t in toks])
        positions = torch.tensor([p for _, s, toks in step for p in range(s, s + len(toks))])
        with torch.inference_mode():
            logits.append(model.compute_logits(model(input_ids, positions, kv_caches, meta), meta.kernels))
    return logits


@pytest.mark.parametrize(
    "slots_of",
    [[1, 1, 1], [1, 0, 1], [2, 1, 0]],
    ids=["one adapter", "one adapter beside the base", "two adapters"],
)
@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
def test_smollm2_layers_with_an_adapter_as_one_op_give_the_same_bits(monkeypatch, slots_of, lora_dtype):
    model = load_model(str(default_model_path()), dtype="float32").model
    for slot in (1, 2):
        adapter = random_adapter(model, f"a{slot}", 8, set(ALL_LINEAR.split(",")) - {"k_proj"}, seed=slot)
        prepare_lora_adapter(model, adapter, lora_dtype).install(slot)
    calls = []
    real = LlamaDecoderLayer.call_one_op
    monkeypatch.setattr(
        LlamaDecoderLayer, "call_one_op", staticmethod(lambda x, *a: calls.append(len(a) > 4) or real(x, *a))
    )
    fused = steps(model, slots_of)
    # every layer of every step with an adapter's row, with the step's adapters (the last step: request 2's)
    assert calls == [True] * 2 * 30 + [slots_of[2] != 0] * 30
    monkeypatch.setattr(LlamaDecoderLayer, "one_op_lora", lambda self, slot: None)
    calls.clear()
    modules = steps(model, slots_of)
    assert True not in calls
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)
    base = steps(model, [0, 0, 0])
    assert not torch.allclose(fused[0], base[0], atol=1e-2)  # the adapter is there
