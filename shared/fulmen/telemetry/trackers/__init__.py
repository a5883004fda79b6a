"""Experiment trackers (``--report-to tensorboard,wandb,mlflow,trackio``): the reporter tails the
trainer's steps and the validation passes in Redis and feeds each tracker from a thread of its own,
off the training step. Start at `reporter`; the adapters: one module per tracker; the user's guide:
docs/guides/trackers.md; why: docs/design/telemetry.md."""

from fulmen.telemetry.trackers.config import record_run_config, run_config
from fulmen.telemetry.trackers.registry import TRACKERS, chosen, trackers_for
from fulmen.telemetry.trackers.reporter import Reporter, reporting
from fulmen.telemetry.trackers.tracker import Entry, RunInfo, Tracker, TrackerUnavailable

__all__ = ["TRACKERS", "Entry", "Reporter", "RunInfo", "Tracker", "TrackerUnavailable", "chosen", "record_run_config",
           "reporting", "run_config", "trackers_for"]
