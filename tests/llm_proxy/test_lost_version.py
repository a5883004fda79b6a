"""A proxy that starts after Redis lost the newest version's chunks (the trainer stopped) never serves
its base weights meanwhile: it is not ready, /readyz names the version it waits for, new calls wait,
and it asks for a rebuild (`fulmen.versions.rebuild_asks`). `fulmen rollback <served>` rebuilds it,
or a trainer answers the ask; a refusal keeps it waiting and says why. The loss is simulated by
deleting the chunk streams (tests/rebuild_helpers.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from proxy_helpers import RunningProxy
from rebuild_helpers import on_store, serves_manifest, train_then_lose, until
from typer.testing import CliRunner

from fulmen.cli.main import app
from fulmen.records import VersionRebuild
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.versions.rebuild import rebuild_version
from fulmen.versions.rebuild_asks import answer_asks
from fulmen_llm_proxy.backends.torch.backend import TorchBackend
from fulmen_llm_proxy.following import ModelFollower

runner = CliRunner()


def test_a_proxy_started_after_the_loss_waits_for_the_newest_version_then_serves_it_rebuilt(
        tiny_model: Path, redis_url: str, experiment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer stopped: the proxy is not ready naming v2, `fulmen rollback v2` rebuilds it, the proxy serves its bytes."""
    checkpoints = tmp_path / "ck"
    on_store(redis_url, experiment, lambda store: train_then_lose(store, tiny_model, checkpoints))
    proxy = RunningProxy(redis_url=redis_url, experiment=experiment, proxy_backend="torch", model_dir=tiny_model)
    try:
        ready = httpx.get(f"{proxy.url}/readyz", timeout=10)
        print("before the rebuild:", ready.status_code, ready.text)
        assert ready.status_code == 503 and "waiting for model version v2" in ready.json()["waiting"]
        assert proxy.app.service.backend.model_version == "base" and proxy.app.service.gate.held

        monkeypatch.setenv("REDIS_URL", redis_url)
        monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)
        result = runner.invoke(app, ["rollback", "v2", "--checkpoint-dir", str(checkpoints)])
        print(result.output)
        assert result.exit_code == 0, result.output
        assert "v2 is the version served already; its weights are rebuilt from" in result.stdout

        deadline = time.monotonic() + 60  # the proxy hears the answer and loads v2
        while httpx.get(f"{proxy.url}/readyz", timeout=10).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = httpx.get(f"{proxy.url}/readyz", timeout=10)
        print("after the rebuild:", ready.status_code, ready.text)
        assert ready.json() == {"ready": True} and proxy.app.service.backend.model_version == "v2"
        assert serves_manifest(proxy.app.service.backend.current_weights(), redis_url, experiment, "v2")
    finally:
        proxy.stop()


def test_after_a_redis_restart_a_proxy_on_the_trainers_host_rebuilds_the_newest_version_itself(
        tiny_model: Path, experiment: str, tmp_path: Path) -> None:
    """Trainer stopped, Redis restarted from its AOF (which the weights' chunks stay out of): a proxy
    started afterwards where the checkpoints are rebuilds v2 from them itself, never serving the base
    weights, and serves v2's bytes; no trainer and no `fulmen rollback` needed."""
    checkpoints = tmp_path / "ck"
    with EmbeddedRedis(tmp_path / "redis", port=None) as server:
        port, url = server.port, server.url
        on_store(url, experiment, lambda store: train_then_lose(store, tiny_model, checkpoints, lose=False))
    with EmbeddedRedis(tmp_path / "redis", port=port):  # the same server, back from its AOF
        lost = on_store(url, experiment, lambda store: store.weights_redis.xlen(store.keys.weights("v2")))
        assert lost == 0  # the restart lost the chunks, as in production
        proxy = RunningProxy(redis_url=url, experiment=experiment, proxy_backend="torch", model_dir=tiny_model,
                             checkpoint_dir=checkpoints)
        try:
            deadline = time.monotonic() + 60
            while httpx.get(f"{proxy.url}/readyz", timeout=10).status_code != 200:
                assert time.monotonic() < deadline, "the proxy never became ready"
                time.sleep(0.05)
            assert proxy.app.service.backend.model_version == "v2"  # ready only once it serves v2
            assert serves_manifest(proxy.app.service.backend.current_weights(), url, experiment, "v2")
        finally:
            proxy.stop()


async def _answered(store: RedisStore, folder: Path) -> None:
    """The trainer's pass over the asks, once the follower's own task has written one."""
    for _ in range(200):
        if await answer_asks(store, "trainer-0", lambda v: rebuild_version(store, v, folder, by="trainer-0")):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no ask came")


async def _answers(store: RedisStore) -> list[tuple[str, str, str]]:
    raw = await store.redis.xrange(store.keys.version_rebuilds)
    return [(r.action.value, r.model_version, r.by) for r in (VersionRebuild.from_wire(f[b"m"]) for _, f in raw)]


async def test_a_proxy_asks_and_the_trainer_answers(real_store: RedisStore, tiny_model: Path, tmp_path: Path) -> None:
    """The proxy's ask is answered from the checkpoints (v2 loaded); a refusal keeps it waiting, saying why."""
    await train_then_lose(real_store, tiny_model, tmp_path / "ck")
    for folder, who in ((tmp_path / "ck", "p1"), (tmp_path / "none", "p2")):
        await real_store.weights_redis.delete(real_store.keys.weights("v2"))
        backend = TorchBackend(tiny_model)
        await backend.start()
        follower = ModelFollower(real_store, backend, lambda v, outcome: None, who=f"llm-proxy {who}")
        try:
            await follower.catch_up()
            assert backend.model_version == "base" and "waiting for model version v2" in follower.waiting
            await _answered(real_store, folder)
            if who == "p2":  # no checkpoint there: refused, and the proxy keeps waiting, saying why
                await until(lambda: "cannot rebuild" in follower.waiting)  # noqa: B023 - called at once
                print(follower.waiting)
                assert "trainer-0 cannot rebuild them" in follower.waiting and backend.model_version == "base"
                # the trainer's own check rebuilds it later (its checkpoints back): the proxy hears it
                await rebuild_version(real_store, "v2", tmp_path / "ck", by="trainer-0")
            await until(lambda: backend.model_version == "v2")  # noqa: B023 - called at once
            assert backend.model_version == "v2" and follower.waiting is None
        finally:
            follower.close()
            await backend.close()
    answers = [a for a in await _answers(real_store) if a[0] != "ask"]
    print(answers)
    assert answers == [("rebuilt", "v2", "trainer-0"), ("refused", "v2", "trainer-0"), ("rebuilt", "v2", "trainer-0")]
