"""Handing memory freed after large requests back to the system.

A large body's preparation allocates far more than the body itself, and frees it all
when the request ends: tokenizing one 8 MB text builds several hundred MB of offsets
and alignments in `tokenizers`, on the thread that parsed it. glibc's malloc keeps
freed memory in its arenas (one per thread that allocated, up to 8 per core) for the
next allocation, and returns it to the system only from the top of a heap; the holes
large requests leave behind are reused only by allocations that fit them. Batch after
batch of large bad inputs, RSS then stays at its highest and creeps up, with nothing
live (the bad-input run in issue 14 went from 230 to 658 MB and stayed there).

`malloc_trim(0)` walks every arena and gives the free pages in it back (madvise), so
RSS falls back to what is live. It holds each arena's lock while it walks it, so it
runs after large bodies only, on the thread that prepares them (serving/offload.py),
never on the event loop, and never two at once. Where the C library has no
`malloc_trim` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

# A body at least this large was costly enough to prepare that a trim after it (a few
# ms on a heap of a few hundred MB) is small beside it; smaller bodies leave little.
TRIM_AFTER_BODY_BYTES = 1024 * 1024


def _malloc_trim() -> Callable[[], object] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class Trimmer:
    """Gives free heap memory back to the system: `trim()`, from any thread but the loop."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self.trims = 0  # done so far

    @property
    def available(self) -> bool:
        return self._trim is not None

    def trim(self) -> None:
        if self._trim is not None:
            self._trim()
            self.trims += 1
