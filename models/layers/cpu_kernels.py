"""CPU kernels of our own, built with torch's C++ extension builder, one build per ISA target.

Only where PyTorch has nothing that fits (csrc/): `paged_attention` reads every
query row's keys and values straight out of the paged cache, in an order fixed by the row alone; `rms_norm` and `silu_and_mul` do in one pass what eager PyTorch does in
~8 and 2; `quant_linear` multiplies by 4- and 8-bit weights with integer dot products, one tiled
kernel for every step size (models/layers/quantization.py); `rows_matmul` and `sigmoid` give
DeepSeek's dense products (absorbed attention, router) a row's bits whatever its step. They need a C++ compiler (g++ / clang)
and ninja; a build takes ~2-5 min on two cores once per machine and target and is cached in torch's extensions
directory ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Without a compiler, or with
PAGEDSERVE_CPU_KERNELS=0, the callers keep their pure-PyTorch path, which is also the reference
the tests hold the kernels to.

One build per target of cpu_isa.py's ladder (`pagedserve_cpu_kernels_<target>`, each in its own
directory, with only its target's flags), and one of them per process (they register the same
ops): the best target this CPU runs, or PAGEDSERVE_CPU_ISA=<target> where the CPU runs that.
Where a compiler and a writable directory are, torch's builder makes it (nothing to do when it is
current). Elsewhere a build made beforehand (the Docker image's build stage, which runs
`python -m models.layers.cpu_kernels --build-all`) is loaded as it is, with no call to the builder
(which would print "Your compiler (c++) is not compatible" on every start without a compiler, and
fail to write its lock file in a `--read-only` container), if it is at least as new as every
source. If the chosen target can be neither built nor found, the best lower target the CPU runs
that can is loaded, with a warning: any of them is far faster than the PyTorch paths.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from unittest import mock

import torch

from models.layers import cpu_isa

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "elementwise.cpp",
        "sampler_ops.cpp",
        "quant_linear.cpp",
        "decode_ops.cpp",
        "decoder_layer.cpp",
        "rows_matmul.cpp",
        "lora_ops.cpp",
    )
]
# Not compiled alone; a build is stale when one is newer.
_HEADERS = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "vec8.h",
        "quant_common.h",
        "quant_tile.h",
        "quant_tile_avx2.h",
        "quant_tile_wide.h",
        "quant_tile_amx.h",
    )
]
_OPS = (
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "sigmoid",
    "softmax_rows",
    "argmax_rows",
    "draw_rows",
    "quant_linear",
    "quant_linear_silu_mul",
    "rope_neox",
    "write_kv_blocks",
    "llama_decoder_layer",
    "rows_matmul",
)

_lock = threading.Lock()
# "loaded": whether torch.ops.pagedserve is usable; "target": the target whose build is loaded.
_state: dict[str, bool | str] = {}


def _cflags(target: cpu_isa.Target) -> list[str]:
    # -fopenmp: at::parallel_for is inlined from ATen's headers as an OpenMP region; without
    # it the kernel runs on one thread. The runtime is torch's own libgomp (same soname).
    # -ffast-math (compile only: linking with it would set flush-to-zero for the whole
    # process) lets the dot products reduce as a tree and the softmax's exp use glibc's
    # vector expf; every value the kernel sees is finite.
    return ["-O3", "-fopenmp", "-ffast-math", *target.cflags]


def build_name(target: str) -> str:
    """The extension's name carries its target: builds sit side by side in the extensions directory."""
    return f"pagedserve_cpu_kernels_{target}"


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0"


def requested_target() -> str | None:
    """PAGEDSERVE_CPU_ISA=<target>: a target below the CPU's best, to compare them or to step
    around a fault in one; refused (the best is used) where the CPU does not run it."""
    return os.environ.get("PAGEDSERVE_CPU_ISA") or None


def available() -> bool:
    """Whether the torch.ops.pagedserve kernels can be called (building them if needed).
    Called for every layer of every step: after the first call, one dict lookup."""
    loaded = _state.get("loaded")
    if loaded is not None:
        return bool(loaded)
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = enabled() and _load()
    return bool(_state["loaded"])


def loaded_target() -> str | None:
    """The target whose build this process loaded (None: none, or not asked for yet)."""
    target = _state.get("target")
    return target if isinstance(target, str) else None


def build_directory(target: str) -> Path:
    """Where torch's builder puts (and finds) `target`'s build, without creating it."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:  # the same default as torch's _get_build_directory
        accelerator = (
            f"rocm{torch.version.hip.replace('.', '')}"
            if torch.version.hip is not None
            else f"cu{torch.version.cuda.replace('.', '')}"
            if torch.version.cuda is not None
            else "cpu"
        )
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / build_name(target)


def _current_library(target: str) -> Path | None:
    """`target`'s built library, if there is one and no source is newer."""
    library = build_directory(target) / f"{build_name(target)}.so"
    try:
        built = library.stat().st_mtime
        if any(source.stat().st_mtime > built for source in _SOURCES + _HEADERS):
            return None
    except OSError:
        return None
    return library


def _why_no_builder(target: str) -> str | None:
    """Why torch's builder cannot run for `target` here (None: it can): no compiler, or a build
    directory this process cannot write (or create)."""
    from torch.utils.cpp_extension import get_cxx_compiler

    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no compiler ({compiler}) on PATH"
    directory = build_directory(target)
    existing = next(path for path in (directory, *directory.parents) if path.exists())
    if not os.access(existing, os.W_OK):
        return f"{existing} is read-only"
    return None


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """One builder at a time in `directory`, under a lock the OS frees when its holder dies.

    torch's builder has a lock of its own, a file it creates and removes when done: a builder
    killed part way (a deadline, the OOM killer, a pod stopped) leaves it behind, and every later
    build or load of that target waits on it forever. Taken under this lock, such a file can only
    be left over, and is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process's build of the CPU kernels in %s", directory)
            fcntl.flock(held, fcntl.LOCK_EX)
        left_over = directory / "lock"  # torch's FileBaton
        if left_over.exists():
            logger.warning("removing %s, left by a build that did not finish", left_over)
            left_over.unlink(missing_ok=True)
        yield  # the lock goes with the file's closing


def _build_and_load(target: cpu_isa.Target) -> None:
    from torch.utils.cpp_extension import load

    directory = build_directory(target.name)
    with build_lock(directory):
        if _current_library(target.name) is None:  # a build is coming (else torch only loads it)
            logger.warning(
                "building the CPU kernels for %s in %s (once per machine and target, ~2-5 min)", target.name, directory
            )
        load(
            name=build_name(target.name),
            sources=[str(source) for source in _SOURCES],
            extra_cflags=_cflags(target),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


def _registered() -> list[str]:
    return [op for op in _OPS if hasattr(torch.ops.pagedserve, op)]


def _load() -> bool:
    """Loads one build: the chosen target's (built here if it can be), else the best lower one found."""
    requested = requested_target()
    choice = cpu_isa.choose(cpu_isa.read_cpu_flags(), requested)
    if choice.refused:
        logger.warning("PAGEDSERVE_CPU_ISA=%s refused: %s", requested, choice.refused)
    logger.info("CPU kernels target %s", choice.reason)
    passed_over: dict[str, list[str]] = {}  # why -> the better targets passed over for it
    for target in (choice.target, *choice.fallbacks):
        library = None
        try:
            why_no_builder = _why_no_builder(target.name)
            if why_no_builder is None:
                _build_and_load(target)
            else:
                library = _current_library(target.name)
                if library is None:
                    why = f"no current build in {build_directory(target.name).parent}, and {why_no_builder}"
                    passed_over.setdefault(why, []).append(target.name)
                    continue
                torch.ops.load_library(str(library))
        except Exception as e:  # noqa: BLE001 - a failed build or load: a lower target may do
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            passed_over.setdefault(why, []).append(target.name)
            if _registered():  # it got in part way: no second library on top of it
                break
            continue
        missing = [op for op in _OPS if op not in _registered()]
        if missing:
            passed_over.setdefault(f"registers no {', '.join(missing)}", []).append(target.name)
            break
        if passed_over:
            logger.warning(
                "CPU kernels: the %s build instead of %s (%s)", target.name, choice.target.name, _summary(passed_over)
            )
        logger.info(
            "CPU kernels in use: %s (%s)%s",
            build_name(target.name),
            ", ".join(_OPS),
            f", prebuilt: {library}" if library is not None else "",
        )
        _state["target"] = target.name
        return True
    logger.warning(
        "CPU kernels unavailable: the PyTorch paths serve, quantized weights are dequantized at every call (slow): %s",
        _summary(passed_over),
    )
    return False


def _summary(passed_over: dict[str, list[str]]) -> str:
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in passed_over.items())


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    value_dim: int = 0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (T, H, Dk): the step's queries, sequence i's at rows query_start[i]..query_start[i+1]-1,
    the last of its seq_lens[i] tokens; kv_cache GQA (num_blocks, block_size, 2, Hk, D) block-major
    or MLA (num_blocks, block_size, E) with values the first `value_dim` of E (csrc/paged_attention.cpp)
    -> (T, H, Dv). window: a query at position p attends keys p - window + 1..p (None: 0..p);
    softcap: scores become softcap * tanh(score / softcap) before the softmax (None: as they are)."""
    return torch.ops.pagedserve.paged_attention(
        q, kv_cache, block_table, seq_lens, query_start, scale, value_dim, window or 0, softcap or 0.0
    )


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can take this activation tensor (CPU, 2-D)."""
    return x.device.type == "cpu" and x.dim() == 2 and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, N), weight (N,) of x's dtype -> weight * round(x * rsqrt(mean(x^2) + eps))."""
    return torch.ops.pagedserve.rms_norm(x, weight, eps)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x) element by element, each element's bits whatever its place in x (a router's scores)."""
    return torch.ops.pagedserve.sigmoid(x)


def rows_matmul(x: torch.Tensor, w: torch.Tensor, kn: bool) -> torch.Tensor:
    """x (T, K) or (T, B, K) (last dimension contiguous) times w (K, N) / (B, K, N) where `kn`, else
    (N, K) / (B, N, K) transposed -> (T, N) or (T, B, N) float32, every output summed in an order
    of its row alone, whatever the step's other rows or the thread count (csrc/rows_matmul.cpp):
    DeepSeek's W_UK / W_UV products, the MoE router's logits, dense layers under --batch-invariant."""
    return torch.ops.pagedserve.rows_matmul(x, w, kn)


def softmax_rows(logits: torch.Tensor, log: bool = False) -> torch.Tensor:
    """logits (N, V) float32 -> softmax (or log_softmax) of each row: exactly 0 (-inf) where a logit
    is -inf, summed in one order whatever the ISA build, the row's neighbours or the thread count."""
    return torch.ops.pagedserve.softmax_rows(logits, log)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (N, V) float32 -> (N,) int64: each row's first maximum, as torch.argmax(dim=-1) (a NaN
    counts as the largest)."""
    return torch.ops.pagedserve.argmax_rows(logits)


def draw_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (N, V) float32, temperature and u (N,) float32, top_k (N,) int64 (V: none), top_p
    (N,) float32 (1: none), min_p (N,) float32 (0: none) -> (N,) int64: each row's inverse-CDF draw
    of u from softmax(logits / temperature) cut by top-k, top-p, then min-p as engine/sampling/
    defines them, never a token whose logit is -inf; -1 for a row with no token left
    (csrc/sampler_ops.cpp's draw_row: the same token on every ISA build)."""
    return torch.ops.pagedserve.draw_rows(logits, temperature, u, top_k, top_p, min_p)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) = [gate | up] -> (T, I): round(silu(gate)) * up."""
    return torch.ops.pagedserve.silu_and_mul(gate_up)


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    out_features: int,
    min_per_scale: float = 0.0,
) -> torch.Tensor:
    """x (M, K) -> (M, N = out_features) in x's dtype, x rounded to int16 per 32 values and W in
    panels of 8 columns (models/layers/quantization.py's `to_panels`); 4 bits without mins:
    min = scale * min_per_scale (Q4_0's -8), or none; `bits` 4 | quantization.TABLE_KIND: the nibbles
    index IQ4_NL's and IQ4_XS's table, no mins."""
    return torch.ops.pagedserve.quant_linear(
        x, qweight, scales, mins, bias, bits, group_size, out_features, min_per_scale
    )


def quant_linear_silu_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    out_features: int,
    min_per_scale: float = 0.0,
) -> torch.Tensor:
    """silu_and_mul(quant_linear(...)) in one pass, float32 x, out_features = 2I a multiple of 16
    ([gate | up]) -> (M, I): the same numbers, without the (M, 2I) product between the two."""
    return torch.ops.pagedserve.quant_linear_silu_mul(
        x, qweight, scales, mins, bias, bits, group_size, out_features, min_per_scale
    )


def rope_neox(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) float32 -> x * cos + roll(x, D/2) * signed_sin, as RotaryEmbedding.rotate."""
    return torch.ops.pagedserve.rope_neox(x, cos, signed_sin)


def write_kv_blocks(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v (T, Hk, D) at their slots of a block-major GQA cache (see attention.py), cast to its dtype."""
    torch.ops.pagedserve.write_kv_blocks(kv_cache, k, v, slot_mapping)


def llama_decoder_layer(
    x: torch.Tensor,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    weights: list,
    info: list[int],
    heads: tuple[int, int, int],
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_offset: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    query_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Llama decoder layer whose 4 projections run on quant_linear, as one op (csrc/decoder_layer.cpp):
    weights = [qweight, scales, mins, bias] x (qkv, o, gate_up, down), info = [bits, group_size, out_features,
    min_per_scale] x 4, heads = (H, Hk, head_dim) -> the layer's output (T, hidden). key_offset and key_scale
    (Hk, head_dim), query_scale (H, head_dim): an int8 cache's keys are written as (k - key_offset) * key_scale,
    read by q * query_scale (LlamaAttention.int8_keys)."""
    return torch.ops.pagedserve.llama_decoder_layer(
        x,
        input_norm,
        post_norm,
        eps,
        weights,
        info,
        heads,
        cos,
        signed_sin,
        kv_cache,
        slot_mapping,
        block_table,
        seq_lens,
        query_start,
        scale,
        window or 0,
        key_offset,
        key_scale,
        query_scale,
    )


def _compiler_emits(target: cpu_isa.Target) -> bool:
    from torch.utils.cpp_extension import get_cxx_compiler

    probe = subprocess.run(
        [get_cxx_compiler(), *target.cflags, "-x", "c++", "-fsyntax-only", "-"],
        input="",
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0


def build_all(names: Sequence[str] | None = None) -> list[str]:
    """Builds the targets `names` (all of the ladder by default) that this compiler can emit, each
    into `build_directory(target)`, and loads none of them; returns the names built. A compiler
    needs no such CPU to target one, so one machine builds the library of every CPU."""
    targets = [cpu_isa.target(name) for name in names] if names else list(cpu_isa.TARGETS)
    built = []
    # torch's builder loads what it builds; a process holds one build (they register the same
    # ops), and a build for another CPU may not even run here.
    with mock.patch.object(torch.ops, "load_library", lambda path: None):
        for target in targets:
            if not _compiler_emits(target):
                logger.warning("%s skipped: the compiler does not take %s", target.name, " ".join(target.cflags))
                continue
            _build_and_load(target)
            built.append(target.name)
            logger.info("%s: %s", target.name, build_directory(target.name) / f"{build_name(target.name)}.so")
    return built


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.layers.cpu_kernels",
        description="Build the CPU kernels into $TORCH_EXTENSIONS_DIR, one build per "
        "ISA target, for any CPU (the Docker image's build stage).",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--build-all", action="store_true", help="every target this compiler can emit")
    which.add_argument(
        "--build",
        nargs="+",
        metavar="TARGET",
        choices=[t.name for t in cpu_isa.TARGETS],
        help="these targets only (%(choices)s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build_all(args.build)
    return 0 if built and (not args.build or set(built) == set(args.build)) else 1


if __name__ == "__main__":
    sys.exit(main())
