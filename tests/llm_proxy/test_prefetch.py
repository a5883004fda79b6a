"""A proxy reads the next model version while the trainer writes it (`read_stream`'s ``follow_s``,
`ModelFollower`'s prefetch), and serves it only once a resources entry names that blob."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model, load_tiny_model
from fulmen.records import ResourcesUpdate
from fulmen.store import RedisStore
from fulmen.versions.model_version import publish_model_version
from fulmen.versions.transport.folder import FolderTransport
from fulmen.versions.transport.redis import RedisTransport
from fulmen.versions.transport.stream import read_stream
from fulmen_llm_proxy import following
from fulmen_llm_proxy.backends.torch.backend import TorchBackend
from fulmen_llm_proxy.following import ModelFollower

CHUNK = 16 << 10  # several chunks for the tiny model's 0.3 MB


async def _entries_of_v1(store: RedisStore, tiny_model: Path, tmp_path: Path) -> list:
    """v1's stream entries as a publish writes them, then the stream emptied (to write them again)."""
    model, _ = load_tiny_model(build_tiny_model(tmp_path / "other", seed=3))
    await publish_model_version(store, model.state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=CHUNK))
    key = store.keys.weights("v1")
    entries = await store.redis.xrange(key)
    assert len(entries) > 3
    await store.redis.delete(key)
    return entries


async def test_a_stream_is_read_as_it_is_written_and_a_stopped_one_is_dropped(
    real_store: RedisStore, tiny_model: Path, tmp_path: Path
) -> None:
    entries = await _entries_of_v1(real_store, tiny_model, tmp_path)
    key = real_store.keys.weights("v1")
    reading = asyncio.ensure_future(read_stream(real_store, "v1", follow_s=5.0))
    for entry_id, fields in entries:  # written while the read waits for each next chunk
        await asyncio.sleep(0.01)
        await real_store.redis.xadd(key, fields, id=entry_id)
    followed = await asyncio.wait_for(reading, 10)
    whole = await read_stream(real_store, "v1")
    assert followed is not None and whole is not None
    assert bytes(followed[0]) == bytes(whole[0]) and followed[1:] == whole[1:]

    await real_store.redis.delete(key)
    for entry_id, fields in entries[:2]:  # a publish that stops after two chunks
        await real_store.redis.xadd(key, fields, id=entry_id)
    assert await asyncio.wait_for(read_stream(real_store, "v1", follow_s=0.3), 10) is None


async def test_the_follower_serves_the_version_it_read_while_it_was_written(
    real_store: RedisStore, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower starts reading v1 before the publish; the resources entry then finds it read (no
    second read of the stream), and the weights served are the published ones. A version published
    by hand under another name is read the usual way."""
    backend = TorchBackend(tiny_model)
    await backend.start()
    follower = ModelFollower(real_store, backend, lambda v, outcome: None)
    whole_reads: list[str] = []
    real_read = read_stream

    async def counting_read(store, version, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("follow_s") is None:
            whole_reads.append(version)
        return await real_read(store, version, *args, **kwargs)

    monkeypatch.setattr("fulmen.versions.transport.stream.read_stream", counting_read)
    try:
        await follower.catch_up()
        follower._prefetch_next()
        assert follower._prefetch is not None and follower._prefetch[0] == "v1"
        model, _ = load_tiny_model(build_tiny_model(tmp_path / "v1", seed=5))
        update = await publish_model_version(real_store, model.state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=CHUNK))
        await follower.consider(update)
        assert backend.model_version == "v1" and follower.prefetched == ["v1"] and whole_reads == []
        served, published = backend.current_weights(), model.state_dict()
        assert set(served) == set(published)
        assert all(torch.equal(served[n].float(), t.float()) for n, t in published.items())
        assert follower._prefetch is not None and follower._prefetch[0] == "v2"  # the next one already

        other, _ = load_tiny_model(build_tiny_model(tmp_path / "hand", seed=6))
        update = await publish_model_version(real_store, other.state_dict(), model="tiny", model_version="by-hand")
        await follower.consider(update)
        assert backend.model_version == "by-hand" and follower.prefetched == ["v1"] and whole_reads == ["by-hand"]
    finally:
        follower._drop_prefetch()
        await backend.close()


async def test_a_prefetch_that_failed_falls_back_to_a_whole_read(
    real_store: RedisStore, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetch that went wrong (here: a stall past its bound) costs time, never the version."""
    monkeypatch.setattr(following, "PREFETCH_FOLLOW_S", 0.2)
    backend = TorchBackend(tiny_model)
    await backend.start()
    follower = ModelFollower(real_store, backend, lambda v, outcome: None)
    try:
        stuck = asyncio.get_running_loop().create_future()  # a read that never ends
        follower._prefetch = ("v1", asyncio.ensure_future(stuck))
        model, _ = load_tiny_model(build_tiny_model(tmp_path / "v1", seed=5))
        update = await publish_model_version(real_store, model.state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=CHUNK))
        await follower.consider(update)
        assert backend.model_version == "v1" and follower.prefetched == []
    finally:
        follower._drop_prefetch()
        await backend.close()


def test_the_next_name_is_the_trailing_number_plus_one() -> None:
    from fulmen_llm_proxy.following import next_name

    assert [next_name(n) for n in ("v7", "v9", "run2-step9", "base", None, "trained")] == [
        "v8", "v10", "run2-step10", "v1", "v1", "v1"]


async def _publish_and_serve(store: RedisStore, follower: ModelFollower, tmp_path: Path, n: int, seed: int,
                             **publish: object) -> ResourcesUpdate:
    """Publish a new tiny model as v<n>, have the follower take it, check it serves those very weights."""
    model, _ = load_tiny_model(build_tiny_model(tmp_path / f"m{n}", seed=seed))
    update = await publish_model_version(store, model.state_dict(), model="tiny", **publish)  # type: ignore[arg-type]
    await follower.consider(update)
    served, published = follower.backend.current_weights(), model.state_dict()
    assert follower.backend.model_version == f"v{n}" and served is not None
    assert all(torch.equal(served[k].float(), t.float()) for k, t in published.items())
    return update


async def test_a_proxy_reads_a_folder_version_while_it_is_written(
    real_store: RedisStore, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the trainer's shared folder known, the follower reads the next version's file as it is
    written and serves exactly the published weights, read once; then it knows the folder from the
    announcement alone, and a file written over a retired version's is served as published too."""
    from fulmen.versions import model_version as model_versions
    from fulmen.versions.retention import retain_versions

    shared = tmp_path / "shared"
    backend = TorchBackend(tiny_model)
    await backend.start()
    follower = ModelFollower(real_store, backend, lambda v, outcome: None, shared)
    usual_reads: list[str] = []
    real_read_file = model_versions.blobs.read_file

    def counting_read_file(path: Path):  # type: ignore[no-untyped-def]
        usual_reads.append(path.parent.name)
        return real_read_file(path)

    monkeypatch.setattr(model_versions.blobs, "read_file", counting_read_file)
    inodes: dict[int, int] = {}
    try:
        await follower.catch_up()
        for n in range(1, 6):
            follower._prefetch_next()
            assert follower._file_ahead is not None and follower._file_ahead.version == f"v{n}"
            update = await _publish_and_serve(real_store, follower, tmp_path, n, seed=10 + n, transport=FolderTransport(shared))
            inodes[n] = os.stat(update.resources["llm"]["weights"]["path"]).st_ino
            await retain_versions(real_store, 2, shared)  # v3 on is written over a retired version's file
            if n == 1:
                follower.shared_dir = None  # from here on, learnt from the announcements
        assert follower.prefetched == ["v1", "v2", "v3", "v4", "v5"] and usual_reads == []
        # the proxy let go of each file it read: v1's and v2's were free to be written over
        assert (inodes[4], inodes[5]) == (inodes[1], inodes[2])
        assert follower.shared_dir == shared.resolve()
    finally:
        follower._drop_prefetch()
        await backend.close()


async def test_each_version_is_read_into_the_last_ones_buffer_and_served_exactly(
    real_store: RedisStore, tiny_model: Path, tmp_path: Path
) -> None:
    """The blob buffer of a version, once its weights are in the model, takes the next version's bytes
    (no new memory per version); the weights served are each version's own, bit for bit."""
    backend = TorchBackend(tiny_model)
    await backend.start()
    follower = ModelFollower(real_store, backend, lambda v, outcome: None)
    try:
        await follower.catch_up()
        follower._prefetch_next()
        for n in range(1, 5):
            await _publish_and_serve(real_store, follower, tmp_path, n, seed=20 + n, transport=RedisTransport(chunk_bytes=CHUNK))
        assert follower.prefetched == ["v1", "v2", "v3", "v4"] and follower.buffers.reused == 3
    finally:
        follower._drop_prefetch()
        await backend.close()


def test_a_buffer_something_still_views_is_not_handed_out_again() -> None:
    from fulmen_llm_proxy.blob_buffer import ReusedBuffer

    buffers = ReusedBuffer()
    buffers.keep(bytearray(64))
    view = torch.frombuffer(buffers.kept, dtype=torch.uint8)  # a tensor still served from it
    assert len(buffers.allocate(64)) == 64 and buffers.reused == 0  # a new one
    buffers.keep(bytearray(64))
    assert len(buffers.allocate(32)) == 32 and buffers.reused == 0  # another size
    buffers.keep(bytearray(64))
    kept = id(buffers.kept)
    assert id(buffers.allocate(64)) == kept and buffers.reused == 1
    del view
