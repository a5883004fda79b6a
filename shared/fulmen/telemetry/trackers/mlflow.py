"""MLflow: one MLflow run per experiment, found again after a restart by its ``fulmen.run`` tag, in
the MLflow experiment ``MLFLOW_EXPERIMENT_NAME`` (default fulmen) of ``MLFLOW_TRACKING_URI``; unset,
a local file store in the experiment's run folder (``<run folder>/mlruns``). mlflow-skinny is enough:
the client only."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, ClassVar

from fulmen.telemetry.trackers.tracker import DEFAULT_PROJECT, Entry, RunInfo, Tracker, flat_config, require

RUN_TAG = "fulmen.run"
FOLDER = "mlruns"
PARAMS_PER_BATCH = 100  # MLflow's limits on one log_batch
METRICS_PER_BATCH = 1000
PARAM_VALUE_CHARS = 6000
_KEY_CHARS = re.compile(r"[^\w\-. /:]")  # what MLflow accepts in a metric name ("pass@1" becomes "pass_at_1")


def metric_key(key: str) -> str:
    return _KEY_CHARS.sub("_", key.replace("@", "_at_"))


class MlflowTracker(Tracker):
    name: ClassVar[str] = "mlflow"
    package: ClassVar[str] = "mlflow"
    extra: ClassVar[str] = "mlflow"

    client: Any = None
    run_id: str = ""

    def tracking_uri(self) -> str:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return uri
        # MLflow 3 keeps the file store in maintenance mode behind this switch; a server or a
        # database (MLFLOW_TRACKING_URI) is what it recommends beyond one machine
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (self.folder / FOLDER).resolve().as_uri()

    def open(self, run: RunInfo) -> None:
        tracking = require(type(self), "mlflow.tracking")
        self.entities = require(type(self), "mlflow.entities")
        self.client = client = tracking.MlflowClient(tracking_uri=self.tracking_uri())
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run.run_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = client.create_run(experiment_id, run_name=run.name, tags={RUN_TAG: run.run_id}).info.run_id
        params = [self.entities.Param(key, _param_value(value)) for key, value in flat_config(run.config).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])

    def log(self, entry: Entry) -> None:
        when_ms = int((entry.time or time.time()) * 1000)
        metrics = [self.entities.Metric(metric_key(key), value, when_ms, entry.step) for key, value in entry.metrics.items()]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + METRICS_PER_BATCH])

    def close(self) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:PARAM_VALUE_CHARS]
