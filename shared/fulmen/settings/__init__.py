"""One settings object per process, of its service's class: `load_settings` applies flag > environment >
.env > default in one place, and refuses a ``FULMEN_*`` name no class knows (another service's is fine:
honcho gives every process the same environment). `env_setting` reads one field where no settings
object is at hand. The classes: `fulmen.settings.services`; the reasoning: docs/design/settings.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args

from pydantic import SecretStr, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from fulmen.errors import InvalidInput
from fulmen.settings.base import ENV_PREFIX, REDIS_URL_FIELD, CommonSettings, check_experiment, env_name
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
    "env_name", "env_setting", "known_env_names", "load_settings",
]

S = TypeVar("S", bound=CommonSettings)


def known_env_names() -> set[str]:
    """Every ``FULMEN_*`` name some service reads."""
    return {env_name(f) for cls in SERVICE_SETTINGS for f in cls.model_fields if f != REDIS_URL_FIELD}


@functools.cache
def _field_adapter(field: str) -> tuple[TypeAdapter[Any], Any]:
    for cls in SERVICE_SETTINGS:
        info = cls.model_fields.get(field)
        if info is not None:
            return TypeAdapter(Annotated[info.annotation, info]), info.default
    raise KeyError(f"no settings class has a field {field!r}")


def env_setting(field: str) -> Any:
    """One field's value from the environment (its default when unset), validated as the settings
    validate it: for code deep inside (the store's keys) that has no settings object at hand."""
    adapter, default = _field_adapter(field)
    raw = os.environ.get(env_name(field))
    if raw is None:
        return default
    try:
        return adapter.validate_python(raw)
    except ValidationError as e:
        raise InvalidInput(f"{env_name(field)}={raw!r} is invalid: {e.errors()[0]['msg']}") from None


def load_settings(
    cls: type[S] = CommonSettings, /, *, dotenv: Mapping[str, str] | None = None, **overrides: Any  # type: ignore[assignment]
) -> S:
    """Build ``cls`` from flags (``overrides``; None means "not given") over the environment, over
    ``dotenv`` (a .env file's values, which fill in what the environment does not set, as honcho).

    Unknown ``FULMEN_*`` environment variables are errors: a typo must not be silently ignored."""
    dotenv = {name: value for name, value in (dotenv or {}).items() if name not in os.environ}
    known = known_env_names()
    unknown = sorted(name for name in {*os.environ, *dotenv} if name.startswith(ENV_PREFIX) and name not in known)
    if unknown:
        raise InvalidInput(f"unknown environment variables {unknown}; known: {sorted(known)}")
    given = _from_run_file(cls, overrides.get("config"), dotenv)
    given.update({field: dotenv[env_name(field)] for field in cls.model_fields if env_name(field) in dotenv})
    given.update({name: value for name, value in overrides.items() if value is not None})
    try:
        settings = cls(**given)
    except ValidationError as e:
        problems = "; ".join(_problem(cls, err) for err in e.errors())
        raise InvalidInput(f"invalid settings: {problems}") from None
    check_experiment(settings.experiment)
    return settings


def _from_run_file(cls: type[CommonSettings], flag: Any, dotenv: Mapping[str, str]) -> dict[str, Any]:
    """The run file's values for ``cls``'s fields, except those the environment or .env sets (they win).
    The file comes from --config, else FULMEN_CONFIG (environment, then .env)."""
    name = env_name("config")
    path = flag if flag is not None else os.environ.get(name, dotenv.get(name))
    if path is None:
        return {}
    from fulmen.settings.run_file import read_run_file

    run = read_run_file(Path(path))
    return {field: value for field, value in run.values.items()
            if field in cls.model_fields and env_name(field) not in os.environ and env_name(field) not in dotenv}


def _problem(cls: type[CommonSettings], err: ErrorDetails) -> str:
    """One validation error: the field, its variable, what is allowed (pydantic's message, which lists
    a choice's values) and the value given, unless the field is a secret."""
    name = ".".join(str(x) for x in err["loc"])
    field = cls.model_fields.get(name)
    if field is None:  # a model-wide check, an alias, an unknown name: no value shown
        return f"{name}: {err['msg']}" if name else str(err["msg"])
    secret = field.annotation is SecretStr or SecretStr in get_args(field.annotation)
    got = "" if secret or err["type"] == "missing" else f", got {err['input']!r}"
    return f"{name} ({env_name(name)}): {err['msg']}{got}"
