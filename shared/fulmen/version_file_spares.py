"""Weights files of deleted versions, kept to be written over by the next version (issue 16).

Writing a version's file into new pages of the page cache is most of a folder publish's cost where
memory given back is slow to get again (virtual machines that return freed memory to their host: a
1 GB file takes seconds), while writing over a file whose pages are cached costs a fraction of that.
So retention (`retire`) keeps the weights file of a version it deletes in ``<shared>/.spare/`` (the
newest `SPARES_KEPT`), and a publisher (`take_spare`) renames one into its new version's folder and
writes over it, its size set to the new version's.

A spare is written over only when no process has it open or mapped — a proxy still reading the old
version, a reader that kept its memory map — which the kernel tells exactly: a write lease
(``F_SETLEASE``) is granted only on a file nobody else has open. Where the filesystem grants no
leases (NFS) the check fails and every version gets a new file, as without spares. A spare found in
use is dropped (unlinked: its readers keep their copy of the old bytes), never written.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"  # a version's weights file in its folder
SPARE_DIR = ".spare"
SPARES_KEPT = 2  # a spare costs its size on disk (and page cache the kernel may reclaim)


def retire(shared_dir: Path, version: str) -> None:
    """Delete ``<shared_dir>/<version>/``, its weights file kept as a spare."""
    folder, spares = shared_dir / version, shared_dir / SPARE_DIR
    with contextlib.suppress(OSError):  # no file (a half-written folder), or no room for a spare
        spares.mkdir(exist_ok=True)
        os.rename(folder / WEIGHTS_FILE, spares / f"{version}-{uuid.uuid4().hex[:8]}")
    shutil.rmtree(folder, ignore_errors=True)
    for old in _spares(spares)[SPARES_KEPT:]:
        with contextlib.suppress(OSError):
            old.unlink()


def take_spare(shared_dir: Path, target: Path, size: int) -> int | None:
    """A spare renamed to ``target``, opened for writing and sized to ``size`` bytes; None if there
    is none that nobody else has open."""
    for spare in _spares(shared_dir / SPARE_DIR):
        try:
            os.rename(spare, target)  # one publisher wins each spare
        except OSError:
            continue
        fd = os.open(target, os.O_WRONLY)
        if _nobody_else_has(fd):
            os.ftruncate(fd, size)  # versions of one model have one size: usually no change
            return fd
        os.close(fd)
        with contextlib.suppress(OSError):
            target.unlink()
    return None


def _spares(spares: Path) -> list[Path]:
    """The spares, newest first (the most likely to still be cached)."""
    try:
        found = [(p.stat().st_mtime, p) for p in spares.iterdir() if p.is_file()]
    except OSError:
        return []
    return [p for _, p in sorted(found, key=lambda item: item[0], reverse=True)]


def _nobody_else_has(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:  # EAGAIN: open or mapped elsewhere; EINVAL, ENOLCK: no leases on this filesystem
        return False
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True
