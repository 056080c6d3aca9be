"""freeze_heap: what is alive when a serving process calls it is out of every later collection's
walk, and what is garbage then is freed rather than kept for good. In a subprocess: a frozen heap
is the process's for its whole life."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from engine.heap import freeze_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    alive = [cycle() for _ in range(100_000)]  # held: the startup heap
    garbage = cycle()
    dropped = weakref.ref(garbage)
    del garbage  # a cycle: only the collector frees it
    walked_before = len(gc.get_objects())
    freeze_heap()
    print(walked_before, len(gc.get_objects()), gc.get_freeze_count(), dropped() is None, len(alive))
""")


def test_the_heap_alive_at_the_call_is_frozen_and_its_garbage_freed():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    walked_before, walked_after, frozen, garbage_freed, _ = out.split()
    assert int(walked_before) > 200_000  # 100,000 cycles of two objects, and the imports'
    assert int(frozen) >= int(walked_before) - 1000
    assert int(walked_after) < 1000  # what a full collection walks now: only what was made since
    assert garbage_freed == "True"
