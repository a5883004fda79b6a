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


async def test_a_delta_final_version_exports_its_whole_weights(real_store: RedisStore, tmp_path: Path) -> None:
    """publish_format=delta: the final model folder holds v2's whole weights (the delta applied onto
    v1), every tensor as the trainer held it, not the delta's changed elements."""
    import torch
    from safetensors.torch import load_file

    from fulmen.versions.delta import encode_delta
    from fulmen.versions.manifest import DELTA, Manifest, describe_all

    base = build_tiny_model(tmp_path / "tiny")
    first, _ = load_tiny_model(build_tiny_model(tmp_path / "m1", seed=1))
    v1 = {n: t.detach().clone() for n, t in first.state_dict().items()}
    await publish_model_version(real_store, v1, model="tiny")
    v2 = {n: t + 0.01 if n.endswith("lm_head.weight") else t for n, t in v1.items()}  # one tensor changed
    await publish_model_version(real_store, encode_delta(v1, v2), model="tiny", manifest=Manifest(DELTA, "v1", describe_all(v2)),
                                weights_format={"format": DELTA, "base_version": "v1"})
    folder, chosen = await _run(real_store, tmp_path, base).final_model(tmp_path / "out")
    assert chosen == {"final_model_version": "v2"}
    exported = load_file(str(folder / "model.safetensors"))
    assert set(exported) >= {n for n in v2 if "rotary" not in n}
    assert all(torch.equal(exported[n], v2[n]) for n in exported)
