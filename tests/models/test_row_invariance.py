"""A token comes out the same bits however it is scheduled: in a fresh prompt, in a
chunk after cached tokens (what a prefix-cache hit makes of a prompt), as a decode, among other
sequences' prompts and decodes (up to 256 rows in its step), on 1 thread or 2, with a float32 or
float16 or bfloat16 cache. Attention is held to it directly; whole logits where every linear layer computes
a row alone (a test method here; the quantized kernel once it is row-invariant)."""

from __future__ import annotations

import pytest
import torch

from models.layers import cpu_kernels
from models.layers.attention import AttentionMetadata, KVCacheSpec, paged_attention, write_kv
from models.layers.linear import Linear
from models.layers.quantization import DenseMethod
from tests.models.conftest import paged_forward, shuffled_block_tables

SEQ_LEN = 150  # more than one of the kernel's 128-key softmax blocks
BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def kernels_and_threads():
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable: the eager paths make no such promise")
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _runs(start: int, n: int) -> list[int]:
    """Where each step of 2, 3, .., 9, 2, .. rows from `start` begins, up to n."""
    starts, step = [], 0
    while start < n:
        starts.append(start)
        start += 2 + step % 8
        step += 1
    return starts


def schedules(n: int) -> dict[str, list[list[tuple[int, int, int]]]]:
    """Ways sequence 0 (n tokens) goes through the engine: steps of (sequence, start, count);
    sequences 1.. are neighbours, their contexts filled by earlier steps."""
    neighbours = [(i, 0, 20 + i % 50) for i in range(1, 200)]
    return {
        "prompt": [[(0, 0, n)]],
        "cached prefix, then the rest as a chunk": [
            [(0, 0, 6 * BLOCK_SIZE)],
            [(0, 6 * BLOCK_SIZE, n - 6 * BLOCK_SIZE)],
        ],
        "decodes": [[(0, t, 1)] for t in range(n)],
        # speculative verification: a token and its drafts, 2-9 rows a step (paged_attention cuts a step
        # of few sequences into pieces of a head's query vectors, to keep both threads busy)
        "a prompt, then steps of 2-9 rows": [[(0, 0, 40)]]
        + [[(0, start, min(2 + step % 8, n - start))] for step, start in enumerate(_runs(40, n))],
        "prompt among a decode, a prompt and a chunk": [
            [(1, 0, 30), (3, 0, 50)],
            [(1, 30, 1), (0, 0, n), (2, 0, 20), (3, 50, 7)],
        ],
        "last token among 255 other rows": [
            neighbours[:100],
            neighbours[100:] + [(200, 0, 40)],
            [(0, 0, n - 1)],
            [(i, c, 1) for i, _, c in neighbours] + [(200, 40, 56), (0, n - 1, 1)],
        ],
    }


def schedule_block_tables(schedule, seed: int) -> tuple[dict[int, list[int]], int]:
    """Shuffled block tables for every sequence a schedule of (sequence, start, count) steps
    touches, each long enough for its last token: ({sequence: table}, blocks in the cache)."""
    lengths: dict[int, int] = {}
    for step in schedule:
        for i, start, count in step:
            lengths[i] = max(lengths.get(i, 0), start + count)
    ids = sorted(lengths)
    tables, num_blocks = shuffled_block_tables([lengths[i] for i in ids], BLOCK_SIZE, seed=seed)
    return dict(zip(ids, tables)), num_blocks


class Sequences:
    """Random queries, keys and values per token of each sequence, and a fresh paged cache for
    each run, its blocks shuffled differently every time."""

    def __init__(self, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, latent_values=0):
        self.shape, self.dtype, self.cache_dtype = (num_heads, num_kv_heads, head_dim), dtype, cache_dtype
        self.latent_values = latent_values  # > 0: an MLA cache, values = the first latent_values of an entry
        self.gen = torch.Generator().manual_seed(0)
        self.data: dict[int, tuple[torch.Tensor, ...]] = {}

    def tokens(self, i: int, start: int, count: int) -> tuple[torch.Tensor, ...]:
        if i not in self.data:
            n, (h, hk, d) = 512, self.shape
            self.data[i] = tuple(torch.randn(n, heads, d, generator=self.gen).to(self.dtype) for heads in (h, hk, hk))
        return tuple(x[start : start + count] for x in self.data[i])

    def run(self, schedule, seed: int) -> torch.Tensor:
        """Sequence 0's attention output for each of its tokens, (n, H, Dv)."""
        tables, num_blocks = schedule_block_tables(schedule, seed)
        h, hk, d = self.shape
        entry = (d,) if self.latent_values else (2, hk, d)
        cache = KVCacheSpec(1, entry, self.cache_dtype).allocate(num_blocks, BLOCK_SIZE, "cpu")[0]
        length = max(start + count for step in schedule for i, start, count in step if i == 0)
        out = torch.full((length, h, self.latent_values or d), float("nan"), dtype=self.dtype)
        for step in schedule:
            meta = AttentionMetadata.build(
                [c for _, _, c in step], [s + c for _, s, c in step], [tables[i] for i, _, _ in step], BLOCK_SIZE
            )
            q, k, v = (torch.cat(x) for x in zip(*(self.tokens(*chunk) for chunk in step)))
            if self.latent_values:  # MLA: one latent "head" per token, written token-major
                write_kv(cache, k[:, 0], meta.slot_mapping)
                rows = cpu_kernels.paged_attention(
                    q, cache, meta.block_table, meta.seq_lens, meta.query_start, d**-0.5, self.latent_values
                )
            else:
                rows = paged_attention(q, k, v, cache, meta, d**-0.5)
            for (i, start, count), o in zip(step, rows.split([c for _, _, c in step])):
                if i == 0:
                    out[start : start + count] = o
        return out


def assert_same_everywhere(seqs: Sequences) -> torch.Tensor:
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for seed, (name, schedule) in enumerate(schedules(SEQ_LEN).items()):
            results[f"{name}, {threads} thread(s)"] = seqs.run(schedule, seed)
    (first, reference), *others = results.items()
    assert not reference.isnan().any()
    for name, out in others:
        differ = (out != reference).flatten(1).any(1).nonzero().flatten().tolist()
        assert not differ, f"{name}: tokens {differ[:10]} differ from {first}"
    return reference


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 20), (8, 1, 8)])
def test_attention_of_a_token_is_the_same_however_it_is_scheduled(
    num_heads, num_kv_heads, head_dim, dtype, cache_dtype
):
    assert_same_everywhere(Sequences(num_heads, num_kv_heads, head_dim, dtype, cache_dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_mla_attention_of_a_token_is_the_same_however_it_is_scheduled_and_equals_the_reference(cache_dtype):
    # DeepSeek's absorbed form: one latent of L + R = 40 numbers per token for all 4 heads,
    # values its first L = 32.
    seqs = Sequences(4, 1, 40, torch.float32, cache_dtype, latent_values=32)
    got = assert_same_everywhere(seqs)
    q, latent, _ = seqs.tokens(0, 0, SEQ_LEN)
    entries = latent[:, 0].to(cache_dtype).double()  # (n, 40)
    scores = torch.einsum("thd,sd->hts", q.double(), entries) * 40**-0.5
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
    expected = torch.einsum("hts,sl->thl", scores.masked_fill(~causal, float("-inf")).softmax(-1), entries[:, :32])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


class RowByRow(DenseMethod):
    """A dense method that multiplies each row alone, each output a sum along K (split over outputs,
    never over a sum, whatever the threads: MKL's single-row product is not, for some N on AVX-512
    Xeons): the row-invariant linear layers the rest of the forward pass is tested under."""

    row_invariant = True  # CausalLM.row_invariant: so the engine's thread tuner may vary the count

    def apply(self, layer, x, bias, kernels):
        out = torch.stack([(layer.weight * x[i]).sum(-1) for i in range(x.shape[0])])
        return out if bias is None else out + bias


def logits_per_schedule(model, cache_dtype) -> dict[str, torch.Tensor]:
    """Sequence 0's logits (n, vocab) for every schedule and thread count."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.hf_config.vocab_size
    token_ids = {i: torch.randint(3, vocab, (512,), generator=gen).tolist() for i in range(201)}
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for seed, (name, schedule) in enumerate(schedules(SEQ_LEN).items()):
            by_sequence, num_blocks = schedule_block_tables(schedule, seed)
            tables = [by_sequence.get(i, []) for i in range(max(by_sequence) + 1)]
            caches = model.kv_cache_spec(cache_dtype).allocate(num_blocks, BLOCK_SIZE, "cpu")
            out = torch.empty(SEQ_LEN, vocab)
            for step in schedule:
                chunks = [(i, start, token_ids[i][start : start + count]) for i, start, count in step]
                for (i, start, count), logits in zip(step, paged_forward(model, caches, chunks, tables, BLOCK_SIZE)):
                    if i == 0:
                        out[start : start + count] = logits
            results[f"{name}, {threads} thread(s)"] = out
    return results


def assert_all_equal(results: dict[str, torch.Tensor]) -> None:
    (first, reference), *others = results.items()
    for name, out in others:
        differ = (out != reference).any(1).nonzero().flatten().tolist()
        assert not differ, f"{name}: logits of tokens {differ[:10]} differ from {first}"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_logits_of_a_token_are_the_same_however_it_is_scheduled_when_every_linear_layer_is(
    make_checkpoint, cache_dtype
):
    from models.loader import load_model

    path, _ = make_checkpoint("llama", max_position_embeddings=512)
    model = row_by_row(load_model(path, dtype="float32")).model
    assert_all_equal(logits_per_schedule(model, cache_dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_dense_logits_are_the_same_however_a_token_is_scheduled_and_match_transformers(
    make_checkpoint, dtype
):
    # `--batch-invariant`: the dense layers on RowsDenseMethod (csrc/rows_matmul.cpp), a dense model's
    # logits as row-invariant as a quantized one's; and the same model as transformers' within
    # float32's rounding (bf16: its own).
    from models.loader import load_model
    from tests.models.conftest import assert_logits_close

    path, hf = make_checkpoint("llama", max_position_embeddings=512)
    loaded = load_model(path, dtype=dtype, batch_invariant=True)
    assert loaded.model.row_invariant() and not loaded.is_quantized
    assert loaded.quantization.startswith("dense-batch-invariant")
    results = logits_per_schedule(loaded.model, torch.float32 if dtype == "float32" else torch.bfloat16)
    assert_all_equal(results)
    if dtype == "float32":
        gen = torch.Generator().manual_seed(1)  # logits_per_schedule's sequence 0
        ids = torch.randint(3, loaded.model.hf_config.vocab_size, (512,), generator=gen)[:SEQ_LEN]
        with torch.no_grad():
            reference = hf.float()(input_ids=ids[None]).logits[0]
        assert_logits_close(next(iter(results.values())), reference)


def test_batch_invariant_needs_the_cpu_kernels(make_checkpoint, monkeypatch):
    from models.loader import load_model

    path, _ = make_checkpoint("llama")
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    with pytest.raises(ValueError, match="--batch-invariant needs"):
        load_model(path, dtype="float32", batch_invariant=True)


def row_by_row(loaded):
    """`loaded` with every linear layer (embedding included) on RowByRow; returned."""
    assert not loaded.model.row_invariant()  # dense: torch's GEMMs
    method = RowByRow()
    for module in loaded.model.modules():
        if isinstance(module, Linear):
            module.quant_method = method
    assert loaded.model.row_invariant()
    return loaded


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_logits_of_a_quantized_model_are_the_same_however_a_token_is_scheduled(make_checkpoint, quantization):
    from models.loader import load_model

    path, _ = make_checkpoint("llama", max_position_embeddings=512)
    loaded = load_model(path, dtype="float32", quantization=quantization)
    assert loaded.model.row_invariant()
    assert_all_equal(logits_per_schedule(loaded.model, torch.float16))


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_logits_of_a_5_bit_gguf_are_the_same_however_a_token_is_scheduled(tmp_path, qtype):
    # int5 as stored (Q5_0's -16 folded into the integer sums, Q5_1's mins), every layer on `tile`
    from gguf import GGMLQuantizationType

    from models.loader import load_model
    from tests.models.test_gguf import tiny_llama, write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_llama(max_position_embeddings=512), GGMLQuantizationType[qtype])
    loaded = load_model(str(path), dtype="float32")
    assert {m.quant_method.name for m in loaded.model.modules() if isinstance(m, Linear)} == {"int5"}
    assert loaded.model.row_invariant()
    assert_all_equal(logits_per_schedule(loaded.model, torch.float16))


@pytest.mark.parametrize("case", ["v2-group-limited-q-lora-yarn", "v3-q-lora"])
def test_logits_of_a_quantized_deepseek_are_the_same_however_a_token_is_scheduled(tmp_path, case):
    # MLA's absorbed products (W_UK, W_UV) and the router (its logits, softmax or sigmoid scores, so
    # the experts chosen and their weights) on csrc/rows_matmul.cpp and our sigmoid; torch's batched
    # matmuls and sigmoid rounded a row by the step's row count. V2: softmax routing over limited
    # groups; V3: sigmoid with a correction bias; both with shared experts and a dense first layer.
    from models.loader import load_model
    from tests.models.test_deepseek import save_quantizable_deepseek

    path = save_quantizable_deepseek(case, tmp_path / case, max_position_embeddings=512)
    loaded = load_model(str(path), dtype="float32", quantization="int8")
    assert loaded.model.row_invariant()
    assert_all_equal(logits_per_schedule(loaded.model, torch.float16))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logits_of_a_quantized_gemma_are_the_same_however_a_token_is_scheduled(make_checkpoint, arch):
    """Sliding-window layers (window 8 over 150 tokens) beside global ones, Gemma 2's soft-capped scores."""
    from models.loader import load_model

    extra = (
        {"attn_logit_softcapping": 3.0}
        if arch == "gemma2"
        else {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}
    )
    path, _ = make_checkpoint(
        arch,
        max_position_embeddings=512,
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        **extra,
    )
    loaded = load_model(path, dtype="float32", quantization="int8")
    assert loaded.model.row_invariant()
    assert_all_equal(logits_per_schedule(loaded.model, torch.float16))
