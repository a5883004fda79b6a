"""The `fulmen` command line. Every option can also come from the environment (FULMEN_<NAME>)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fulmen import semconv
from fulmen.connection import connect, redact
from fulmen.errors import FulmenError
from fulmen.records.status import RolloutMode, RolloutStatus
from fulmen.settings import Settings, load_settings
from fulmen.store import RedisStore, run_watchdog
from fulmen.store.experiments import delete_experiment, list_experiments
from fulmen.store.retention import RetentionPolicy, trim
from fulmen.tasks_file import BadLine, parse_tasks

app = typer.Typer(
    help="Fulmen: train any agent with RL, prompt optimisation and SFT over Redis Streams.\n\n"
    "Redis comes from REDIS_URL; without it, the embedded server (`fulmen redis`).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)
log = logging.getLogger("fulmen")

T = TypeVar("T")

ExperimentOpt = Annotated[
    str | None,
    typer.Option("--experiment", "-e", help="Experiment name [env FULMEN_EXPERIMENT; default: default]."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def settings_from_flags(**overrides: Any) -> Settings:
    """Settings from a command's flags over the environment, logging set up; a bad value exits 2.
    Every service's command starts with this."""
    try:
        settings = load_settings(**overrides)
    except FulmenError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for chatty in ("httpx", "httpx2", "httpcore", "httpcore2", "openai"):  # a line per HTTP request drowns the services' own
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    return settings


def run_on_store(settings: Settings, work: Callable[[RedisStore], Awaitable[T]]) -> T:
    """Connect, run one piece of work on the experiment's store, and turn Fulmen errors into exit 1.

    The connection waits (with backoff and a log line) for Redis to come up, up to redis_wait_s."""

    async def main() -> T:
        client = await connect(settings)
        try:
            return await work(
                RedisStore(client, settings.experiment, max_record_bytes=settings.max_record_bytes)
            )
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    except FulmenError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None


# --- redis -------------------------------------------------------------------------------------------


@app.command()
def redis(
    port: Annotated[int | None, typer.Option(help="Port [env FULMEN_REDIS_PORT; default 6399].")] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Data folder [env FULMEN_DATA_DIR; default .fulmen].")
    ] = None,
) -> None:
    """Run the embedded Redis (AOF on, loopback only) in the foreground, for honcho.

    With REDIS_URL set, Fulmen uses that server instead: this command then stays up doing nothing,
    so that honcho (which stops everything when one process exits) keeps the other services running."""
    settings = settings_from_flags(redis_port=port, data_dir=data_dir)
    if not settings.embedded:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # before the line that says we are up
        log.info(
            "REDIS_URL is set (%s): nothing to run; idling until stopped", redact(settings.redis_url_value())
        )
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
        return
    from fulmen.embedded import run_foreground

    redis_dir = settings.data_dir / "redis"
    log.info("embedded Redis on 127.0.0.1:%d, data in %s", settings.redis_port, redis_dir)
    run_foreground(redis_dir, settings.redis_port)


# --- push --------------------------------------------------------------------------------------------


@app.command()
def push(
    file: Annotated[str, typer.Argument(help="JSON-lines file of tasks, or - for standard input.")],
    experiment: ExperimentOpt = None,
    mode: Annotated[RolloutMode, typer.Option(help="Rollout mode.")] = RolloutMode.TRAIN,
    id_field: Annotated[
        str,
        typer.Option(help="Task field used as rollout id (pushing twice then adds nothing). '' for none."),
    ] = "id",
    strict: Annotated[bool, typer.Option(help="Refuse the whole file if any line is bad.")] = False,
    resources_id: Annotated[str | None, typer.Option(help="Resources the rollouts run with.")] = None,
    max_attempts: Annotated[int, typer.Option(min=1, help="Attempts per rollout, the first included.")] = 1,
    retry_on: Annotated[
        list[str] | None, typer.Option(help="Retry after: failed, timeout, unresponsive (repeatable).")
    ] = None,
    timeout_seconds: Annotated[
        float | None, typer.Option(help="An attempt running longer times out.")
    ] = None,
    unresponsive_seconds: Annotated[
        float | None, typer.Option(help="An attempt silent this long is unresponsive.")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Rollouts per round trip.")] = 500,
) -> None:
    """Queue every task of a JSON-lines file as a rollout.

    Each line is a JSON object: the task the agent receives. Bad lines are reported with their line
    number and skipped (or, with --strict, nothing is queued). Ends with a summary."""
    settings = settings_from_flags(experiment=experiment)
    defaults: dict[str, Any] = {
        "mode": mode,
        "resources_id": resources_id,
        "config": {
            "max_attempts": max_attempts,
            "retry_condition": retry_on or [],
            "timeout_seconds": timeout_seconds,
            "unresponsive_seconds": unresponsive_seconds,
        },
    }
    try:
        stream = sys.stdin if file == "-" else open(file, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as e:
        err.print(f"[red]error:[/red] cannot read {file}: {e.strerror}")
        raise typer.Exit(2) from None
    total = None
    if stream is not sys.stdin:
        total = sum(1 for line in stream if line.strip())  # for the progress bar
        stream.seek(0)

    async def work(store: RedisStore) -> tuple[int, int, list[BadLine]]:
        await store.ensure()
        bad: list[BadLine] = []
        created = existed = 0
        items = parse_tasks(stream, store, id_field=id_field or None, defaults=defaults)
        if strict:
            items = list(items)  # validate everything before queuing anything
            bad = [x for x in items if isinstance(x, BadLine)]
            if bad:
                return 0, 0, bad
        columns = (TextColumn("push"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
            task = progress.add_task("push", total=total)
            batch = []
            for item in [*items, None]:
                if isinstance(item, BadLine):
                    bad.append(item)
                    err.print(f"[yellow]line {item.line_number}:[/yellow] {item.reason} (skipped)")
                    progress.advance(task)
                    continue
                if item is not None:
                    batch.append(item)
                if batch and (item is None or len(batch) >= batch_size):
                    results = await store.enqueue_rollouts(batch)
                    created += sum(results)
                    existed += len(results) - sum(results)
                    progress.advance(task, len(batch))
                    batch = []
        return created, existed, bad

    try:
        created, existed, bad = run_on_store(settings, work)
    finally:
        if stream is not sys.stdin:
            stream.close()
    if strict and bad:
        for b in bad:
            err.print(f"[red]line {b.line_number}:[/red] {b.reason}")
        err.print(f"[red]refused:[/red] {len(bad)} bad line(s) and --strict; nothing was queued")
        raise typer.Exit(1)
    summary = f"queued {created} rollout(s) in experiment {settings.experiment!r}"
    if existed:
        summary += f"; {existed} already present (same id), left unchanged"
    if bad:
        summary += f"; skipped {len(bad)} bad line(s)"
    out.print(summary)
    if bad and not created and not existed:
        raise typer.Exit(1)


# --- status and inspection ---------------------------------------------------------------------------


@app.command()
def status(experiment: ExperimentOpt = None, as_json: JsonOpt = False) -> None:
    """One screen: queue depth, rollouts per status, pending per consumer, dead letters, resources."""
    settings = settings_from_flags(experiment=experiment)
    stats = run_on_store(settings, lambda store: store.statistics())
    if as_json:
        out.print_json(json.dumps(stats))
        return
    table = Table(title=f"experiment {stats['experiment']}", show_header=False)
    table.add_row("queue depth", str(stats["queue_depth"]))
    table.add_row("active attempts", str(stats["active_attempts"]))
    for name, count in stats["rollouts"].items():
        table.add_row(f"  {name}", str(count))
    table.add_row("total rollouts", str(stats["total_rollouts"]))
    pending = ", ".join(f"{c}: {n}" for c, n in stats["pending"].items() if n) or "none"
    table.add_row("pending (claimed, not started)", pending)
    table.add_row("dead letters", str(stats["dead_letters"]))
    table.add_row("finished", str(stats["finished"]))
    latest = stats["latest_resources"]
    table.add_row("latest resources", f"{latest['resources_id']} v{latest['version']}" if latest else "none")
    table.add_row("workers", str(stats["workers"]))
    out.print(table)


@app.command()
def top(
    experiment: ExperimentOpt = None,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit (for scripts).")] = False,
) -> None:
    """A live view of the whole pipeline, refreshed in place until Ctrl-C.

    Services and their live replicas (from heartbeats), queue depth, active attempts, rollouts per
    end status, finished rollouts, samples and dead letters with their rates (between refreshes), pending
    entries and lag per consumer group, the reward curve as a sparkline (the trainer's step log) and
    the model version being served. Reads only Redis: run it from any machine that reaches it."""
    settings = settings_from_flags(experiment=experiment)
    import redis as redis_sync

    from fulmen.top import run

    client = redis_sync.Redis.from_url(settings.redis_url_value(), socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        code = run(client, settings.experiment, interval, once, out)
    except (redis_sync.RedisError, OSError) as e:
        err.print(f"[red]error:[/red] Redis at {redact(settings.redis_url_value())} unreachable: {type(e).__name__}")
        raise typer.Exit(1) from None
    finally:
        client.close()
    raise typer.Exit(code)


@app.command()
def rollouts(
    experiment: ExperimentOpt = None,
    status_: Annotated[
        list[RolloutStatus] | None, typer.Option("--status", help="Only these statuses (repeatable).")
    ] = None,
    mode: Annotated[RolloutMode | None, typer.Option(help="Only this mode.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many.")] = 20,
    offset: Annotated[int, typer.Option(min=0, help="Skip this many first.")] = 0,
    oldest_first: Annotated[bool, typer.Option(help="Oldest first (default: newest first).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List rollouts, newest first, with their status and attempts."""
    settings = settings_from_flags(experiment=experiment)
    found = run_on_store(
        settings,
        lambda store: store.query_rollouts(
            status=status_ or None, mode=mode, descending=not oldest_first, limit=limit, offset=offset
        ),
    )
    if as_json:
        out.print_json(
            json.dumps(
                [
                    {
                        "rollout_id": r.rollout_id,
                        "status": r.status.value,
                        "mode": r.mode and r.mode.value,
                        "attempts": r.attempt_count,
                        "input": r.input,
                        "enqueue_time": r.enqueue_time,
                        "end_time": r.end_time,
                    }
                    for r in found
                ],
                default=str,
            )
        )
        return
    table = Table("rollout", "status", "mode", "attempts", "input")
    for r in found:
        text = json.dumps(r.input, default=str)
        table.add_row(
            r.rollout_id, r.status.value, r.mode.value if r.mode else "", str(r.attempt_count), text[:60]
        )
    out.print(table)
    if not found:
        out.print("no rollouts match")


@app.command()
def spans(
    rollout_id: Annotated[str, typer.Argument(help="The rollout whose spans to show.")],
    experiment: ExperimentOpt = None,
    attempt: Annotated[str, typer.Option(help="'latest', 'all', or an attempt id.")] = "all",
    as_json: JsonOpt = False,
) -> None:
    """Show a rollout's spans in sequence order."""
    settings = settings_from_flags(experiment=experiment)
    found = run_on_store(settings, lambda store: store.query_spans(rollout_id, None if attempt == "all" else attempt))
    if as_json:
        out.print_json(
            json.dumps(
                [
                    {
                        "sequence_id": s.sequence_id,
                        "attempt_id": s.attempt_id,
                        "span_id": s.span_id,
                        "parent_id": s.parent_id,
                        "name": s.name,
                        "start_time": s.start_time,
                        "end_time": s.end_time,
                        "attributes": semconv.readable(s.attributes),
                    }
                    for s in found
                ],
                default=str,
            )
        )
        return
    table = Table("seq", "attempt", "name", "span", "parent", "attributes")
    for s in found:
        attrs = json.dumps(semconv.readable(s.attributes), default=str)
        table.add_row(str(s.sequence_id), s.attempt_id, s.name, s.span_id, s.parent_id or "", attrs[:60])
    out.print(table)
    if not found:
        out.print(f"rollout {rollout_id} has no spans")


@app.command("dead-letters")
def dead_letters(
    experiment: ExperimentOpt = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = 20,
) -> None:
    """Show poison messages and why they were set aside."""
    settings = settings_from_flags(experiment=experiment)
    letters = run_on_store(settings, lambda store: store.query_dead_letters(limit))
    table = Table("id", "source", "entry", "reason")
    for d in letters:
        table.add_row(d.dead_letter_id, d.source, d.entry_id, d.reason)
    out.print(table)


# --- operations --------------------------------------------------------------------------------------


@app.command()
def watchdog(
    experiment: ExperimentOpt = None,
    interval_s: Annotated[float, typer.Option(min=0.05, help="Seconds between sweeps.")] = 1.0,
) -> None:
    """End attempts past their timeout or heartbeat, and requeue or fail their rollouts.

    Safe to run several at once (each attempt changes status exactly once). Stops on SIGTERM."""
    settings = settings_from_flags(experiment=experiment)

    async def work(store: RedisStore) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("watchdog on experiment %s, every %.2fs", store.experiment, interval_s)
        from fulmen.ops_http import start_ops

        with start_ops(settings, "watchdog"):
            await run_watchdog(store, interval_s, stop)
        log.info("watchdog stopped")

    run_on_store(settings, work)


@app.command()
def experiments(
    delete: Annotated[str | None, typer.Option(help="Delete this experiment and all its data.")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask before deleting.")] = False,
) -> None:
    """List the experiments in this Redis, or delete one."""
    settings = settings_from_flags()
    if delete and not yes:
        typer.confirm(f"Delete experiment {delete!r} and all its rollouts, spans and resources?", abort=True)

    async def work(store: RedisStore) -> None:
        if delete:
            n = await delete_experiment(store.redis, delete)
            out.print(f"deleted experiment {delete!r} ({n} keys)")
        else:
            for name in await list_experiments(store.redis):
                out.print(name)

    run_on_store(settings, work)


@app.command("trim")
def trim_command(
    experiment: ExperimentOpt = None,
    max_age_s: Annotated[float | None, typer.Option(help="Trim consumed entries older than this.")] = None,
    max_count: Annotated[int | None, typer.Option(help="Keep at most this many entries per stream.")] = None,
    delete_rollouts: Annotated[bool, typer.Option(help="Also delete the trimmed rollouts' records.")] = False,
) -> None:
    """Trim what every consumer group has acknowledged (queue, finished stream and their spans)."""
    settings = settings_from_flags(experiment=experiment)

    async def work(store: RedisStore) -> None:
        report = await trim(store, RetentionPolicy(max_age_s, max_count, delete_rollouts))
        out.print(
            f"trimmed {report.queue_entries} queue entries, {report.finished} finished entries, "
            f"{report.span_streams} span streams, {report.rollouts} rollouts"
        )

    run_on_store(settings, work)


def _add_service_commands() -> None:
    """`fulmen runner`, `fulmen llm-proxy`, ...: each service registers its command as an entry point."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="fulmen.services"):
        try:
            command = ep.load()
        except Exception as e:  # one broken service must not take the whole CLI down
            err.print(f"[yellow]warning:[/yellow] command {ep.name!r} unavailable: {type(e).__name__}: {e}")
            continue
        app.command(ep.name)(command)


def main() -> None:
    _add_service_commands()
    app()


if __name__ == "__main__":
    main()
