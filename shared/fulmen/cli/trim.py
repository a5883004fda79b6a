"""`fulmen trim`: retention by hand (`fulmen.retention.trim`), and the watchdog's retention schedule
from its settings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from fulmen.cli.service import ExperimentOpt, err, out, run_on_store, settings_from_flags
from fulmen.errors import InvalidInput
from fulmen.retention.trim import FINISHED, QUEUE, SAMPLES, RetentionPolicy, trim
from fulmen.settings import WatchdogSettings
from fulmen.store import RedisStore
from fulmen.watchdog import RETENTION_INTERVAL_S, RetentionSchedule


def trim_command(
    experiment: ExperimentOpt = None,
    max_age_s: Annotated[float | None, typer.Option(
        help="Queue, finished and samples entries at least this old (seconds) go, once every consumer group acknowledged them.")] = None,
    max_count: Annotated[int | None, typer.Option(
        help="At most this many entries stay per queue, finished and samples stream (acknowledged ones go first).")] = None,
    queue: Annotated[bool, typer.Option(help="Trim every shard's queue by the limits.")] = True,
    finished: Annotated[bool, typer.Option(
        help="Trim every shard's finished stream by the limits, and the spans of the rollouts whose entries go.")] = True,
    samples: Annotated[bool, typer.Option(help="Trim the samples stream by the limits.")] = True,
    delete_rollouts: Annotated[bool, typer.Option(help="Also delete the records of the rollouts whose finished entries go.")] = False,
    resources: Annotated[bool, typer.Option(
        help="Trim the resources log by the limits too (never what a stored or served model version needs).")] = False,
    keep_versions: Annotated[int | None, typer.Option(
        help="Delete the weights of all model versions but the newest this many and every one served.")] = None,
    weights_dir: Annotated[Path | None, typer.Option(help="The shared folder of folder versions, whose folders go too.")] = None,
    steps_max_count: Annotated[int | None, typer.Option(help="Keep the trainer's newest this many step records.")] = None,
    dead_letters_max_age_s: Annotated[float | None, typer.Option(help="Delete dead letters at least this old (seconds).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Remove nothing; print what would go.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON line.")] = False,
) -> None:
    """Trim the store: what every consumer group acknowledged (queue, finished entries and their spans,
    samples), and by their own rules the resources log, weights, trainer steps and dead letters.

    Every shard is trimmed. Nothing a consumer group has not acknowledged ever goes. Archive first what
    must outlive the store (`fulmen archive`)."""
    settings = settings_from_flags(experiment=experiment)
    chosen = frozenset(name for name, on in ((QUEUE, queue), (FINISHED, finished), (SAMPLES, samples)) if on)
    try:
        policy = RetentionPolicy(max_age_s, max_count, delete_rollouts, chosen, resources, keep_versions, weights_dir,
                                 steps_max_count, dead_letters_max_age_s)
    except InvalidInput as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    verb = "would trim" if dry_run else "trimmed"

    def progress(kind: str, key: str, count: int) -> None:
        if not as_json:
            out.print(f"{kind:>13}  {key}: {verb} {count}", markup=False, highlight=False, soft_wrap=True)

    async def work(store: RedisStore) -> None:
        report = await trim(store, policy, dry_run=dry_run, progress=progress)
        if as_json:
            out.print(json.dumps(dataclasses.asdict(report)), markup=False, highlight=False, soft_wrap=True)
        else:
            out.print(report.summary(), markup=False, highlight=False, soft_wrap=True)

    run_on_store(settings, work)


def retention_schedule(settings: WatchdogSettings) -> RetentionSchedule | None:
    """The watchdog's retention from its settings: None when no limit is set (the default); every
    `RETENTION_INTERVAL_S` unless ``retention_interval_s`` says otherwise. Raises InvalidInput for
    settings that make no policy (an interval and no limit, the resources log with no age or count)."""
    s = settings
    limits = (s.retention_max_age_s, s.retention_max_count, s.retention_keep_versions, s.retention_steps_max_count,
              s.retention_dead_letters_max_age_s)
    if all(v is None for v in limits) and not (s.retention_resources or s.retention_delete_rollouts):
        if s.retention_interval_s is not None:
            raise InvalidInput("retention_interval_s is set but no retention limit is (retention_max_age_s, "
                               "retention_max_count, retention_keep_versions, …): nothing would be trimmed")
        return None
    policy = RetentionPolicy(
        max_age_s=s.retention_max_age_s, max_count=s.retention_max_count, delete_rollouts=s.retention_delete_rollouts,
        resources=s.retention_resources, keep_versions=s.retention_keep_versions, weights_dir=s.weights_dir,
        steps_max_count=s.retention_steps_max_count, dead_letters_max_age_s=s.retention_dead_letters_max_age_s,
    )
    return RetentionSchedule(policy, s.retention_interval_s or RETENTION_INTERVAL_S)
