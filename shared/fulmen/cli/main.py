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

from fulmen.cli import archive as archive_cli
from fulmen.cli import config as config_cli
from fulmen.cli import inspect as inspect_cli
from fulmen.cli import push as push_cli
from fulmen.cli import start as start_cli
from fulmen.cli import trim as trim_cli
from fulmen.cli import watchdog as watchdog_cli
from fulmen.cli.service import (
    ExperimentOpt,
    err,
    error_exit,
    flag,
    out,
    run_on_store,
    settings_command,
    settings_from_flags,
)
from fulmen.errors import InvalidInput
from fulmen.records.status import Priority, RolloutMode
from fulmen.settings import AlgorithmSettings, CommonSettings
from fulmen.settings.services import ServedModelSettings
from fulmen.store import RedisStore
from fulmen.store.experiments import delete_experiment, list_experiments
from fulmen.store.redis.connection import redact

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
    from fulmen.store.redis.embedded import run_foreground

    redis_dir = settings.data_dir / "redis"
    log.info("embedded Redis on 127.0.0.1:%d, data in %s", settings.redis_port, redis_dir)
    run_foreground(redis_dir, settings.redis_port)


# --- push --------------------------------------------------------------------------------------------


@app.command()
def push(
    file: Annotated[str, typer.Argument(
        help="Tasks: a JSON-lines file, - for standard input, or a Hugging Face dataset: a save_to_disk folder, "
             "a .parquet or an .arrow file.")],
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
    split: Annotated[str | None, typer.Option(
        help="A dataset folder holding a DatasetDict: the split to push (default train).")] = None,
    column: Annotated[list[str] | None, typer.Option(
        help="Dataset only: task field from a column, as FIELD=COLUMN (repeatable; e.g. --column question=prompt); "
             "other columns stay as they are. =COLUMN: the task is that column's value (a mapping).")] = None,
) -> None:
    """Queue every task of a JSON-lines file or a Hugging Face dataset as a rollout.

    Each line is a JSON object (each dataset row a mapping, after --column): the task the agent
    receives. Bad lines or rows (not UTF-8, not a JSON object, an id given twice, a value msgpack
    cannot hold, ...) are reported with their number (a line's from 1, a row's from 0 as dataset[n])
    and skipped (or, with --strict, nothing is queued). Ends with a summary. Exit code: 0 when
    something was queued or already present, 1 when lines were refused and nothing was, 2 when the
    file cannot be read."""
    settings = settings_from_flags(experiment=experiment)
    config = {"max_attempts": max_attempts, "retry_condition": retry_on or [], "timeout_seconds": timeout_seconds,
              "unresponsive_seconds": unresponsive_seconds}
    defaults: dict[str, Any] = {"mode": mode, "resources_id": resources_id, "priority": priority, "config": config}
    options = push_cli.PushOptions(defaults=defaults, id_field=id_field or None, strict=strict,
                                   batch_size=batch_size, priority_field=priority_field or None)
    push_cli.push_file(settings, file, split, column, options)


for _name, _command in {**inspect_cli.COMMANDS, **archive_cli.COMMANDS}.items():
    app.command(_name)(_command)


# --- operations --------------------------------------------------------------------------------------


app.command("watchdog")(watchdog_cli.command)


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
app.command("config")(config_cli.config_command)
app.command("start")(start_cli.start_command)


@app.command("rollback")
def rollback_command(
    version: Annotated[str, typer.Argument(help="The model version to serve again, e.g. v12 (`fulmen status` lists them).")],
    experiment: ExperimentOpt = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(
        help="The trainer's checkpoint folder, to rebuild weights Redis lost (unset: <data_dir>/checkpoints/<experiment>).")] = None,
) -> None:
    """Serve an older model version again: every proxy and vLLM server follows, as for a new version.

    Only a version whose weights are still stored can come back (the newest --keep-versions); weights a restarted Redis lost are rebuilt first from the trainer's checkpoint of that version (the served version's too: `fulmen rollback <served>` rebuilds it). A running trainer goes on from its own weights and its next version replaces the rollback: stop it first to keep the older version served."""
    settings = settings_from_flags(experiment=experiment)
    folder = checkpoint_dir or settings.data_dir / "checkpoints" / settings.experiment

    async def work(store: RedisStore) -> None:
        import time

        from fulmen.records import ServiceBeat
        from fulmen.serving.rollback import restore_served, rollback
        from fulmen.telemetry.http import HEARTBEAT_S

        rebuilt = await restore_served(store, version, folder)
        if rebuilt is not None:
            done = f"rebuilt from {rebuilt.checkpoint}" if rebuilt.checkpoint else "stored"
            out.print(f"{version} is the version served already; its weights are {done}")
            return
        update = await rollback(store, version, checkpoint_dir=folder)
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

    Torch proxies hold both versions (twice the model's memory); vLLM replicas hold a LoRA B as an adapter beside A; every call of a rollout goes to the same version. A new version from the trainer ends the test: run it with the trainer stopped."""
    settings = settings_from_flags(experiment=experiment)
    if not off and (a is None or b is None):
        err.print("[red]error:[/red] give two versions (fulmen ab A B [--split F]) or --off")
        raise typer.Exit(2)

    async def work(store: RedisStore) -> None:
        from fulmen.serving.ab import start_ab, stop_ab

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
    from fulmen.cli import dev as dev_mode

    dev_mode.apply_dotenv(env_file)
    os.environ["FULMEN_AGENT"] = agent
    if tasks is not None:
        os.environ["FULMEN_TRAIN_DATA"] = str(tasks)
    _run_services("algorithm" if tasks is not None else "demo", dashboard)


@app.command()
@settings_command(ServedModelSettings)
def serve(
    settings: ServedModelSettings,
    sampling: Annotated[
        str | None, typer.Option(help='Sampling parameters agents get in llm.sampling_parameters, as JSON, '
                                      'e.g. \'{"temperature": 1.0}\'.')
    ] = None,
) -> None:
    """Name the model your agents call: publish the policy resources (the "llm" entry runners hand
    agents as `llm.model`, version base) without running the algorithm.

    Then `fulmen llm-proxy --model-dir DIR` serves the model and `fulmen runner --agent ...` runs your
    agent on it; the trainer publishes its versions to the same resources."""
    import json

    from fulmen.errors import NotFound
    from fulmen.keys import POLICY_RESOURCES_ID
    from fulmen.versions.model_version import BASE_VERSION

    if settings.model_name is None and settings.model_dir is None:
        raise error_exit("name the model: --model-dir DIR (served as the folder's name) or --model-name NAME")
    if settings.model_dir is not None and not (settings.model_dir / "config.json").is_file():
        raise error_exit(f"--model-dir {settings.model_dir} is not a Hugging Face model folder (no config.json)")
    name = settings.model_name or settings.model_dir.resolve().name  # type: ignore[union-attr]
    try:
        parameters = json.loads(sampling) if sampling else None
    except ValueError as e:
        raise error_exit(f"--sampling is not JSON: {e}") from None
    if parameters is not None and not isinstance(parameters, dict):
        raise error_exit("--sampling must be a JSON object, e.g. '{\"temperature\": 1.0}'")
    llm: dict[str, Any] = {"kind": "llm", "model": name, "model_version": BASE_VERSION.name}
    if parameters:
        llm["sampling_parameters"] = parameters

    async def work(store: RedisStore) -> None:
        try:
            current = await store.resources.get_resources(POLICY_RESOURCES_ID)
        except NotFound:
            update = await store.resources.add_resources({"llm": llm}, resources_id=POLICY_RESOURCES_ID)
        else:
            update = await store.resources.update_resources(POLICY_RESOURCES_ID, {**current.resources, "llm": llm})
        out.print(f"published resources [bold]{update.resources_id}[/bold] (version {update.version}): "
                  f"agents call model [bold]{name}[/bold]")
        if settings.model_dir is not None:
            out.print(f"serve it with: fulmen llm-proxy --model-dir {settings.model_dir}")

    run_on_store(settings, work)


# What `fulmen train` takes as flags (the rest of every service's settings come from the environment).
TRAIN_FLAGS = ("experiment", "train_data", "val_data", "train_split", "val_split", "task_columns", "model_dir",
               "model_name", "total_steps", "epochs", "n_samples", "groups_per_step", "val_every", "val_samples",
               "val_temperature")
TRAIN_NAMES = {"train_data": ("--tasks",), "val_data": ("--val-tasks",)}
TRAIN_STEPS = 20  # a first run's length, unless --total-steps or --epochs says otherwise


@app.command()
@settings_command(AlgorithmSettings, fields=TRAIN_FLAGS, names=TRAIN_NAMES)
def train(
    settings: AlgorithmSettings,
    agent: Annotated[str, typer.Option("--agent", "-a", help="Your agent, as module:function or module:Class.")],
    env_file: Annotated[
        Path | None, typer.Option(help="A settings file (KEY=VALUE lines, as .env) for every service; "
                                       "the environment and the flags win.")
    ] = None,
    dashboard: Annotated[bool, typer.Option(help="Serve the dashboard too (http://127.0.0.1:8300/).")] = True,
) -> None:
    """Train your agent end to end: every service in this one process, on the embedded Redis (or
    REDIS_URL), until --total-steps trainer steps (default 20) or --epochs passes.

    Without --model-dir it trains the tiny model (built in the data folder: a pipeline check, not a
    useful model). At the end it prints where the reward curve, the metrics and the models are;
    stopped early (Ctrl-C) and started again, it goes on where it was."""
    from fulmen.cli.dev import exit_leaving_threads

    _check_train_inputs(settings, agent, env_file)
    _export_train_settings(_train_settings(settings), agent)
    summary = _run_services("algorithm", dashboard, exit_at_end=False)
    _print_train_summary(summary)
    exit_leaving_threads(0 if summary is not None and not summary.get("stopped") else 1)


def _check_train_inputs(settings: AlgorithmSettings, agent: str, env_file: Path | None) -> None:
    """`fulmen train`'s files and agent, checked before anything starts (a wrong one exits 2); the
    settings file read into the environment."""
    from fulmen.cli import dev as dev_mode

    if env_file is not None:
        if not env_file.is_file():
            raise error_exit(f"--env-file {env_file} does not exist")
        dev_mode.apply_dotenv(env_file)
    if settings.train_data is None:
        raise error_exit("no training tasks: pass --tasks tasks.jsonl (one JSON task per line)")
    for path in (settings.train_data, settings.val_data):
        if path is not None and not path.exists():
            raise error_exit(f"{path} does not exist")
    _load_agent_or_exit(agent)


def _train_settings(settings: AlgorithmSettings) -> AlgorithmSettings:
    """`fulmen train`'s defaults: the tiny model without --model-dir, TRAIN_STEPS without an end."""
    if settings.model_dir is None:
        from fulmen.cli.standalone import tiny_model_dir

        settings = settings.model_copy(update={"model_dir": tiny_model_dir(settings)})
        out.print(f"no --model-dir: training the tiny model in {settings.model_dir} (a pipeline check)")
    if settings.total_steps is None and settings.epochs is None:
        settings = settings.model_copy(update={"total_steps": TRAIN_STEPS})
    return settings


def _export_train_settings(settings: AlgorithmSettings, agent: str) -> None:
    """Hand `fulmen train`'s flags to every service through the environment, where each reads its
    settings; the proxy gets a free port unless one is set (its default 8000 may be taken)."""
    from fulmen.settings import env_name, env_setting

    os.environ["FULMEN_AGENT"] = agent
    try:
        proxy_port = env_setting("proxy_port")
    except InvalidInput as e:
        raise error_exit(str(e)) from None
    if proxy_port is None:
        from fulmen.store.redis.embedded import free_port

        os.environ["FULMEN_PROXY_PORT"] = str(free_port())
    for field in TRAIN_FLAGS:
        value = getattr(settings, field)
        if value is not None:
            os.environ[env_name(field)] = str(value)


def _load_agent_or_exit(spec: str) -> None:
    """Load the agent now: a wrong --agent fails before anything starts."""
    from fulmen.errors import FulmenError
    from fulmen.sdk.agent import load_agent

    try:
        load_agent(spec)
    except (FulmenError, ImportError, AttributeError) as e:
        raise error_exit(str(e)) from None


def _print_train_summary(summary: dict[str, Any] | None) -> None:
    if summary is None:
        err.print("[red]the run did not finish[/red]: see the log above; started again, it goes on where it was")
        return
    if summary.get("stopped"):
        out.print(f"stopped at step {summary.get('steps')}: the same command goes on from there")
        return
    out.print(f"[bold]trained {summary.get('steps')} step(s)[/bold]")
    if summary.get("final_val_accuracy") is not None:
        scores = "".join(f", {k} {v:.3f}" for k, v in (summary.get("final_val_scores") or {}).items() if k != "samples")
        out.print(f"  {'held out:':<14}accuracy {summary['final_val_accuracy']:.3f}{scores}")
    for label, key in (("reward curve", "curve"), ("metrics", "metrics"), ("final model", "final_model"),
                       ("summary", "summary")):
        if summary.get(key):
            version = f" (version {summary.get('final_model_version')})" if key == "final_model" else ""
            out.print(f"  {label + ':':<14}{summary[key]}{version}")


def _run_services(ends_run: str, dashboard: bool, *, exit_at_end: bool = True) -> dict[str, Any] | None:
    """Run every service as a task of this process until ``ends_run`` ends; its result (the run's
    summary). With ``exit_at_end``, exit with the run's code instead of returning."""
    from fulmen.cli import dev as dev_mode
    from fulmen.cli.standalone import ensure_redis

    os.environ.pop("PORT", None)  # one process: no service may take honcho's per-process port
    settings = settings_from_flags()
    try:
        services = dev_mode.load_services()
    except Exception as e:
        raise error_exit(f"cannot load the services: {type(e).__name__}: {e}") from None
    services.pop("demo" if ends_run == "algorithm" else "algorithm", None)
    with contextlib.suppress(ImportError):  # transformers' lazy imports are not thread-safe: the
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 - services load models in threads at once
    if ends_run not in services:
        raise error_exit("the services are not installed in this environment: run pip install -e . (or "
                         "pip install fulmen) in it first")
    if not dashboard:
        services.pop("dashboard", None)
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        ensure_redis(settings, stack, say=lambda text: log.info("%s", text))
        loop = asyncio.new_event_loop()
        try:
            code = loop.run_until_complete(dev_mode.run_all(services, ends_run=ends_run, results=results))
        finally:
            loop.close()  # not asyncio.run: it would wait for worker threads still in a job (a validation pass)
    if exit_at_end:
        dev_mode.exit_leaving_threads(code)
    summary = results.get(ends_run)
    return summary if code == 0 and isinstance(summary, dict) else None


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
    from fulmen.cli.service import run_as_program

    run_as_program()  # a service whose command returned exits at once (`fulmen.cli.service.leave`)
    _add_service_commands()
    app()


if __name__ == "__main__":
    main()
