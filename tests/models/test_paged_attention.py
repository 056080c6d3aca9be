"""paged_attention == dense causal attention (SDPA per sequence) for ragged batches over a paged cache."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from models.layers.attention import AttentionMetadata, KVCacheSpec, paged_attention
from tests.models.conftest import shuffled_block_tables

HEAD_DIM = 8


pytestmark = pytest.mark.usefixtures("attention_path")  # every test: C++ kernel, then PyTorch path


def dense_reference(q, k_all, v_all, scale):
    """q (Q, H, D) are the last Q of the L positions of k_all/v_all (L, Hk, D); causal."""
    num_q, length = q.shape[0], k_all.shape[0]
    q_pos = torch.arange(length - num_q, length)[:, None]
    mask = torch.arange(length)[None, :] <= q_pos  # (Q, L)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )  # (H, Q, D)
    return out.transpose(0, 1)


def run_step(cache, seqs, chunks, block_tables, block_size, scale):
    """chunks: list of (seq index, start, num new tokens); returns per-chunk outputs."""
    meta = AttentionMetadata.build(
        [n for _, _, n in chunks], [s + n for _, s, n in chunks], [block_tables[i] for i, _, _ in chunks], block_size
    )
    q = torch.cat([seqs[i]["q"][s : s + n] for i, s, n in chunks])
    k = torch.cat([seqs[i]["k"][s : s + n] for i, s, n in chunks])
    v = torch.cat([seqs[i]["v"][s : s + n] for i, s, n in chunks])
    out = paged_attention(q, k, v, cache, meta, scale)
    return out.split([n for _, _, n in chunks])


def make_seqs(lengths, num_heads, num_kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "q": torch.randn(n, num_heads, HEAD_DIM, generator=gen),
            "k": torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen),
            "v": torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen),
        }
        for n in lengths
    ]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_mixed_decodes_and_chunked_prefills_match_dense(block_size, num_heads, num_kv_heads):
    # (cached context, new tokens this step): fresh prefills, decodes, chunks after context.
    plan = [(0, 5), (12, 1), (30, 7), (3, 1), (0, 1), (17, 16)]
    seqs = make_seqs([c + n for c, n in plan], num_heads, num_kv_heads, seed=block_size)
    tables, num_blocks = shuffled_block_tables([c + n for c, n in plan], block_size, seed=num_kv_heads)
    cache = KVCacheSpec(1, (2, num_kv_heads, HEAD_DIM), torch.float32).allocate(num_blocks, block_size, "cpu")[0]
    scale = HEAD_DIM**-0.5
    # Step 1 fills each sequence's context (checked too); step 2 is the mixed batch, in shuffled order.
    first = [(i, 0, c) for i, (c, _) in enumerate(plan) if c > 0]
    second = [(i, c, n) for i, (c, n) in enumerate(plan)]
    random.Random(block_size).shuffle(second)
    for chunks in (first, second):
        for (i, start, n), out in zip(chunks, run_step(cache, seqs, chunks, tables, block_size, scale)):
            s = seqs[i]
            ref = dense_reference(s["q"][start : start + n], s["k"][: start + n], s["v"][: start + n], scale)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_match_dense(seed):
    """Random lengths and chunk sizes, many steps: each token's output only depends on its own sequence."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 5, 16])
    num_kv_heads = rng.choice([1, 2, 4])
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
    seqs = make_seqs(lengths, 4, num_kv_heads, seed)
    tables, num_blocks = shuffled_block_tables(lengths, block_size, seed)
    cache = KVCacheSpec(1, (2, num_kv_heads, HEAD_DIM), torch.float32).allocate(num_blocks, block_size, "cpu")[0]
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        chunks = [
            (i, done[i], min(n - done[i], rng.choice([1, 1, 2, 6, 40]))) for i, n in enumerate(lengths) if done[i] < n
        ]
        rng.shuffle(chunks)
        for (i, start, n), out in zip(chunks, run_step(cache, seqs, chunks, tables, block_size, 0.3)):
            s = seqs[i]
            ref = dense_reference(s["q"][start : start + n], s["k"][: start + n], s["v"][: start + n], 0.3)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            done[i] += n


def test_tokens_go_to_their_block_table_slots():
    """Token t of a sequence lands at block_table[t // block_size] * block_size + t % block_size."""
    meta = AttentionMetadata.build([3, 1], [5, 4], [[7, 2, 9], [4, 0]], block_size=2)
    # seq 0: positions 2, 3, 4 -> blocks 2, 2, 9; seq 1: position 3 -> block 0, offset 1
    assert meta.slot_mapping.tolist() == [4, 5, 18, 1]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_the_layers_of_a_step_share_its_metadata(cache_dtype):
    """Every layer of a step attends with the same AttentionMetadata (the eager paths gather into
    buffers kept on it): each of three layers' outputs, over caches of their own, equals dense
    attention on that layer's keys, in whatever order the layers run, again and again."""
    block_size, num_kv_heads, scale = 4, 2, HEAD_DIM**-0.5
    plan = [(9, 1), (0, 6), (13, 1), (5, 3), (21, 1)]  # (cached context, new tokens): decodes, a prompt, a chunk
    lengths = [c + n for c, n in plan]
    tables, num_blocks = shuffled_block_tables(lengths, block_size, seed=3)
    layers = []
    for seed in range(3):
        seqs = make_seqs(lengths, 4, num_kv_heads, seed=10 + seed)
        for s in seqs:  # what a 16-bit cache holds, so that the dense reference reads the same keys
            s["k"], s["v"] = s["k"].to(cache_dtype).float(), s["v"].to(cache_dtype).float()
        cache = KVCacheSpec(1, (2, num_kv_heads, HEAD_DIM), cache_dtype).allocate(num_blocks, block_size, "cpu")[0]
        run_step(cache, seqs, [(i, 0, c) for i, (c, _) in enumerate(plan) if c > 0], tables, block_size, scale)
        layers.append((seqs, cache))
    chunks = [(i, c, n) for i, (c, n) in enumerate(plan)]
    meta = AttentionMetadata.build([n for _, _, n in chunks], [c + n for _, c, n in chunks], tables, block_size)
    for seqs, cache in layers + layers[::-1]:
        q = torch.cat([seqs[i]["q"][c : c + n] for i, c, n in chunks])
        k = torch.cat([seqs[i]["k"][c : c + n] for i, c, n in chunks])
        v = torch.cat([seqs[i]["v"][c : c + n] for i, c, n in chunks])
        out = paged_attention(q, k, v, cache, meta, scale)
        for (i, c, n), got in zip(chunks, out.split([n for _, _, n in chunks])):
            s = seqs[i]
            ref = dense_reference(s["q"][c : c + n], s["k"][: c + n], s["v"][: c + n], scale)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def windowed_reference(q, k_all, v_all, scale, window, softcap):
    """dense_reference with transformers' sliding window (key position > p - window) and soft-capping."""
    num_q, length = q.shape[0], k_all.shape[0]
    q_pos = torch.arange(length - num_q, length)[:, None]
    keys = torch.arange(length)[None, :]
    mask = (keys <= q_pos) & (keys > q_pos - window if window else True)  # (Q, L)
    group = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
    v = v_all.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # (H, Q, L)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1)


@pytest.mark.parametrize("window,softcap", [(8, None), (1, None), (5, 0.7), (None, 0.5), (200, None), (130, None)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sliding_window_and_softcap_match_dense(block_size, window, softcap):
    """A query at p sees keys p - window + 1..p, scores soft-capped; mixed steps over shuffled blocks,
    with contexts longer than the kernel's key blocks of 128 so that some are skipped whole."""
    num_heads, num_kv_heads = 6, 2
    plan = [(0, 21), (40, 1), (300, 1), (13, 9), (0, 1), (150, 40), (260, 3)]
    lengths = [c + n for c, n in plan]
    seqs = make_seqs(lengths, num_heads, num_kv_heads, seed=block_size)
    tables, num_blocks = shuffled_block_tables(lengths, block_size, seed=7)
    cache = KVCacheSpec(1, (2, num_kv_heads, HEAD_DIM), torch.float32).allocate(num_blocks, block_size, "cpu")[0]
    scale = 1.3  # large scores, so that soft-capping changes them
    first = [(i, 0, c) for i, (c, _) in enumerate(plan) if c > 0]
    second = [(i, c, n) for i, (c, n) in enumerate(plan)]
    random.Random(block_size).shuffle(second)
    for chunks in (first, second):
        meta = AttentionMetadata.build(
            [n for _, _, n in chunks], [s + n for _, s, n in chunks], [tables[i] for i, _, _ in chunks], block_size
        )
        q = torch.cat([seqs[i]["q"][s : s + n] for i, s, n in chunks])
        k = torch.cat([seqs[i]["k"][s : s + n] for i, s, n in chunks])
        v = torch.cat([seqs[i]["v"][s : s + n] for i, s, n in chunks])
        out = paged_attention(q, k, v, cache, meta, scale, window=window, softcap=softcap)
        for (i, start, n), got in zip(chunks, out.split([n for _, _, n in chunks])):
            s = seqs[i]
            ref = windowed_reference(
                s["q"][start : start + n], s["k"][: start + n], s["v"][: start + n], scale, window, softcap
            )
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(8, None), (130, 0.7)])
def test_windowed_rows_do_not_depend_on_their_step(attention_path, window, softcap):
    """On the kernel, a token's output within its window is the same bits whether its sequence is
    prefilled at once, in chunks beside other sequences, or decoded token by token."""
    if attention_path != "cpu-kernel":
        pytest.skip("the eager paths are not row-invariant")
    block_size, num_kv_heads, length = 16, 2, 300
    seqs = make_seqs([length, 200], 6, num_kv_heads, seed=11)
    tables, num_blocks = shuffled_block_tables([length, 200], block_size, seed=5)
    outputs = []
    for schedule in ([length], [37, 1, 1, 100, 161], [1] * 20 + [280]):
        cache = KVCacheSpec(1, (2, num_kv_heads, HEAD_DIM), torch.float32).allocate(num_blocks, block_size, "cpu")[0]
        done, parts = 0, []
        for n in schedule:
            other = min(done, 199)  # a neighbour sequence in the same step
            chunks = [(1, other, 1), (0, done, n)]
            meta = AttentionMetadata.build([1, n], [other + 1, done + n], [tables[1], tables[0]], block_size)
            q = torch.cat([seqs[i]["q"][s : s + m] for i, s, m in chunks])
            k = torch.cat([seqs[i]["k"][s : s + m] for i, s, m in chunks])
            v = torch.cat([seqs[i]["v"][s : s + m] for i, s, m in chunks])
            parts.append(paged_attention(q, k, v, cache, meta, 1.3, window=window, softcap=softcap)[1:])
            done += n
        outputs.append(torch.cat(parts))
    for other in outputs[1:]:
        assert torch.equal(other, outputs[0])


def int8_step_outputs(seqs, plan, tables, num_blocks, block_size, scale, num_kv_heads, head_dim, window=None):
    """Two steps over an int8 cache (the contexts, then the plan's mixed batch in shuffled order) ->
    {(seq, start): output} of every chunk."""
    cache = KVCacheSpec(1, (2, num_kv_heads, head_dim), torch.int8).allocate(num_blocks, block_size, "cpu")[0]
    first = [(i, 0, c) for i, (c, _) in enumerate(plan) if c > 0]
    second = [(i, c, n) for i, (c, n) in enumerate(plan)]
    random.Random(block_size).shuffle(second)
    got = {}
    for chunks in (first, second):
        meta = AttentionMetadata.build(
            [n for _, _, n in chunks], [s + n for _, s, n in chunks], [tables[i] for i, _, _ in chunks], block_size
        )
        q = torch.cat([seqs[i]["q"][s : s + n] for i, s, n in chunks])
        k = torch.cat([seqs[i]["k"][s : s + n] for i, s, n in chunks])
        v = torch.cat([seqs[i]["v"][s : s + n] for i, s, n in chunks])
        out = paged_attention(q, k, v, cache, meta, scale, window=window)
        got.update({(i, s): o for (i, s, _), o in zip(chunks, out.split([n for _, _, n in chunks]))})
    return got


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("block_size,window", [(16, None), (5, None), (16, 9)])
def test_int8_cache_is_attention_over_its_dequantized_rows(block_size, window, head_dim):
    """An int8 cache (--kv-cache-dtype int8) holds each key and value row as round(x / scale) and
    its float16 scale absmax / 127; every path attends exactly (to float32 rounding) what dense
    attention gives over those dequantized rows, and within the quantization's own bound of dense
    attention over the float rows: each number moves by at most absmax / 254 of its row, so an output
    (a convex mix of values) by at most max absmax / 254 through the values, plus what the keys'
    error does to the weights (below 1e-2 here)."""
    from models.layers.attention import dequantize_rows, quantize_rows

    num_heads, num_kv_heads = 6, 2
    plan = [(0, 21), (40, 1), (300, 1), (13, 9), (0, 1), (150, 40)]
    lengths = [c + n for c, n in plan]
    gen = torch.Generator().manual_seed(head_dim)
    seqs = [
        {
            "q": torch.randn(n, num_heads, head_dim, generator=gen),
            "k": torch.randn(n, num_kv_heads, head_dim, generator=gen),
            "v": torch.randn(n, num_kv_heads, head_dim, generator=gen),
        }
        for n in lengths
    ]
    tables, num_blocks = shuffled_block_tables(lengths, block_size, seed=3)
    scale = head_dim**-0.5
    got = int8_step_outputs(seqs, plan, tables, num_blocks, block_size, scale, num_kv_heads, head_dim, window)
    worst = 0.0
    for (i, start), out in got.items():
        s, end = seqs[i], start + out.shape[0]
        k8, v8 = (dequantize_rows(quantize_rows(s[x][:end]), torch.float32) for x in ("k", "v"))
        ref8 = windowed_reference(s["q"][start:end], k8, v8, scale, window, None)
        torch.testing.assert_close(out, ref8, rtol=1e-5, atol=1e-5)
        ref = windowed_reference(s["q"][start:end], s["k"][:end], s["v"][:end], scale, window, None)
        step = s["v"][:end].abs().amax().item() / 254  # the values' bound
        assert (out - ref).abs().max().item() <= step + 1e-2
        worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    assert worst < 2e-2  # relative (Frobenius) error of a chunk's output against float K/V


def test_int8_rows_are_written_alike_by_both_paths():
    """csrc's write_kv_blocks and attention.py's store_kv write the same bytes (values and scales),
    so the two attention paths read the same cache."""
    from models.layers import cpu_kernels
    from models.layers.attention import store_kv

    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable")
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 37, 3, 64, generator=gen) * torch.rand(2, 37, 3, 1, generator=gen) * 10
    k[5, 1] = 0  # an all-zero row: scale 0, numbers 0
    spec = KVCacheSpec(1, (2, 3, 64), torch.int8)
    a, b = (spec.allocate(6, 8, "cpu")[0] for _ in range(2))
    slots = torch.randperm(48, generator=gen)[:37]
    cpu_kernels.write_kv_blocks(a, k, v, slots)
    store_kv(b, k, v, slots)
    assert torch.equal(a, b)
    for dtype in (torch.bfloat16, torch.float16):  # 16-bit activations quantize alike too
        cpu_kernels.write_kv_blocks(a, k.to(dtype), v.to(dtype), slots)
        store_kv(b, k.to(dtype), v.to(dtype), slots)
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_rows_do_not_depend_on_their_step(attention_path, threads):
    """On the kernel, a token's output over an int8 cache is the same bits whether its sequence is
    prefilled at once, in chunks beside another sequence, or decoded token by token, on any thread count."""
    if attention_path != "cpu-kernel":
        pytest.skip("the eager paths are not row-invariant")
    block_size, num_kv_heads, length, head_dim = 16, 2, 200, 64
    gen = torch.Generator().manual_seed(4)
    seqs = [
        {x: torch.randn(n, 6 if x == "q" else num_kv_heads, head_dim, generator=gen) for x in "qkv"}
        for n in (length, 150)
    ]
    tables, num_blocks = shuffled_block_tables([length, 150], block_size, seed=5)
    outputs = []
    previous = torch.get_num_threads()
    try:
        for schedule in ([length], [37, 1, 1, 100, 61], [1] * 20 + [180]):
            torch.set_num_threads(threads if len(outputs) else 2)
            cache = KVCacheSpec(1, (2, num_kv_heads, head_dim), torch.int8).allocate(num_blocks, block_size, "cpu")[0]
            done, parts = 0, []
            for n in schedule:
                other = min(done, 149)
                chunks = [(1, other, 1), (0, done, n)]
                meta = AttentionMetadata.build([1, n], [other + 1, done + n], [tables[1], tables[0]], block_size)
                q, k, v = (torch.cat([seqs[i][x][s : s + m] for i, s, m in chunks]) for x in "qkv")
                parts.append(paged_attention(q, k, v, cache, meta, head_dim**-0.5)[1:])
                done += n
            outputs.append(torch.cat(parts))
    finally:
        torch.set_num_threads(previous)
    for other in outputs[1:]:
        assert torch.equal(other, outputs[0])


def test_int8_cache_sizes():
    """An int8 entry is its numbers and a float16 scale a row: (D + 2) / (4 D) of float32's bytes, so
    at head dim 64 a cache holds 1.94x the tokens of a 16-bit one (at least the 1.9x it aims at)."""
    f32 = KVCacheSpec(2, (2, 5, 64), torch.float32)
    bf16 = KVCacheSpec(2, (2, 5, 64), torch.bfloat16)
    i8 = KVCacheSpec(2, (2, 5, 64), torch.int8)
    assert i8.stored_shape == (2, 5, 66) and i8.bytes_per_entry == 2 * 5 * 66
    assert f32.bytes_per_entry / i8.bytes_per_entry == pytest.approx(256 / 66)
    assert bf16.bytes_per_entry / i8.bytes_per_entry >= 1.9
    assert i8.allocate(3, 16, "cpu")[0].shape == (3, 16, 2, 5, 66)


def test_int8_scales_are_float16_and_the_numbers_made_against_them():
    """A row's scale is absmax / 127 rounded to float16, and its numbers round(x / scale) with that
    rounded scale, so dequantizing moves no number by more than half a step; rows of zeros, of tiny
    numbers (a float16 subnormal scale) and of large ones (up to float16's range) survive; a row too
    small for a float16 scale (absmax below ~4e-6) reads back as zeros."""
    from models.layers.attention import dequantize_rows, quantize_rows

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=gen) * torch.tensor([1.0, 0.0, 1e-3, 1e3, 1e6, 30.0])[:, None]
    rows = quantize_rows(x)
    assert rows.shape == (6, 66) and rows.dtype == torch.int8
    scale = rows[:, 64:].contiguous().view(torch.float16).float()
    assert torch.equal(scale, (x.abs().amax(-1, keepdim=True) / 127).clamp(max=65504).half().float())
    back = dequantize_rows(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-6) + 1e-30).all()
    assert torch.equal(back[1], torch.zeros(64))
    tiny = torch.randn(64, generator=gen) * 1e-7
    assert torch.equal(dequantize_rows(quantize_rows(tiny), torch.float32), torch.zeros(64))
