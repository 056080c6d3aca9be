"""Random-weight GGUFs of real models' shapes, for benchmarks at the sizes people serve.

    python -m loadtest.make_gguf --shape smollm2-1.7b --type q4_0     # -> <cache>/synthetic/smollm2-1.7b-q4_0.gguf
    python -m loadtest.make_gguf --shape smollm2-360m --type q8_0 --out /tmp/m.gguf --seed 1

A file is a llama-architecture GGUF with SmolLM2's tokenizer: every `tokenizer.*` key (vocab,
merges, token types, special ids, chat template) is copied from the real SmolLM2-135M-Instruct
GGUF, so pagedserve and llama.cpp's llama-server tokenize a prompt the same way. Weights are
normal with std 0.02 and norms are ones: activations stay finite for any number of tokens,
and a product costs what it costs on trained weights (the kernels never look at values).

Tensor types follow llama.cpp's `llama-quantize` for SmolLM2: every linear weight in the
chosen type, norms F32, and the tied token embedding (also the output matrix) Q8_0. For
Q4_0/Q4_1, llama-quantize would ask for Q6_K there and falls back to Q8_0 when the hidden size
is not a multiple of 256 (135M, 360M: the real Q4_1 file has a Q8_0 embedding); the 1.7B shape
(2048 wide) would get Q6_K. Q8_0 is used everywhere here because the gguf package cannot
write Q6_K; both servers load either.

Q and K rows are random, so llama.cpp's per-head row permutation needs no applying: the file
holds them in GGUF order by definition and the loader's un-permuting is as harmless as it is
on any file.

The file is written tensor by tensor into a temporary name and renamed into place, so an
interrupted run never leaves a half-written model where `compare` would find it. Tensors are
made by `--jobs` processes (default one per core; each holds one quantized tensor and one
float32 chunk of rows), each from its own seeded generator, so the bytes do not depend on
the count: the 1.7B file took 7.7 s on 16 cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quant_shape_to_byte_shape, quantize

Q = GGMLQuantizationType
WEIGHT_STD = 0.02
EMBEDDING_TYPE = Q.Q8_0
TYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}
FILE_TYPES = {Q.Q4_0: LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: LlamaFileType.MOSTLY_Q4_1, Q.Q8_0: LlamaFileType.MOSTLY_Q8_0}
# Float32 values generated and quantized at once: bounds the writer's memory whatever the shape.
_CHUNK_VALUES = 1 << 22


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    vocab_size: int = 49152  # SmolLM2's tokenizer: the copied vocab must fill the embedding
    context_length: int = 8192
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# From the HuggingFaceTB/SmolLM2-*-Instruct config.json files; all tie word embeddings.
SHAPES = {
    "smollm2-135m": Shape(576, 1536, 30, 9, 3, 100000.0),
    "smollm2-360m": Shape(960, 2560, 32, 15, 5, 100000.0),
    "smollm2-1.7b": Shape(2048, 8192, 24, 32, 32, 130000.0),
    # tests: the real vocabulary and every tensor kind, in a few MB
    "tiny": Shape(64, 128, 2, 4, 2, 100000.0),
}
_SHORTCUT = re.compile(r"(?P<shape>[\w.-]+):(?P<type>q\d_\d)")


def default_path(shape: str, qtype: str, seed: int = 0) -> Path:
    """Where `python -m loadtest.make_gguf` writes when given no --out."""
    from models.fetch import cache_dir

    suffix = f"-seed{seed}" if seed else ""
    return cache_dir() / "synthetic" / f"{shape}-{qtype}{suffix}.gguf"


def parse_shortcut(text: str) -> tuple[str, str] | None:
    """'smollm2-1.7b:q4_0' -> ('smollm2-1.7b', 'q4_0'); None for anything else (a path)."""
    match = _SHORTCUT.fullmatch(text.strip().lower())
    if match is None or match["shape"] not in SHAPES or match["type"] not in TYPES:
        return None
    return match["shape"], match["type"]


def ensure_gguf(shape: str, qtype: str, seed: int = 0) -> Path:
    """The default path of this shape and type, written first if it is not there yet."""
    path = default_path(shape, qtype, seed)
    if not path.is_file():
        print(f"make_gguf: writing {path} ...", file=sys.stderr, flush=True)
        write_gguf(path, shape, qtype, seed, jobs=None)
    return path


def tensor_plan(shape: Shape, qtype: GGMLQuantizationType) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(GGUF name, (rows, cols) or (n,), type) of every tensor, in llama.cpp's converter's names."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...], GGMLQuantizationType]] = [
        ("token_embd.weight", (shape.vocab_size, h), EMBEDDING_TYPE)
    ]
    for i in range(shape.num_layers):
        plan += [
            (f"blk.{i}.attn_norm.weight", (h,), Q.F32),
            (f"blk.{i}.attn_q.weight", (q, h), qtype),
            (f"blk.{i}.attn_k.weight", (kv, h), qtype),
            (f"blk.{i}.attn_v.weight", (kv, h), qtype),
            (f"blk.{i}.attn_output.weight", (h, q), qtype),
            (f"blk.{i}.ffn_norm.weight", (h,), Q.F32),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate_size, h), qtype),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate_size, h), qtype),
            (f"blk.{i}.ffn_down.weight", (h, shape.intermediate_size), qtype),
        ]
    plan.append(("output_norm.weight", (h,), Q.F32))  # no output.weight: tied to token_embd
    return plan


def random_tensor(dims: tuple[int, ...], qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Norms: float32 ones. Weights: N(0, WEIGHT_STD) quantized to `qtype`, as (rows, bytes) uint8,
    generated a chunk of rows at a time so no whole float32 matrix is ever held."""
    if qtype == Q.F32:
        return np.ones(dims, dtype=np.float32)
    rows, cols = dims
    out = np.empty(quant_shape_to_byte_shape(dims, qtype), dtype=np.uint8)  # (rows, bytes per row)
    step = max(1, _CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        chunk *= WEIGHT_STD
        out[start : start + len(chunk)] = quantize(chunk, qtype)
    return out


def _tensor_task(task: tuple[tuple[int, ...], GGMLQuantizationType, int, int]) -> np.ndarray:
    dims, qtype, seed, index = task
    return random_tensor(dims, qtype, np.random.default_rng([seed, index]))


# (key, value, type, array element type) of one metadata key
Field = tuple[str, object, GGUFValueType, GGUFValueType | None]


def tokenizer_fields(source: Path) -> list[Field]:
    """Every tokenizer.* key of `source`. Parsing a 49k-token vocabulary takes seconds: read it
    once when writing several files."""
    reader = GGUFReader(source)
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            fields.append((key, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None))
    if not any(key == "tokenizer.ggml.tokens" for key, *_ in fields):
        raise ValueError(f"{source} has no tokenizer.ggml.tokens to copy")
    return fields


def write_gguf(
    out: Path,
    shape_name: str,
    qtype_name: str,
    seed: int = 0,
    tokenizer: list[Field] | None = None,
    jobs: int | None = 1,
) -> Path:
    """Write a random-weight GGUF of SHAPES[shape_name] in TYPES[qtype_name] to `out`.
    `tokenizer`: from tokenizer_fields (default: the real SmolLM2-135M-Instruct file's).
    `jobs`: processes making tensors (None: one per core); the file's bytes do not depend on it."""
    if tokenizer is None:
        from models.fetch import default_model_path

        tokenizer = tokenizer_fields(default_model_path())
    shape, qtype = SHAPES[shape_name], TYPES[qtype_name]
    tokens = next(value for key, value, *_ in tokenizer if key == "tokenizer.ggml.tokens")
    assert isinstance(tokens, list)  # GGUFReader's contents() of a string array
    vocab = len(tokens)
    if vocab != shape.vocab_size:
        raise ValueError(f"the tokenizer has {vocab} tokens; shape {shape_name} needs {shape.vocab_size}")

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    writer = GGUFWriter(tmp, "llama")
    try:
        writer.add_type("model")
        writer.add_name(f"synthetic {shape_name} {qtype_name} (random weights, seed {seed})")
        writer.add_file_type(FILE_TYPES[qtype])
        writer.add_quantization_version(GGML_QUANT_VERSION)
        writer.add_context_length(shape.context_length)
        writer.add_embedding_length(shape.hidden_size)
        writer.add_block_count(shape.num_layers)
        writer.add_feed_forward_length(shape.intermediate_size)
        writer.add_head_count(shape.num_heads)
        writer.add_head_count_kv(shape.num_kv_heads)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
        writer.add_vocab_size(shape.vocab_size)
        for key, value, vtype, sub_type in tokenizer:
            writer.add_key_value(key, value, vtype, sub_type)

        plan = tensor_plan(shape, qtype)
        for name, dims, ttype in plan:  # the header lists every tensor before any data is written
            if ttype == Q.F32:
                writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
            else:
                byte_shape = quant_shape_to_byte_shape(dims, ttype)
                writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=ttype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # One generator per tensor: a tensor's values depend only on the seed and its place, so
        # tensors can be made in any order, by any number of processes, into the same bytes.
        tasks = [(dims, ttype, seed, index) for index, (_, dims, ttype) in enumerate(plan)]
        jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
        if jobs == 1:
            for task in tasks:
                writer.write_tensor_data(_tensor_task(task))
        else:
            # spawn: a forked torch (imported by the caller) can deadlock in its thread pools.
            with multiprocessing.get_context("spawn").Pool(jobs) as pool:
                # imap yields in the file's order; finished tensors wait for the writer, which
                # (a disk write against a quantization) keeps up.
                for data in pool.imap(_tensor_task, tasks):
                    writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.make_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--type", default="q4_0", choices=sorted(TYPES), help="linear weights' GGUF type")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default: <pagedserve cache>/synthetic/<shape>-<type>.gguf")
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="GGUF whose tokenizer.* keys are copied (default: the real SmolLM2-135M-Instruct file)",
    )
    p.add_argument("--force", action="store_true", help="write even if the file exists")
    p.add_argument("--jobs", type=int, default=None, help="processes making tensors (default: one per core)")
    args = p.parse_args(argv)
    out = args.out or default_path(args.shape, args.type, args.seed)
    if out.exists() and not args.force:
        print(f"{out} exists (--force rewrites it)", file=sys.stderr)
        print(out)
        return
    start = time.perf_counter()
    tokenizer = tokenizer_fields(args.tokenizer_from) if args.tokenizer_from else None
    write_gguf(out, args.shape, args.type, args.seed, tokenizer, jobs=args.jobs)
    print(f"wrote {out.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()
