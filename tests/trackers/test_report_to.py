"""--report-to: the names it takes, the trackers it builds, and the clear error of a missing package."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from fulmen.errors import InvalidInput
from fulmen.settings import AlgorithmSettings, DemoSettings, load_settings
from fulmen.settings.services import TRACKERS as SETTING_NAMES
from fulmen.store import RedisStore
from fulmen.telemetry.trackers import TRACKERS, TrackerUnavailable, reporting, run_config, trackers_for


def test_the_setting_names_every_registered_tracker() -> None:
    """The names the setting accepts are the adapters registered, one each."""
    assert tuple(TRACKERS) == SETTING_NAMES


@pytest.mark.parametrize(("given", "kept"), [
    (None, "none"), ("none", "none"), (" WandB, tensorboard,wandb", "wandb,tensorboard"), ("mlflow,", "mlflow"),
])
def test_report_to_is_kept_as_a_clean_list(given: str | None, kept: str) -> None:
    """Case, spaces and repeats do not matter; the default reports nowhere."""
    assert load_settings(AlgorithmSettings, report_to=given).report_to == kept
    assert load_settings(DemoSettings, report_to=given).report_to == kept


@pytest.mark.parametrize(("given", "says"), [("comet", "unknown tracker 'comet'"), ("wandb,none", "none cannot")])
def test_a_wrong_report_to_fails_at_load(given: str, says: str) -> None:
    with pytest.raises(InvalidInput, match=says):
        load_settings(AlgorithmSettings, report_to=given)


def test_a_missing_package_fails_at_start_naming_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The algorithm refuses to start, before any work, with the pip command that fixes it."""
    from fulmen_algorithm.main import run_algorithm

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert [t.name for t in trackers_for("tensorboard", tmp_path)] == ["tensorboard"]
    with pytest.raises(TrackerUnavailable, match=r"pip install 'fulmen\[wandb\]'"):
        trackers_for("tensorboard,wandb", tmp_path)
    settings = load_settings(AlgorithmSettings, report_to="wandb", data_dir=tmp_path)
    with pytest.raises(TrackerUnavailable, match="--report-to wandb needs the wandb package"):
        asyncio.run(run_algorithm(settings, asyncio.Event()))


async def test_no_tracker_means_no_reporter(real_store: RedisStore) -> None:
    """The default costs nothing: no reporter, no thread, nothing written to Redis."""
    async with reporting(real_store, [], name=real_store.experiment) as reporter:
        assert reporter is None
    assert not await real_store.redis.exists(real_store.keys.trackers)


def test_the_config_is_every_setting_by_group_without_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's settings from the shared environment are in it; the Redis URL (a password) is not."""
    monkeypatch.setenv("REDIS_URL", "redis://:secret@example:6379/0")
    monkeypatch.setenv("FULMEN_LEARNING_RATE", "0.003")
    config = run_config(load_settings(AlgorithmSettings, n_samples=4, report_to="wandb"))
    assert config["rollouts"]["n_samples"] == 4 and config["trackers"]["report_to"] == "wandb"
    assert config["optimizer"]["learning_rate"] == 0.003
    assert "secret" not in repr(config) and "redis_url" not in repr(config)
