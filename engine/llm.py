"""Offline batch generation: the EngineCore stepped in the caller's thread, no server.

llm = LLM("path/to/checkpoint", dtype="float32", num_kv_blocks=256)
results = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))

with LLM("path", tensor_parallel_size=2) as llm:   # ranks 1..N-1 stop on close()
    ...
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence, cast

from engine.config import EngineConfig
from engine.core import EngineCore, tokenize_prompt
from engine.request import RequestOutput, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from models.loader import LoadedModel


@dataclass
class CompletionResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    queue_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0

    def add(self, output: RequestOutput) -> None:
        self.text += output.text
        self.token_ids.extend(output.token_ids)
        if output.logprobs is not None:
            self.logprobs = (self.logprobs or []) + output.logprobs
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            self.finish_reason, self.stop_reason, self.error = output.finish_reason, output.stop_reason, output.error
            self.num_cached_tokens = output.num_cached_tokens
            self.queue_time, self.prefill_time = output.queue_time, output.prefill_time
            self.decode_time = output.decode_time


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "cpu",
        quantization: str = "auto",
        tensor_parallel_size: int = 1,
        batch_invariant: bool = False,
        **engine_kwargs: Any,
    ):
        from models.loader import load_model  # lazy: the engine package does not need the loader

        config = EngineConfig(**engine_kwargs)
        load_kwargs: dict[str, Any] = dict(
            model=model,
            dtype=dtype,
            device=device,
            max_model_len=config.max_model_len,
            quantization=quantization,
            batch_invariant=batch_invariant,
        )
        ranks = None
        if tensor_parallel_size > 1:
            from engine.parallel import ParallelConfig, load_parallel

            loaded, config, ranks = load_parallel(load_kwargs, config, ParallelConfig(tensor_parallel_size))
        else:
            loaded = load_model(**load_kwargs)
        try:
            self.engine = EngineCore(loaded, config, ranks=ranks)
        except BaseException:
            if ranks is not None:
                ranks.shutdown()
            raise
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel ranks this LLM started (nothing to do with one)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **engine_kwargs: Any) -> LLM:
        """Wrap an already loaded model (LoadedModel) instead of loading one."""
        llm = cls.__new__(cls)
        llm.engine = EngineCore(loaded, EngineConfig(**engine_kwargs))
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionResult]:
        """Run every prompt to completion, in one continuous batch; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast("str | Sequence[int]", prompts)]
        prompts = cast("Sequence[str | Sequence[int]]", prompts)  # a batch now
        params = SamplingParams() if params is None else params
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        token_ids = [tokenize_prompt(self.engine.tokenizer, p) for p in prompts]
        for ids, p in zip(token_ids, params_list):  # refuse the batch before running any of it
            self.engine.limits.check(ids, p.max_tokens)
        results = {}
        for ids, p in zip(token_ids, params_list):
            request_id = f"llm-{next(self._ids)}"
            results[request_id] = CompletionResult(request_id, ids)
            self.engine.add_request(request_id, ids, p)
        while self.engine.has_unfinished:
            for output in self.engine.step():
                if output.request_id in results:
                    results[output.request_id].add(output)
        return list(results.values())
