"""The run's config as trackers get it: every setting of the process that reports (the algorithm's)
and the trainer's as the shared environment sets them, grouped as the settings are (``objective``,
``optimizer``, ``lora``, …), secrets and connection details left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import SecretStr

from fulmen.errors import FulmenError
from fulmen.settings import CommonSettings, TrainerSettings, load_settings
from fulmen.settings.base import field_group

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
