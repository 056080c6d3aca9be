"""loadtest.bench_lora builds random adapters through the server's prepare/install API and reports
base and adapter decode steps, interleaved, with their ratio."""

from __future__ import annotations

from loadtest import bench_lora
from loadtest.make_gguf import tokenizer_fields, write_gguf
from models.fetch import default_model_path


def test_reports_base_adapter_steps_and_their_ratio(tmp_path, capsys):
    model = write_gguf(
        tmp_path / "tiny-q4_0.gguf", "tiny", "q4_0", seed=1, tokenizer=tokenizer_fields(default_model_path())
    )
    bench_lora.main(
        [
            "--model",
            str(model),
            "--threads",
            "1",
            "--rounds",
            "1",
            "--repeats",
            "1",
            "--streams",
            "1",
            "3",
            "--adapters",
            "2",
            "--rank",
            "4",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("load average")  # the figures' context, after them as before them
    rows = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in lines[2:-1]}
    assert list(rows) == ["b1 base", "b1 lora", "b1 ratio", "b3 base", "b3 lora", "b3 ratio"]
    for n in (1, 3):
        base_ms, lora_ms = float(rows[f"b{n} base"][0]), float(rows[f"b{n} lora"][0])
        throughput, latency = map(float, rows[f"b{n} ratio"])
        assert base_ms > 0 and lora_ms > 0 and latency > 0
        assert abs(throughput * latency - 1) < 0.01
