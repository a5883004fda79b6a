"""The run's effective settings and run file, kept in the store by the algorithm at start, shown on
the dashboard's run page (escaped: a run file is whatever its author wrote)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from seed import seed

from fulmen.settings import AlgorithmSettings, load_settings
from fulmen.store import RedisStore
from fulmen.telemetry.trackers import record_run_config


async def test_the_run_page_shows_the_settings_the_run_recorded(real_store: RedisStore, client: httpx.AsyncClient,
                                                                tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    await seed(real_store)
    e = real_store.experiment
    page = await client.get(f"/e/{e}")
    assert page.status_code == 200 and "No run has recorded its settings" in page.text
    monkeypatch.setenv("FULMEN_EXPERIMENT", e)
    monkeypatch.setenv("REDIS_URL", "redis://user:hunter2@127.0.0.1:1/0")  # a secret: never stored
    run_file = tmp_path / "run.yaml"
    run_file.write_text("# <b>my run</b>\nalgorithm:\n  n_samples: 7\ntrainer:\n  learning_rate: 0.0123\n")
    settings = load_settings(AlgorithmSettings, config=run_file)
    record = await record_run_config(real_store, settings)
    stored = json.loads(await real_store.redis.get(real_store.keys.run_config))
    assert stored == json.loads(json.dumps(record))
    flat = {name: value for group in stored["settings"].values() for name, value in group.items()}
    assert flat["n_samples"] == 7 and flat["learning_rate"] == 0.0123  # the trainer's, from the same file
    assert "redis_url" not in flat and "hunter2" not in json.dumps(stored)
    page = await client.get(f"/e/{e}")
    assert page.status_code == 200 and str(run_file) in page.text and "0.0123" in page.text
    assert "&lt;b&gt;my run&lt;/b&gt;" in page.text and "<b>my run</b>" not in page.text
    await real_store.redis.set(real_store.keys.run_config, b"not json")
    assert "No run has recorded its settings" in (await client.get(f"/e/{e}")).text
