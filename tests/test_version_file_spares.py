"""Retention keeps a deleted version's weights file, and the next publish writes over it
(`fulmen.versions.transport.file_spares`) — never over one some process still has open or mapped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fulmen.versions.blobs import blob_sha256, read_file, serialize, write_file
from fulmen.versions.manifest import FULL, Manifest, describe_all
from fulmen.versions.transport.file_spares import SPARE_DIR, SPARES_KEPT, retire
from fulmen.versions.transport.file_write import write_file_hashing
from fulmen.versions.transport.stream import check_whole


def _state(seed: int, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(rows, 32, generator=g), "b": torch.randn(16, generator=g).to(torch.bfloat16)}


def _fresh_bytes(tmp_path: Path, state: dict[str, torch.Tensor]) -> bytes:
    manifest = Manifest(FULL, None, describe_all(state))
    blob = serialize(state, manifest)
    return Path(write_file(tmp_path / "fresh", "x", blob, blob_sha256(blob, manifest))["path"]).read_bytes()


def _spares(shared: Path) -> list[Path]:
    return sorted((shared / SPARE_DIR).iterdir()) if (shared / SPARE_DIR).exists() else []


def test_a_retired_file_is_written_over_by_the_next_version(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    first, _ = write_file_hashing(shared, "v1", _state(1), FULL)
    inode = os.stat(first["path"]).st_ino
    retire(shared, "v1")
    assert not (shared / "v1").exists() and len(_spares(shared)) == 1

    for version, rows in (("v2", 64), ("v3", 40), ("v4", 90)):  # the same size, smaller, larger
        weights, _ = write_file_hashing(shared, version, _state(rows, rows), FULL)
        assert os.stat(weights["path"]).st_ino == inode  # the same file, its pages written over
        assert Path(weights["path"]).read_bytes() == _fresh_bytes(tmp_path / version, _state(rows, rows))
        assert check_whole(version, read_file(Path(weights["path"])), weights["sha256"]) == "manifest"
        assert _spares(shared) == [] and sorted(p.name for p in (shared / version).iterdir()) == ["model.safetensors"]
        retire(shared, version)


def test_only_the_newest_spares_are_kept(tmp_path: Path) -> None:
    for n in range(1, SPARES_KEPT + 3):
        write_file_hashing(tmp_path, f"v{n}", _state(n), FULL)
    for n in range(1, SPARES_KEPT + 3):
        os.utime(tmp_path / f"v{n}" / "model.safetensors", (n, n))  # written in that order
        retire(tmp_path, f"v{n}")
    assert [p.name.split("-")[0] for p in _spares(tmp_path)] == [f"v{n}" for n in range(3, SPARES_KEPT + 3)]


def test_a_spare_some_reader_still_maps_is_never_written(tmp_path: Path) -> None:
    first, _ = write_file_hashing(tmp_path, "v1", _state(1), FULL)
    before, inode = Path(first["path"]).read_bytes(), os.stat(first["path"]).st_ino
    mapped = read_file(Path(first["path"]))  # a proxy still loading v1, say
    retire(tmp_path, "v1")
    weights, _ = write_file_hashing(tmp_path, "v2", _state(2), FULL)
    assert os.stat(weights["path"]).st_ino != inode  # a new file (the mapped one is alive: not reused)
    assert bytes(mapped) == before  # the reader's bytes are v1's still
    assert _spares(tmp_path) == []  # dropped, not kept for later
    assert check_whole("v2", read_file(Path(weights["path"])), weights["sha256"]) == "manifest"
    mapped.close()


def test_no_spare_where_a_lease_cannot_tell_and_a_link_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fulmen.versions.transport import file_spares as version_file_spares
    from fulmen.versions.transport.file_spares import filesystem

    assert filesystem(tmp_path) in version_file_spares.LOCAL_FILESYSTEMS  # what the other tests rely on
    assert filesystem(Path("/proc/self")) == "proc"
    monkeypatch.setattr(version_file_spares, "LOCAL_FILESYSTEMS", frozenset({"nfs4"}))
    write_file_hashing(tmp_path, "v1", _state(1), FULL)
    retire(tmp_path, "v1")
    assert _spares(tmp_path) == [] and not (tmp_path / "v1").exists()
    monkeypatch.undo()

    victim = tmp_path / "victim"
    victim.write_bytes(b"not a model version")
    (tmp_path / SPARE_DIR).mkdir()
    (tmp_path / SPARE_DIR / "v0-link").symlink_to(victim)
    weights, _ = write_file_hashing(tmp_path, "v2", _state(2), FULL)
    assert victim.read_bytes() == b"not a model version"
    assert not Path(weights["path"]).is_symlink() and os.stat(weights["path"]).st_ino != os.stat(victim).st_ino
