"""Load generator for OpenAI-compatible servers (pagedserve, vLLM, SGLang...).

    python -m loadtest --url http://127.0.0.1:8000 --model NAME --concurrency 1,4,16

or in-process: `await run_benchmark(BenchmarkConfig(url=..., model=...))`.
"""

from loadtest.benchmark import run_benchmark, run_sweep
from loadtest.config import BenchmarkConfig

__all__ = ["BenchmarkConfig", "run_benchmark", "run_sweep"]
