"""trackio: one trackio run per experiment, named by the reporter's run id and resumed by that name
(``resume="allow"``), in the project ``TRACKIO_PROJECT`` (default fulmen). trackio keeps its local
store under ``TRACKIO_DIR`` (default ~/.cache/huggingface/trackio); ``trackio show`` draws it."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from fulmen.telemetry.trackers.tracker import DEFAULT_PROJECT, Entry, RunInfo, Tracker, require


class TrackioTracker(Tracker):
    name: ClassVar[str] = "trackio"
    package: ClassVar[str] = "trackio"
    extra: ClassVar[str] = "trackio"

    run: Any = None

    def open(self, run: RunInfo) -> None:
        trackio = require(type(self))
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", DEFAULT_PROJECT), name=run.run_id,
                                config=dict(run.config), resume="allow", embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)

    def log(self, entry: Entry) -> None:
        self.run.log(dict(entry.metrics), step=entry.step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
