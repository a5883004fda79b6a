"""What every experiment tracker adapter is: `Tracker` (open a run, log entries, close), the `Entry`
it logs and the `RunInfo` it opens, and `require`, the lazy import that names the extra to install.

The adapters: one module per tracker beside this one; who calls them: `worker` (one thread each) and
`reporter`. Why: docs/design/telemetry.md.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Literal

from fulmen.errors import InvalidInput

EntryKind = Literal["train", "validation", "rollouts"]
DEFAULT_PROJECT = "fulmen"  # the project (W&B), experiment (MLflow) or project (trackio) runs land in


class TrackerUnavailable(InvalidInput):
    """A tracker was asked for whose package is not installed: the message names the extra."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One thing to report at one trainer step: a step's metrics (``train``), a validation pass
    (``validation``, at the step it validated) or the rollouts per status (``rollouts``)."""

    kind: EntryKind
    step: int
    metrics: Mapping[str, float]
    time: float  # wall-clock seconds when it happened


@dataclass(frozen=True, slots=True)
class RunInfo:
    """The tracker run of one experiment: ``run_id`` is the same after every restart (kept in Redis),
    so each adapter finds its run again by it and decides itself whether the run is new."""

    run_id: str
    name: str  # what a tracker shows: the experiment
    config: Mapping[str, Any] = field(default_factory=dict)  # the run's settings, by group


class Tracker(ABC):
    """One experiment tracker. Its methods run in the tracker's own thread, never on the training
    path: they may block or raise, and the worker bounds both."""

    name: ClassVar[str]  # as --report-to names it
    package: ClassVar[str]  # the module `require` imports
    extra: ClassVar[str]  # pip install 'fulmen[<extra>]'

    def __init__(self, folder: Path) -> None:
        self.folder = folder  # this experiment's run folder: where a local tracker writes

    @classmethod
    def check(cls) -> None:
        """Raise `TrackerUnavailable` now if the package is missing (cheap: nothing is imported)."""
        if importlib.util.find_spec(cls.package) is None:
            raise TrackerUnavailable(cls.missing())

    @classmethod
    def missing(cls) -> str:
        return (f"--report-to {cls.name} needs the {cls.package} package: pip install 'fulmen[{cls.extra}]' "
                "(or 'fulmen[trackers]' for every tracker)")

    @abstractmethod
    def open(self, run: RunInfo) -> None:
        """Start or resume ``run``; its config goes with it on first start."""

    @abstractmethod
    def log(self, entry: Entry) -> None:
        """Report one entry (steps arrive in increasing order; a validation may name an earlier step)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and end this process's part of the run (a restart resumes it)."""


def require(tracker: type[Tracker], module: str | None = None) -> ModuleType:
    """Import ``module`` (default: the tracker's package), or raise `TrackerUnavailable` naming the extra."""
    try:
        return importlib.import_module(module or tracker.package)
    except ImportError as e:
        raise TrackerUnavailable(f"{tracker.missing()} ({e})") from None


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"objective": {"kl_coef": 0.1}}`` as ``{"objective.kl_coef": 0.1}``: for trackers whose
    parameters are flat (MLflow, TensorBoard's table)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
