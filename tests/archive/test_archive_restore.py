"""The archive survives the loss of the Redis host: a finished run archived, restored into a second
Redis, reads the same through `fulmen status --json` and the dashboard; restore refuses an
experiment that has data."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from redis_cluster import store_url
from typer.testing import CliRunner

from fulmen.archive.files import list_chunks
from fulmen.cli.main import app
from fulmen.settings import DashboardSettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen_dashboard.app import DashboardApp

sys.path.insert(0, str(Path(__file__).parent))
from finished_run import finished_run

runner = CliRunner()


@pytest.fixture(scope="module")
def second_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """Another Redis host: where the archive is restored after the first one is lost."""
    with EmbeddedRedis(tmp_path_factory.mktemp("second-redis"), port=None) as server:
        yield server


@pytest.fixture
async def second_store(second_server: EmbeddedRedis, experiment: str) -> AsyncIterator[RedisStore]:
    client = async_client(second_server.url)
    await client.ping()
    yield RedisStore(client, experiment)
    await client.aclose()


async def _cli(url: str, *args: str) -> str:
    """Run a `fulmen` command on the Redis at ``url``; its stdout (the command must succeed)."""
    result = await asyncio.to_thread(runner.invoke, app, list(args), env={"REDIS_URL": url}, terminal_width=400)
    assert result.exit_code == 0, result.output
    return result.stdout


# Text about "now" on the dashboard's pages: the time each response took to render.
_NOW = re.compile(r"app;dur=[0-9.]+")


async def _pages(store: RedisStore, rollout_id: str) -> dict[str, str]:
    """The dashboard's run page and the pages it links to, rendered by the app over ``store``'s Redis."""
    e = store.experiment
    app_ = DashboardApp(DashboardSettings(experiment=e), client=store.redis)
    transport = httpx.ASGITransport(app=app_)
    pages = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://dash.test") as client:
        for path in (f"/e/{e}", f"/e/{e}/rollouts", f"/e/{e}/rollouts/{rollout_id}", f"/e/{e}/curves.json",
                     f"/e/{e}/dead-letters"):
            page = await client.get(path)
            assert page.status_code == 200, (path, page.text)
            pages[path] = _NOW.sub("app;dur=?", page.text)
    return pages


async def test_a_finished_run_restored_on_another_redis_reads_as_the_original(
    real_store: RedisStore, second_store: RedisStore, redis_url: str, second_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Archive a finished run (rollouts with spans, one failed, samples, steps, resources versions, a
    validation pass, a dead letter, the algorithm's end state), restore it into an empty second
    Redis: `fulmen status --json` is byte for byte the same, and so are the dashboard's run, rollouts,
    rollout, curves and dead-letters pages."""
    e = real_store.experiment
    summary = await finished_run(real_store, tmp_path / "data")
    assert summary["steps"] == 3 and summary["validations"][-1]["label"] == "final"
    directory = tmp_path / "archive"
    archived = await _cli(redis_url, "archive", "--to", str(directory), "-e", e)
    print(archived.strip())
    assert {c.kind for c in list_chunks(directory)} == {"rollouts", "samples", "steps", "resources", "validations",
                                                         "dead-letters", "state"}
    status = await _cli(redis_url, "status", "--json", "-e", e)
    rollout_id = (await real_store.rollouts.query_rollouts(limit=1))[0].rollout_id
    pages = await _pages(real_store, rollout_id)

    restored = await _cli(second_server.url, "restore", "--from", str(directory))
    print(restored.strip())
    assert f"restored experiment {e}" in restored
    again = await _cli(second_server.url, "status", "--json", "-e", e)
    assert json.loads(again) == json.loads(status)
    assert again == status
    print(json.dumps(json.loads(status))[:400])
    assert json.loads(status)["rollouts"]["succeeded"] > 0 and json.loads(status)["dead_letters"] == 1
    after = await _pages(second_store, rollout_id)
    for path, html in pages.items():
        assert after[path] == html, path
    assert "final" in pages[f"/e/{e}"] and ">3<" in pages[f"/e/{e}"]  # the final pass; the trainer's step


async def test_restore_refuses_an_experiment_that_has_data(
    real_store: RedisStore, redis_url: str, tmp_path: Path
) -> None:
    """Restoring into an experiment with any data exits 2 with a clear error and writes nothing."""
    await real_store.rollouts.enqueue_rollout({"q": 1}, rollout_id="r1")
    directory = tmp_path / "archive"
    await _cli(redis_url, "archive", "--to", str(directory), "-e", real_store.experiment)
    before = sorted(await real_store.redis.keys("*"))
    result = await asyncio.to_thread(runner.invoke, app, ["restore", "--from", str(directory)],
                                     env={"REDIS_URL": redis_url}, terminal_width=400)
    assert result.exit_code == 2, result.output
    assert f"experiment {real_store.experiment} already has data" in result.output
    assert sorted(await real_store.redis.keys("*")) == before


@pytest.mark.parametrize("variant", ["cluster-3-shards"])
async def test_a_sharded_run_on_a_cluster_restored_under_another_name(
    request: pytest.FixtureRequest, variant: str, tmp_path: Path, experiment: str
) -> None:
    """On a real 3-master Redis Cluster, the store in 3 shards: the run restored as another
    experiment (through the CLI) reads the same in `fulmen status --json` and on the dashboard's
    pages, the experiment's name aside."""
    url = store_url(request, variant)
    client = async_client(url)
    await client.ping()
    try:
        store = RedisStore(client, experiment, shards=3)
        await finished_run(store, tmp_path / "data")
        directory = tmp_path / "archive"
        await _cli(url, "archive", "--to", str(directory), "-e", experiment)
        copy = RedisStore(client, experiment + "-copy", shards=3)
        print((await _cli(url, "restore", "--from", str(directory), "-e", copy.experiment)).strip())
        status = await _cli(url, "status", "--json", "-e", experiment)
        again = await _cli(url, "status", "--json", "-e", copy.experiment)
        assert again.replace(copy.experiment, experiment) == status
        rollout_id = (await store.rollouts.query_rollouts(limit=1))[0].rollout_id
        pages, after = await _pages(store, rollout_id), await _pages(copy, rollout_id)
        for path, html in pages.items():
            assert after[path.replace(experiment, copy.experiment)].replace(copy.experiment, experiment) == html, path
        assert await client.xinfo_groups(copy.keys.shards[1].finished)  # the groups, in every shard
    finally:
        await client.aclose()
