"""engine/lora.py: which slot an adapter takes, what the prefix cache keys it by, what is refused."""

from __future__ import annotations

import pytest

from engine.lora import LoRANameTakenError, LoRANotFoundError, LoRASlots


def test_a_freed_slot_is_taken_again_and_a_reload_gets_a_new_cache_key():
    slots = LoRASlots(max_loras=2)
    assert (slots.add("a"), slots.add("b")) == (1, 2)
    first_key = slots.cache_key("a")
    assert slots.remove("a") == 1
    assert slots.add("a") == 1
    assert slots.cache_key("a") not in (first_key, slots.cache_key("b"))
    assert slots.cache_key(None) is None


def test_names_and_room_are_checked():
    slots = LoRASlots(max_loras=1)
    slots.add("a")
    with pytest.raises(LoRANameTakenError, match="already loaded"):
        slots.add("a")
    with pytest.raises(ValueError, match="--max-loras 1"):
        slots.add("b")
    with pytest.raises(LoRANotFoundError):
        slots.remove("b")
    assert slots.slots == {"a": 1}
