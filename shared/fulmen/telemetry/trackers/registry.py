"""The trackers by the name ``--report-to`` gives them, and `trackers_for`, which builds the chosen
ones (checking now, at start, that their packages are installed)."""

from __future__ import annotations

from pathlib import Path

from fulmen.settings.services import NO_TRACKER
from fulmen.telemetry.trackers.mlflow import MlflowTracker
from fulmen.telemetry.trackers.tensorboard import TensorBoardTracker
from fulmen.telemetry.trackers.tracker import Tracker
from fulmen.telemetry.trackers.trackio import TrackioTracker
from fulmen.telemetry.trackers.wandb import WandbTracker

TRACKERS: dict[str, type[Tracker]] = {
    cls.name: cls for cls in (TensorBoardTracker, WandbTracker, MlflowTracker, TrackioTracker)
}


def chosen(report_to: str) -> list[str]:
    """The tracker names of a report_to value (``"wandb,tensorboard"``; ``"none"``: none)."""
    return [name for name in report_to.split(",") if name and name != NO_TRACKER]


def trackers_for(report_to: str, folder: Path) -> list[Tracker]:
    """One tracker per name, writing local files under ``folder`` (the experiment's run folder);
    `TrackerUnavailable`, naming the extra to install, if a package is missing."""
    classes = [TRACKERS[name] for name in chosen(report_to)]
    for cls in classes:
        cls.check()
    return [cls(folder) for cls in classes]
