"""Weights files of deleted versions, kept to be written over by the next version.

`retire` keeps them, `take_spare` reuses one; only on `LOCAL_FILESYSTEMS`, and never one still open
or mapped. Why: docs/design/model-versions.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import uuid
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"  # a version's weights file in its folder
SPARE_DIR = ".spare"
SPARES_KEPT = 2  # a spare costs its size on disk (and page cache the kernel may reclaim)
LOCAL_FILESYSTEMS = frozenset({"ext4", "ext3", "xfs", "btrfs", "tmpfs"})  # where a write lease tells


def retire(shared_dir: Path, version: str) -> None:
    """Delete ``<shared_dir>/<version>/``, its weights file kept as a spare where spares are used."""
    folder, spares = shared_dir / version, shared_dir / SPARE_DIR
    if filesystem(shared_dir) in LOCAL_FILESYSTEMS:
        with contextlib.suppress(OSError):  # no file (a half-written folder), or no room for a spare
            spares.mkdir(exist_ok=True)
            os.rename(folder / WEIGHTS_FILE, spares / f"{version}-{uuid.uuid4().hex[:8]}")
    shutil.rmtree(folder, ignore_errors=True)
    for old in _spares(spares)[SPARES_KEPT:]:
        with contextlib.suppress(OSError):
            old.unlink()


def take_spare(shared_dir: Path, target: Path, size: int) -> int | None:
    """A spare renamed to ``target``, opened for reading and writing and sized to ``size`` bytes; None
    if there is none that nobody else has open (a spare that cannot be used is dropped)."""
    for spare in _spares(shared_dir / SPARE_DIR):
        try:
            os.rename(spare, target)  # one publisher wins each spare
        except OSError:
            continue
        fd = None
        try:
            fd = os.open(target, os.O_RDWR | os.O_NOFOLLOW)  # read too: a writer may map it
            if stat.S_ISREG(os.fstat(fd).st_mode) and _nobody_else_has(fd):
                os.ftruncate(fd, size)  # versions of one model have one size: usually no change
                return fd
        except OSError:
            pass
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            target.unlink()
    return None


def filesystem(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on (its longest mount point in /proc/self/mounts)."""
    try:
        target, mounts = os.path.realpath(path), Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _spares(spares: Path) -> list[Path]:
    """The spares, newest first (the most likely to still be cached)."""
    try:
        names = list(spares.iterdir())
    except OSError:
        return []
    found = []
    for path in names:
        with contextlib.suppress(OSError):  # taken by another publisher meanwhile
            info = path.lstat()
            if stat.S_ISREG(info.st_mode):
                found.append((info.st_mtime, path))
    return [p for _, p in sorted(found, key=lambda item: item[0], reverse=True)]


def _nobody_else_has(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:  # EAGAIN: open or mapped elsewhere; EINVAL, ENOLCK: no leases on this filesystem
        return False
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True
