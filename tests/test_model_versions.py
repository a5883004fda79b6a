"""Model versions through the store: chunked (or shared-folder) weights plus a resources entry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import pytest
import torch
from redis_cluster import EmbeddedCluster

from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.records import ResourcesUpdate, TrainStep, WeightsChunk
from fulmen.store import RedisStore
from fulmen.telemetry.steps import append_step, latest_step, read_curve
from fulmen.versions.blobs import CHUNK_HEADER_BYTES
from fulmen.versions.model_version import (
    BASE_VERSION,
    POLICY_RESOURCES_ID,
    ModelVersion,
    PublishOptions,
    fetch_model_version,
    llm_resource,
    publish_model_version,
    wait_until_served,
)
from fulmen.versions.transport.folder import FolderTransport
from fulmen.versions.transport.redis import RedisTransport


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 16, generator=g),
        "layer.0.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(16, generator=g).to(torch.float16),
        "steps": torch.tensor([3, -1, 2**40], dtype=torch.int64),
        # the extremes of float32 (NaN and infinity are refused: test_non_finite_versions_are_refused)
        "odd": torch.tensor([-0.0, torch.finfo(torch.float32).max, torch.finfo(torch.float32).smallest_normal / 4]),
    }


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].contiguous().view(torch.uint8).equal(b[name].contiguous().view(torch.uint8)), name


async def test_chunked_round_trip_is_bit_exact(store: RedisStore) -> None:
    """A state dict split into many chunks comes back bit for bit, dtypes included."""
    weights = _state_dict()
    update = await publish_model_version(store, weights, model="tiny", transport=RedisTransport(chunk_bytes=500))
    llm = llm_resource(update)
    assert (
        llm is not None and llm["kind"] == "llm" and llm["model"] == "tiny" and llm["model_version"] == "v1"
    )
    entry = llm["weights"]
    assert entry["stream"] == store.keys.weights("v1")
    assert entry["chunks"] == -(-entry["bytes"] // 500) > 4
    assert await store.redis.xlen(entry["stream"]) == entry["chunks"]
    _assert_bitwise_equal(await fetch_model_version(store, "v1"), weights)
    _assert_bitwise_equal(await fetch_model_version(store, "v1", resource=llm), weights)


async def test_default_versions_count_up_and_resources_carry_over(store: RedisStore) -> None:
    """Default names go v1, v2, …; earlier resources and llm keys carry over; extras and metadata apply."""
    await store.resources.add_resources({"prompt": "Q: {q}", "llm": {"endpoint": "http://proxy"}}, "policy")
    first = await publish_model_version(store, _state_dict(0), model="tiny", options=PublishOptions(metadata={"step": 1}))
    second = await publish_model_version(
        store, _state_dict(1), model="tiny", options=PublishOptions(extra_resources={"prompt": "new"}, metadata={"step": 2})
    )
    assert [llm_resource(u)["model_version"] for u in (first, second)] == ["v1", "v2"]  # type: ignore[index]
    assert first.resources["prompt"] == "Q: {q}" and second.resources["prompt"] == "new"
    assert second.resources["llm"]["endpoint"] == "http://proxy"
    assert second.metadata == {"step": 2} and second.version > first.version
    latest = await store.resources.get_resources("policy")
    assert latest == second
    _assert_bitwise_equal(await fetch_model_version(store, "v1"), _state_dict(0))
    _assert_bitwise_equal(await fetch_model_version(store, "v2"), _state_dict(1))


async def test_new_resources_id_is_created_and_taken_default_names_are_skipped(store: RedisStore) -> None:
    """A new resources id is created; a default name already used elsewhere is skipped, not reused."""
    await publish_model_version(store, _state_dict(0), model="a", options=PublishOptions(resources_id="policy-a"))
    update = await publish_model_version(store, _state_dict(1), model="b", options=PublishOptions(resources_id="policy-b"))
    assert update.resources_id == "policy-b"
    assert llm_resource(update)["model_version"] == "v2"  # type: ignore[index]
    _assert_bitwise_equal(await fetch_model_version(store, "v1"), _state_dict(0))


async def test_resources_are_published_after_every_chunk(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the resources entry is published, all the version's chunks are already on the stream."""
    seen: list[int] = []
    publish = store.resources.add_resources

    async def spy(resources: dict, resources_id: str | None = None, metadata: dict | None = None):  # type: ignore[no-untyped-def]
        seen.append(await store.redis.xlen(resources["llm"]["weights"]["stream"]))
        return await publish(resources, resources_id, metadata)

    monkeypatch.setattr(store.resources, "add_resources", spy)
    update = await publish_model_version(store, _state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=300))
    assert seen == [llm_resource(update)["weights"]["chunks"]]  # type: ignore[index]


async def test_a_chunk_refused_with_others_in_flight_leaves_no_version(
    real_store: RedisStore, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks go out several at a time before their replies are read (`fulmen.versions.blobs`): one
    refused by Redis half-way (here an entry slipped in ahead of it) fails the publish, deletes what
    was written, publishes no resources version, and leaves the client usable."""
    import redis

    from fulmen.versions import blobs as version_blobs

    chunks = version_blobs.Blob.chunks
    other = redis.Redis.from_url(redis_url)

    def meddling(blob: version_blobs.Blob, chunk_bytes: int):  # type: ignore[no-untyped-def]
        for n, piece in enumerate(chunks(blob, chunk_bytes)):
            if n == 5:  # chunk 0, the claim, is on the stream: an entry past the next ids
                other.xadd(real_store.keys.weights("v1"), {"x": b"1"}, id="0-1000")
            yield piece

    monkeypatch.setattr(version_blobs.Blob, "chunks", meddling)
    try:
        with pytest.raises(Exception, match="equal or smaller"):
            await publish_model_version(real_store, _state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=100))
    finally:
        other.close()
    assert not await real_store.redis.exists(real_store.keys.weights("v1"))
    with pytest.raises(NotFound):
        await real_store.resources.get_resources(POLICY_RESOURCES_ID)
    monkeypatch.undo()
    await publish_model_version(real_store, _state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=100))
    _assert_bitwise_equal(await fetch_model_version(real_store, "v1"), _state_dict())


async def test_an_unreadable_policy_entry_is_replaced_by_the_next_publish(
    store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy version no reader decodes (an llm model_version of 5), forced past the store's check,
    does not stop publishing: the next publish goes on from the version before it, names the next
    model version, warns, and moves the bad entry to the dead letters with the reason."""
    await publish_model_version(store, _state_dict(), model="tiny")
    forced = int(await store.redis.get(store.keys.resources_version)) + 1
    llm = {"kind": "llm", "model": "tiny", "model_version": 5}
    bad = ResourcesUpdate(POLICY_RESOURCES_ID, forced, {"llm": llm}, time.time()).to_wire()
    key = store.keys.resources(POLICY_RESOURCES_ID)
    # as the store's publish script writes a version (counter, hash, log), without the writer's check
    await store.redis.set(store.keys.resources_version, forced)
    await store.redis.hset(key, mapping={str(forced): bad, "latest": forced})
    await store.redis.xadd(store.keys.resources_log, {"m": bad})
    with pytest.raises(RecordError, match="model_version 5"):
        await store.resources.get_resources(POLICY_RESOURCES_ID)
    with caplog.at_level(logging.WARNING):
        update = await publish_model_version(store, _state_dict(1), model="tiny")
    current = await store.resources.get_resources(POLICY_RESOURCES_ID)
    assert current == update and current.version == forced + 1
    assert llm_resource(current)["model_version"] == "v2"  # type: ignore[index]
    assert f"version {forced} cannot be read" in caplog.text and "model_version 5" in caplog.text
    _assert_bitwise_equal(await fetch_model_version(store, "v2"), _state_dict(1))
    [letter] = await store.dead_letters.query_dead_letters()
    assert (letter.source, letter.entry_id, letter.payload) == (key, str(forced), {"m": bad})
    assert f"replaced by version {forced + 1}" in letter.reason and "model_version 5" in letter.reason


async def test_explicit_existing_version_is_refused(store: RedisStore) -> None:
    """Publishing a version name twice is refused: versions are immutable."""
    await publish_model_version(store, _state_dict(0), model="tiny", model_version="step-7")
    with pytest.raises(InvalidInput, match="exists already"):
        await publish_model_version(store, _state_dict(1), model="tiny", model_version="step-7")
    _assert_bitwise_equal(await fetch_model_version(store, "step-7"), _state_dict(0))


async def test_concurrent_publishers_of_one_name_never_mix_chunks(real_store: RedisStore) -> None:
    """Two publishers racing for one name: exactly one wins, and its weights are intact."""
    results = await asyncio.gather(
        *(
            publish_model_version(real_store, _state_dict(i), model="t", model_version="v9", transport=RedisTransport(chunk_bytes=200))
            for i in range(2)
        ),
        return_exceptions=True,
    )
    assert sorted(type(r).__name__ for r in results) == ["InvalidInput", "ResourcesUpdate"]
    winner = next(i for i, r in enumerate(results) if not isinstance(r, BaseException))
    _assert_bitwise_equal(await fetch_model_version(real_store, "v9"), _state_dict(winner))


async def test_missing_version_is_not_found(store: RedisStore) -> None:
    """Fetching a version nobody published raises NotFound."""
    with pytest.raises(NotFound, match="v404"):
        await fetch_model_version(store, "v404")


async def test_missing_chunk_is_a_record_error(store: RedisStore) -> None:
    """A chunk deleted from the middle (or the end) of the stream makes the fetch fail clearly."""
    update = await publish_model_version(store, _state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=400))
    key = llm_resource(update)["weights"]["stream"]  # type: ignore[index]
    last = (await store.redis.xrevrange(key, count=1))[0][0]
    await store.redis.xdel(key, last)
    with pytest.raises(RecordError, match="incomplete"):
        await fetch_model_version(store, "v1")
    await store.redis.xdel(key, "0-2")
    with pytest.raises(RecordError, match=r"expected chunk 1 .* found chunk 2"):
        await fetch_model_version(store, "v1")


async def test_pages_read_ahead_come_back_in_order_and_gaps_are_refused(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several XRANGE pages in flight at once (`fulmen.versions.transport.stream`), the chunks still come
    back in order, bit for bit; a chunk missing from a page in the middle, or the stream's end, is
    refused as before."""
    from fulmen.versions.transport import stream as version_stream

    monkeypatch.setattr(version_stream, "READ_PAGE_BYTES", 1000)  # 2 chunks a page
    weights = _state_dict()
    update = await publish_model_version(store, weights, model="tiny", transport=RedisTransport(chunk_bytes=500))
    entry = llm_resource(update)["weights"]  # type: ignore[index]
    assert entry["chunks"] > 2 * (1 + version_stream.PAGES_AHEAD)
    _assert_bitwise_equal(await fetch_model_version(store, "v1"), weights)
    key = entry["stream"]
    entries = await store.redis.xrange(key)
    await store.redis.xdel(key, f"0-{entry['chunks']}")
    with pytest.raises(RecordError, match="incomplete"):
        await fetch_model_version(store, "v1")
    await store.redis.xdel(key, "0-6")  # chunk 5: the third page's first
    with pytest.raises(RecordError, match=r"expected chunk 5 .* found chunk 6"):
        await fetch_model_version(store, "v1")
    await store.redis.delete(key)  # whole again, one byte of a tensor in a late page flipped
    for n, (_, fields) in enumerate(entries, start=1):
        data = fields[b"d"] if n != len(entries) - 1 else bytes([fields[b"d"][0] ^ 1]) + fields[b"d"][1:]
        await store.redis.xadd(key, {"m": fields[b"m"], "d": data}, id=f"0-{n}")
    with pytest.raises(RecordError, match=r"corrupt: .* manifest's sha256"):
        await fetch_model_version(store, "v1")


@pytest.mark.parametrize("where", ["header", "tensors"])
async def test_corrupt_chunk_is_a_record_error(store: RedisStore, where: str) -> None:
    """A chunk whose bytes changed fails the sha256 check, never loads silently: in the header (its
    sha256 is the one published) or in a tensor's bytes (its sha256 in the manifest)."""
    update = await publish_model_version(store, _state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=400))
    key = llm_resource(update)["weights"]["stream"]  # type: ignore[index]
    entries = await store.redis.xrange(key)
    await store.redis.delete(key)
    for n, (_, fields) in enumerate(entries, start=1):
        data = fields[b"d"]
        if n == (2 if where == "header" else len(entries)):
            data = bytes([data[0] ^ 1]) + data[1:]
        await store.redis.xadd(key, {"m": fields[b"m"], "d": data}, id=f"0-{n}")
    with pytest.raises(RecordError, match="corrupt: sha256" if where == "header" else "corrupt: .* manifest's sha256"):
        await fetch_model_version(store, "v1")
    await store.redis.xadd(key, {"m": b"not msgpack"}, id=f"0-{len(entries) + 1}")
    await store.redis.xdel(key, f"0-{len(entries)}")
    with pytest.raises(RecordError):
        await fetch_model_version(store, "v1")


async def test_chunks_with_their_bytes_inside_the_record_still_read(store: RedisStore) -> None:
    """Chunks written before the bytes moved beside the record (inside its msgpack) read back the
    same; a chunk holding its bytes in both places is refused."""
    weights = _state_dict()
    update = await publish_model_version(store, weights, model="tiny", transport=RedisTransport(chunk_bytes=400))
    key = llm_resource(update)["weights"]["stream"]  # type: ignore[index]
    entries = await store.redis.xrange(key)
    assert all(WeightsChunk.from_wire(fields[b"m"]).data == b"" for _, fields in entries)
    await store.redis.delete(key)
    for n, (_, fields) in enumerate(entries, start=1):
        c = WeightsChunk.from_wire(fields[b"m"])
        inside = WeightsChunk(c.model_version, c.index, c.total, c.sha256, c.size, fields[b"d"])
        await store.redis.xadd(key, {"m": inside.to_wire()}, id=f"0-{n}")
    _assert_bitwise_equal(await fetch_model_version(store, "v1"), weights)
    await store.redis.xadd(key, {"m": inside.to_wire(), "d": fields[b"d"]}, id=f"0-{len(entries) + 1}")
    await store.redis.xdel(key, f"0-{len(entries)}")
    with pytest.raises(RecordError, match="twice"):
        await fetch_model_version(store, "v1")


async def test_oversize_chunk_is_refused_before_writing(store: RedisStore) -> None:
    """chunk_bytes beyond the store's record limit is refused up front; nothing is written."""
    small = RedisStore(store.redis, store.experiment, max_record_bytes=64 * 1024)
    with pytest.raises(InvalidInput, match="chunk_bytes"):
        await publish_model_version(small, _state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=64 * 1024))
    assert not await store.redis.exists(store.keys.weights("v1"))
    with pytest.raises(NotFound):
        await store.resources.get_resources("policy")
    update = await publish_model_version(
        small, _state_dict(), model="tiny", transport=RedisTransport(chunk_bytes=64 * 1024 - CHUNK_HEADER_BYTES)
    )
    assert llm_resource(update)["weights"]["chunks"] == 1  # type: ignore[index]


async def test_shared_folder_round_trip(store: RedisStore, tmp_path: Path) -> None:
    """With shared_dir the weights go to <dir>/<version>/model.safetensors and fetch reads them there."""
    weights = _state_dict()
    update = await publish_model_version(store, weights, model="tiny", transport=FolderTransport(tmp_path))
    entry = llm_resource(update)["weights"]  # type: ignore[index]
    assert Path(entry["path"]) == (tmp_path / "v1" / "model.safetensors").resolve()
    assert Path(entry["path"]).stat().st_size == entry["bytes"]
    assert not await store.redis.exists(store.keys.weights("v1"))
    _assert_bitwise_equal(await fetch_model_version(store, "v1"), weights)  # found via the resources log
    _assert_bitwise_equal(await fetch_model_version(store, "v1", resource=llm_resource(update)), weights)
    Path(entry["path"]).write_bytes(Path(entry["path"]).read_bytes()[:-1] + b"!")
    with pytest.raises(RecordError, match="corrupt"):
        await fetch_model_version(store, "v1")


async def test_tied_and_non_contiguous_tensors_publish(store: RedisStore) -> None:
    """Tensors sharing memory (tied embeddings) and transposed views publish and fetch as values."""
    embed = torch.randn(8, 4)
    weights = {"embed": embed, "lm_head": embed, "t": torch.randn(3, 5).t()}
    await publish_model_version(store, weights, model="tiny")
    fetched = await fetch_model_version(store, "v1")
    assert all(torch.equal(fetched[n], weights[n]) for n in weights)


async def test_llm_resource_is_none_without_llm(store: RedisStore) -> None:
    """llm_resource returns None for resources without an llm entry."""
    update = await store.resources.add_resources({"prompt": "hi"})
    assert llm_resource(update) is None


def test_a_model_version_is_one_value_with_a_number_and_a_name() -> None:
    """A name parses to (number, name) in one place; names given by hand and the base weights are 0."""
    assert ModelVersion.parse("v12") == ModelVersion(12, "v12") == ModelVersion.numbered(12)
    assert ModelVersion.parse("base") == ModelVersion.parse(None) == ModelVersion.numbered(0) == BASE_VERSION
    assert ModelVersion.parse("trained-1") == ModelVersion(0, "trained-1")
    assert ModelVersion.parse("v") == ModelVersion(0, "v") and str(ModelVersion(3, "v3")) == "v3"


async def test_published_versions_are_numbered_from_the_previous_one(store: RedisStore) -> None:
    """ModelVersion.of reads what a resources update names; the next default version counts on from it."""
    first = await publish_model_version(store, _state_dict(0), model="tiny")
    second = await publish_model_version(store, _state_dict(1), model="tiny")
    assert [ModelVersion.of(u) for u in (first, second)] == [ModelVersion(1, "v1"), ModelVersion(2, "v2")]
    assert ModelVersion.of(await store.resources.get_resources(POLICY_RESOURCES_ID)) == ModelVersion(2, "v2")


async def test_waiting_for_proxies_gives_up_when_none_serves_the_version(store: RedisStore) -> None:
    """No live proxy: the wait ends False at its timeout rather than hanging."""
    assert not await wait_until_served(store, ModelVersion(1, "v1"), timeout_s=0.2, poll_s=0.05)


async def test_the_steps_stream_gives_progress_and_one_point_per_step(real_store: RedisStore) -> None:
    """latest_step is the last summary's step (0 before any); read_curve keeps the latest summary of a
    step trained again after a restart, in step order."""
    assert await latest_step(real_store.redis, real_store.keys) == 0
    for step, reward in [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.35), (4, 0.4)]:  # step 3 trained twice
        await append_step(real_store.redis, real_store.keys, TrainStep(step, f"v{step}", reward, 0.0, 8, 0.0))
    assert await latest_step(real_store.redis, real_store.keys) == 4
    curve = await read_curve(real_store.redis, real_store.keys)
    assert [(s.step, s.reward_mean) for s in curve] == [(1, 0.1), (2, 0.2), (3, 0.35), (4, 0.4)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_non_finite_versions_are_refused(store: RedisStore, tmp_path: Path, bad: float) -> None:
    """Publishing weights with a NaN or infinity is refused; such a version written anyway is refused on fetch."""
    weights = {**_state_dict(), "layer.0.bias": torch.tensor([0.0, bad]).to(torch.float16)}
    with pytest.raises(InvalidInput, match="NaN or infinite"):
        await publish_model_version(store, weights, model="tiny")
    assert await store.resources.get_latest_resources() is None
    # written by hand, past the publisher's check (a foreign writer): every fetch refuses it
    from safetensors.torch import save

    blob = save(weights)
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(RecordError, match="NaN or infinite"):
        await fetch_model_version(store, "v9", resource={"weights": {"path": str(path)}})


async def test_weights_path_naming_a_fifo_is_refused(store: RedisStore, tmp_path: Path) -> None:
    """A weights path that names a FIFO (or any non-regular file) is refused at once, not read."""
    import os

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    try:
        with pytest.raises(RecordError, match="not a regular file"):
            await asyncio.wait_for(fetch_model_version(store, "v9", resource={"path": str(fifo)}), 30)
    finally:
        # Without the fix a thread is blocked opening the FIFO: a writer's open releases it.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


async def test_weights_round_trip_on_a_redis_cluster(
    redis_cluster: EmbeddedCluster, experiment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster client has no single connection to send chunks on in order: they go in pipelines.
    Pages are read ahead the same, and retention's AOF check leaves the cluster's own rule alone."""
    from fulmen.store.redis.aof import rewrite_if_grown
    from fulmen.store.redis.connection import async_client
    from fulmen.versions.retention import retain_versions
    from fulmen.versions.transport import stream as version_stream

    monkeypatch.setattr(version_stream, "READ_PAGE_BYTES", 1000)
    client = async_client(redis_cluster.url)
    await client.ping()
    try:
        store = RedisStore(client, experiment)
        for seed in (0, 1):
            await publish_model_version(store, _state_dict(seed), model="tiny", transport=RedisTransport(chunk_bytes=500))
        _assert_bitwise_equal(await fetch_model_version(store, "v2"), _state_dict(1))
        assert await retain_versions(store, 1) == ["v1"]
        assert not await rewrite_if_grown(client, min_bytes=1)
    finally:
        await client.aclose()
