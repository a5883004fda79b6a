"""The store's validation passes: oldest first, one per label, unreadable entries skipped."""

from __future__ import annotations

from fulmen.store import RedisStore


async def test_passes_are_one_per_label_oldest_first_and_the_newest_bound_holds(real_store: RedisStore) -> None:
    await real_store.validations.append({"label": "v0", "accuracy": 0.4})
    await real_store.validations.append({"label": "v2", "accuracy": 0.5})
    await real_store.validations.append({"label": "v2", "accuracy": 0.9})  # the same pass run twice
    await real_store.redis.xadd(real_store.keys.validations, {"m": b"not json"})
    await real_store.redis.xadd(real_store.keys.validations, {"other": b"{}"})
    await real_store.validations.append({"label": "v4", "accuracy": 0.7})
    passes = await real_store.validations.passes()
    assert [(p["label"], p["accuracy"]) for p in passes] == [("v0", 0.4), ("v2", 0.5), ("v4", 0.7)]
    assert [p["label"] for p in await real_store.validations.passes(newest=3)] == ["v4"]
    assert [p["label"] for p in await real_store.validations.passes(newest=4)] == ["v2", "v4"]
