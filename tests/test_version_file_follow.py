"""A proxy hashes a shared-folder version's file while the trainer writes it
(`fulmen.versions.transport.file_follow`), and uses what it read only when the announced file is that very file
and every tensor checks out against the header written last."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import pytest
import torch

from fulmen.versions.blobs import claimed_file, deserialize, serialize, write_all
from fulmen.versions.manifest import DELTA, FULL, Manifest, TensorEntry, describe_all, dtype_name
from fulmen.versions.transport import file_follow as version_file_follow
from fulmen.versions.transport.file_follow import FileReadAhead
from fulmen.versions.transport.file_spares import retire
from fulmen.versions.transport.file_write import PLACEHOLDER_SHA256, _with_manifest, write_file_hashing


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.w": torch.randn(64, 48, generator=g).to(torch.bfloat16) for i in range(6)}


async def _write_in_two_halves(shared: Path, version: str, state: dict[str, torch.Tensor], ahead: FileReadAhead,
                               corrupt: bool = False) -> dict:
    """As `write_file_hashing` writes: the header with placeholder hashes, the tensors in order (the
    first half, then — once the read-ahead hashes some — the rest), the real header last."""
    placeholder = Manifest(FULL, None, {n: TensorEntry(dtype_name(t), tuple(t.shape), PLACEHOLDER_SHA256)
                                        for n, t in state.items()})
    manifest = Manifest(FULL, None, describe_all(state))
    blob = serialize(state, placeholder)
    header = _with_manifest(blob.header, placeholder, manifest)
    parts = blob.parts[1:]
    with claimed_file(shared, version, len(blob)) as (path, f):
        write_all(f, blob.header)
        for part in parts[: len(parts) // 2]:
            write_all(f, part)
        for _ in range(500):
            if ahead.jobs:
                break
            await asyncio.sleep(0.01)
        hashed_early = len(ahead.jobs)
        for part in parts[len(parts) // 2 :]:
            write_all(f, bytes(part)[::-1] if corrupt and part is parts[-1] else part)
        f.seek(0)
        write_all(f, header)
    import hashlib

    return {"path": str(path), "sha256": hashlib.sha256(header).hexdigest(), "bytes": len(blob),
            "hashed_early": hashed_early}


@pytest.fixture(autouse=True)
def _small_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version_file_follow, "MAP_STEP_BYTES", 1)  # every tensor as soon as it is written
    monkeypatch.setattr(version_file_follow, "GROW_POLL_S", 0.001)


async def test_a_file_is_hashed_while_it_is_written_and_served_as_announced(tmp_path: Path) -> None:
    state = _state(1)
    ahead = FileReadAhead(tmp_path, "v1", stall_s=5.0)
    weights = await _write_in_two_halves(tmp_path, "v1", state, ahead)
    assert 1 <= weights["hashed_early"] < len(state)  # tensors hashed before the last one was written
    found = await ahead.take(weights)
    assert found is not None and found[1:] == (weights["sha256"], "manifest")
    published = deserialize("v1", *found)
    assert published.manifest == Manifest(FULL, None, describe_all(state))
    assert all(torch.equal(published.state[n], t) for n, t in state.items())
    assert ahead.fd is None  # closed by take


async def test_what_does_not_check_out_is_read_again_the_usual_way(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong sha256, another file (the same bytes or other ones), a tensor that is not its
    manifest's: None."""
    ahead = FileReadAhead(tmp_path, "v1", stall_s=5.0)
    weights = await _write_in_two_halves(tmp_path, "v1", _state(1), ahead)
    assert await ahead.take({**weights, "sha256": "0" * 64}) is None

    ahead = FileReadAhead(tmp_path, "v1", stall_s=5.0)
    while ahead.fd is None:
        await asyncio.sleep(0.01)
    copy = tmp_path / "elsewhere" / "model.safetensors"  # the same bytes, another file
    copy.parent.mkdir()
    shutil.copyfile(weights["path"], copy)
    assert await ahead.take({**weights, "path": str(copy)}) is None

    ahead = FileReadAhead(tmp_path, "v1", stall_s=5.0)  # follows v1's file as it is now...
    while ahead.fd is None:
        await asyncio.sleep(0.01)
    shutil.rmtree(tmp_path / "v1")  # ...which a publisher replaces with another
    other, _ = await asyncio.to_thread(write_file_hashing, tmp_path, "v1", _state(2), FULL)
    assert await ahead.take(other) is None

    ahead = FileReadAhead(tmp_path, "v2", stall_s=5.0)
    corrupt = await _write_in_two_halves(tmp_path, "v2", _state(3), ahead, corrupt=True)
    with caplog.at_level(logging.WARNING):
        assert await ahead.take(corrupt) is None
    assert "does not match its manifest's sha256" in caplog.text


async def test_a_delta_and_a_stalled_write_are_left_to_the_usual_read(tmp_path: Path) -> None:
    from fulmen.versions.blobs import blob_sha256, write_file

    ahead = FileReadAhead(tmp_path, "v1", stall_s=5.0)
    manifest = Manifest(DELTA, "v0", describe_all(_state(1)))
    blob = serialize(_state(1), manifest)
    weights = await asyncio.to_thread(write_file, tmp_path, "v1", blob, blob_sha256(blob, manifest))
    assert await ahead.take(weights) is None  # a delta's blob is hashed whole

    ahead = FileReadAhead(tmp_path, "v2", stall_s=0.2)
    folder = tmp_path / "v2"
    folder.mkdir()
    (folder / "model.safetensors.partial").write_bytes(serialize(_state(1), manifest).header)  # and no more
    assert await asyncio.wait_for(ahead.task, 5) is False
    ahead.close()


async def test_a_file_written_over_a_spare_is_read_once_it_is_whole(tmp_path: Path) -> None:
    """A recycled file's size says nothing of what is written: it is read once renamed into place,
    never before (its old bytes would fail the check, and it would be read again)."""
    from fulmen.versions.blobs import blob_sha256, write_file

    write_file_hashing(tmp_path, "v1", _state(1), FULL)
    retire(tmp_path, "v1")
    ahead = FileReadAhead(tmp_path, "v2", stall_s=5.0)
    manifest = Manifest(FULL, None, describe_all(_state(2)))
    blob = serialize(_state(2), manifest)
    with claimed_file(tmp_path, "v2", len(blob)) as (path, f):
        assert (tmp_path / "v2" / "model.safetensors.recycled").exists()
        write_all(f, blob.parts[0])
        await asyncio.sleep(0.3)  # the read-ahead looks at the folder meanwhile
        assert ahead.fd is None
        for part in blob.parts[1:]:
            write_all(f, part)
    weights = {"path": str(path), "sha256": blob_sha256(blob, manifest), "bytes": len(blob)}
    assert Path(weights["path"]).read_bytes() == Path(write_file(tmp_path / "fresh", "v2", blob, "")["path"]).read_bytes()
    found = await ahead.take(weights)
    assert found is not None and found[2] == "manifest"
    assert all(torch.equal(deserialize("v2", *found).state[n], t) for n, t in _state(2).items())
