"""The C++ kernels equal the PyTorch paths they replace, and are built where they can be."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from models.layers import cpu_kernels
from models.layers.attention import AttentionMetadata, _decode, pad_queries
from tests.models.conftest import shuffled_block_tables


def test_kernel_is_built_where_a_compiler_is():
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine: the PyTorch path serves")
    assert cpu_kernels.available(), "a compiler is here but the kernel did not build (see the warning logged)"


def needs_kernel():
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable")


def random_decodes(lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """A cache filled with random keys/values, the metadata of one decode per sequence and its queries."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_block_tables(lengths, block_size, seed=seed)
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build([1] * len(lengths), lengths, tables, block_size)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype)
    return q, cache, meta


def kernel(q, cache, meta, scale):
    return cpu_kernels.paged_attention(q, cache, meta.block_table, meta.seq_lens, meta.query_start, scale)


def eager_decode(q, cache, meta, scale):
    group = meta.groups[0]
    return _decode(pad_queries(q, group), cache, group, scale).view(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (4, 1)], ids=["mha", "gqa3", "gqa4", "mqa"])
@pytest.mark.parametrize("head_dim", [8, 20, 64, 128])  # 64 and 128 are compiled as constants, others at run time
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_kernel_equals_the_pytorch_decode_in_float32(num_heads, num_kv_heads, head_dim, block_size):
    needs_kernel()
    rng = random.Random(head_dim * block_size)
    # Up to 300 keys: more than one of the kernel's 128-key softmax blocks.
    lengths = [1, block_size, block_size + 1, 128, 129] + [rng.randint(1, 300) for _ in range(9)]
    q, cache, meta = random_decodes(lengths, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=7)
    scale = head_dim**-0.5
    torch.testing.assert_close(kernel(q, cache, meta, scale), eager_decode(q, cache, meta, scale), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_in_reduced_precision_is_closer_to_float32_than_the_pytorch_path(dtype):
    # Both read the same rounded cache; the kernel keeps scores and sums in float32, the
    # PyTorch path rounds scores and probabilities to the cache dtype.
    needs_kernel()
    lengths = [random.Random(i).randint(1, 300) for i in range(16)]
    q, cache, meta = random_decodes(lengths, 9, 3, 64, 16, dtype, seed=3)
    exact = eager_decode(q.float(), cache.float(), meta, 0.125)
    eager = eager_decode(q, cache, meta, 0.125).float()
    got = kernel(q, cache, meta, 0.125)
    assert got.dtype == dtype
    kernel_err, eager_err = (got.float() - exact).abs().max(), (eager - exact).abs().max()
    assert kernel_err <= eager_err
    torch.testing.assert_close(got.float(), exact, rtol=0, atol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_kernel_reads_a_16_bit_cache_under_float32_queries(cache_dtype):
    """The server's cache for quantized models (--kv-cache-dtype): float32 queries, 16-bit
    keys and values; equal to the PyTorch path on the widened cache up to float32 rounding."""
    needs_kernel()
    lengths = [random.Random(i).randint(1, 200) for i in range(12)]
    q, cache, meta = random_decodes(lengths, 9, 3, 64, 16, torch.float32, seed=5)
    cache = cache.to(cache_dtype)
    got = kernel(q, cache, meta, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, eager_decode(q, cache.float(), meta, 0.125), rtol=1e-5, atol=1e-6)


def test_kernel_refuses_what_would_read_outside_the_cache():
    needs_kernel()
    q, cache, meta = random_decodes([5, 20], 4, 2, 8, 4, torch.float32, seed=0)
    bad_table = meta.block_table.clone()
    bad_table[1, 0] = cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.paged_attention(q, cache, bad_table, meta.seq_lens, meta.query_start, 1.0)
    with pytest.raises(RuntimeError, match="sequence length out of range"):
        cpu_kernels.paged_attention(q, cache, meta.block_table, meta.seq_lens * 100, meta.query_start, 1.0)
    with pytest.raises(RuntimeError, match="query_start"):
        cpu_kernels.paged_attention(q, cache, meta.block_table, meta.seq_lens, meta.query_start + 1, 1.0)
    with pytest.raises(RuntimeError, match="must have q.s dtype"):
        cpu_kernels.paged_attention(q.half(), cache, meta.block_table, meta.seq_lens, meta.query_start, 1.0)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_and_silu_and_mul_equal_the_pytorch_layers(rows):
    from transformers.activations import ACT2FN

    needs_kernel()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen) * 3
    weight = torch.randn(96, generator=gen) * 0.5 + 1
    gate_up = torch.randn(rows, 2 * 80, generator=gen) * 4
    for dtype in (torch.float32, torch.bfloat16):
        # A few ulps: our exp (vec8.h's, the same in every ISA build) is not torch's.
        tol = 8 * torch.finfo(dtype).eps
        xd, wd, gd = x.to(dtype), weight.to(dtype), gate_up.to(dtype)
        got = cpu_kernels.rms_norm(xd, wd, 1e-6)
        expected = wd * torch.nn.functional.rms_norm(xd, (96,), eps=1e-6)  # transformers' Llama rounding
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
        gate, up = gd.split(80, dim=-1)
        got = cpu_kernels.silu_and_mul(gd)
        torch.testing.assert_close(got.float(), (ACT2FN["silu"](gate) * up).float(), rtol=tol, atol=tol)
    huge = torch.tensor([[-1e4, 1e4, -50.0, 0.0]])  # exp overflow territory: -0, x, ~0, 0
    out = cpu_kernels.silu_and_mul(torch.cat([huge, torch.ones_like(huge)], dim=1))
    assert torch.isfinite(out).all()
    # x * sigmoid(x) within an ulp or two of x (AVX2's expf leaves 1 ulp at 1e4), exactly 0 below.
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(out, torch.nn.functional.silu(huge), rtol=2 * eps, atol=1e-12)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_kernels.rms_norm(x, weight[:10], 1e-6)
    with pytest.raises(RuntimeError, match="gate_up"):
        cpu_kernels.silu_and_mul(gate_up[:, :-1])


@pytest.mark.parametrize("width", [1, 7, 8, 33, 67, 49152 + 5])
def test_softmax_rows_equal_torchs_and_give_a_forbidden_token_nothing(width):
    needs_kernel()
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(4, width, generator=gen) * 6
    logits[1, 1::3] = float("-inf")  # forbidden tokens (a grammar, top-k, min_tokens)
    logits[2, 0] = 120.0  # one token far ahead: the others' exps underflow
    logits[3] = float("-inf")  # nothing allowed
    eps = torch.finfo(torch.float32).eps
    probs, logprobs = cpu_kernels.softmax_rows(logits), cpu_kernels.softmax_rows(logits, log=True)
    # Within a few dozen ulps of the float64 softmax. Not of torch's float32 one: its sums' order
    # follows the CPU's vector width, and on an AVX2 Zen 3 it strays 61 ulps from float64 at 49157
    # terms where ours (8 lanes in one order on every build, csrc/vec8.h) strays 28.
    exact = logits[:3].double()
    torch.testing.assert_close(probs[:3].double(), exact.softmax(-1), rtol=32 * eps, atol=1e-30)
    torch.testing.assert_close(logprobs[:3].double(), exact.log_softmax(-1), rtol=32 * eps, atol=32 * eps)
    forbidden = torch.isinf(logits)
    assert (probs[forbidden] == 0).all() and (logprobs[forbidden] == float("-inf")).all()  # never 1e-38
    assert torch.isfinite(logprobs[~forbidden]).all() and (probs[:3].sum(-1) - 1).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.softmax_rows(logits.double())


@pytest.mark.parametrize("width", [1, 7, 31, 255, 257, 1000, 49152 + 3])
def test_argmax_rows_is_torchs_argmax_first_index_and_nan_included(width):
    needs_kernel()
    gen = torch.Generator().manual_seed(width)
    logits = (torch.randn(8, width, generator=gen) * 4).round()  # rounded: ties everywhere
    logits[1] = float("-inf")  # nothing allowed: index 0, as torch
    logits[2, width // 2 :] = logits[2].max() + 1  # the first of a run of equal maxima, mid-row
    logits[3, -1] = float("inf")
    logits[4, width // 3] = float("nan")  # a NaN counts as the largest, as in torch
    logits[5, width // 4 :: 5] = float("nan")
    logits[6, -1] = float("nan")
    logits[7, :-1] = float("-inf")
    assert torch.equal(cpu_kernels.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(
        cpu_kernels.argmax_rows(logits[:, : max(1, width - 1)]), logits[:, : max(1, width - 1)].argmax(-1)
    )
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.argmax_rows(logits.double())


def test_draw_rows_is_the_inverse_cdf_draw_and_never_takes_a_forbidden_token():
    needs_kernel()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 49152 + 3, generator=gen) * 4
    logits[::3, ::2] = float("-inf")
    u, temperature = torch.rand(64, generator=gen), torch.rand(64, generator=gen) + 0.3
    got = cpu_kernels.draw_rows(logits, temperature, u)
    cdf = (logits / temperature[:, None]).softmax(-1).double().cumsum(-1)  # the reference, in float64
    want = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True).squeeze(1)
    assert (got == want).sum() >= 62  # float32 sums in blocks: a draw within rounding of a boundary may move
    assert not torch.isinf(logits.gather(1, got[:, None])).any()
    x = torch.full((4, 10), float("-inf"))
    x[1, 7] = 0.0
    x[2:, 3] = x[2:, 5] = 1.0
    # nothing left: -1; one token: it, whatever u; u = 0: the first with weight; u * total on a
    # boundary: past it (the first cumulative sum above u * total, as searchsorted(right=True)).
    assert cpu_kernels.draw_rows(x, torch.ones(4), torch.tensor([0.5, 0.999, 0.0, 0.5])).tolist() == [-1, 7, 3, 5]
    with pytest.raises(RuntimeError, match="temperature and u"):
        cpu_kernels.draw_rows(x, torch.ones(3), torch.zeros(4))


@pytest.mark.parametrize("kn", [True, False], ids=["kn", "nk"])
@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize(
    "shape",
    [(1, 16, 128, 512), (7, 3, 37, 21), (13, 1, 8, 5), (2, 4, 3, 1)],
    ids=["mla-decode", "tails", "whole-k", "tiny"],
)
def test_rows_matmul_is_the_product_in_float32(kn, x_dtype, w_dtype, shape):
    # DeepSeek's W_UK (kn: w (B, K, N)) and W_UV / the router (nk: w (B, N, K)); edges of rows,
    # outputs and K past whole vectors. Float32 sums: within a few float32 eps of the exact product
    # of the operands as given, whatever their dtypes.
    needs_kernel()
    T, B, K, N = shape
    gen = torch.Generator().manual_seed(T * 100 + K)
    x = torch.randn(T, B, K + 3, generator=gen).to(x_dtype)[..., 1 : K + 1]  # strided rows, contiguous k
    w = torch.randn(B, K, N, generator=gen).to(w_dtype)
    got = cpu_kernels.rows_matmul(x, w if kn else w.transpose(1, 2).contiguous(), kn)
    want = torch.einsum("tbk,bkn->tbn", x.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (T, B, N)
    bound = (x.double().abs().unsqueeze(-1) * w.double().abs().unsqueeze(0)).sum(-2)  # sum |x w|
    assert ((got.double() - want).abs() <= 4 * K * torch.finfo(torch.float32).eps * bound + 1e-30).all()
    if B == 1:  # 2-D: x (T, K) by w (K, N) / (N, K)
        flat = cpu_kernels.rows_matmul(x[:, 0], w[0] if kn else w[0].T.contiguous(), kn)
        assert torch.equal(flat, got[:, 0])


def test_sigmoid_is_torchs_to_float32_rounding():
    needs_kernel()
    x = torch.cat([torch.linspace(-100, 100, 20001), torch.tensor([0.0, -0.0, 1e-30, -88.0, 88.0, 104.0])])
    got, want = cpu_kernels.sigmoid(x), torch.sigmoid(x.double())
    assert ((got.double() - want).abs() <= 4 * torch.finfo(torch.float32).eps * want + 1e-37).all()
    strided = x[:20000].view(8, -1)[:, 3:11]
    assert torch.equal(cpu_kernels.sigmoid(strided), cpu_kernels.sigmoid(strided.contiguous()))


def test_the_kernels_can_be_switched_off():
    code = "from models.layers import cpu_kernels; print(cpu_kernels.available())"
    env = {**os.environ, "PAGEDSERVE_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_rope_kernel_equals_the_pytorch_rotation_in_float32():
    from models.layers.rope import RotaryEmbedding
    from transformers import LlamaConfig

    needs_kernel()
    rope = RotaryEmbedding(LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=64), 64)
    positions = torch.tensor([0, 5, 63, 17])
    cos, sin = rope.cos_sin(positions, torch.float32)
    qkv = torch.randn(4, 7, 64, generator=torch.Generator().manual_seed(0))
    qk = qkv[:, :5]  # a strided view, as the attention hands it over
    expected = qk * cos + qk.roll(32, dims=-1) * sin
    got = cpu_kernels.rope_neox(qk, cos, sin)
    torch.testing.assert_close(got, expected, rtol=2 * torch.finfo(torch.float32).eps, atol=1e-6)
    torch.testing.assert_close(rope.rotate(qk, cos, sin), expected, rtol=2 * torch.finfo(torch.float32).eps, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_kernel_and_eager_store_the_block_major_layout(cache_dtype):
    """Both writers put token t's key of KV head h at block s // 4, k, h, offset s % 4 (its value
    under v): a cache one of them wrote reads the same through the other path."""
    from models.layers.attention import store_kv

    needs_kernel()
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(6, 4, 2, 3, 8, dtype=cache_dtype)  # (num_blocks, block_size, 2, Hk, D)
    expected, eager = cache.clone(), cache.clone()
    kv = torch.randn(5, 2, 3, 8, generator=gen)
    k, v = kv[:, 0], kv[:, 1]  # strided views
    slots = torch.tensor([3, 0, 22, 9, 17])
    blocks = expected.view(6, 2, 3, 4, 8)  # (num_blocks, k or v, Hk, block_size, D)
    for t, slot in enumerate(slots.tolist()):
        blocks[slot // 4, 0, :, slot % 4] = k[t].to(cache_dtype)
        blocks[slot // 4, 1, :, slot % 4] = v[t].to(cache_dtype)
    cpu_kernels.write_kv_blocks(cache, k, v, slots)
    store_kv(eager, k, v, slots)
    assert torch.equal(cache, expected)
    assert torch.equal(eager, expected)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.write_kv_blocks(cache, k, v, torch.tensor([0, 1, 2, 3, 24]))


def _load_in_subprocess(extensions_dir, env_overrides, prelude=""):
    code = prelude + (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from models.layers import cpu_kernels; print('AVAILABLE', cpu_kernels.available())\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir), **env_overrides}
    env.pop("PAGEDSERVE_CPU_KERNELS", None)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )


@pytest.fixture
def prebuilt_extensions(tmp_path):
    """A copy of the build this process loaded, in an extensions directory of its own (as the image has)."""
    needs_kernel()
    name = cpu_kernels.build_name(cpu_kernels.loaded_target())
    built = cpu_kernels.build_directory(cpu_kernels.loaded_target())
    if not (built / f"{name}.so").exists():
        pytest.skip("no build in the default extensions directory")
    shutil.copytree(built, tmp_path / name)
    return tmp_path


def test_a_prebuilt_build_loads_without_a_compiler_and_without_torchs_compiler_warning(prebuilt_extensions):
    # The runtime image has no compiler: torch's builder would print "Your compiler (c++) is not
    # compatible..." on every start, only to find the build current.
    venv_bin = os.path.dirname(sys.executable)
    out = _load_in_subprocess(prebuilt_extensions, {"PATH": venv_bin, "CXX": "pagedserve-no-such-compiler"})
    assert out.returncode == 0, out.stderr
    assert "AVAILABLE True" in out.stdout, out.stderr
    assert "CPU kernels in use" in out.stderr and "prebuilt" in out.stderr
    assert "is not compatible" not in out.stderr + out.stdout and "WARNING !!" not in out.stderr + out.stdout


def test_a_prebuilt_build_loads_from_a_read_only_directory(prebuilt_extensions):
    # A --read-only container: torch's builder would need to write its lock file and build.ninja.
    # (Root ignores file modes, so the read-only mount is simulated where the module asks.)
    prelude = (
        "import os; _access = os.access\n"
        "os.access = lambda p, mode, **kw: False if mode & os.W_OK else _access(p, mode, **kw)\n"
    )
    name = cpu_kernels.build_name(cpu_kernels.loaded_target())
    before = sorted(os.listdir(prebuilt_extensions / name))
    out = _load_in_subprocess(prebuilt_extensions, {}, prelude)
    assert out.returncode == 0, out.stderr
    assert "AVAILABLE True" in out.stdout and "prebuilt" in out.stderr, out.stderr
    assert sorted(os.listdir(prebuilt_extensions)) == [name]
    assert sorted(os.listdir(prebuilt_extensions / name)) == before  # nothing written


def test_a_stale_prebuilt_build_is_not_loaded_without_the_builder(prebuilt_extensions, monkeypatch):
    target = cpu_kernels.loaded_target()
    library = prebuilt_extensions / cpu_kernels.build_name(target) / f"{cpu_kernels.build_name(target)}.so"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(prebuilt_extensions))
    assert cpu_kernels._current_library(target) == library
    os.utime(library, (0, 0))  # older than the sources
    assert cpu_kernels._current_library(target) is None


def test_a_build_killed_part_way_leaves_no_lock_that_stops_the_next(tmp_path):
    # A builder holds the lock and has made torch's lock file, as torch's builder does; killed
    # there, it frees the lock, and the next builder removes the file torch would wait on forever.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, pathlib\n"
            "from models.layers import cpu_kernels\n"
            "with cpu_kernels.build_lock(pathlib.Path(sys.argv[1])):\n"
            "    (pathlib.Path(sys.argv[1]) / 'lock').touch()\n"
            "    print('held', flush=True)\n"
            "    time.sleep(600)\n",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    try:
        assert holder.stdout.readline() == "held\n"
        entered = threading.Event()
        waiter = threading.Thread(target=lambda: _enter_build_lock(tmp_path, entered), daemon=True)
        waiter.start()
        assert not entered.wait(1.0), "two builders held the lock at once"
        assert (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    assert entered.wait(30), "the lock of a killed builder was not freed"
    waiter.join(30)
    assert not (tmp_path / "lock").exists()


def _enter_build_lock(directory, entered):
    with cpu_kernels.build_lock(directory):
        assert not (directory / "lock").exists()
        entered.set()


def test_a_rows_norm_activation_and_rotation_do_not_depend_on_its_batch_address_or_threads():
    # Each kernel splits rows across threads and reduces a row in one order: the same bits for a
    # row alone, in a batch, starting at any address (a vectorizer that peeled for alignment
    # would change the order), on 1 or 2 threads.
    needs_kernel()
    gen = torch.Generator().manual_seed(2)
    width = 67  # rows of 268 bytes: every alignment mod 64 occurs
    x, gate_up = torch.randn(300, width, generator=gen) * 3, torch.randn(300, 2 * width, generator=gen) * 4
    weight = torch.randn(width, generator=gen)
    qk, cos, sin = (
        torch.randn(300, 5, 20, generator=gen),
        torch.randn(300, 1, 20, generator=gen),
        torch.randn(300, 1, 20, generator=gen),
    )
    logits = torch.randn(300, 1003, generator=gen) * 5
    heads, w_kn, w_nk = (
        torch.randn(300, 5, 20, generator=gen),
        torch.randn(5, 20, 37, generator=gen),
        torch.randn(5, 37, 20, generator=gen),
    )
    router = torch.randn(13, width, generator=gen).bfloat16()
    ops = {
        "rms_norm": lambda rows: cpu_kernels.rms_norm(x[rows], weight, 1e-6),
        "silu_and_mul": lambda rows: cpu_kernels.silu_and_mul(gate_up[rows]),
        "rope_neox": lambda rows: cpu_kernels.rope_neox(qk[rows], cos[rows], sin[rows]),
        "softmax_rows": lambda rows: cpu_kernels.softmax_rows(logits[rows]),
        "softmax_rows log": lambda rows: cpu_kernels.softmax_rows(logits[rows], log=True),
        "argmax_rows": lambda rows: cpu_kernels.argmax_rows(logits[rows]),
        "sigmoid": lambda rows: cpu_kernels.sigmoid(logits[rows]),
        "rows_matmul kn": lambda rows: cpu_kernels.rows_matmul(heads[rows], w_kn, True),
        "rows_matmul nk": lambda rows: cpu_kernels.rows_matmul(heads[rows], w_nk, False),
        "rows_matmul 2-D, bf16 weights": lambda rows: cpu_kernels.rows_matmul(x[rows], router, False),
        "draw_rows": lambda rows: cpu_kernels.draw_rows(
            logits[rows], (logits[rows, 0].abs() + 0.5), logits[rows, 1].sigmoid()
        ),
    }
    before = torch.get_num_threads()
    try:
        for name, op in ops.items():
            torch.set_num_threads(1)
            batch = op(slice(0, 300))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(op(slice(0, 300)), batch), name
                for r in (0, 1, 2, 3, 150, 299):
                    assert torch.equal(op(slice(r, r + 1))[0], batch[r]), (name, r, threads)  # a view: any address
    finally:
        torch.set_num_threads(before)


def test_every_kernel_source_and_header_ships_and_counts_for_staleness():
    # The image builds the kernels from the installed package: a header left out of package-data
    # fails that build; a header left out of _HEADERS leaves a stale prebuilt library "current".
    import re
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["models"]
    shipped = {path for pattern in patterns for path in (repo / "models").glob(pattern)}
    csrc = repo / "models" / "layers" / "csrc"
    assert set(csrc.iterdir()) <= shipped
    included = {
        csrc / name for source in cpu_kernels._SOURCES for name in re.findall(r'#include "([^"]+)"', source.read_text())
    }
    assert included and included == set(cpu_kernels._HEADERS)
    assert set(cpu_kernels._SOURCES) | set(cpu_kernels._HEADERS) == set(csrc.iterdir())
