"""A/B serving (issue 16, item 6): two versions at once, rollouts split by a stable hash, every call of a
rollout served by one version, reward reported per version; `--off` and a new trainer version end it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.errors import InvalidInput
from fulmen.serving.ab import arm_of, start_ab, stop_ab
from fulmen.store import RedisStore
from fulmen.versions.folder import base_weights
from fulmen.versions.model_version import llm_resource, publish_model_version
from fulmen.versions.retention import retain_versions, stored_versions
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.backends.torch.backend import TorchBackend
from fulmen_llm_proxy.following import ModelFollower


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_the_split_is_stable_and_near_the_fraction() -> None:
    ids = [f"ro-{i}" for i in range(4000)]
    arms = [arm_of(r, 0.3) for r in ids]
    assert arms == [arm_of(r, 0.3) for r in ids]  # the same answer every time (and on every proxy)
    assert 0.27 < arms.count("b") / len(ids) < 0.33
    assert arm_of("", 0.9) == "a" and arm_of("ro-1", 0.0) == "a"
    # a rollout in B at a small split stays in B at a larger one: growing B moves rollouts one way only
    assert all(arm_of(r, 0.5) == "b" for r in ids if arm_of(r, 0.3) == "b")


async def _call(backend: TorchBackend, rollout_id: str) -> str:
    body = {"model": "tiny", "prompt": [1, 5, 9], "max_tokens": 4, "temperature": 0}
    result = Result()
    await backend.complete(Call("text_completion", body, "tiny", False, 4, 0.0, 1.0, None, [], rollout_id=rollout_id), result)
    return result.model_version


async def test_a_torch_proxy_serves_both_versions_by_rollout(real_store: RedisStore, tiny: Path) -> None:
    for i in range(1, 4):
        g = torch.Generator().manual_seed(i)
        await publish_model_version(real_store, {n: t + 0.05 * torch.randn(t.shape, generator=g)
                                                 for n, t in base_weights(tiny).items()}, model="tiny")
    backend = TorchBackend(tiny)
    await backend.start()
    follower = ModelFollower(real_store, backend, lambda v, o: None)
    try:
        await follower.catch_up()
        assert backend.model_version == "v3" and backend.b is None
        await follower.consider(await start_ab(real_store, "v1", "v2", 0.5))
        assert (backend.model_version, backend.b_version, backend.split) == ("v1", "v2", 0.5)
        ids = [f"ro-{i}" for i in range(16)]
        served = {r: await _call(backend, r) for r in ids}
        assert served == {r: "v2" if arm_of(r, 0.5) == "b" else "v1" for r in ids}
        assert set(served.values()) == {"v1", "v2"}
        assert await _call(backend, ids[0]) == served[ids[0]]  # every call of a rollout: one version
        # B is kept by retention while the test runs, like the served A
        await retain_versions(real_store, 1)
        assert await stored_versions(real_store) == ["v1", "v2", "v3"]

        await follower.consider(await stop_ab(real_store))
        assert backend.b is None and {await _call(backend, r) for r in ids} == {"v1"}
        await follower.consider(await start_ab(real_store, "v1", "v3", 0.2))
        assert backend.b_version == "v3"
        # a new version from the trainer ends the test
        update = await publish_model_version(real_store, base_weights(tiny), model="tiny")
        assert "ab" not in llm_resource(update)
        await follower.consider(update)
        assert backend.model_version == "v4" and backend.b is None
    finally:
        await backend.close()


async def test_bad_tests_are_refused(real_store: RedisStore, tiny: Path) -> None:
    with pytest.raises(InvalidInput, match="nothing was published"):
        await start_ab(real_store, "v1", "v2")
    await publish_model_version(real_store, base_weights(tiny), model="tiny")
    with pytest.raises(InvalidInput, match="two versions"):
        await start_ab(real_store, "v1", "v1")
    with pytest.raises(InvalidInput, match="v5 was never published"):
        await start_ab(real_store, "v1", "v5")
    with pytest.raises(InvalidInput, match="strictly between 0 and 1"):
        await start_ab(real_store, "v1", "v5", split=1.0)
    with pytest.raises(InvalidInput, match="not in A/B mode"):
        await stop_ab(real_store)
