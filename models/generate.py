"""Greedy generation from the command line, all prompts as one batch through the paged cache.

    python -m models.generate --model PATH --prompt "Hello" --prompt "Hi" --max-tokens 32

Prints one JSON line per prompt: {"prompt": ..., "text": ..., "token_ids": [...]}.
A smoke test of the model layer; the engine's offline LLM class does the real serving.
With --tensor-parallel-size N, N spawned ranks (gloo) run the same loop on their parts of the
model, rank 0 choosing each token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from models.layers.attention import AttentionMetadata
from models.layers.parallel import TensorParallel
from models.layers.quantization import QUANTIZATIONS
from models.fetch import FetchError
from models.loader import DEFAULT_MODEL, LoadedModel, check_model, load_model

if TYPE_CHECKING:
    from multiprocessing.queues import Queue


@torch.inference_mode()
def generate_greedy(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_tokens: int,
    ignore_eos: bool = False,
    block_size: int = 16,
    tp: TensorParallel | None = None,
) -> list[list[int]]:
    """Greedy token ids for each prompt: one prefill of all prompts, then one decode step for all at a time.
    `tp`: the rank `loaded` was built as; rank 0 chooses the tokens, every rank gets them."""
    model, config = loaded.model, loaded.config
    device = next(model.parameters()).device
    for p in prompts:
        if not p:
            raise ValueError("empty prompt: need at least one token")
        if len(p) + max_tokens > config.max_model_len:
            raise ValueError(f"prompt of {len(p)} tokens + {max_tokens} new > max_model_len {config.max_model_len}")
    # Each prompt owns enough consecutive blocks for its prompt and all new tokens.
    block_tables: list[list[int]] = []
    num_blocks = 0
    for p in prompts:
        n = -(-(len(p) + max_tokens) // block_size)
        block_tables.append(list(range(num_blocks, num_blocks + n)))
        num_blocks += n
    kv_caches = model.kv_cache_spec(config.dtype).allocate(num_blocks, block_size, device)
    tokens = [list(p) for p in prompts]  # prompt + generated so far
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts))) if max_tokens > 0 else []
    new_ids = [list(p) for p in prompts]  # tokens each active sequence feeds this step
    while active:
        query_lens = [len(new_ids[i]) for i in active]
        seq_lens = [len(tokens[i]) for i in active]
        meta = AttentionMetadata.build(query_lens, seq_lens, [block_tables[i] for i in active], block_size, device)
        input_ids = torch.tensor([t for i in active for t in new_ids[i]], dtype=torch.int64, device=device)
        positions = torch.tensor(
            [pos for q, s in zip(query_lens, seq_lens) for pos in range(s - q, s)], dtype=torch.int64, device=device
        )
        hidden = model(input_ids, positions, kv_caches, meta)  # (num_tokens, hidden_size)
        last = torch.tensor(query_lens, device=device).cumsum(0) - 1  # each sequence's last token row
        next_ids = model.compute_logits(hidden[last]).argmax(dim=-1)  # rank 0's: the whole vocabulary
        if tp is not None and tp.size > 1 and tp.comm is not None:
            next_ids = tp.comm.broadcast(next_ids)
        still = []
        for i, t in zip(active, next_ids.tolist()):
            outputs[i].append(t)
            tokens[i].append(t)
            new_ids[i] = [t]
            if len(outputs[i]) < max_tokens and (ignore_eos or t not in config.eos_token_ids):
                still.append(i)
        active = still
    return outputs


def _encode(loaded: LoadedModel, prompt: str, chat: bool) -> list[int]:
    tok = loaded.tokenizer
    if not chat:
        return tok(prompt).input_ids  # exactly the checkpoint tokenizer's defaults (BOS etc.)
    if tok.chat_template is None:
        raise ValueError(f"{loaded.config.path} has no chat template; drop --chat")
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids  # the template already holds the special tokens


def _rank_main(rank: int, args: argparse.Namespace, port: int, out: Queue[list]) -> None:
    """One tensor-parallel rank: its part of the model, the same greedy loop as every rank (rank 0
    chooses each token and sends it), rank 0's outputs into `out` (a queue)."""
    import torch.distributed as dist

    from models.layers.parallel import DistCommunicator, TensorParallel

    size = args.tensor_parallel_size
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size, DistCommunicator())
        loaded = load_model(
            args.model, dtype=args.dtype, device=args.device, quantization=args.quantization, tensor_parallel=tp
        )
        prompts = [_encode(loaded, p, args.chat) for p in args.prompt]
        outputs = generate_greedy(loaded, prompts, args.max_tokens, args.ignore_eos, tp=tp)
        if rank == 0:
            out.put([loaded.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs])
            out.put(outputs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done, and the outputs delivered: leave without the interpreter's teardown. In about 1 run of 10-20
    # under the test suite a rank that had finished aborted there ("terminate called without an active
    # exception": a C++ thread destroyed while joinable; 0 of 45 runs alone, with or without CPU load),
    # and the parent read exit code -6 as a failed rank.
    out.close()
    out.join_thread()  # the queue's feeder has handed the outputs to the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _generate_parallel(args: argparse.Namespace) -> tuple[list[str], list[list[int]]]:
    """Every rank in a spawned process of its own; (texts, token ids) of rank 0."""
    import multiprocessing
    import queue
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [
        context.Process(target=_rank_main, args=(rank, args, port, out)) for rank in range(args.tensor_parallel_size)
    ]
    for p in ranks:
        p.start()
    try:
        # The outputs before the joins: a rank that put them waits at exit until its queue's
        # feeder has written them to the pipe, which a parent blocked in join() would never read.
        results: list[Any] = []  # the texts, then the token ids
        while len(results) < 2:
            try:
                results.append(out.get(timeout=0.5))
            except queue.Empty:
                failed = [p.exitcode for p in ranks if p.exitcode]
                if failed or all(p.exitcode == 0 for p in ranks) and out.empty():
                    raise SystemExit(f"a tensor-parallel rank failed (exit codes {[p.exitcode for p in ranks]})")
        for p in ranks:
            p.join()
        failed = [p.exitcode for p in ranks if p.exitcode]
        if failed:
            raise SystemExit(f"a tensor-parallel rank failed (exit codes {failed})")
        return results[0], results[1]
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.generate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint dir, .gguf file, hub id, or a model's name (python -m models.fetch --list)",
    )
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: as the checkpoint stores it; none: dense; int8/int4: quantize at load",
    )
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--chat", action="store_true", help="apply the chat template (add_generation_prompt)")
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="split the model over N ranks (docs/scaling.md)"
    )
    args = parser.parse_args(argv)
    if args.max_tokens < 0:
        parser.error("--max-tokens must be >= 0")
    if args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size must be >= 1")
    try:
        if args.tensor_parallel_size > 1:
            check_model(args.model)  # before any rank is spawned: one line, not a traceback per rank
            loaded = None
        else:
            loaded = load_model(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization)
    except (ValueError, OSError, FetchError) as exc:
        parser.exit(2, f"pagedserve: error: {exc}\n")
    if loaded is None:
        texts, outputs = _generate_parallel(args)
    else:
        outputs = generate_greedy(
            loaded, [_encode(loaded, p, args.chat) for p in args.prompt], args.max_tokens, args.ignore_eos
        )
        # decode() of one sequence is a str (its stub also allows a list of them, for batches)
        texts = [loaded.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]  # type: ignore[misc]
    for prompt, text, ids in zip(args.prompt, texts, outputs):
        print(json.dumps({"prompt": prompt, "text": text, "token_ids": ids}, ensure_ascii=False))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
