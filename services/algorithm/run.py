"""A training run: GRPO groups enqueued as the trainer allows, validation on schedule, a report at the end.

`Run` is built from the settings and the tasks and driven by ``await run.run(store)`` (like arq's
`Worker`). Its position lives in the store (the `Scheduler`'s state and `RunProgress`): killed and
started again, it continues where it was and never enqueues a task twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from fulmen.settings import AlgorithmSettings
from fulmen.store import RedisStore
from fulmen_algorithm.dataset import Task
from fulmen_algorithm.jobs import enqueue_validation, pending_validations
from fulmen_algorithm.pass_at_k import score_fields
from fulmen_algorithm.run_state import RunProgress
from fulmen_algorithm.scheduler import Scheduler, SchedulerOptions, recoverable_rollout_config
from fulmen_algorithm.validation import PassSampling, reached_target, recorded, start_pass, validate

log = logging.getLogger("fulmen.algorithm")

# How long one tick waits for completions before it looks at the trainer again.
TICK_WAIT_S = 0.5
# Seconds between two progress lines in the log.
PROGRESS_EVERY_S = 2.0
# How often the end of a run looks whether the evaluator's passes it queued have ended.
PASS_POLL_S = 0.5
# How long no evaluator may be seen on the queue before the run ends without its passes: the evaluator's
# rq worker is registered only while it works the queue, and it starts a new worker each second.
EVALUATOR_ABSENT_S = 10.0
# Where in the data folder the runs write their curve, summary and final model: a folder per experiment.
RUN_DIR = "run"
VALIDATION_FIELDS = ("label", "step", "accuracy", "mean_reward")
FINAL_DIR = "final-model"
BEST_DIR = "best-model"  # the best validated version so far, written while its weights are stored
BEST_ROLE = "best validated version"  # what the model card calls the version in BEST_DIR
CURVE_FILE = "reward-curve.png"


def run_dir(settings: AlgorithmSettings) -> Path:
    """This experiment's report folder (``.fulmen/run/<experiment>/``): runs of other experiments keep theirs."""
    return settings.data_dir / RUN_DIR / settings.experiment


class Run:
    def __init__(
        self,
        settings: AlgorithmSettings,
        tasks: list[Task],
        val_tasks: list[Task],
        *,
        setup: Callable[[RedisStore], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.tasks = tasks
        self.val_tasks = val_tasks
        self.setup = setup
        self.stopping = asyncio.Event()
        self.started = time.monotonic()
        self._last_line = 0.0
        self._done_at_start = 0
        self._next_validation = 0
        self._queued_passes: list[int] = []  # the versions whose pass this run queued for the evaluator
        self._baseline_started = False  # the baseline pass's rollouts queued by this run, ahead of training
        self._best_saved: str | None = None  # the best validated version, written to BEST_DIR while stored

    def stop(self) -> None:
        """End the loop at the next tick (SIGTERM): no final validation, the state stays for a restart."""
        self.stopping.set()

    async def run(self, store: RedisStore) -> dict[str, Any]:
        """Run until the end condition, then validate a last time and write the report; the summary."""
        if self.setup is not None:
            await self.setup(store)
        self.store, self.progress = store, RunProgress(store)
        s = self.settings
        options = SchedulerOptions(
            n_samples=s.n_samples, groups_per_step=s.groups_per_step, max_inflight=s.max_inflight,
            staleness=s.staleness, epochs=s.epochs, seed=s.seed, total_steps=s.total_steps,
        )
        self.scheduler = Scheduler(
            store, self.tasks, options,
            rollout_config=recoverable_rollout_config(s.rollout_unresponsive_s, s.rollout_max_attempts),
        )
        await self.scheduler.load()
        self.started = time.monotonic()
        self._done_at_start = await self.progress.rollouts_done()
        # the first pass validates the starting weights: the curve's baseline (the warm start in the demo)
        self._next_validation = await self.progress.next_validation()
        while not self.stopping.is_set():
            if await self.tick():
                break
            await self.scheduler.count_finished(block_s=TICK_WAIT_S)
        return await self.finish()

    async def tick(self) -> bool:
        """Enqueue what pacing allows, schedule a validation when one is due; True once the run is over."""
        step = await self.scheduler.trainer_step()
        await self.schedule_validation(step)  # first: the baseline's rollouts go ahead of any training rollout
        await self.scheduler.fill()
        inflight = await self.scheduler.inflight()
        if await self.ended(step, inflight):
            return True
        if time.monotonic() - self._last_line > PROGRESS_EVERY_S:
            await self.log_progress(step, inflight)
        return False

    async def schedule_validation(self, step: int) -> None:
        """Every ``val_every`` trainer steps, a pass for the evaluator; the next due step is stored."""
        if not (self.val_tasks and self.settings.val_every) or step < self._next_validation:
            return
        if step == 0:
            # The baseline measures the starting weights: its rollouts are queued here, urgent, before the
            # first training rollout, so v0 serves them however late the evaluator starts its job (whose
            # own enqueue of the same ids then adds nothing).
            await start_pass(self.store, self.val_tasks, label="v0", config=self.scheduler.rollout_config,
                             sampling=PassSampling.of(self.settings))
            self._baseline_started = True
        await asyncio.to_thread(enqueue_validation, self.settings, step)
        self._queued_passes.append(step)
        self._next_validation = step + self.settings.val_every
        await self.progress.set_next_validation(self._next_validation)

    async def ended(self, step: int, inflight: int) -> bool:
        s = self.settings
        if s.total_steps is not None and step >= s.total_steps:
            return True
        await self.keep_best()
        if s.target_accuracy is not None and reached_target(await recorded(self.store), s.target_accuracy):
            log.info("validation reached %.2f twice in a row: ending the run at step %d", s.target_accuracy, step)
            return True
        return self.scheduler.exhausted and inflight == 0

    async def keep_best(self) -> None:
        """Write the best validated version so far as a folder while its weights are still stored
        (retention keeps only the newest few): the run's final model, unless a later pass does better."""
        from fulmen_algorithm.report import best_pass, export_version, model_card, served_version

        best = best_pass(await recorded(self.store))
        version = served_version(best) if best is not None else None
        if version is None or version == self._best_saved or self.settings.model_dir is None:
            return
        out = run_dir(self.settings) / BEST_DIR
        card = await model_card(self.store, self.settings, BEST_ROLE)
        if await export_version(self.store, version, self.settings.model_dir, out, card) is not None:
            self._best_saved = version
            log.info("best validated version so far: %s (accuracy %.3f, pass %s), kept in %s",
                     version, best["accuracy"], best.get("label"), out)

    async def log_progress(self, step: int, inflight: int) -> None:
        done = await self.progress.rollouts_done() - self._done_at_start
        rate = done / max(time.monotonic() - self.started, 1e-9)
        stats = await self.store.statistics()
        vals = await recorded(self.store)
        val = f"{vals[-1]['accuracy']:.2f} ({vals[-1]['label']})" if vals else "-"
        log.info("step %d | epoch %d | val accuracy %s | %d in flight | queue %d | %.1f rollouts/s",
                 step, self.scheduler.state.epoch, val, inflight, stats["queue_depth"], rate)
        self._last_line = time.monotonic()

    async def finish(self) -> dict[str, Any]:
        """The summary: steps, position, wall time, and unless stopped the final validation and the report."""
        summary: dict[str, Any] = {"steps": await self.scheduler.trainer_step(), **self.scheduler.snapshot(),
                                   "wall_s": round(time.monotonic() - self.started, 1)}
        if self.val_tasks and not self.stopping.is_set():
            await self._unless_stopped(self._queued_passes_end())
        if self.val_tasks and not self.stopping.is_set():
            final = await self._unless_stopped(validate(
                self.store, self.val_tasks, label="final", step=await self.scheduler.trainer_step(),
                timeout_s=self.settings.val_timeout_s, config=self.scheduler.rollout_config,
                sampling=PassSampling.of(self.settings),
            ))
            if final is not None:
                summary["final_val_accuracy"] = final["accuracy"]
                summary["final_val_reward"] = final["mean_reward"]
                if scores := score_fields(final):
                    summary["final_val_scores"] = scores
                summary["validations"] = [{**{k: v.get(k) for k in VALIDATION_FIELDS}, **score_fields(v)}
                                          for v in await recorded(self.store)]
        if self.stopping.is_set():
            # Stopped, not finished: started again, the run goes on from the store, and the report of
            # a run that had finished (its summary, curve and final model) stays as it was.
            summary["stopped"] = True
            return summary
        summary.update(await self.write_report(summary))
        return summary

    async def _queued_passes_end(self) -> dict[str, Any]:
        """Wait (up to a pass's timeout) for the evaluator's passes this run queued, so that the curve and
        the summary have every scheduled pass and none is left half-run in the queue when the run ends.
        With no evaluator seen on the queue for EVALUATOR_ABSENT_S, the run ends without them."""
        deadline, said = time.monotonic() + self.settings.val_timeout_s, False
        heard = time.monotonic()  # when an evaluator was last seen listening (a gap between its workers is not its absence)
        while self._queued_passes:
            pending, listening = await asyncio.to_thread(pending_validations, self.settings, self._queued_passes)
            self._queued_passes = pending  # an ended pass is not asked about again
            if not pending:
                break
            versions = ", ".join(f"v{v}" for v in pending)
            if listening and not said:
                log.info("waiting for the evaluator's validation pass of %s before the final pass", versions)
                said = True
            now = time.monotonic()
            if listening:
                heard = now
            elif now - heard >= EVALUATOR_ABSENT_S or now > deadline:
                await self._baseline_here()
                if others := ", ".join(f"v{v}" for v in self._queued_passes):
                    log.warning("the validation pass of %s is still queued and no `fulmen evaluator` is running: "
                                "the run ends without it (start one and it runs the pass)", others)
                return {}
            if now > deadline:
                log.warning("the validation pass of %s has not ended within val_timeout_s (%g s): the run "
                            "ends without it", versions, self.settings.val_timeout_s)
                return {}
            await asyncio.sleep(PASS_POLL_S)
        return {}

    async def _baseline_here(self) -> None:
        """With no evaluator, the baseline pass whose rollouts this run queued (served by the starting
        weights) is waited for and recorded here, so that the curve keeps its first point; a pass the
        evaluator records as well counts once (`recorded`)."""
        if not (self._baseline_started and 0 in self._queued_passes):
            return
        log.info("no `fulmen evaluator` is running: the baseline pass (v0), whose rollouts this run queued, "
                 "is recorded here")
        await validate(self.store, self.val_tasks, label="v0", step=0, timeout_s=self.settings.val_timeout_s,
                       config=self.scheduler.rollout_config, sampling=PassSampling.of(self.settings))
        self._queued_passes.remove(0)

    async def _unless_stopped(self, work: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any] | None:
        """``work`` (the final pass: up to val_timeout_s), cancelled if the run is stopped first (SIGTERM
        must end the process within seconds); None then."""
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def final_model(self, out: Path) -> tuple[Path | None, dict[str, Any]]:
        """The best validated version as the final model (the latest if no pass says otherwise, or if
        the best one's weights are gone), and which version that is."""
        from fulmen_algorithm.report import (
            best_pass,
            export_final_model,
            export_version,
            model_card,
            served_version,
        )

        s = self.settings
        assert s.model_dir is not None
        final_dir = out / FINAL_DIR
        best = best_pass(await recorded(self.store))
        version = served_version(best) if best is not None else None
        folder = None
        if best is not None and version is not None:
            kept = out / BEST_DIR
            if version == self._best_saved and kept.is_dir():
                await asyncio.to_thread(_replace_folder, kept, final_dir)
                folder = final_dir
            else:
                card = await model_card(self.store, s, BEST_ROLE, out / CURVE_FILE)
                folder = await export_version(self.store, version, s.model_dir, final_dir, card)
            if folder is None:
                log.warning("the best validated version %s is no longer stored: the final model is the latest", version)
        if folder is None:
            card = await model_card(self.store, s, "latest version", out / CURVE_FILE)
            folder = await export_final_model(self.store, s.model_dir, final_dir, card=card)
            version = _folder_version(folder)
            best = None
        chosen: dict[str, Any] = {"final_model_version": version}
        if best is not None:
            chosen["final_model_pass"] = best.get("label")
            chosen["final_model_accuracy"] = best.get("accuracy")
            log.info("final model: version %s, the best validated (accuracy %.3f in pass %s)",
                     version, best["accuracy"], best.get("label"))
        return folder, chosen

    async def write_report(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The curve (PNG), the summary (JSON) and the final model, in this experiment's `run_dir`."""
        from fulmen.telemetry.steps import read_curve
        from fulmen_algorithm.report import plot_curve

        s = self.settings
        out = run_dir(s)
        steps = await read_curve(self.store.redis, self.store.keys)
        paths: dict[str, Any] = {"metrics": str(s.metrics_file)}
        paths["curve"] = str(plot_curve(out / CURVE_FILE, steps, await recorded(self.store)))
        if s.model_dir is not None:
            final, chosen = await self.final_model(out)
            paths["final_model"] = str(final) if final else None
            paths.update(chosen)
        (out / "summary.json").write_text(json.dumps({**summary, **paths}, indent=2))
        paths["summary"] = str(out / "summary.json")
        return paths


def _replace_folder(source: Path, target: Path) -> None:
    import shutil

    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)


def _folder_version(folder: Path | None) -> str | None:
    if folder is None or not (folder / "fulmen_version.json").exists():
        return None
    return json.loads((folder / "fulmen_version.json").read_text()).get("model_version")
