"""Real files' Q6_K tensors served as stored (int6): the Qwen2.5 Coder 0.5B Q4_K_M file (its Q6_K
`ffn_down` layers) and the same model requantized to Q6_K by llama.cpp's own quantizer, whose
perplexity must stay within 1% of transformers' float32 on the same file (test_qwen_gguf's
reference, computed here from the file).
"""

from __future__ import annotations

import gc
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from loadtest.perplexity import DEFAULT_TEXT, perplexity
from models.gguf import quantized_weight
from models.layers import cpu_kernels
from models.layers import quantization as Q

pytestmark = pytest.mark.slow  # a 0.5B model loaded, and for the requantized file once more as float32

# llama-cpp-python built from its PyPI sources in a venv of its own (docs/models.md says how).
LLAMA_CPP_PYTHON = Path.home() / ".cache" / "llama-cpp-python-0.3.36-venv" / "bin" / "python"
QUANTIZE = """
import ctypes, sys, llama_cpp as l
p = l.llama_model_quantize_default_params()
p.allow_requantize = True
p.ftype = l.LLAMA_FTYPE_MOSTLY_Q6_K
sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def served_as_stored(path: Path, model: torch.nn.Module) -> int:
    """Every Q6_K `ffn_down` of the file is an int6 layer holding the file's blocks (read back from
    the kernel's panels) in the file's bytes; returns how many."""
    count = 0
    for tensor in GGUFReader(path).tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q6_K or not tensor.name.endswith(".ffn_down.weight"):
            continue
        layer = model.model.layers[int(tensor.name.split(".")[1])].mlp.down_proj
        assert layer.quant_method.name == "int6", tensor.name
        n, k = layer.out_features, layer.in_features
        blocks = np.asarray(tensor.data)
        want = quantized_weight(blocks, GGMLQuantizationType.Q6_K, n, k)
        if cpu_kernels.available():
            back = Q.panel_rows(6, layer.qweight, layer.scales, None, torch.arange(n))
            assert torch.equal(back.qweight, want.qweight) and torch.equal(back.scales, want.scales)
            padded = -(-n // 8) * 8
            held = layer.qweight.numel() + layer.scales.numel() * layer.scales.element_size()
            assert held == blocks.nbytes * padded // n, tensor.name
        count += 1
    return count


def test_the_q4_k_m_files_q6_k_layers_are_the_files_bytes(qwen05_servable):
    from models.loader import load_model

    loaded = load_model(str(qwen05_servable))
    assert served_as_stored(qwen05_servable, loaded.model) > 0


def test_a_file_requantized_to_q6_k_by_llama_cpp_is_served_as_stored_within_one_percent(qwen05_servable, tmp_path):
    """ftype Q6_K: the 896-column tensors fall back to Q8_0 (not a multiple of 256), the 4864-column
    `ffn_down` are Q6_K."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.loader import load_model

    if not LLAMA_CPP_PYTHON.is_file():
        pytest.skip(f"no llama-cpp-python at {LLAMA_CPP_PYTHON} (docs/models.md builds it)")
    path = tmp_path / "q6_k.gguf"
    subprocess.run([str(LLAMA_CPP_PYTHON), "-c", QUANTIZE, str(qwen05_servable), str(path)], check=True, timeout=1800)
    text = DEFAULT_TEXT.read_text()
    loaded = load_model(str(path))
    assert served_as_stored(path, loaded.model) == loaded.config.hf_config.num_hidden_layers
    ours, count = perplexity(loaded, text)
    ids = loaded.tokenizer(text).input_ids
    del loaded
    gc.collect()
    reference_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert reference_tokenizer(text).input_ids == ids
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]])).logits[0]  # (n - 1, vocab)
    reference = math.exp(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:])).item())
    print(f"perplexity over {count} tokens: served {ours:.4f}, transformers float32 {reference:.4f}")
    assert abs(ours / reference - 1) < 0.01, (ours, reference)
