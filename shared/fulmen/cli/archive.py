"""`fulmen archive`, `fulmen restore` and `fulmen export` (`fulmen replay` is the adapter's: it runs the
adapter's code)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Annotated

import typer

from fulmen import progress
from fulmen.cli.service import (
    ExperimentOpt,
    err,
    error_exit,
    opened_store,
    out,
    run_on_store,
    settings_from_flags,
    stop_on_signals,
)
from fulmen.errors import FulmenError, InvalidInput
from fulmen.settings import CommonSettings
from fulmen.store import RedisStore

EXPORT_PAGE = 1000  # samples-stream entries per read
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds of ``30s``, ``10m``, ``1.5h``, ``1d`` or a plain number of seconds (at least 1 s)."""
    m = _DURATION.fullmatch(text.strip().lower())
    if m is None or float(m[1]) * _UNIT_S[m[2]] < 1:
        raise typer.BadParameter(f"{text!r} is not a duration of at least 1s: use e.g. 30s, 10m, 1h")
    return float(m[1]) * _UNIT_S[m[2]]


def archive(
    directory: Annotated[Path | None, typer.Option(
        "--to", help="The experiment's archive directory (default: <data dir>/archive/<experiment>).")] = None,
    experiment: ExperimentOpt = None,
    chunk: Annotated[int, typer.Option(min=1, max=100_000, help="Entries per file.")] = 1000,
    samples: Annotated[bool, typer.Option(help="Archive the samples stream too.")] = True,
    every: Annotated[str | None, typer.Option(
        "--every", help="Archive continuously: a pass every this long (30s, 10m, 1h) until SIGTERM.")] = None,
) -> None:
    """Write an experiment's history to files, before `fulmen trim`, so that it survives the loss of Redis.

    Finished rollouts (with their attempts and spans), samples, the trainer's steps, the resources
    log, the validation passes, the dead letters and a snapshot of the run's state (the algorithm's
    position, the adapter's counters, the consumer groups). Incremental: each run writes only what
    earlier runs have not (for rollouts and samples its cursor is the consumer group "archive" on
    every finished stream, every store shard's, and on the samples stream; for the other streams,
    the last entry its files hold; the state when it changed), and from its first run on,
    `fulmen trim` keeps every finished and sample entry not yet archived: run archive, then trim,
    as often as you like, and nothing is lost or written twice. Files are gzip-compressed msgpack,
    each written under a temporary name and renamed: a crash leaves whole files only, and the next
    run goes on where the last file ends. With --every it runs until SIGTERM (exit 0), a log line
    per pass; a failed pass is logged and tried again. `fulmen restore --from DIR` rebuilds the
    experiment from the files; `fulmen replay --from DIR` turns the archived spans into samples
    again; `fulmen export --from DIR` makes a dataset of the archived samples."""
    settings = settings_from_flags(experiment=experiment)
    target = directory or settings.data_dir / "archive" / settings.experiment
    every_s = parse_duration(every) if every is not None else None
    if every_s is not None:
        _archive_every(settings, target, every_s, chunk, samples)
        return

    async def work(store: RedisStore) -> None:
        from fulmen.archive.write import archive as run_archive

        with progress.bar("archive") as bar:
            report = await run_archive(store, target, chunk=chunk, samples=samples, bar=bar)
        out.print(f"archived {report.summary()} to {target}")

    run_on_store(settings, work)


def _archive_every(settings: CommonSettings, target: Path, every_s: float, chunk: int, samples: bool) -> None:
    from fulmen.archive.schedule import archive_every

    async def main() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop.set)
        async with opened_store(settings) as store:
            await archive_every(store, target, every_s, stop, chunk=chunk, samples=samples)

    try:
        asyncio.run(main())
    except InvalidInput as e:
        raise error_exit(str(e)) from None
    except FulmenError as e:
        raise error_exit(str(e), 1) from None


def restore(
    source: Annotated[Path, typer.Option(
        "--from", help="An archive directory (`fulmen archive`'s: one experiment's files).")],
    experiment: Annotated[str | None, typer.Option(
        "--experiment", "-e", help="The experiment to rebuild it as (default: the archived experiment's "
        "name). It must have no data.")] = None,
) -> None:
    """Rebuild an experiment from its archive, after the loss of Redis or into another Redis.

    Into an experiment that has no data at all (refused otherwise): every archived stream entry
    under its own id (finished rollouts with their attempts and spans, samples, trainer steps,
    resources log, validation passes, dead letters), the resources, and the newest snapshot of the
    run's state (the algorithm's position, the adapter's counters, the consumer groups' cursors),
    so that `fulmen status`, `fulmen top` and the dashboard read it as they read the original, and a
    service started on it goes on from there. Not `fulmen replay`, which re-derives samples from
    archived spans with the adapter's code and appends them to a live experiment. Rollouts that had
    not finished when the archive last ran, and the model weights' chunks, are not in the archive (the
    stored versions' index and manifests are: a version is rebuilt from the trainer's checkpoint
    when a proxy or `fulmen rollback` asks for it)."""
    from fulmen.archive.restore import archive_info
    from fulmen.archive.restore import restore as run_restore

    try:
        info = archive_info(source)
    except FulmenError as e:
        raise error_exit(str(e)) from None
    settings = settings_from_flags(experiment=experiment or info.experiment)

    async def work(store: RedisStore) -> None:
        target = RedisStore(store.redis, store.experiment, max_record_bytes=store.max_record_bytes,
                            shards=info.shards, weights_redis=store.weights_redis)
        try:
            with progress.bar("restore") as bar:
                report = await run_restore(target, source, bar)
        except InvalidInput as e:
            raise error_exit(str(e)) from None
        out.print(f"restored experiment {target.experiment} from {source} ({info.experiment}'s archive): "
                  f"{report.summary()}")

    run_on_store(settings, work)


def export(
    output: Annotated[Path, typer.Argument(help="The dataset file to write (JSON lines).")],
    sources: Annotated[list[Path] | None, typer.Option(
        "--from", help="Archive directories or files: `fulmen archive`'s, `fulmen replay --to-file`'s "
        "(repeatable). Unset: the samples stream in Redis.")] = None,
    experiment: ExperimentOpt = None,
    shape: Annotated[str, typer.Option(help="all, triplet (one LLM call each) or trajectory (joined turns).")] = "all",
    min_reward: Annotated[float | None, typer.Option(
        help="Keep only samples whose final reward is at least this (rejection sampling for SFT).")] = None,
    token_ids: Annotated[bool, typer.Option(
        "--token-ids", help="Add prompt_token_ids, response_token_ids and response_mask (1: the model's "
        "tokens) to each record.")] = False,
) -> None:
    """Write samples as a dataset Hugging Face `datasets` loads directly: SFT conversations with rewards.

    JSON lines: a `messages` column (role and content, the chat the model answered, its answer last),
    `reward` (the attempt's final reward), `turn_reward`, and the sample's ids, shape and model
    version (with --token-ids, the token ids and the loss mask too). Load it with
    datasets.load_dataset("json", data_files="OUT"). Skip records are left out
    and a sample met twice is written once."""
    from fulmen.archive.export import SHAPES, archived_count, archived_records
    from fulmen.archive.export import export as run_export

    if shape not in SHAPES:
        err.print(f"[red]error:[/red] --shape {shape!r} is none of {', '.join(SHAPES)}")
        raise typer.Exit(2)
    settings = settings_from_flags(experiment=experiment)
    if sources:
        try:
            with progress.bar("export") as bar:
                if bar.drawn:
                    bar.update(total=archived_count(sources))
                report = run_export(bar.each(archived_records(sources)), output, settings.max_record_bytes,
                                    shape=shape, min_reward=min_reward, token_ids=token_ids)
        except (FulmenError, OSError) as e:  # not an archive file; cannot write
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
    else:
        records = run_on_store(settings, _samples_in_redis)
        try:
            with progress.bar("export", len(records)) as bar:
                report = run_export(bar.each(records), output, settings.max_record_bytes, shape=shape,
                                    min_reward=min_reward, token_ids=token_ids)
        except OSError as e:
            err.print(f"[red]error:[/red] cannot write {output}: {e.strerror}")
            raise typer.Exit(1) from None
    out.print(f"exported {report.rows} samples to {output} ({report.skips} skip records, {report.duplicates} "
              f"duplicates, {report.filtered} filtered out, {report.unreadable} unreadable)")


async def _samples_in_redis(store: RedisStore) -> list[bytes]:
    """Every record of the samples stream, read a page at a time under a bar."""
    records: list[bytes] = []
    start = "-"
    with progress.bar("read samples") as bar:
        if bar.drawn:
            bar.update(total=await store.redis.xlen(store.keys.samples))
        while entries := await store.redis.xrange(store.keys.samples, min=start, count=EXPORT_PAGE):
            records += [fields[b"m"] for _, fields in entries if b"m" in fields]
            start = "(" + entries[-1][0].decode()
            bar.advance(len(entries))
    return records


COMMANDS = {"archive": archive, "restore": restore, "export": export}
