"""Weights & Biases: one W&B run per experiment, its id the reporter's run id, resumed after a restart
(``resume="allow"``). W&B's own environment applies: ``WANDB_PROJECT`` (default fulmen),
``WANDB_API_KEY``, ``WANDB_MODE=offline`` (files under ``WANDB_DIR``, sent later by ``wandb sync``)."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from fulmen.telemetry.trackers.tracker import DEFAULT_PROJECT, Entry, RunInfo, Tracker, require

VAL_STEP = "val/step"  # validation charts are drawn against the step they validated, not the step they arrived at


class WandbTracker(Tracker):
    name: ClassVar[str] = "wandb"
    package: ClassVar[str] = "wandb"
    extra: ClassVar[str] = "wandb"

    run: Any = None

    def open(self, run: RunInfo) -> None:
        wandb = require(type(self))
        # console off: W&B would otherwise wrap this process's stdout and stderr; stats off: they
        # would describe the algorithm's host, not the trainer's
        settings = wandb.Settings(console="off", x_disable_stats=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT), id=run.run_id,
                              name=run.name, resume="allow", settings=settings, reinit="create_new")
        self.run.config.update(dict(run.config), allow_val_change=True)
        self.run.define_metric(VAL_STEP)
        self.run.define_metric("val/*", step_metric=VAL_STEP)

    def log(self, entry: Entry) -> None:
        if entry.kind == "validation":
            # a pass arrives minutes after the step it validated, and W&B's step only goes forward: it
            # joins the current row (commit=False moves no step) and is drawn against its own val/step
            self.run.log({**entry.metrics, VAL_STEP: entry.step}, commit=False)
        else:
            self.run.log(dict(entry.metrics), step=entry.step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            require(type(self)).teardown()
