"""A tiny random Llama checkpoint (saved by transformers' save_pretrained), loaded once in float32."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(checkpoint dir, HF model) - 2 layers, hidden 64, GQA 4/2 heads, vocab 300, 256 positions."""
    from tests.models.conftest import make_hf_model, save_checkpoint

    hf_model = make_hf_model("llama", seed=1, max_position_embeddings=256)
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp("engine-tiny-llama"))
    return path, hf_model


@pytest.fixture(scope="session")
def loaded(tiny_llama):
    """The checkpoint loaded by our loader in float32 (shared: models hold no per-request state)."""
    from models.loader import load_model

    return load_model(tiny_llama[0], dtype="float32")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core machine run ~20x faster on one thread than on two
    (OpenMP workers spin against other processes); restored after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
