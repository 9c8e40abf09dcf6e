"""The process heap tuned for serving: start-up objects frozen out of the garbage collector, and
glibc's allocator keeping the memory of large buffers (request bodies) for reuse.

A request body of hundreds of kilobytes is a fresh allocation per request; by default glibc maps
such a block anew and unmaps it on free, so every request pays the page faults of touching it
again (measured: most of the cost of an 800 KB body). ``keep_large_buffers`` serves blocks up to
``MMAP_THRESHOLD`` from the heap and trims the heap only when ``TRIM_THRESHOLD`` is free at its top.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

# Young-generation collections every this many net allocations instead of 700: each one walks
# every young object, including those of the requests in flight, which the default would revisit
# every few requests.
GC_YOUNG_THRESHOLD = 20_000

MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap (a 10 MiB body + framing fits)
TRIM_THRESHOLD = 128 << 20  # free memory at the heap's top kept before it is given back

_M_TRIM_THRESHOLD = -1  # mallopt parameters of glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def keep_large_buffers() -> bool:
    """Tune glibc's malloc as above; False where the C library has no ``mallopt`` (e.g. musl)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trimmed = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mapped) and bool(trimmed)


def settle() -> None:
    """Before serving: start-up objects (modules, the config, plugins) move out of the collector's
    view (``gc.freeze``), so full collections walk only what serving created; see GC_YOUNG_THRESHOLD;
    large buffers are kept (``keep_large_buffers``)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
    keep_large_buffers()
