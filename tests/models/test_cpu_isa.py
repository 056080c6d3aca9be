"""One build of the CPU kernels per ISA target: which one a CPU gets, and that a CPU whose best
build is missing (and cannot be made) still gets a lower one, not the PyTorch paths."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models.layers import cpu_isa, cpu_kernels

REPO = Path(__file__).resolve().parents[2]
_AVX512 = "avx512f avx512cd avx512bw avx512vl avx512dq"
# /proc/cpuinfo `flags` of the CPUs we meet (trimmed to what matters, plus a few neighbours).
CPUS = {
    "zen3": "fpu sse2 pni ssse3 sse4_1 sse4_2 popcnt avx fma f16c avx2 bmi2 sha_ni",
    "zen4": f"sse4_2 avx fma f16c avx2 {_AVX512} avx512_vnni avx512_bf16 avx512vbmi gfni",
    "sapphire_rapids": f"sse4_2 avx fma f16c avx2 avx_vnni {_AVX512} avx512_vnni avx512_bf16 avx512vbmi amx_tile amx_int8",
    "cascade_lake": f"sse4_2 avx fma f16c avx2 {_AVX512} avx512_vnni",  # the Xeon: no BF16, no AMX
    "skylake_sp": f"sse4_2 avx fma f16c avx2 {_AVX512}",
    "alder_lake": "sse4_2 avx fma f16c avx2 avx_vnni",
    "sandy_bridge": "sse2 sse4_2 avx",
    "odd": "avx512f avx512_vnni",  # no AVX2: none of the rungs above generic
}


def cpuinfo(flags: str, processors: int = 2) -> str:
    return "".join(f"processor\t: {i}\nmodel name\t: some cpu\nflags\t\t: {flags}\n\n" for i in range(processors))


@pytest.mark.parametrize(
    "cpu,best,fallbacks",
    [
        ("zen3", "avx2", ["generic"]),
        ("zen4", "avx512vnni", ["avx512", "avx2", "generic"]),  # no avx_vnni: never the avx2vnni build
        ("sapphire_rapids", "avx512amx", ["avx512vnni", "avx512", "avx2vnni", "avx2", "generic"]),
        ("cascade_lake", "avx512vnni", ["avx512", "avx2", "generic"]),
        ("skylake_sp", "avx512", ["avx2", "generic"]),
        ("alder_lake", "avx2vnni", ["avx2", "generic"]),
        ("sandy_bridge", "generic", []),
        ("odd", "generic", []),
    ],
)
def test_each_cpu_gets_the_last_target_whose_flags_it_has(cpu, best, fallbacks):
    flags = cpu_isa.parse_cpu_flags(cpuinfo(CPUS[cpu]))
    choice = cpu_isa.choose(flags)
    assert (choice.target.name, [t.name for t in choice.fallbacks]) == (best, fallbacks)
    assert choice.refused is None
    assert choice.reason.startswith(f"{best}: the CPU has ")  # the flags that decided it go to the log


def test_cpuinfo_flags_are_those_every_processor_lists():
    mixed = cpuinfo(CPUS["alder_lake"], 1) + cpuinfo(CPUS["zen3"], 1)
    assert cpu_isa.choose(cpu_isa.parse_cpu_flags(mixed)).target.name == "avx2"  # avx_vnni on one only
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\n"
    assert cpu_isa.parse_cpu_flags(arm) == frozenset()
    assert cpu_isa.choose(frozenset()).target.name == "generic"


def test_a_requested_target_is_used_only_where_the_cpu_runs_it():
    spr = cpu_isa.parse_cpu_flags(cpuinfo(CPUS["sapphire_rapids"]))
    lower = cpu_isa.choose(spr, "avx2")
    assert (lower.target.name, [t.name for t in lower.fallbacks], lower.refused) == ("avx2", ["generic"], None)
    assert "as requested" in lower.reason and "avx512amx" in lower.reason
    zen4 = cpu_isa.parse_cpu_flags(cpuinfo(CPUS["zen4"]))
    refused = cpu_isa.choose(zen4, "avx2vnni")  # below its best, but Zen 4 has no AVX-VNNI
    assert refused.target.name == "avx512vnni"
    assert refused.refused == "avx2vnni needs avx_vnni, which this CPU lacks: using avx512vnni"
    assert (
        cpu_isa.choose(zen4, "avx512amx").refused
        == "avx512amx needs amx_tile amx_int8, which this CPU lacks: using avx512vnni"
    )
    unknown = cpu_isa.choose(zen4, "avx512bf16")
    assert unknown.target.name == "avx512vnni" and "no target 'avx512bf16'" in unknown.refused
    assert cpu_isa.choose(zen4, "generic").fallbacks == ()


# The cpuinfo flag of each ISA macro the kernels test: a build defines the macro only where its
# target needs the flag, so no build runs an instruction its CPU may lack.
MACRO_FLAGS = {
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512VL__": "avx512vl",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512VBMI__": "avx512vbmi",
    "__AMX_TILE__": "amx_tile",
    "__AMX_INT8__": "amx_int8",
}


def test_every_isa_macro_the_kernels_test_is_defined_by_a_target_that_needs_its_flag():
    from torch.utils.cpp_extension import get_cxx_compiler

    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        pytest.skip("no C++ compiler here")
    tested = {
        macro
        for source in (*(REPO / "models/layers/csrc").glob("*.cpp"), *(REPO / "models/layers/csrc").glob("*.h"))
        for line in source.read_text().splitlines()
        if line.lstrip().startswith("#")
        for macro in re.findall(r"__(?:AVX|F16C|FMA|AMX|SSE)\w*__", line)
    }
    assert tested <= MACRO_FLAGS.keys(), f"{tested - MACRO_FLAGS.keys()}: add a target to cpu_isa.TARGETS, then here"
    defined_somewhere = set()
    for target in cpu_isa.TARGETS:
        out = subprocess.run(
            [compiler, *target.cflags, "-dM", "-E", "-x", "c++", "-"],
            input="",
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        defined = {macro for macro in MACRO_FLAGS if f"#define {macro} " in out}
        assert {MACRO_FLAGS[m] for m in defined} <= set(target.cpu_flags), target.name
        defined_somewhere |= defined
    assert tested <= defined_somewhere  # no path of the kernels is left out of every build


@pytest.mark.slow
@pytest.mark.parametrize("target", [t.name for t in cpu_isa.TARGETS if t.name != "generic"])
def test_every_target_compiles_the_products_whatever_this_cpu(target):
    """The quantized products (every tile family a target builds: AVX2's assembly, the wide tiles, AMX's)
    compile with each target's flags on any machine, so that a CPU unlike CI's gets a build that compiles
    (only the CPUs that have a target run it)."""
    from torch.utils.cpp_extension import get_cxx_compiler, include_paths

    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        pytest.skip("no C++ compiler here")
    out = subprocess.run(
        [
            compiler,
            "-fsyntax-only",
            "-std=c++20",  # as torch's builder
            *(f"-I{path}" for path in include_paths()),
            *cpu_kernels._cflags(cpu_isa.target(target)),
            str(REPO / "models/layers/csrc/quant_linear.cpp"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]


# ---- loading: a real build of `generic` (it runs on any CPU), made once for the tests below


@pytest.fixture(scope="module")
def generic_build(tmp_path_factory):
    """An extensions directory holding only a `generic` build, made by the image's build command."""
    from torch.utils.cpp_extension import get_cxx_compiler

    if shutil.which(get_cxx_compiler()) is None:
        pytest.skip("no C++ compiler here")
    root = tmp_path_factory.mktemp("extensions")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    out = subprocess.run(
        [sys.executable, "-m", "models.layers.cpu_kernels", "--build", "generic"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "building the CPU kernels for generic" in out.stderr  # said before the minute it takes
    assert sorted(os.listdir(root)) == [cpu_kernels.build_name("generic")]
    return root


# In the subprocess: this CPU's flags replaced by `flags`, then the kernels loaded and run.
_RUN = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO)
from models.layers import cpu_isa, cpu_kernels, quantization as Q
if {flags!r} is not None:
    cpu_isa.read_cpu_flags = lambda: frozenset({flags!r}.split())
print("AVAILABLE", cpu_kernels.available(), cpu_kernels.loaded_target())
x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
w = torch.rand(128) + 0.5
want = w * torch.nn.functional.rms_norm(x, (128,), eps=1e-6)
assert torch.allclose(cpu_kernels.rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)
qw = Q.quantize_int4(torch.randn(24, 128, generator=torch.Generator().manual_seed(1)), 32)
got = Q.quantized_linear(x, qw)
exact = torch.nn.functional.linear(x, qw.dequantize())
assert (got - exact).abs().max() < 1e-4 * exact.abs().max()
print("OPS OK")
"""


def run_kernels(root: Path, flags: str | None, env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if k not in ("PAGEDSERVE_CPU_KERNELS", "PAGEDSERVE_CPU_ISA")}
    env = {**inherited, "TORCH_EXTENSIONS_DIR": str(root), **env}
    return subprocess.run(
        [sys.executable, "-c", prelude + _RUN.format(flags=flags)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


NO_COMPILER = {"PATH": os.path.dirname(sys.executable), "CXX": "pagedserve-no-such-compiler"}
READ_ONLY = (
    "import os; _access = os.access\n"  # root ignores file modes: the module is asked instead
    "os.access = lambda p, mode, **kw: False if mode & os.W_OK else _access(p, mode, **kw)\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("why", ["no_compiler", "read_only"])
def test_a_lower_prebuilt_build_serves_where_the_best_cannot_be_built(generic_build, why):
    # A Sapphire Rapids host, an image that holds only `generic`: not the PyTorch paths.
    out = run_kernels(
        generic_build,
        CPUS["sapphire_rapids"],
        NO_COMPILER if why == "no_compiler" else {},
        READ_ONLY if why == "read_only" else "",
    )
    assert out.returncode == 0, out.stderr
    assert "AVAILABLE True generic" in out.stdout and "OPS OK" in out.stdout, out.stderr
    assert "CPU kernels target avx512amx: the CPU has avx2 fma f16c avx512f" in out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "the generic build instead of avx512amx" in warnings[0], out.stderr
    assert "prebuilt: " in out.stderr
    assert "is not compatible" not in out.stderr and "Read-only" not in out.stderr
    assert sorted(os.listdir(generic_build)) == [cpu_kernels.build_name("generic")]  # nothing built or written


@pytest.mark.slow
def test_a_requested_lower_target_loads_without_a_warning(generic_build):
    out = run_kernels(generic_build, None, {**NO_COMPILER, "PAGEDSERVE_CPU_ISA": "generic"})
    assert out.returncode == 0, out.stderr
    assert "AVAILABLE True generic" in out.stdout and "OPS OK" in out.stdout, out.stderr
    assert "WARNING" not in out.stderr and "CPU kernels target generic as requested" in out.stderr


@pytest.mark.slow
def test_a_request_the_cpu_cannot_run_is_refused_in_the_log(generic_build):
    # Zen 3 asked for avx512: refused, its best (avx2) is not in this directory, generic serves.
    out = run_kernels(generic_build, CPUS["zen3"], {**NO_COMPILER, "PAGEDSERVE_CPU_ISA": "avx512"})
    assert "AVAILABLE True generic" in out.stdout and "OPS OK" in out.stdout, out.stderr
    assert "PAGEDSERVE_CPU_ISA=avx512 refused: avx512 needs avx512f avx512bw avx512vl avx512dq" in out.stderr


# ---- the same numbers from every build with FMA: a seeded request does not depend on the CPU

_SAME_ON_EVERY_CPU = """
import json, torch
from engine.llm import LLM
from engine.request import SamplingParams
from models.fetch import default_model_path
from models.layers import cpu_kernels
assert cpu_kernels.available()
print("BUILD", cpu_kernels.loaded_target(), "torch", torch.backends.cpu.get_cpu_capability())
# Inputs made by integer arithmetic and one division: torch's randn and sin are vectorized per CPU too.
x = ((torch.arange(7 * 1003) * 7919 % 1000 - 500) / 97.0).view(7, 1003)
ops = [cpu_kernels.rms_norm(x, x[0], 1e-6), cpu_kernels.silu_and_mul(x[:, :1000]), cpu_kernels.softmax_rows(x),
       cpu_kernels.softmax_rows(x, log=True),
       cpu_kernels.draw_rows(x * 8, torch.full((7,), 0.7), torch.arange(7) / 7.0).float(),
       cpu_kernels.draw_rows(x, torch.full((7,), 0.7), torch.arange(7) / 7.0, torch.full((7,), 40),
                             torch.full((7,), 0.9)).float()]
# LoRA's products on float32 and 16-bit adapter weights (--lora-dtype): csrc/lora_ops.cpp's loads widen them
a = ((torch.arange(12 * 1003) * 4099 % 1000 - 500) / 211.0).view(12, 1003)
bt = ((torch.arange(12 * 300) * 3571 % 1000 - 500) / 331.0).view(12, 300)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    out = x[:, :300].clone()
    torch.ops.pagedserve.lora_add(out, x, None, a.to(dtype), bt.to(dtype), [0, 300, 0, 12], 0.5)
    ops.append(out)
print("OPS", json.dumps([[v.hex() for v in op.flatten().tolist()] for op in ops]))
llm = LLM(str(default_model_path()))
params = [SamplingParams(temperature=1.0, seed=123, max_tokens=16, logprobs=3),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, logprobs=1),
          SamplingParams(temperature=0.7, top_k=40, min_p=0.05, presence_penalty=0.5, seed=9, max_tokens=16, logprobs=2)]
outs = llm.generate(["The capital of France is", "def fib(n):", "Once upon a time"], params)
print("OUT", json.dumps([[o.token_ids, [[lp.logprob.hex(), [[t, v.hex()] for t, v in lp.top]] for lp in o.logprobs]]
                         for o in outs]))
"""


@pytest.mark.slow
def test_a_seeded_request_gets_the_same_tokens_and_logprobs_from_every_build_with_fma():
    """The CPU's best build with torch's own kernels for it, against the avx2 build with torch's
    AVX2 kernels (ATEN_CPU_CAPABILITY): what an AVX2-only CPU runs. The products' integer sums are
    exact; every float sum (RMSNorm, attention, softmax) and exp is written on 8-lane vectors with
    FMA (csrc/vec8.h), and the sampler's softmax is ours, so the bits are the same. Builds the avx2
    target where it is not built yet (~30-60 s)."""
    from torch.utils.cpp_extension import get_cxx_compiler

    flags = cpu_isa.read_cpu_flags()
    fma_builds = [t.name for t in cpu_isa.supported(flags) if "fma" in t.cpu_flags]
    if len(fma_builds) < 2:
        pytest.skip(f"this CPU runs {fma_builds or 'no'} FMA build: nothing to compare")
    if shutil.which(get_cxx_compiler()) is None:
        pytest.skip("no C++ compiler to build the avx2 target with")
    inherited = {k: v for k, v in os.environ.items() if k not in ("PAGEDSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    runs = {}
    for build, capability in ((fma_builds[-1], None), ("avx2", "avx2")):
        env = {**inherited, "PAGEDSERVE_CPU_ISA": build, **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
        out = subprocess.run(
            [sys.executable, "-c", _SAME_ON_EVERY_CPU], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines = dict(
            line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0] in ("BUILD", "OPS", "OUT")
        )
        assert lines["BUILD"].startswith(build), lines["BUILD"]
        runs[build] = lines
    best, avx2 = runs[fma_builds[-1]], runs["avx2"]
    assert avx2["BUILD"].endswith("torch AVX2"), avx2["BUILD"]
    assert best["OPS"] == avx2["OPS"]
    assert best["OUT"] == avx2["OUT"]
