"""CPU kernels of our own, compiled on first use with torch's C++ extension builder.

Only where PyTorch has nothing that fits (csrc/): `paged_decode_attention` reads each
decode's keys and values straight out of the paged cache instead of gathering a padded
copy first; `rms_norm` and `silu_and_mul` do in one pass what eager PyTorch does in
~8 and 2; `quant_linear` multiplies by 4- and 8-bit weights with integer dot products and
`dequantize_weight` unpacks them for large steps (models/layers/quantization.py). They need a C++ compiler (g++ / clang) and ninja; the build takes ~20 s once
per machine and is cached in torch's extensions directory ($TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions). Without a compiler, or with PAGEDSERVE_CPU_KERNELS=0,
the callers keep their pure-PyTorch path, which is also the reference the tests hold
the kernels to.

A build made elsewhere (the Docker image's build stage) is loaded as it is, with no call to
torch's builder, when this machine has no compiler (torch's builder would print its
"Your compiler (c++) is not compatible" warning on every start, only to find nothing to
build) or when the build directory is read-only (a `--read-only` container: the builder
writes a lock file and build.ninja there). It is loaded only if it is at least as new as
every source and registers every op; otherwise torch's builder runs as before.
"""
from __future__ import annotations

import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("paged_attention.cpp", "elementwise.cpp", "quant_linear.cpp", "decode_ops.cpp")
]
_OPS = ("paged_attention", "rms_norm", "silu_and_mul", "quant_linear", "dequantize_weight", "rope_neox",
        "write_kv_planes")
# (name, cpuinfo flags that must all be present, compiler flags they allow), in order.
_X86_LEVELS = (
    ("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    ("avxvnni", ("avx_vnni",), ("-mavxvnni",)),
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512")),
    ("avx512vnni", ("avx512_vnni",), ("-mavx512vnni",)),
)
_lock = threading.Lock()
_state: dict[str, bool | int] = {}  # "loaded": whether torch.ops.pagedserve is usable


def _cflags() -> list[str]:
    # -fopenmp: at::parallel_for is inlined from ATen's headers as an OpenMP region; without
    # it the kernel runs on one thread. The runtime is torch's own libgomp (same soname).
    # -ffast-math (compile only: linking with it would set flush-to-zero for the whole
    # process) lets the dot products reduce as a tree and the softmax's exp use glibc's
    # vector expf; every value the kernel sees is finite.
    flags = ["-O3", "-fopenmp", "-ffast-math"]
    return flags + isa_flags()


def isa_levels() -> list[str]:
    """The vector extensions of this CPU that the kernels are built for (empty: plain C++)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    levels: list[str] = []
    for name, needed, _ in _X86_LEVELS:
        if set(needed) <= cpu_flags:
            levels.append(name)
        elif name in ("avx2", "avx512"):  # the levels after them need them
            break
    return levels


def isa_flags() -> list[str]:
    """Compiler flags for `isa_levels()`, named one by one: not -march=native, whose string
    is the same on every CPU, so that a build made on one CPU could be loaded on another."""
    levels = set(isa_levels())
    return [flag for name, _, flags in _X86_LEVELS if name in levels for flag in flags]


def build_name() -> str:
    """The extension's name carries the ISA: builds for different CPUs sit side by side in
    the extensions directory, and one is never loaded on a CPU it was not built for."""
    return "pagedserve_cpu_kernels_" + "_".join(isa_levels() or ["generic"])


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0"


def available() -> bool:
    """Whether the torch.ops.pagedserve kernels can be called (building them if needed).
    Called for every layer of every step: after the first call, one dict lookup."""
    loaded = _state.get("loaded")
    if loaded is not None:
        return loaded
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = enabled() and _build()
    return _state["loaded"]


def build_directory() -> Path:
    """Where torch's builder puts (and finds) `build_name()`'s build, without creating it."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:  # the same default as torch's _get_build_directory
        accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None
                       else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None
                       else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / build_name()


def _prebuilt() -> Path | None:
    """The built library to load without torch's builder, if that is what should happen: one
    exists, is current (no source newer), and the builder could not or should not run here
    (no compiler on PATH, or a build directory this process cannot write)."""
    from torch.utils.cpp_extension import get_cxx_compiler

    directory = build_directory()
    library = directory / f"{build_name()}.so"
    try:
        built = library.stat().st_mtime
        if any(source.stat().st_mtime > built for source in _SOURCES):
            return None
    except OSError:
        return None
    if shutil.which(get_cxx_compiler()) is not None and os.access(directory, os.W_OK):
        return None
    return library


def _build() -> bool:
    try:
        from torch.utils.cpp_extension import load

        library = _prebuilt()
        if library is not None:
            torch.ops.load_library(str(library))
        else:
            load(
                name=build_name(),
                sources=[str(source) for source in _SOURCES],
                extra_cflags=_cflags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        for op in _OPS:
            getattr(torch.ops.pagedserve, op)  # raises if registration failed
        logger.info("CPU kernels in use: %s (%s)%s", build_name(), ", ".join(_OPS),
                    f", prebuilt: {library}" if library is not None else "")
        return True
    except Exception as e:  # noqa: BLE001 - any build failure means: use the PyTorch path
        logger.warning("CPU kernels unavailable (%s): the PyTorch paths serve, quantized weights are "
                       "dequantized at every call (slow): %s: %s", build_name(), type(e).__name__,
                       str(e).splitlines()[0] if str(e) else "")
        return False


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    query_start: torch.Tensor, scale: float, value_dim: int = 0,
) -> torch.Tensor:
    """q (T, H, Dk): the step's queries, sequence i's at rows query_start[i]..query_start[i+1]-1,
    the last of its seq_lens[i] tokens; kv_cache GQA (num_blocks, block_size, 2, Hk, D) plane-major
    or MLA (num_blocks, block_size, E) with values the first `value_dim` of E (csrc/paged_attention.cpp)
    -> (T, H, Dv)."""
    return torch.ops.pagedserve.paged_attention(q, kv_cache, block_table, seq_lens, query_start, scale, value_dim)


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can take this activation tensor (CPU, 2-D)."""
    return x.device.type == "cpu" and x.dim() == 2 and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, N), weight (N,) of x's dtype -> weight * round(x * rsqrt(mean(x^2) + eps))."""
    return torch.ops.pagedserve.rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) = [gate | up] -> (T, I): round(silu(gate)) * up."""
    return torch.ops.pagedserve.silu_and_mul(gate_up)


def quant_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    bias: torch.Tensor | None, bits: int, group_size: int, quantize_input: bool = False,
) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype, W as in models/layers/quantization.py; `quantize_input`:
    x rounded to int16 per 32 values for integer dot products, else used as it is."""
    return torch.ops.pagedserve.quant_linear(x, qweight, scales, mins, bias, bits, group_size, quantize_input)


def dequantize_weight(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, group_size: int
) -> torch.Tensor:
    """The float32 weight (N, K) of a quantized one (models/layers/quantization.py's layout)."""
    return torch.ops.pagedserve.dequantize_weight(qweight, scales, mins, bits, group_size)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) float32 -> x * cos + roll(x, D/2) * signed_sin, as RotaryEmbedding.rotate."""
    return torch.ops.pagedserve.rope_neox(x, cos, signed_sin)


def write_kv_planes(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v (T, Hk, D) at their slots of a plane-major GQA cache (see attention.py), cast to its dtype."""
    torch.ops.pagedserve.write_kv_planes(kv_cache, k, v, slot_mapping)


def dequantize_rows() -> int:
    """Steps of at least this many rows multiply quantized weights by dequantizing them once and
    running a dense GEMM; fewer go through `quant_linear`, whose cost grows with the rows much
    faster than a GEMM's. Where the two meet depends on the CPU's vector width, not on timing,
    so a request's results never depend on the machine's load. Measured on SmolLM2's shapes,
    2 threads: AVX2 (Zen 3) ~32 rows; AVX-512 (Sapphire Rapids, whose float32 GEMM is twice as
    wide) below 16."""
    rows = _state.get("dequantize_rows")
    if rows is None:
        rows = _state["dequantize_rows"] = 8 if "avx512" in isa_levels() else 32
    return rows
