"""One settings object per process, of its service's class. Precedence: CLI flag > environment >
default, checked in one place (`load_settings`).

Every class shares `CommonSettings` (Redis, experiment, logging, the ops port); each service's class
adds only what it reads (`fulmen.settings.services`). A ``FULMEN_*`` variable that no class knows is
an error, but one that belongs to another service is not: honcho gives every process the same
environment.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from pydantic import ValidationError

from fulmen.errors import InvalidInput
from fulmen.keys import check_experiment
from fulmen.settings.base import ENV_PREFIX, REDIS_URL_FIELD, CommonSettings, env_name
from fulmen.settings.services import (
    SERVICE_SETTINGS,
    AdapterSettings,
    AlgorithmSettings,
    ApoSettings,
    DashboardSettings,
    DemoSettings,
    EvalSettings,
    EvaluatorSettings,
    ProxySettings,
    RunnerSettings,
    TrainerSettings,
    VllmSyncSettings,
    WatchdogSettings,
)

__all__ = [
    "AdapterSettings", "AlgorithmSettings", "ApoSettings", "CommonSettings", "DashboardSettings", "DemoSettings", "EvalSettings",
    "EvaluatorSettings", "ProxySettings", "RunnerSettings", "TrainerSettings", "VllmSyncSettings", "WatchdogSettings",
    "env_name", "known_env_names", "load_settings",
]

S = TypeVar("S", bound=CommonSettings)


def known_env_names() -> set[str]:
    """Every ``FULMEN_*`` name some service reads."""
    return {env_name(f) for cls in SERVICE_SETTINGS for f in cls.model_fields if f != REDIS_URL_FIELD}


def load_settings(cls: type[S] = CommonSettings, /, **overrides: Any) -> S:  # type: ignore[assignment]
    """Build ``cls`` from flags (``overrides``; None means "not given") over the environment.

    Unknown ``FULMEN_*`` environment variables are errors: a typo must not be silently ignored."""
    known = known_env_names()
    unknown = sorted(name for name in os.environ if name.startswith(ENV_PREFIX) and name not in known)
    if unknown:
        raise InvalidInput(f"unknown environment variables {unknown}; known: {sorted(known)}")
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        settings = cls(**given)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise InvalidInput(f"invalid settings: {problems}") from None
    check_experiment(settings.experiment)
    return settings
