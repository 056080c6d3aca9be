"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py), for tests that check our GGUF reader
against files written the way the files people download were written.

The converter comes from the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI
(pinned, sha256 checked), of which only the converter, its `conversion/` package and its own
gguf-py are unpacked into pagedserve's cache, once per machine. It runs in a subprocess, with its
own gguf-py first on the path, exactly as `python convert_hf_to_gguf.py` would, but for the
vocabulary: the tests' tiny byte-level BPE tokenizer is written as a gpt2 vocabulary whatever the
model (some converters insist on a sentencepiece file), and the BPE pre-tokenizer check, which
knows only real models' tokenizers by hash, names it "default".
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from models.fetch import cache_dir

SDIST = "llama_cpp_python-0.3.36"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59"
    "fe7cf3/llama_cpp_python-0.3.36.tar.gz"
)
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_MEMBERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/gguf/")

_WRAPPER = """
import sys
sys.path.insert(0, sys.argv.pop(1))
sys.argv[0] = "convert_hf_to_gguf.py"
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
model_class = convert_hf_to_gguf.get_model_class


def byte_level_vocab(*args, **kwargs):
    cls = model_class(*args, **kwargs)
    cls.set_vocab = lambda self: self._set_vocab_gpt2()
    return cls


convert_hf_to_gguf.get_model_class = byte_level_vocab
convert_hf_to_gguf.main()
"""


def converter_dir() -> Path:
    """The unpacked converter, fetched from PyPI the first time."""
    target = cache_dir() / "llama.cpp-converter" / SDIST
    if all((target / script).is_file() for script in ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        archive = Path(tmp) / f"{SDIST}.tar.gz"
        with urllib.request.urlopen(SDIST_URL, timeout=120) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out)
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{SDIST_URL}: sha256 {digest}, expected {SDIST_SHA256}")
        root = f"{SDIST}/vendor/llama.cpp/"
        unpacked = Path(tmp) / "llama.cpp"
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                rel = member.name[len(root) :] if member.name.startswith(root) else None
                if rel and member.isfile() and any(rel == m or rel.startswith(m) for m in _MEMBERS):
                    member.name = rel
                    tar.extract(member, unpacked, filter="data")
        try:
            os.replace(unpacked, target)
        except OSError:  # a concurrent fetch got there first, or an older one unpacked fewer members
            shutil.copytree(unpacked, target, dirs_exist_ok=True)
    return target


def convert(checkpoint: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's converter on an HF checkpoint directory -> `out` (outtype: f32, f16, bf16, q8_0)."""
    env = {**os.environ, "NO_LOCAL_GGUF": ""}
    env.pop("NO_LOCAL_GGUF")  # its own gguf-py, not the installed package
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _WRAPPER,
            str(converter_dir()),
            str(checkpoint),
            "--outfile",
            str(out),
            "--outtype",
            outtype,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if result.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return out


def convert_lora(base: Path, adapter: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's convert_lora_to_gguf.py on a PEFT directory over the HF checkpoint `base` -> `out`."""
    script = converter_dir() / "convert_lora_to_gguf.py"
    run = (
        f"import runpy, sys; sys.path.insert(0, {str(converter_dir() / 'gguf-py')!r}); "
        f"sys.path.insert(0, {str(converter_dir())!r}); sys.argv[0] = {str(script)!r}; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", run, "--base", str(base), "--outfile", str(out), "--outtype", outtype, str(adapter)],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"},
    )
    if result.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_lora_to_gguf.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return out
