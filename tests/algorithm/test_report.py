"""The end of a run's report: the final model folder, and what it falls back to when weights are lost."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from fulmen.demo.tiny_model import build_tiny_model, load_tiny_model
from fulmen.settings import AlgorithmSettings
from fulmen.store import RedisStore
from fulmen.versions.model_version import publish_model_version
from fulmen_algorithm.run import Run


async def _publish_two(store: RedisStore, tmp_path: Path) -> Path:
    """v1 and v2 of the tiny model published; returns the base model's folder."""
    base = build_tiny_model(tmp_path / "tiny")
    for seed in (1, 2):
        model, _ = load_tiny_model(build_tiny_model(tmp_path / f"m{seed}", seed=seed))
        await publish_model_version(store, model.state_dict(), model="tiny")
    return base


def _run(store: RedisStore, tmp_path: Path, base: Path) -> Run:
    """A finished run's report writer on ``store``."""
    settings = AlgorithmSettings(experiment=store.experiment, data_dir=tmp_path, model_dir=base,
                                 metrics_file=tmp_path / "m.jsonl")
    run = Run(settings, [{"id": "t0", "question": "1+1="}], [])
    run.store = store  # as `Run.run` sets it: the report's steps read the store, nothing more
    return run


async def test_final_weights_lost_exports_the_newest_version_still_stored(
    real_store: RedisStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """v2's weights gone from Redis: the final model is v1, with a warning naming v2."""
    base = await _publish_two(real_store, tmp_path)
    await real_store.weights_redis.delete(real_store.keys.weights("v2"))
    with caplog.at_level(logging.WARNING):
        folder, chosen = await _run(real_store, tmp_path, base).final_model(tmp_path / "out")
    print("final model:", folder, chosen)
    assert folder is not None and json.loads((folder / "fulmen_version.json").read_text()) == {"model_version": "v1"}
    assert chosen == {"final_model_version": "v1"}
    assert any("final version v2 cannot be exported" in r.getMessage() for r in caplog.records)


async def test_every_version_lost_leaves_no_final_model(
    real_store: RedisStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No version's weights left: no final model folder, a warning, and the report is still written."""
    base = await _publish_two(real_store, tmp_path)
    for version in ("v1", "v2"):
        await real_store.weights_redis.delete(real_store.keys.weights(version))
    run = _run(real_store, tmp_path, base)
    with caplog.at_level(logging.WARNING):
        paths = await run.write_report({"steps": 2})
    print("report:", paths)
    assert paths["final_model"] is None and paths["final_model_version"] is None
    assert json.loads(Path(paths["summary"]).read_text())["final_model"] is None
    assert any("no model version's weights are stored" in r.getMessage() for r in caplog.records)
