"""Which LoRA adapters the engine holds, in which slot of the layers, and why one is refused.

    slots   0: the base model   1 .. max_loras: an adapter each (models/layers/lora.py)
    load    name -> the lowest free slot; a name already held, or no slot free: refused
    unload  the slot is free again; refused while a request of the adapter is running or waiting

The prefix cache keys an adapter's blocks by `cache_key(name)`, its name and which load of it:
an adapter unloaded and loaded again under the same name from other weights shares no KV with
the blocks its namesake left in the cache.

Plain data, no torch: the runner installs and removes the weights, the engine core asks the
scheduler who still uses an adapter.
"""

from __future__ import annotations


class LoRANameTakenError(ValueError):
    """An adapter of this name is already loaded."""


class LoRANotFoundError(ValueError):
    """No adapter of this name is loaded."""


class LoRAInUseError(ValueError):
    """Requests of the adapter are still running or waiting."""


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slots: dict[str, int] = {}  # name -> slot, in load order
        self._keys: dict[str, str] = {}
        self._num_loads = 0

    def check_room(self, name: str) -> None:
        """Why `name` cannot be loaded now (LoRANameTakenError, ValueError), or nothing."""
        if name in self.slots:
            raise LoRANameTakenError(f"a LoRA adapter named {name!r} is already loaded")
        if len(self.slots) >= self.max_loras:
            raise ValueError(
                f"{len(self.slots)} LoRA adapters are loaded, the most this server holds "
                f"(--max-loras {self.max_loras}): unload one first"
            )

    def add(self, name: str) -> int:
        """Take the lowest free slot for `name`."""
        self.check_room(name)
        slot = min(set(range(1, self.max_loras + 1)) - set(self.slots.values()))
        self.slots[name] = slot
        self._num_loads += 1
        self._keys[name] = f"{name}#{self._num_loads}"
        return slot

    def remove(self, name: str) -> int:
        """Free `name`'s slot; returns it."""
        if name not in self.slots:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded")
        del self._keys[name]
        return self.slots.pop(name)

    def cache_key(self, name: str | None) -> str | None:
        return None if name is None else self._keys[name]
