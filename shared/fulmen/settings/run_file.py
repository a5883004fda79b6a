"""A run file: one YAML file that configures every process of a run, grouped by service, read under
the environment and the flags (flag > environment > .env > run file > default).

`read_run_file` checks the whole file at once (unknown keys refused with the nearest valid name,
secrets refused) and flattens it into the one namespace the settings share. The format and the
reasoning: docs/guides/run-files.md and docs/design/settings.md.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from fulmen.errors import InvalidInput
from fulmen.settings.base import CommonSettings
from fulmen.settings.services import SERVICES

# Sections that are not a service's settings: what `fulmen start` runs.
PROCESSES = "processes"
PROCFILE = "procfile"
# A section may also be named as the Procfile names the process.
SECTION_ALIASES = {"proxy": "llm-proxy"}


@dataclass(frozen=True)
class RunFile:
    """A checked run file: ``values`` (field → value, every service's, one namespace), where each
    value was set (``where``: "trainer.learning_rate"), and what `fulmen start` runs."""

    path: Path
    values: dict[str, Any]
    where: dict[str, str] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)
    procfile: Path | None = None


def _is_secret(cls: type[CommonSettings], name: str) -> bool:
    annotation = cls.model_fields[name].annotation
    return annotation is SecretStr or SecretStr in getattr(annotation, "__args__", ())


@functools.cache
def _all_fields() -> dict[str, tuple[str, ...]]:
    """Every field some service reads → the services that read it."""
    readers: dict[str, list[str]] = {}
    for service, cls in SERVICES.items():
        for name in cls.model_fields:
            readers.setdefault(name, []).append(service)
    return {name: tuple(services) for name, services in readers.items()}


def _nearest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _section(name: str) -> str | None:
    key = name.replace("_", "-")
    key = SECTION_ALIASES.get(key, key)
    return key if key in SERVICES else None


def _unknown_key(path: Path, section: str | None, key: str) -> InvalidInput:
    fields = _all_fields()
    if section is None:
        choices = [*fields, *SERVICES, *SECTION_ALIASES, PROCESSES, PROCFILE]
        return InvalidInput(f"{path}: unknown top-level key {key!r} (not a setting, a service's section, "
                            f"{PROCESSES} or {PROCFILE}){_nearest(key, choices)}")
    cls = SERVICES[section]
    if key in fields:
        hint = f"; {key!r} is a setting of {', '.join(fields[key])}, not of {section}"
    else:
        hint = _nearest(key, list(cls.model_fields))
    return InvalidInput(f"{path}: {section}: unknown setting {key!r}{hint}")


def _processes(path: Path, raw: Any, procfile_names: set[str] | None) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise InvalidInput(f"{path}: {PROCESSES} must map process names to counts (runner: 8)")
    counts = {}
    for name, count in raw.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidInput(f"{path}: {PROCESSES}.{name} must be a whole number ≥ 0, got {count!r}")
        if procfile_names is not None and name not in procfile_names:
            raise InvalidInput(f"{path}: {PROCESSES}: no process {name!r} in the Procfile"
                               f"{_nearest(str(name), sorted(procfile_names))}")
        counts[str(name)] = count
    return counts


def _put(run: dict[str, Any], where: dict[str, str], path: Path, key: str, value: Any, place: str) -> None:
    """One value into the flat namespace; the same setting twice with two values is an error."""
    if key in run and run[key] != value:
        raise InvalidInput(f"{path}: {key!r} is {run[key]!r} at {where[key]} and {value!r} at {place}: "
                           "the services share one value per setting; keep one")
    run[key], where[key] = value, place


def read_run_file(path: Path, procfile_names: set[str] | None = None) -> RunFile:
    """Read and check ``path``. Top-level keys: settings (every service that reads one gets it: the
    experiment, the model folder, the seed), a section per service (trainer:, proxy:, ...) whose keys
    must be that service's settings, ``processes:`` (counts for `fulmen start`) and ``procfile:``."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise InvalidInput(f"run file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise InvalidInput(f"run file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise InvalidInput(f"run file {path}: expected a mapping of sections, got {type(raw).__name__}")
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    processes: dict[str, int] = {}
    procfile = None
    for key, value in raw.items():
        key = str(key)
        section = _section(key)
        if key == PROCESSES:
            processes = _processes(path, value, procfile_names)
        elif key == PROCFILE:
            procfile = Path(str(value))  # like every path in the file: from the folder `fulmen start` runs in
        elif section is not None:
            if not isinstance(value, dict):
                raise InvalidInput(f"{path}: section {key!r} must map settings to values")
            cls = SERVICES[section]
            for name, setting in value.items():
                name = str(name)
                if name not in cls.model_fields:
                    raise _unknown_key(path, section, name)
                _refuse_secret(path, cls, name)
                _put(values, where, path, name, setting, f"{key}.{name}")
        elif key in _all_fields():  # a setting at the top: every service that reads it
            _refuse_secret(path, SERVICES[_all_fields()[key][0]], key)
            _put(values, where, path, key, value, key)
        else:
            raise _unknown_key(path, None, key)
    return RunFile(path, values, where, processes, procfile)


def _refuse_secret(path: Path, cls: type[CommonSettings], name: str) -> None:
    if _is_secret(cls, name):
        raise InvalidInput(f"{path}: {name!r} is a secret: set it in the environment, never in a file "
                           "that is committed beside the results")
