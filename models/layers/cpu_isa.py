"""Which build of the CPU kernels (csrc/) a CPU can run: a fixed ladder of ISA targets.

Every target is built from the same sources with only its own compiler flags (the kernels
pick their code paths with `#if defined(__AVX2__)` and the like), so one image can carry them
all and each CPU loads the best it supports. A compiler needs no such CPU to target one.

    target       cpuinfo flags it needs (all of them)         e.g.
    generic      -                                            any x86-64 or other CPU
    avx2         avx2 fma f16c                                Zen 3, Haswell
    avx2vnni     + avx_vnni                                   Alder Lake (no AVX-512)
    avx512       avx2 fma f16c + avx512f/bw/vl/dq             Skylake-SP
    avx512vnni   + avx512_vnni                                Cascade Lake, Zen 4
    avx512amx    + avx512vbmi amx_tile amx_int8               Sapphire Rapids, Granite Rapids

The best target for a CPU is the last one whose flags it has all of. The rungs are not
nested: avx512 does not need avx_vnni (Zen 4 lacks it), so the targets a CPU can fall back
to are the supported ones below its best, never simply every lower rung.

Pure functions over a flag set, but for `read_cpu_flags`, the one place that reads
/proc/cpuinfo.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    name: str
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have, all of them
    cflags: tuple[str, ...]  # compiler flags: what the compiler may emit, nothing more

    def runs_on(self, cpu_flags: frozenset[str]) -> bool:
        return set(self.cpu_flags) <= cpu_flags


_AVX2 = ("avx2", "fma", "f16c")
_AVX2_CFLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = _AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq")
# -mprefer-vector-width=512: gcc otherwise keeps auto-vectorized loops at 256 bits.
_AVX512_CFLAGS = _AVX2_CFLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512")

TARGETS = (
    Target("generic", (), ()),
    Target("avx2", _AVX2, _AVX2_CFLAGS),
    Target("avx2vnni", _AVX2 + ("avx_vnni",), _AVX2_CFLAGS + ("-mavxvnni",)),
    Target("avx512", _AVX512, _AVX512_CFLAGS),
    Target("avx512vnni", _AVX512 + ("avx512_vnni",), _AVX512_CFLAGS + ("-mavx512vnni",)),
    # The AMX tiles also need the OS's leave (quant_tile_amx.h asks for it): refused, this build runs avx512vnni's paths.
    Target(
        "avx512amx",
        _AVX512 + ("avx512_vnni", "avx512vbmi", "amx_tile", "amx_int8"),
        _AVX512_CFLAGS + ("-mavx512vnni", "-mavx512vbmi", "-mamx-tile", "-mamx-int8"),
    ),
)
_BY_NAME = {target.name: target for target in TARGETS}


@dataclass(frozen=True)
class Choice:
    target: Target
    fallbacks: tuple[Target, ...]  # supported targets below `target`, best first
    reason: str  # one line for the log: why this target
    refused: str | None = None  # why a requested target was not used


def target(name: str) -> Target:
    if name not in _BY_NAME:
        raise ValueError(f"no CPU ISA target {name!r}: one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags every processor in /proc/cpuinfo's text lists (x86's `flags` lines; none
    on other CPUs, whose best target is then `generic`)."""
    per_cpu = [
        frozenset(value.split())
        for key, _, value in (line.partition(":") for line in cpuinfo.splitlines())
        if key.strip() == "flags"
    ]
    return frozenset.intersection(*per_cpu) if per_cpu else frozenset()


def read_cpu_flags() -> frozenset[str]:
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def supported(cpu_flags: frozenset[str]) -> list[Target]:
    """The targets this CPU runs, in ladder order (`generic` always)."""
    return [t for t in TARGETS if t.runs_on(cpu_flags)]


def choose(cpu_flags: frozenset[str], requested: str | None = None) -> Choice:
    """The best target for these flags, or `requested` where the CPU runs it; a request for a
    target the CPU lacks (or no such target) is refused, and the best one is used."""
    runnable = supported(cpu_flags)
    best = runnable[-1]
    chosen, refused = best, None
    if requested:
        wanted = _BY_NAME.get(requested)
        if wanted is None:
            refused = f"no target {requested!r} (one of {', '.join(_BY_NAME)}): using {best.name}"
        elif wanted not in runnable:
            missing = " ".join(f for f in wanted.cpu_flags if f not in cpu_flags)
            refused = f"{requested} needs {missing}, which this CPU lacks: using {best.name}"
        else:
            chosen = wanted
    below = tuple(reversed(runnable[: runnable.index(chosen)]))
    return Choice(chosen, below, _reason(chosen, best, cpu_flags), refused)


def _reason(chosen: Target, best: Target, cpu_flags: frozenset[str]) -> str:
    has = " ".join(chosen.cpu_flags) or "no flags needed"
    if chosen is not best:
        return f"{chosen.name} as requested (the CPU has {has}; its best is {best.name})"
    lacking = [
        f"{t.name} needs {' '.join(f for f in t.cpu_flags if f not in cpu_flags)}"
        for t in TARGETS[TARGETS.index(best) + 1 :]
    ]
    return f"{best.name}: the CPU has {has}" + (f"; {', '.join(lacking)}" if lacking else "; the top of the ladder")
