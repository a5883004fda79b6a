"""TensorBoard: event files in the experiment's run folder (``<run folder>/tensorboard/<run id>/``),
written with tensorboard's own event writer (no torch, no TensorFlow). A restart writes a new event
file in the same folder, which TensorBoard reads as the same run. See: ``tensorboard --logdir .fulmen/run``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

from fulmen.telemetry.trackers.tracker import Entry, RunInfo, Tracker, flat_config, require

FOLDER = "tensorboard"
CONFIG_TAG = "config"  # the run's settings, a Markdown table in TensorBoard's Text tab


class TensorBoardTracker(Tracker):
    name: ClassVar[str] = "tensorboard"
    package: ClassVar[str] = "tensorboard"
    extra: ClassVar[str] = "tensorboard"

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.writer: Any = None
        self.summary_pb2: Any = None
        self.event_pb2: Any = None

    def run_folder(self, run: RunInfo) -> Path:
        return self.folder / FOLDER / run.run_id

    def open(self, run: RunInfo) -> None:
        writer = require(type(self), "tensorboard.summary.writer.event_file_writer")
        self.summary_pb2 = require(type(self), "tensorboard.compat.proto.summary_pb2")
        self.event_pb2 = require(type(self), "tensorboard.compat.proto.event_pb2")
        folder = self.run_folder(run)
        first = not any(folder.glob("events.out.tfevents.*"))
        self.writer = writer.EventFileWriter(str(folder))
        if first:
            self._write(0, time.time(), [self._config_value(run)])

    def log(self, entry: Entry) -> None:
        values = [self.summary_pb2.Summary.Value(tag=tag, simple_value=value) for tag, value in entry.metrics.items()]
        self._write(entry.step, entry.time, values)
        self.writer.flush()  # a step every few seconds: each one is on disk when TensorBoard looks

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _write(self, step: int, when: float, values: list[Any]) -> None:
        summary = self.summary_pb2.Summary(value=values)
        self.writer.add_event(self.event_pb2.Event(wall_time=when, step=step, summary=summary))

    def _config_value(self, run: RunInfo) -> Any:
        """The settings as a text summary: TensorBoard's Text tab renders it as a table."""
        rows = ["| setting | value |", "|---|---|"]
        rows += [f"| {key} | {json.dumps(value)} |" for key, value in sorted(flat_config(run.config).items())]
        tensor_pb2 = require(type(self), "tensorboard.compat.proto.tensor_pb2")
        shape_pb2 = require(type(self), "tensorboard.compat.proto.tensor_shape_pb2")
        types_pb2 = require(type(self), "tensorboard.compat.proto.types_pb2")
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=["\n".join(rows).encode()],
                                        tensor_shape=shape_pb2.TensorShapeProto(dim=[shape_pb2.TensorShapeProto.Dim(size=1)]))
        Summary = self.summary_pb2.Summary
        metadata = self.summary_pb2.SummaryMetadata(plugin_data=self.summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        return Summary.Value(tag=CONFIG_TAG, metadata=metadata, tensor=tensor)
