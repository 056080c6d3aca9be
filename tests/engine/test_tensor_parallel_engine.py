"""The engine over two tensor-parallel ranks (rank 0 here, rank 1 a spawned process, gloo):
greedy and seeded tokens equal TP=1's on tiny Llama (GQA), Qwen3 and DeepSeek V3 (MLA + MoE)
checkpoints, through prefix-cache hits and preemptions; a rank killed mid-stream ends the
stream with an error and stops the engine within seconds; shutdown leaves no child process.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import psutil
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.parallel import ParallelConfig, load_parallel
from engine.request import SamplingParams
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.models.test_tensor_parallel import deepseek_v3_checkpoint

# A pool small enough that 10 requests of up to 40 tokens preempt, prompts that share a prefix.
ENGINE = dict(block_size=4, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=48)


def requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, vocab) for _ in range(12)]
    out = []
    for i in range(10):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 14))]
        params = (
            SamplingParams(temperature=0, max_tokens=rng.randint(12, 24), ignore_eos=True)
            if i % 3
            else SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=16, ignore_eos=True)
        )
        out.append((prompt, params))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-engine")
    return {
        "llama gqa": str(save_checkpoint(make_hf_model("llama"), root / "llama")),
        "qwen3": str(save_checkpoint(make_hf_model("qwen3", head_dim=16), root / "qwen3")),
        "deepseek v3": str(deepseek_v3_checkpoint(root / "deepseek")),
    }


def generate(llm: LLM, reqs) -> list[list[int]]:
    return [r.token_ids for r in llm.generate([p for p, _ in reqs], [s for _, s in reqs])]


@pytest.mark.parametrize("arch", ["llama gqa", "qwen3", "deepseek v3"])
def test_tp2_tokens_equal_tp1_with_prefix_hits_and_preemption(arch, checkpoints):
    path = checkpoints[arch]
    one = LLM(path, dtype="float32", **ENGINE)
    reqs = requests(one.tokenizer.vocab_size)
    expected = generate(one, reqs)
    with LLM(path, dtype="float32", tensor_parallel_size=2, **ENGINE) as llm:
        got = generate(llm, reqs)
        again = generate(llm, reqs[:4])  # the same prompts again: served from the prefix cache
        stats = llm.engine.stats()
        ranks = llm.engine.ranks
    assert got == expected
    assert again == expected[:4]
    assert stats.num_preemptions > 0, "the pool was meant to run out"
    assert stats.prefix_cache_hit_rate > 0
    assert not any(p.is_alive() for p in ranks.processes), "close() stops rank 1"


def children() -> list[psutil.Process]:
    """This process's live children but multiprocessing's resource tracker (started with the first
    spawn, shared by all, lives as long as this process)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.is_running() and p.status() != "zombie" and "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_killed_rank_ends_the_stream_with_an_error_and_stops_the_engine(checkpoints):
    before = {p.pid for p in children()}
    config = EngineConfig(**ENGINE)
    loaded, config, ranks = load_parallel(
        dict(model=checkpoints["llama gqa"], dtype="float32"), config, ParallelConfig(2)
    )
    engine = AsyncEngine(loaded, config, ranks=ranks)
    worker = ranks.processes[0]

    async def stream() -> tuple[list, float]:
        outputs, killed_at = [], None
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        async for out in engine.generate([5, 6, 7, 8], params, "r1"):
            outputs.append(out)
            if len(outputs) == 3:
                worker.kill()
                killed_at = time.monotonic()
        return outputs, time.monotonic() - killed_at

    try:
        outputs, seconds = asyncio.run(asyncio.wait_for(stream(), 60))
        assert outputs[-1].finished and outputs[-1].finish_reason == "error"
        assert "tensor-parallel" in outputs[-1].error
        assert seconds < 30, f"rank 0 took {seconds:.1f} s to notice"
        print(f"\nrank 1 killed after 3 tokens: the stream ended with an error {seconds:.2f} s later")
        deadline = time.monotonic() + 10
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_running, "/health must turn 503"
    finally:
        engine.shutdown()
    assert {p.pid for p in children()} <= before, "shutdown leaves no child process"


def test_a_rank_that_dies_while_idle_stops_the_engine_and_shutdown_leaves_no_child(checkpoints):
    before = {p.pid for p in children()}
    loaded, config, ranks = load_parallel(
        dict(model=checkpoints["qwen3"], dtype="float32"), EngineConfig(**ENGINE), ParallelConfig(2)
    )
    engine = AsyncEngine(loaded, config, ranks=ranks)
    try:

        async def one() -> list[int]:
            return [
                t
                async for out in engine.generate([9, 10, 11], SamplingParams(temperature=0, max_tokens=4), "a")
                for t in out.token_ids
            ]

        assert len(asyncio.run(one())) == 4
        assert len(children()) > len(before)
        ranks.processes[0].kill()
        deadline = time.monotonic() + 10
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_running
    finally:
        engine.shutdown()
    assert {p.pid for p in children()} <= before


def test_clean_shutdown_stops_every_rank(checkpoints):
    before = {p.pid for p in children()}
    loaded, config, ranks = load_parallel(
        dict(model=checkpoints["llama gqa"], dtype="float32"), EngineConfig(**ENGINE), ParallelConfig(2)
    )
    engine = AsyncEngine(loaded, config, ranks=ranks)
    engine.shutdown()
    assert [p.exitcode for p in ranks.processes] == [0], "the stop message, not a kill"
    assert {p.pid for p in children()} <= before


def test_indivisible_heads_are_refused_before_serving(tmp_path):
    path = save_checkpoint(
        make_hf_model("llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=8),
        tmp_path / "nine-heads",
    )
    before = {p.pid for p in children()}
    with pytest.raises(ValueError, match=r"tensor parallel size 2 does not divide num_attention_heads \(9\)"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2, **ENGINE)
    assert {p.pid for p in children()} <= before


def test_smollm2_splits_over_three_ranks_not_two():
    """The real SmolLM2-135M Q4_1 GGUF: 9 query heads, 3 KV heads; N=3 answers as one rank does."""
    from models.fetch import default_model_path

    path = str(default_model_path())
    with pytest.raises(ValueError, match=r"tensor parallel size 2 does not divide num_attention_heads \(9\)"):
        LLM(path, tensor_parallel_size=2)
    one = LLM(path)
    prompt = one.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = one.generate(prompt, params)[0]
    with LLM(path, tensor_parallel_size=3) as llm:
        got = llm.generate(prompt, params)[0]
    assert "Paris" in expected.text
    assert got.token_ids == expected.token_ids


def test_a_worker_exits_when_rank_0_dies_and_no_shared_memory_is_left(checkpoints, tmp_path):
    """Rank 0's process killed with SIGKILL (no shutdown at all): its worker notices and exits."""
    import subprocess
    import sys

    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time\n"
        "from engine.config import EngineConfig\n"
        "from engine.parallel import ParallelConfig, load_parallel\n"
        "if __name__ == '__main__':  # spawned ranks import this file again\n"
        f"    load_parallel(dict(model={checkpoints['llama gqa']!r}, dtype='float32'), EngineConfig(num_kv_blocks=16),"
        " ParallelConfig(2))\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
    )
    rank0 = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2]
    )
    try:
        assert rank0.stdout.readline().strip() == "ready"
        workers = psutil.Process(rank0.pid).children()
        assert len(workers) >= 1
        assert not list(Path("/dev/shm").glob(f"pagedserve-tp-{rank0.pid}-*")), "unlinked once every rank mapped it"
        rank0.kill()
        rank0.wait(10)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, "a worker outlived rank 0"
    finally:
        if rank0.poll() is None:
            rank0.kill()
        rank0.wait(10)


def test_a_script_without_the_main_guard_fails_at_once_saying_why(checkpoints, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from engine.config import EngineConfig\n"
        "from engine.parallel import ParallelConfig, load_parallel\n"
        f"load_parallel(dict(model={checkpoints['llama gqa']!r}, dtype='float32'), EngineConfig(num_kv_blocks=16),"
        " ParallelConfig(2))\n"
    )
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode != 0 and time.monotonic() - start < 60, "not the 300 s rendezvous timeout"
    assert "exited during start-up" in out.stderr and "__main__" in out.stderr


def test_bf16_ranks_serve_through_the_shared_memory_collectives(checkpoints):
    """bf16 activations: the collectives add in float32 and round back; the tokens are close to one
    rank's, not equal (a split GEMM rounds its partial sums to bf16 where one GEMM would not)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(checkpoints["llama gqa"], dtype="bfloat16", tensor_parallel_size=2, **ENGINE) as llm:
        results = llm.generate(["Hello world", [5, 6, 7]], params)
    assert [r.error for r in results] == [None, None] and [len(r.token_ids) for r in results] == [12, 12]
