"""A real run, archived and restored: `fulmen dev` trains the tiny model on its own tasks to the end
(every service, validation passes, weights published), on a Redis that then goes away; the archive,
restored into another Redis, gives the same `fulmen status --json` and the same dashboard run pages."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from demo_runs import FULMEN, user_env

from fulmen.demo import arithmetic
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client
from fulmen.store.redis.embedded import EmbeddedRedis, free_port

sys.path.insert(0, str(Path(__file__).parent))
from test_archive_restore import _pages  # the run page and the pages it links to

pytestmark = pytest.mark.slow
EXPERIMENT = "archived-demo"


def _fulmen(url: str, cwd: Path, *args: str) -> str:
    env = {**user_env(), "REDIS_URL": url, "COLUMNS": "400"}
    done = subprocess.run([FULMEN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-6000:])
    return done.stdout


async def _view(url: str) -> dict[str, str]:
    """The dashboard's run page and the pages it links to, for the experiment on the Redis at ``url``."""
    client = async_client(url)
    try:
        store = RedisStore(client, EXPERIMENT)
        rollout = (await client.zrange(store.keys.rollout_index, 0, 0))[0].decode()
        return await _pages(store, rollout)
    finally:
        await client.aclose()


@pytest.mark.timeout(600)
def test_a_real_run_archived_and_restored_reads_as_the_original(tmp_path: Path) -> None:
    """The same status, byte for byte, and the same run, rollouts, rollout, curves and dead-letter pages."""
    model = build_tiny_model(tmp_path / "my-model")
    tasks = arithmetic.write_jsonl(tmp_path / "tasks.jsonl", arithmetic.make_tasks("train", 40, seed=3))
    val = arithmetic.write_jsonl(tmp_path / "val.jsonl", arithmetic.make_tasks("val", 8, seed=3))
    with EmbeddedRedis(tmp_path / "first-redis", port=None) as first:
        env = {**user_env(), "REDIS_URL": first.url, "FULMEN_EXPERIMENT": EXPERIMENT, "FULMEN_MODEL_DIR": str(model),
               "FULMEN_VAL_DATA": str(val), "FULMEN_VAL_EVERY": "2", "FULMEN_TOTAL_STEPS": "3",
               "FULMEN_GROUPS_PER_STEP": "2", "FULMEN_N_SAMPLES": "4", "FULMEN_PROXY_PORT": str(free_port()),
               "FULMEN_TORCH_THREADS": "1"}
        done = subprocess.run([FULMEN, "dev", "--agent", "examples.arithmetic_agent:agent", "--tasks", str(tasks),
                               "--no-dashboard"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
        original = _fulmen(first.url, tmp_path, "status", "--json", "-e", EXPERIMENT)
        # nothing left queued: the run waited for the evaluator's step-2 pass (unfinished rollouts are
        # not archived, by design: docs/design/store.md, "Restore")
        assert json.loads(original)["queue_depth"] == 0, (original, (done.stdout + done.stderr)[-6000:])
        pages = asyncio.run(_view(first.url))
        print(_fulmen(first.url, tmp_path, "archive", "--to", str(tmp_path / "archive"), "-e", EXPERIMENT))
    with EmbeddedRedis(tmp_path / "second-redis", port=None) as second:
        print(_fulmen(second.url, tmp_path, "restore", "--from", str(tmp_path / "archive")))
        restored = _fulmen(second.url, tmp_path, "status", "--json", "-e", EXPERIMENT)
        assert restored == original
        assert asyncio.run(_view(second.url)) == pages
