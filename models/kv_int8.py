"""Per-channel key offsets and scales for an int8 KV cache (`--kv-cache-dtype int8`), calibrated at load.

An int8 row keeps 255 levels between its own -absmax and +absmax (attention.py's quantize_rows), so
the channel with the largest keys sets every channel's step. Two exact rewrites of the scores move
the levels to where they count, per layer, KV head and channel:

- Offsets. Qwen2.5's keys carry a few channels with a large part that is the same for every token
  (k_proj's bias, in slow rotary dimensions). A key less a vector c changes every score of a query
  by the same q . c, which the softmax takes out: the cache stores k - c, c the mean key of a short
  calibration text (this module's). Only for keys with a bias; soft-capped scores (Gemma 2) would
  keep the shift, so those layers store none (LlamaAttention.int8_keys).
- Scales. q . k = (q * s) . (k / s) for any s > 0 per channel: the cache stores the keys divided by
  s = sqrt(absmax of the channel's calibration keys), normalized to a geometric mean of 1, and the
  queries are multiplied by it. Wide channels get narrower and narrow ones wider (SmoothQuant's
  balance with alpha 0.5), so one outlier channel no longer leaves the others a few levels.

Both are computed once, from one prefill of CALIBRATION_TEXT into a float32 cache (the keys after
RoPE, as the cache holds them), and are the same bits on every run of a model on a machine: a row's
bytes depend on its token and position alone, as without them. Their effect on perplexity and on
the next-token distributions is in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from models.layers.attention import AttentionMetadata, kv_blocks

if TYPE_CHECKING:
    from models.loader import LoadedModel

# Prose, a conversation and code, as a server sees them (~400 tokens); not the perplexity text.
CALIBRATION_TEXT = """\
The river rose slowly through the night, and by morning the lower fields were under a sheet of \
brown water that reflected the grey sky. Farmers walked along the raised paths with their dogs, \
counting the fence posts that still showed above the flood and deciding which animals to move first.

User: Can you explain what a hash map is and when I should use one?
Assistant: A hash map stores pairs of keys and values. It computes a number from each key, the hash, \
and uses it to find a slot in an array, so looking up, inserting and deleting a key take about the \
same time however many entries there are. Use one when you need to find things by a name or an id.

```python
def word_counts(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        for word in line.lower().split():
            word = word.strip(".,;:!?\\"'()")
            if word:
                counts[word] = counts.get(word, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


class RingBuffer:
    def __init__(self, size: int) -> None:
        self.items = [None] * size
        self.start = self.length = 0

    def push(self, item) -> None:
        end = (self.start + self.length) % len(self.items)
        self.items[end] = item
        if self.length < len(self.items):
            self.length += 1
        else:
            self.start = (self.start + 1) % len(self.items)
```

In 1887 the observatory recorded a total of 214 clear nights; the average temperature at midnight was \
4.6 degrees, and the brightest comet of the year was first seen on the 18th of January.
"""

CALIBRATION_TOKENS = 512  # at most


# A channel's scale comes from no less than this fraction of its head's widest channel: a channel
# that was near zero in the calibration text keeps a bounded scale if a prompt makes it wide.
_MIN_CHANNEL_FRACTION = 0.01


@torch.inference_mode()
def calibrate_int8_keys(loaded: LoadedModel, block_size: int = 16) -> None:
    """Set `key_offset` (Hk, head_dim; where the keys have a bias, as Qwen2's), `key_scale` (Hk, head_dim)
    and `query_scale` (H, head_dim), float32, on every attention module that has them (LlamaAttention),
    from the keys after RoPE of CALIBRATION_TEXT; once per model. Keys without a bias (SmolLM2) keep no
    offset: their int8 perplexity was no closer to float32's with one."""
    model = loaded.model
    layers = list(model.model.decoder_layers)
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    attns = [a if hasattr(a, "key_scale") else None for a in attns]
    if not any(a is not None and getattr(a, "key_scale") is None for a in attns):
        return
    ids = loaded.tokenizer(CALIBRATION_TEXT).input_ids[: min(CALIBRATION_TOKENS, loaded.config.max_model_len)]
    n = len(ids)
    num_blocks = -(-n // block_size)
    device = next(model.parameters()).device
    kv_caches = model.kv_cache_spec(torch.float32).allocate(num_blocks, block_size, device)  # a tensor a layer
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size)
    model(torch.tensor(ids, device=device), torch.arange(n, device=device), kv_caches, meta)
    for attn, cache in zip(attns, kv_caches, strict=True):
        if attn is None or cache.dim() != 5:
            continue
        keys = kv_blocks(cache)[:, 0]  # (num_blocks, Hk, block_size, D)
        keys = keys.transpose(0, 1).reshape(keys.shape[1], -1, keys.shape[-1])[:, :n].float()  # (Hk, n, D)
        if getattr(attn, "qkv_proj").bias is not None:
            offset = keys.mean(dim=1)
            attn.key_offset = offset.contiguous()  # type: ignore[union-attr]
            if attn.softcap is None:  # type: ignore[union-attr]
                keys = keys - offset[:, None]
        amax = keys.abs().amax(dim=1)  # (Hk, D)
        widest = amax.amax(dim=-1, keepdim=True)
        amax = torch.maximum(amax, widest * _MIN_CHANNEL_FRACTION).clamp_min(torch.finfo(torch.float32).tiny)
        s = amax.sqrt()
        s = s / s.log().mean(dim=-1, keepdim=True).exp()
        group = attn.num_heads // attn.num_kv_heads  # type: ignore[union-attr]
        attn.key_scale = (1 / s).contiguous()  # type: ignore[union-attr]
        attn.query_scale = s.repeat_interleave(group, dim=0).contiguous()  # type: ignore[union-attr]
