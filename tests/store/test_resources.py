"""Resources: immutable versioned snapshots, 'latest', queries and subscriptions."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from fulmen.errors import InvalidInput, NotFound
from fulmen.records import ResourcesUpdate
from fulmen.store import RedisStore

BlockedReader = Callable[[aioredis.Redis], Awaitable[None]]  # the conftest.py fixture


def _versions(updates: list[ResourcesUpdate]) -> list[tuple[str, int]]:
    return [(u.resources_id, u.version) for u in updates]


async def test_add_and_update_versions(store: RedisStore) -> None:
    """add_resources creates version 1; update_resources adds versions; each stays readable."""
    first = await store.resources.add_resources({"prompt": "v1"}, "main", metadata={"by": "apo"})
    assert (first.resources_id, first.version, first.resources) == ("main", 1, {"prompt": "v1"})
    assert first.metadata == {"by": "apo"}
    second = await store.resources.update_resources("main", {"prompt": "v2"})
    assert (second.resources_id, second.version, second.metadata) == ("main", 2, {})
    assert await store.resources.get_resources("main") == second
    assert await store.resources.get_resources("main", version=1) == first
    assert await store.resources.get_resources("main", version=2) == second
    assert second.create_time >= first.create_time


async def test_add_with_existing_id_is_refused(store: RedisStore) -> None:
    """Adding resources under an existing id raises and leaves every version as it was."""
    first = await store.resources.add_resources({"prompt": "v1"}, "main")
    with pytest.raises(InvalidInput, match="resources main exist already"):
        await store.resources.add_resources({"prompt": "other"}, "main")
    assert await store.resources.get_resources("main") == first
    assert await store.resources.query_resources() == [first]
    assert (await store.resources.add_resources({"x": 1}, "second")).version == 2  # no version was used up


async def test_versions_are_immutable(store: RedisStore) -> None:
    """A published snapshot does not change when the caller's dict changes or newer versions come."""
    payload = {"prompt": "v1", "nested": {"k": [1, 2]}}
    first = await store.resources.add_resources(payload, "main")
    payload["prompt"] = "mutated"
    await store.resources.update_resources("main", {"prompt": "v2"})
    await store.resources.update_resources("main", {"prompt": "v3"})
    old = await store.resources.get_resources("main", version=1)
    assert old.resources == {"prompt": "v1", "nested": {"k": [1, 2]}}
    assert old == first


async def test_generated_ids(store: RedisStore) -> None:
    """Resources added without an id get one from their version."""
    a = await store.resources.add_resources({"a": 1})
    b = await store.resources.add_resources({"b": 2})
    assert _versions([a, b]) == [("res-1", 1), ("res-2", 2)]
    assert await store.resources.get_resources("res-2") == b


async def test_latest_is_the_last_published(store: RedisStore) -> None:
    """get_latest_resources is None before any publish, then the last version of any id."""
    assert await store.resources.get_latest_resources() is None
    await store.resources.add_resources({"p": 1}, "a")
    b = await store.resources.add_resources({"p": 2}, "b")
    assert await store.resources.get_latest_resources() == b
    a2 = await store.resources.update_resources("a", {"p": 3})
    assert await store.resources.get_latest_resources() == a2
    assert (await store.statistics())["latest_resources"] == {"resources_id": "a", "version": 3}


async def test_get_unknown_resources_raises_not_found(store: RedisStore) -> None:
    """An unknown id or version raises NotFound naming it."""
    with pytest.raises(NotFound, match=r"resources nope \(version latest\) do not exist"):
        await store.resources.get_resources("nope")
    await store.resources.add_resources({"p": 1}, "main")
    with pytest.raises(NotFound, match=r"resources main \(version 7\) do not exist"):
        await store.resources.get_resources("main", version=7)


async def test_invalid_resources_id_is_refused(store: RedisStore) -> None:
    """A resources id with forbidden characters raises InvalidInput; nothing is published."""
    with pytest.raises(InvalidInput, match="resources_id 'a b' is invalid"):
        await store.resources.add_resources({"p": 1}, "a b")
    with pytest.raises(InvalidInput, match="resources_id 'a/b' is invalid"):
        await store.resources.update_resources("a/b", {"p": 1})
    assert await store.resources.query_resources() == []


async def test_resources_the_readers_refuse_are_refused_when_written(store: RedisStore) -> None:
    """add_resources and update_resources refuse what get_resources would refuse (an llm model_version
    that is not a name), naming the field; nothing is published and no version is used up."""
    bad = {"llm": {"kind": "llm", "model": "m", "model_version": 5}}
    with pytest.raises(InvalidInput, match=r"resources policy cannot be published: .*model_version 5 is not a name"):
        await store.resources.add_resources(bad, "policy")
    first = await store.resources.add_resources({"llm": {"kind": "llm", "model": "m", "model_version": "v1"}}, "policy")
    with pytest.raises(InvalidInput, match="model_version 5 is not a name"):
        await store.resources.update_resources("policy", bad)
    assert first.version == 1
    assert await store.resources.get_resources("policy") == first
    assert await store.resources.query_resources() == [first]


async def test_query_resources_order_and_pages(store: RedisStore) -> None:
    """query_resources lists versions in publication order, reversed on request, paginated."""
    await store.resources.add_resources({"p": 1}, "a")
    await store.resources.add_resources({"p": 2}, "b")
    await store.resources.update_resources("a", {"p": 3})
    await store.resources.update_resources("b", {"p": 4})
    assert _versions(await store.resources.query_resources()) == [("a", 1), ("b", 2), ("a", 3), ("b", 4)]
    assert _versions(await store.resources.query_resources(descending=True)) == [("b", 4), ("a", 3), ("b", 2), ("a", 1)]
    assert _versions(await store.resources.query_resources(limit=2)) == [("a", 1), ("b", 2)]
    assert _versions(await store.resources.query_resources(limit=2, offset=1)) == [("b", 2), ("a", 3)]
    assert _versions(await store.resources.query_resources(descending=True, limit=1)) == [("b", 4)]
    assert await store.resources.query_resources(offset=10) == []


async def test_concurrent_publishers_get_distinct_ordered_versions(real_store: RedisStore) -> None:
    """Concurrent publishes get distinct versions and enter the log in version order."""
    await asyncio.gather(*(real_store.resources.update_resources("main", {"i": i}) for i in range(10)))
    versions = [u.version for u in await real_store.resources.query_resources()]
    assert versions == list(range(1, 11))
    assert (await real_store.resources.get_latest_resources()).version == 10
    assert (await real_store.resources.get_resources("main")).version == 10


async def test_subscribe_yields_new_versions(real_store: RedisStore, blocked_reader: BlockedReader) -> None:
    """A subscription yields the versions published after it started, in order, and none before."""
    store = real_store
    await store.resources.add_resources({"p": 0}, "main")
    updates = store.resources.subscribe_resources()
    task = asyncio.create_task(anext(updates))
    await blocked_reader(store.redis)
    second = await store.resources.update_resources("main", {"p": 1})
    third = await store.resources.add_resources({"q": 1}, "other")
    assert await asyncio.wait_for(task, 5) == second
    assert await asyncio.wait_for(anext(updates), 5) == third
    await updates.aclose()


async def test_subscribe_after_version_replays_later_versions(
    real_store: RedisStore, blocked_reader: BlockedReader
) -> None:
    """A subscription after version n yields every version above n, then new ones as they come."""
    store = real_store
    for i in range(3):
        await store.resources.update_resources("main", {"p": i})
    updates = store.resources.subscribe_resources(after_version=1)
    assert [(await asyncio.wait_for(anext(updates), 5)).version for _ in range(2)] == [2, 3]
    task = asyncio.create_task(anext(updates))
    await blocked_reader(store.redis)
    fourth = await store.resources.update_resources("main", {"p": 3})
    assert await asyncio.wait_for(task, 5) == fourth
    await updates.aclose()
