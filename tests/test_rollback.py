"""`fulmen rollback VERSION` (issue 16, item 6): an older stored version becomes the served one, the
proxies follow it like a new version, retention keeps it, later versions never reuse a deleted
name, and what cannot come back is refused with the reason."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fulmen.cli.main import app
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.errors import InvalidInput
from fulmen.serving.rollback import rollback
from fulmen.store import RedisStore
from fulmen.versions.folder import base_weights
from fulmen.versions.manifest import tensor_sha256
from fulmen.versions.model_version import (
    ModelVersion,
    llm_resource,
    next_model_version,
    publish_model_version,
)
from fulmen.versions.retention import retain_versions, stored_versions

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _version(tiny: Path, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in base_weights(tiny).items()}


async def _publish(store: RedisStore, tiny: Path, count: int) -> None:
    for i in range(1, count + 1):
        await publish_model_version(store, _version(tiny, i), model="tiny")


async def test_a_rollback_is_followed_kept_and_never_renamed(real_store: RedisStore, tiny: Path) -> None:
    from fulmen_llm_proxy.backends.torch.backend import TorchBackend
    from fulmen_llm_proxy.following import ModelFollower

    await _publish(real_store, tiny, 6)
    await retain_versions(real_store, 4)
    assert await stored_versions(real_store) == ["v3", "v4", "v5", "v6"]
    update = await rollback(real_store, "v3")
    llm = llm_resource(update)
    assert llm["model_version"] == "v3" and llm["rollback"]["from"] == "v6" and llm["newest_version"] == "v6"

    backend = TorchBackend(tiny)  # a proxy follows it as it follows a new version
    await backend.start()
    follower = ModelFollower(real_store, backend, lambda v, o: None)
    await follower.catch_up()
    assert backend.model_version == "v3"
    # it reads ahead the version the trainer publishes next: after the newest, not after v3
    assert follower._prefetch is not None and follower._prefetch[0] == "v7"
    follower._drop_prefetch()
    served = backend.current_weights()
    assert all(tensor_sha256(served[n]) == tensor_sha256(t) for n, t in _version(tiny, 3).items())
    await backend.close()

    # retention keeps the named version even when it is not among the newest
    assert await retain_versions(real_store, 1) == ["v4", "v5"]
    assert await stored_versions(real_store) == ["v3", "v6"]
    # the next version comes after the newest ever published, never a deleted name
    assert await next_model_version(real_store) == ModelVersion(7, "v7")
    nxt = llm_resource(await publish_model_version(real_store, _version(tiny, 7), model="tiny"))
    assert nxt["model_version"] == "v7" and "rollback" not in nxt and "newest_version" not in nxt


async def test_what_cannot_come_back_is_refused_with_the_reason(real_store: RedisStore, tiny: Path) -> None:
    with pytest.raises(InvalidInput, match="nothing was published"):
        await rollback(real_store, "v1")
    await _publish(real_store, tiny, 3)
    await retain_versions(real_store, 2)
    with pytest.raises(InvalidInput, match=r"weights of v1 were deleted.*stored versions: v2, v3"):
        await rollback(real_store, "v1")
    with pytest.raises(InvalidInput, match="v9 was never published"):
        await rollback(real_store, "v9")
    with pytest.raises(InvalidInput, match="v3 is the version 'policy' serves already"):
        await rollback(real_store, "v3")


def test_the_command_rolls_back_and_status_shows_it(tiny: Path, redis_url: str, experiment: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import redis.asyncio as aioredis

    async def publish() -> None:
        client = aioredis.from_url(redis_url)
        try:
            await _publish(RedisStore(client, experiment), tiny, 2)
        finally:
            await client.aclose()

    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)
    asyncio.run(publish())
    result = runner.invoke(app, ["rollback", "v1"])
    assert result.exit_code == 0, result.output
    assert "rolled back from v2 to v1" in result.stdout
    status = runner.invoke(app, ["status", "--json"])
    versions = json.loads(status.stdout)["model_versions"]
    assert versions["serving"] == "v1" and versions["rollback"]["from"] == "v2" and versions["stored"] == ["v1", "v2"]
    bad = runner.invoke(app, ["rollback", "v7"])
    assert bad.exit_code == 1 and "v7 was never published" in bad.output
    # fulmen ab: the same versions, served side by side
    started = runner.invoke(app, ["ab", "v1", "v2", "--split", "0.25"])
    assert started.exit_code == 0 and "v2 serves 25% of rollouts, v1 the rest" in started.stdout
    status = runner.invoke(app, ["status", "--json"])
    assert json.loads(status.stdout)["model_versions"]["ab"] == {"b": "v2", "split": 0.25}
    assert "A/B test" in runner.invoke(app, ["status"]).stdout
    assert runner.invoke(app, ["ab", "--off"]).exit_code == 0
    assert json.loads(runner.invoke(app, ["status", "--json"]).stdout)["model_versions"]["ab"] is None
    assert runner.invoke(app, ["ab", "v1"]).exit_code == 2
