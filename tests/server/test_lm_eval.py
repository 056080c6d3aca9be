"""lm-evaluation-harness scores a live pagedserve (`local-completions`: echo, logprobs, token-id
prompts) exactly as it scores the same float32 checkpoint with its own `hf` model, item by item.

Offline: the task and its JSONL data are written here, the tokenizer is the checkpoint's own
directory, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set for the lm_eval processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import MODEL_NAME

pytest.importorskip("lm_eval")

TASK = "pagedserve_local_choice"
TOL = 1e-4
DOCS = [
    {"context": "The capital of France is", "choices": [" Paris", " Berlin", " a small town by the sea"], "label": 0},
    {"context": "Two plus two equals", "choices": [" four", " five"], "label": 0},
    {"context": "Water freezes at zero degrees", "choices": [" Celsius.", " Fahrenheit, they say."], "label": 0},
    {"context": "Once upon a time there was", "choices": [" a princess", " an engine that served tokens"], "label": 1},
]


def write_task(directory: Path) -> Path:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (directory / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    return directory


def run_lm_eval(model: str, model_args: str, tasks_dir: Path, out: Path) -> dict[int, list[float]]:
    """doc id -> the loglikelihood of each choice, from lm_eval's logged samples."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(out / "hf-home"),
        "OPENAI_API_KEY": "unused",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASK,
        "--include_path",
        str(tasks_dir),
        "--batch_size",
        "1",
        "--device",
        "cpu",
        "--log_samples",
        "--output_path",
        str(out),
    ]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    samples = list(out.rglob(f"samples_{TASK}_*.jsonl"))
    assert len(samples) == 1, list(out.rglob("*"))
    per_doc = {}
    for line in samples[0].read_text().splitlines():
        sample = json.loads(line)
        per_doc[sample["doc_id"]] = [float(resp[0][0]) for resp in sample["resps"]]
    return per_doc


@pytest.mark.slow
def test_lm_eval_local_completions_equals_its_hf_model(live, tiny_model_dir, tmp_path):
    tasks_dir = write_task(tmp_path)
    served = run_lm_eval(
        "local-completions",
        f"model={MODEL_NAME},base_url={live.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={tiny_model_dir},tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=256",
        tasks_dir,
        tmp_path / "served",
    )
    reference = run_lm_eval(
        "hf", f"pretrained={tiny_model_dir},dtype=float32,max_length=256", tasks_dir, tmp_path / "hf"
    )
    assert sorted(served) == sorted(reference) == list(range(len(DOCS)))
    for doc_id, values in reference.items():
        assert len(values) == len(DOCS[doc_id]["choices"])
        assert served[doc_id] == pytest.approx(values, abs=TOL), doc_id
        assert all(v < 0 for v in values)
