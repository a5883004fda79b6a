"""One blob buffer kept from one model version to the next.

A version read from Redis is copied into a buffer of the blob's size (`fulmen.version_stream`); once
the backend has copied the weights into the model, the buffer is free. Freeing it hands its pages
back to the system, and reading the next version into a new one faults every page in again: on a
virtual machine that returns freed memory to its host that costs seconds per GB, on the event loop,
in the middle of the read. So the follower keeps the last buffer and reads the next version of the
same size into it — only when nothing else still holds it (a LoRA adapter served from it, tensors
not yet swapped in): its reference count says so, torch's views of it included. The cost: the
buffer's size in memory between two versions, which the read needs at its peak anyway.
"""

from __future__ import annotations

import sys
from typing import Any


def _references_when_alone() -> int:
    """What `sys.getrefcount` says of a local nobody else holds: 2 on CPython 3.11 (the local and the
    call's argument), less where the interpreter borrows references (3.14). Measured the way
    `ReusedBuffer.allocate` measures."""
    kept = bytearray(1)
    return sys.getrefcount(kept)


ALONE = _references_when_alone()


class ReusedBuffer:
    def __init__(self) -> None:
        self.kept: bytearray | None = None
        self.reused = 0  # buffers handed out again (for tests and logs)

    def allocate(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes: the kept one if it has that size and nothing else holds it."""
        kept, self.kept = self.kept, None
        # any reference besides ``kept`` is a user (a tensor viewing it holds one)
        if kept is not None and len(kept) == size and sys.getrefcount(kept) == ALONE:
            self.reused += 1
            return kept
        return bytearray(size)

    def keep(self, buffer: Any) -> None:
        """Keep ``buffer`` (a version's blob, once read) for the next version, if it is a bytearray."""
        if isinstance(buffer, bytearray):
            self.kept = buffer
