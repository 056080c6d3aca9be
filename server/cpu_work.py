"""CPU work of a request (JSON parsing, chat templates, tokenization) off the event loop, and
the character bound that refuses a prompt too long to fit before it is tokenized in full.

Tokenizing megabytes takes seconds; on the event loop that would freeze every stream and
/health. The work runs in one worker thread (HF tokenizers release the GIL while they
encode, and one thread never shares the tokenizer with another tokenizing thread).

The bound: a token covers at most `longest` characters, the longest string in the
vocabulary (special tokens included). A text of more than max_model_len * longest
characters therefore tokenizes to more than max_model_len tokens, and is refused without
tokenizing it. A normalizer can shrink text before it is split (NFC composes a base and
its marks, Hangul jamo into a syllable), so with one the bound allows 4 characters more
per character.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from server.errors import invalid

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_NORMALIZER_SLACK = 4


def new_cpu_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-cpu")


async def off_loop(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in `pool`; its exceptions (APIError included) are raised here."""
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))


def prompt_char_limit(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """Characters beyond which a text certainly has more than max_model_len tokens."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        longest *= _NORMALIZER_SLACK
    return max_model_len * max(longest, 1)


def check_prompt_chars(text: str, max_chars: int, max_model_len: int, param: str) -> None:
    """400 for a text that cannot fit in the context, before the tokenizer sees it."""
    if max_chars and len(text) > max_chars:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, the {param} has "
            f"{len(text)} characters, more than {max_model_len} tokens can hold ({max_chars}). "
            f"Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )
