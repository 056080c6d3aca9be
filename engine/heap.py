"""A serving process's Python heap, kept out of the cyclic garbage collector's way.

A full collection (generation 2) walks every object the collector tracks, with the GIL held. Once
its model is loaded and warmed up, a server holds ~350,000 of them (torch, transformers, FastAPI,
the tokenizer, the model's modules), and one full collection takes a few hundred milliseconds:
every stream, and the event loop, would stall as long whenever the objects that had survived since the
last one reached a quarter of that heap.

`freeze_heap()` collects once, then moves everything alive into the permanent generation
(gc.freeze, as vLLM's engine does after start-up): later collections walk only what was made since
(a full collection right after it takes no time). The server and each tensor-parallel rank call it once
their model is loaded. (Called before the load as well, it did not shorten the server's start-up:
with the imports' heap out of the count, the load's own objects set off full collections more often.)

Only for a process that holds its model for its whole life: a frozen object is never collected,
so a process that loads and drops models (tests, a notebook) must not call it.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    gc.collect()  # what is garbage now is freed, not frozen
    gc.freeze()
