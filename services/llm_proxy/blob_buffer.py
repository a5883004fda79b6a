"""One blob buffer kept from one model version to the next.

Reused only while nothing else holds it (its reference count says so). Why keep it: docs/design/proxy.md.
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
