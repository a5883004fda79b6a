"""The `fulmen` command line. Every option can also come from the environment (FULMEN_<NAME>)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fulmen import archive_cli, inspect_cli, trim_cli
from fulmen.connection import redact
from fulmen.errors import InvalidInput
from fulmen.records.status import Priority, RolloutMode
from fulmen.service_cli import (
    ExperimentOpt,
    err,
    flag,
    out,
    run_on_store,
    settings_command,
    settings_from_flags,
)
from fulmen.settings import CommonSettings, WatchdogSettings
from fulmen.store import RedisStore, run_watchdog
from fulmen.store.experiments import delete_experiment, list_experiments
from fulmen.store.watchdog import INTERVAL_S as WATCHDOG_INTERVAL_S
from fulmen.tasks_file import BadLine, LineNote, parse_tasks

app = typer.Typer(
    help="Fulmen: train any agent with RL, prompt optimisation and SFT over Redis Streams.\n\n"
    "Redis comes from REDIS_URL; without it, the embedded server (`fulmen redis`).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
log = logging.getLogger("fulmen")

# Rollouts `fulmen push` sends per round trip: large enough to amortise the round trip, small
# enough that the progress bar moves.
PUSH_BATCH = 500

RedisPortOpt = flag(CommonSettings, "redis_port", ["--port"])
DataDirOpt = flag(CommonSettings, "data_dir")

# --- redis -------------------------------------------------------------------------------------------


@app.command()
def redis(
    port: RedisPortOpt = None,
    data_dir: DataDirOpt = None,
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
    strict: Annotated[
        bool, typer.Option(help="Refuse the whole file if any line is bad (a duplicate id, NaN or Infinity too).")
    ] = False,
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
    batch_size: Annotated[int, typer.Option(min=1, help="Rollouts per round trip.")] = PUSH_BATCH,
    priority: Annotated[
        Priority | None,
        typer.Option(help="Queue lane: urgent, normal or low (default: urgent for --mode val, else normal)."),
    ] = None,
    priority_field: Annotated[
        str, typer.Option(help="Task field that sets a line's own priority over --priority. '' for none.")
    ] = "",
) -> None:
    """Queue every task of a JSON-lines file as a rollout.

    Each line is a JSON object: the task the agent receives. Bad lines (not UTF-8, not a JSON object,
    an id given twice, ...) are reported with their line number and skipped (or, with --strict,
    nothing is queued). Ends with a summary. Exit code: 0 when something was queued or already
    present, 1 when lines were refused and nothing was, 2 when the file cannot be read."""
    settings = settings_from_flags(experiment=experiment)
    defaults: dict[str, Any] = {
        "mode": mode,
        "resources_id": resources_id,
        "priority": priority,
        "config": {
            "max_attempts": max_attempts,
            "retry_condition": retry_on or [],
            "timeout_seconds": timeout_seconds,
            "unresponsive_seconds": unresponsive_seconds,
        },
    }
    # Bytes, decoded line by line (`fulmen.tasks.parse_task_lines`): a line that is not UTF-8 is one
    # bad line, where a text stream would raise on it and end the whole push.
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    try:
        stream = stdin if file == "-" else open(file, "rb")  # noqa: SIM115 - closed below
        total = None
        if stream is not stdin:
            total = sum(1 for line in stream if line.strip())  # for the progress bar
            stream.seek(0)
    except OSError as e:
        err.print(f"[red]error:[/red] cannot read {file}: {e.strerror}")
        raise typer.Exit(2) from None

    async def work(store: RedisStore) -> tuple[int, int, list[BadLine]]:
        await store.ensure()
        bad: list[BadLine] = []
        created = existed = 0
        items = parse_tasks(stream, store, id_field=id_field or None, defaults=defaults, strict=strict,
                            priority_field=priority_field or None)
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
                if isinstance(item, LineNote):
                    err.print(f"[yellow]line {item.line_number}:[/yellow] {item.reason} (queued)")
                    continue
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
        if stream is not stdin:
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


for _name, _command in {**inspect_cli.COMMANDS, **archive_cli.COMMANDS}.items():
    app.command(_name)(_command)


# --- operations --------------------------------------------------------------------------------------


@app.command()
@settings_command(WatchdogSettings)
def watchdog(
    settings: WatchdogSettings,
    interval_s: Annotated[float, typer.Option(min=0.05, help="Seconds between sweeps.")] = WATCHDOG_INTERVAL_S,
) -> None:
    """End attempts past their timeout or heartbeat, and requeue or fail their rollouts; with a
    retention limit set, trim the store by it every retention interval (off by default).

    Safe to run several at once (each attempt changes status exactly once). Stops on SIGTERM."""
    try:
        retention = trim_cli.retention_schedule(settings)
    except InvalidInput as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None

    async def work(store: RedisStore) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("watchdog on experiment %s, every %.2fs", store.experiment, interval_s)
        if retention is not None:
            log.info("retention every %.0fs: %s", retention.interval_s, retention.policy)
        from fulmen.ops_http import start_ops

        with start_ops(settings, "watchdog"):
            await run_watchdog(store, interval_s, stop, retention)
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


app.command("trim")(trim_cli.trim_command)


@app.command("rollback")
def rollback_command(
    version: Annotated[str, typer.Argument(help="The model version to serve again, e.g. v12 (`fulmen status` lists them).")],
    experiment: ExperimentOpt = None,
) -> None:
    """Serve an older model version again: every proxy and vLLM server follows, as for a new version.

    Only a version whose weights are still stored can come back (the newest --keep-versions). A running trainer goes on from its own weights and its next version replaces the rollback: stop it first to keep the older version served."""
    settings = settings_from_flags(experiment=experiment)

    async def work(store: RedisStore) -> None:
        import time

        from fulmen.ops_http import HEARTBEAT_S
        from fulmen.records import ServiceBeat
        from fulmen.rollback import rollback

        update = await rollback(store, version)
        moved = update.resources["llm"]["rollback"]
        out.print(f"rolled back from {moved['from']} to {moved['to']} (resources {update.resources_id} v{update.version}); "
                  "the proxies and vLLM servers load it now")
        beats = [ServiceBeat.from_wire(raw) for raw in (await store.redis.hgetall(store.keys.services)).values()]
        if any(b.service == "trainer" and time.time() - b.time <= 3 * HEARTBEAT_S for b in beats):
            err.print("[yellow]warning:[/yellow] a trainer is running: its next version replaces this rollback "
                      "(stop it to keep serving the older version)")

    run_on_store(settings, work)


@app.command("ab")
def ab_command(
    a: Annotated[str | None, typer.Argument(help="The version most rollouts keep (A), e.g. v9.")] = None,
    b: Annotated[str | None, typer.Argument(help="The version under test (B), e.g. v12.")] = None,
    split: Annotated[float, typer.Option(help="Fraction of rollouts B serves (by a stable hash of the rollout id).")] = 0.5,
    off: Annotated[bool, typer.Option("--off", help="End the A/B test: A alone again.")] = False,
    experiment: ExperimentOpt = None,
) -> None:
    """Serve two model versions at once and split rollouts between them; `fulmen status` shows the reward per version.

    Torch proxies hold both versions (twice the model's memory); every call of a rollout goes to the same version. A new version from the trainer ends the test: run it with the trainer stopped."""
    settings = settings_from_flags(experiment=experiment)
    if not off and (a is None or b is None):
        err.print("[red]error:[/red] give two versions (fulmen ab A B [--split F]) or --off")
        raise typer.Exit(2)

    async def work(store: RedisStore) -> None:
        from fulmen.ab import start_ab, stop_ab

        if off:
            update = await stop_ab(store)
            out.print(f"A/B test over: {update.resources['llm']['model_version']} serves every rollout")
        else:
            assert a is not None and b is not None
            await start_ab(store, a, b, split)
            out.print(f"A/B test: {b} serves {split:.0%} of rollouts, {a} the rest (fulmen status: reward by version)")

    run_on_store(settings, work)


@app.command()
def dev(
    agent: Annotated[str, typer.Option("--agent", "-a", help="The agent to run, as module:function or module:Class.")],
    tasks: Annotated[
        Path | None,
        typer.Option(help="Training tasks (JSON lines) for `fulmen algorithm`; unset: the demo's arithmetic tasks."),
    ] = None,
    env_file: Annotated[Path, typer.Option(help="Settings file read as honcho reads it (the environment wins).")] = Path(".env"),
    dashboard: Annotated[bool, typer.Option(help="Serve the dashboard too.")] = True,
) -> None:
    """Every service of the Procfile in this one process, as asyncio tasks on the embedded Redis.

    Behaves like `honcho start` (same settings, same end: when the run is over, everything stops),
    but a debugger can stop in your agent, the adapter or the loss and step through one rollout.
    Without --tasks it runs the demo (`fulmen demo`)."""
    from fulmen import dev as dev_mode

    dev_mode.apply_dotenv(env_file)
    os.environ["FULMEN_AGENT"] = agent
    if tasks is not None:
        os.environ["FULMEN_TRAIN_DATA"] = str(tasks)
    os.environ.pop("PORT", None)  # one process: no service may take honcho's per-process port
    settings = settings_from_flags()
    try:
        services = dev_mode.load_services()
    except Exception as e:
        err.print(f"[red]error:[/red] cannot load the services: {type(e).__name__}: {e}")
        raise typer.Exit(2) from None
    services.pop("demo" if tasks is not None else "algorithm", None)
    with contextlib.suppress(ImportError):  # transformers' lazy imports are not thread-safe: the
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 - services load models in threads at once
    if ("algorithm" if tasks is not None else "demo") not in services:
        err.print("[red]error:[/red] the services are not installed in this environment: run pip install -e . (or "
                  "pip install fulmen) in it first")
        raise typer.Exit(2)
    if not dashboard:
        services.pop("dashboard", None)
    with contextlib.ExitStack() as stack:
        if settings.embedded:
            from fulmen.embedded import EmbeddedRedis

            log.info("embedded Redis on 127.0.0.1:%d, data in %s", settings.redis_port, settings.data_dir / "redis")
            stack.enter_context(EmbeddedRedis(settings.data_dir / "redis", port=settings.redis_port))
        loop = asyncio.new_event_loop()
        try:
            code = loop.run_until_complete(
                dev_mode.run_all(services, ends_run="algorithm" if tasks is not None else "demo"))
        finally:
            loop.close()  # not asyncio.run: it would wait for worker threads still in a job (a validation pass)
    dev_mode.exit_leaving_threads(code)


def _add_service_commands() -> None:
    """`fulmen runner`, `fulmen llm-proxy`, ...: each service registers its command as an entry point."""
    from importlib.metadata import entry_points

    registered = {c.name for c in app.registered_commands}
    for ep in entry_points(group="fulmen.services"):
        if ep.name in registered:  # called twice (tests): once is enough
            continue
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
