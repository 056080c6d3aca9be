"""Tensor parallelism at the model level: TP=2 over gloo (two processes) gives the bits of the
same split computed in one process (two ranks as threads adding in rank order), and TP=1's
logits to float32 rounding; for split and replicated KV heads, tied embeddings, int8/int4
and GGUF Q4_0/Q8_0 weights. Shapes that N does not divide are refused by name.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType as Q

from models.layers.parallel import Communicator, DistCommunicator, ShmCommunicator, TensorParallel
from models.loader import load_model
from tests.models.conftest import make_hf_model, paged_forward, save_checkpoint

BLOCK_SIZE = 4
# Two prompts prefilled together, then a step of one decode each: cached keys, ragged lengths.
STEPS = [
    [(0, 0, [5, 17, 33, 2, 91, 14, 7]), (1, 0, [44, 12, 3])],
    [(0, 7, [120]), (1, 3, [250])],
]
TABLES = [[3, 0, 5], [1, 4]]


class ThreadCommunicator(Communicator):
    """N ranks as threads of one process: all-reduce adds the ranks' tensors in rank order
    (for two ranks, the bits any all-reduce gives: a + b == b + a)."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=60)
        self.local = threading.local()

    def for_rank(self, rank: int) -> ThreadCommunicator:
        self.local.rank = rank
        return self

    def all_reduce(self, x):
        rank = self.local.rank
        self.slots[rank] = x.clone()
        self.barrier.wait()
        total = self.slots[0].clone()
        for part in self.slots[1:]:
            total += part
        self.barrier.wait()
        x.copy_(total)
        return x

    def gather(self, x):
        rank = self.local.rank
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = [p.clone() for p in self.slots] if rank == 0 else None
        self.barrier.wait()
        return parts


def run_steps(model_path: str, tp: TensorParallel | None, quantization: str) -> list[torch.Tensor]:
    """Rank 0's logits of each step, then the bytes of this rank's weights and KV cache."""
    loaded = load_model(model_path, dtype="float32", quantization=quantization, tensor_parallel=tp)
    model = loaded.model
    caches = model.kv_cache_spec(torch.float32).allocate(8, BLOCK_SIZE, "cpu")
    logits = [torch.cat(paged_forward(model, caches, step, TABLES, BLOCK_SIZE)) for step in STEPS]
    return logits + [torch.tensor([loaded.weight_bytes, sum(c.numel() for c in caches)])]


def in_threads(model_path: str, quantization: str, size: int = 2) -> list[torch.Tensor]:
    """Every rank's split in one process; rank 0's logits."""
    comm, results, errors = ThreadCommunicator(size), {}, []

    def rank_main(rank: int):
        try:
            comm.for_rank(rank)
            results[rank] = run_steps(model_path, TensorParallel(rank, size, comm), quantization)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            comm.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # as each gloo rank runs: dense GEMMs round by thread count
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(saved)
    if errors:
        raise errors[0]
    return results[0]


def _gloo_rank(rank: int, port: int, cases: list[tuple[str, str]], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        tp = TensorParallel(rank, 2, DistCommunicator())
        results = [run_steps(path, tp, quantization) for path, quantization in cases]
        shm_results = []
        if ShmCommunicator.supported():  # the same ranks through shared memory (small slots: pieces)
            shm = f"/dev/shm/pagedserve-test-{port}"
            if rank == 0:
                ShmCommunicator(0, 2, shm, capacity=256, create=True)
            dist.barrier()
            tp = TensorParallel(rank, 2, ShmCommunicator(rank, 2, shm, capacity=256, create=False))
            dist.barrier()
            if rank == 0:
                os.unlink(shm)
            shm_results = [run_steps(path, tp, quantization) for path, quantization in cases]
        if rank == 0:
            torch.save((results, shm_results), out)
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_gguf_of(path: Path, qtype, **overrides) -> Path:
    """test_gguf's tiny Llama, written as llama.cpp does, with an even vocabulary (266)."""
    from tests.models.test_gguf import TOKENS, tiny_llama, write_gguf

    write_gguf(path, tiny_llama(vocab_size=len(TOKENS) + 1, **overrides), qtype)
    return path


def deepseek_v3_checkpoint(path: Path) -> Path:
    """test_deepseek's tiny V3 (MLA with a q LoRA, 8 routed experts + 1 shared, one dense layer)."""
    from tests.models.test_deepseek import _COMMON, CASES, _randomize

    config_cls, model_cls, extra = CASES["v3-q-lora"]
    config = config_cls(**_COMMON, **extra)
    config._attn_implementation = "eager"
    hf = model_cls(config).eval()
    _randomize(hf, seed=1)
    return save_checkpoint(hf, path)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (model path, --quantization)."""
    root = tmp_path_factory.mktemp("tp")
    quantizable = dict(intermediate_size=128)  # down_proj: 64 inputs a rank, two groups of 32
    split = save_checkpoint(make_hf_model("llama", **quantizable), root / "split-kv")
    out = {
        "split kv heads, dense": (str(split), "none"),
        "replicated kv head, dense": (
            str(save_checkpoint(make_hf_model("llama", num_key_value_heads=1), root / "one-kv")),
            "none",
        ),
        "tied embeddings, qwen3": (
            str(save_checkpoint(make_hf_model("qwen3", tie_word_embeddings=True, head_dim=16), root / "qwen3")),
            "none",
        ),
        "deepseek v3, MLA + MoE": (str(deepseek_v3_checkpoint(root / "deepseek")), "none"),
        "int8": (str(split), "int8"),
        "int4": (str(split), "int4"),
    }
    for qtype in (Q.Q4_0, Q.Q8_0):
        path = write_gguf_of(root / f"m-{qtype.name}.gguf", qtype, **quantizable)
        out[f"gguf {qtype.name}"] = (str(path), "auto")
    return out


@pytest.fixture(scope="module")
def gloo_results(cases, tmp_path_factory) -> dict[str, list[torch.Tensor]]:
    out = tmp_path_factory.mktemp("gloo") / "logits.pt"
    mp.start_processes(_gloo_rank, args=(free_port(), list(cases.values()), str(out)), nprocs=2, start_method="spawn")
    results, shm_results = torch.load(out)
    if shm_results:
        for case, gloo, shm in zip(cases, results, shm_results):
            for step, (a, b) in enumerate(zip(gloo, shm, strict=True)):
                assert torch.equal(a, b), f"{case}, step {step}: shared-memory collectives differ from gloo's"
    return dict(zip(cases, results))


# Dense: float32 rounding of the row-parallel sums. Quantized: the kernel rounds activations to
# int16 per 32 values, and a one-ulp difference in a layer's input can move one of those
# roundings: a step of 2^-15 of its group's largest value (8 steps' worth allowed).
TOLERANCE = {"none": 1e-5, "int8": 8 * 2**-15, "int4": 8 * 2**-15, "auto": 8 * 2**-15}
CASES = [
    "split kv heads, dense",
    "replicated kv head, dense",
    "tied embeddings, qwen3",
    "deepseek v3, MLA + MoE",
    "int8",
    "int4",
    "gguf Q4_0",
    "gguf Q8_0",
]


@pytest.mark.parametrize("case", CASES)
def test_tp2_over_gloo_is_the_one_process_split_bitwise_and_close_to_tp1(case, cases, gloo_results):
    path, quantization = cases[case]
    threads = in_threads(path, quantization)
    single = run_steps(path, None, quantization)
    (weights, cache), (weights_tp1, cache_tp1) = gloo_results[case].pop().tolist(), single.pop().tolist()
    threads.pop()
    assert weights < 0.75 * weights_tp1, "rank 0 should hold about half of the weights"
    # Each rank caches its KV heads: half of them, or a replicated one; MLA's latent: all of it.
    expected_cache = {"replicated kv head, dense": cache_tp1, "deepseek v3, MLA + MoE": cache_tp1}
    assert cache == expected_cache.get(case, cache_tp1 // 2)
    for step, (gloo, local, one) in enumerate(zip(gloo_results[case], threads, single, strict=True)):
        assert gloo.shape == one.shape
        assert torch.equal(gloo, local), f"step {step}: gloo differs from the same split in one process"
        scale = one.abs().max().item()
        diff = (gloo - one).abs().max().item()
        assert diff <= TOLERANCE[quantization] * max(scale, 1.0), (
            f"step {step}: TP=2 vs TP=1 max diff {diff:.2e} (scale {scale:.2f})"
        )


def test_shapes_that_tp_does_not_divide_are_refused_by_name(tmp_path):
    comm = ThreadCommunicator(2)
    three = TensorParallel(0, 3, comm)
    path = save_checkpoint(make_hf_model("llama", num_attention_heads=4, num_key_value_heads=2), tmp_path / "a")
    with pytest.raises(ValueError, match=r"tensor parallel size 3 does not divide num_attention_heads \(4\)"):
        load_model(str(path), dtype="float32", tensor_parallel=three)
    heads = save_checkpoint(
        make_hf_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16),
        tmp_path / "b",
    )
    with pytest.raises(ValueError, match=r"tensor parallel size 2 does not divide num_key_value_heads \(3\)"):
        load_model(str(heads), dtype="float32", tensor_parallel=TensorParallel(0, 2, comm))
    inter = save_checkpoint(make_hf_model("llama", intermediate_size=90), tmp_path / "c")
    with pytest.raises(ValueError, match=r"tensor parallel size 4 does not divide intermediate_size \(90\)"):
        load_model(str(inter), dtype="float32", tensor_parallel=TensorParallel(0, 4, comm))


def test_a_row_split_inside_a_quantization_group_is_refused(tmp_path):
    # intermediate 96: down_proj's 96 inputs split in two cut a group of 32 of the Q8_0 blocks.
    path = write_gguf_of(tmp_path / "m.gguf", Q.Q8_0, intermediate_size=96)
    with pytest.raises(
        ValueError,
        match=r"down_proj.weight'.*split of its 96 inputs at 0\.\.48 cuts its "
        r"quantization groups of 32",
    ):
        load_model(str(path), dtype="float32", tensor_parallel=TensorParallel(0, 2, ThreadCommunicator(2)))


def test_models_generate_takes_tensor_parallel_size(cases):
    import json
    import subprocess
    import sys

    def run(*extra: str) -> list[dict]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "models.generate",
                "--model",
                cases["split kv heads, dense"][0],
                "--prompt",
                "Hello",
                "--prompt",
                "Paged attention",
                "--max-tokens",
                "8",
                "--dtype",
                "float32",
                "--ignore-eos",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    one = run()
    assert len(one) == 2 and all(len(r["token_ids"]) == 8 for r in one)
    assert run("--tensor-parallel-size", "2") == one


@pytest.mark.skipif(not ShmCommunicator.supported(), reason="shared-memory collectives: x86 Linux only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shared_memory_collectives_add_in_float32_in_rank_order_any_layout(dtype, tmp_path):
    """Two ranks as threads over one file, slots smaller than the tensors (pieces): every rank
    gets (a + b) in float32 rounded to the dtype; non-contiguous tensors in place; gather exact."""
    path = str(tmp_path / "shm")
    comms = [ShmCommunicator(r, 2, path, capacity=100, create=r == 0) for r in range(2)]
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(24, 17, generator=gen).to(dtype).t() for _ in range(2)]  # (17, 24), not contiguous
    expected = (tensors[0].float() + tensors[1].float()).to(dtype)
    reduced, gathered = {}, {}

    def rank(r: int):
        x = tensors[r].clone().t().contiguous().t()  # the same layout: a transposed view
        reduced[r] = comms[r].all_reduce(x)
        gathered[r] = comms[r].gather(tensors[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(torch.equal(reduced[r], expected) for r in range(2))
    assert not reduced[0].is_contiguous(), "reduced in place, in the caller's layout"
    assert gathered[1] is None and all(torch.equal(g, t) for g, t in zip(gathered[0], tensors))
