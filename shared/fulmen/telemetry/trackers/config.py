"""The run's config as trackers and the dashboard get it: every setting of the process that reports
(the algorithm's) and the trainer's as the shared environment sets them, grouped as the settings are
(``objective``, ``optimizer``, ``lora``, …), secrets and connection details left out. `record_run_config`
keeps it, with the run file's text, in the store beside the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from fulmen.errors import FulmenError
from fulmen.settings import CommonSettings, TrainerSettings, load_settings
from fulmen.settings.base import field_group
from fulmen.store import RedisStore

# Where Redis is and how it is reached say nothing about the training, and may name a host.
LEFT_OUT = ("redis_url", "weights_redis_url", "redis_port", "redis_wait_s", "redis_outage_s", "metrics_host",
            "metrics_port", "metrics_token")


def run_config(settings: CommonSettings) -> dict[str, dict[str, Any]]:
    """``{group: {field: value}}`` of ``settings``, then of the trainer's settings for what it adds."""
    config: dict[str, dict[str, Any]] = {}
    _add(config, settings)
    try:
        run_file = getattr(settings, "config", None)  # a run file the process was started with
        trainer = load_settings(TrainerSettings, experiment=settings.experiment,
                                **({"config": run_file} if run_file is not None else {}))
    except (FulmenError, TypeError):
        return config  # the trainer's environment is not this process's: its own settings are the config
    _add(config, trainer)
    return config


def _add(config: dict[str, dict[str, Any]], settings: CommonSettings) -> None:
    cls = type(settings)
    for name in cls.model_fields:
        value = getattr(settings, name)
        if name in LEFT_OUT or isinstance(value, SecretStr):
            continue
        group = config.setdefault(field_group(cls, name), {})
        group.setdefault(name, _plain(value))


def _plain(value: Any) -> Any:
    """A value every tracker stores: paths as text, the rest as JSON has it."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


async def record_run_config(store: RedisStore, settings: CommonSettings) -> dict[str, Any]:
    """Keep the run's effective settings and its run file (path and text, if it was started from one)
    in the store, for the dashboard and whoever reads the run later. What was stored."""
    run_file = getattr(settings, "config", None)
    text = None
    if run_file is not None:
        try:
            text = Path(run_file).read_text()
        except OSError:
            text = None
    record = {"run_file": str(run_file) if run_file is not None else None, "run_file_text": text,
              "settings": run_config(settings)}
    await store.redis.set(store.keys.run_config, json.dumps(record, default=str))
    return record
