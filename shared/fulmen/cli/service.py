"""What every `fulmen` command shares: its settings as flags, logging, the error exit, running work on
the store, and running a `Service` (`run(settings, stop)`, which `fulmen <name>` and `fulmen dev` call).

`settings_command` turns a settings class into options, one flag per field (None when not given, so
`load_settings` applies flag > environment > default). Services import this, never `fulmen.cli.main`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar, Union, get_args, get_origin, get_type_hints

import typer
from pydantic import SecretStr
from rich.console import Console
from rich.markup import escape

from fulmen.errors import FulmenError, InvalidInput
from fulmen.settings import CommonSettings, env_name, load_settings
from fulmen.settings.base import field_group, group_title
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect, connect_weights

out = Console()
err = Console(stderr=True)
log = logging.getLogger(__name__)

T = TypeVar("T")
S = TypeVar("S", bound=CommonSettings)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log a line per HTTP request: at INFO they drown the services' own lines.
CHATTY_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai")
# Every command takes the experiment, with its short form; a service's own fields follow.
ALWAYS_FLAGS = ("config", "experiment")
SHORT_NAMES = {"experiment": "-e"}
# Choices given in any case (as the environment may give them): `--log-level debug`.
ANY_CASE = ("log_level",)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    # transformers draws a progress bar for every model it writes or loads ("Writing model shards" on
    # each trainer step): noise in a service's log. Read when transformers is first imported; a
    # user who wants the bars sets the variable to 0.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for chatty in CHATTY_LOGGERS:
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))


# True in the `fulmen` program (`fulmen.cli.main.main` calls `run_as_program`); False when a command runs
# inside another process (tests' CliRunner), which must get control back.
_as_program = False


def run_as_program() -> None:
    """Mark this process as the `fulmen` program: a command that returns leaves at once (`leave`)."""
    global _as_program
    _as_program = True


def leave(code: int = 0) -> None:
    """End the `fulmen` program now, its output flushed, without the interpreter's teardown: with
    torch and transformers loaded that teardown (a garbage collection over millions of objects) takes
    seconds, and honcho SIGKILLs a service still running 5 s after SIGTERM. A service has stopped
    cleanly when its command returns: its work is in the store, its clients closed. In-process
    (not `run_as_program`) this does nothing."""
    if not _as_program:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)


def settings_from_flags(cls: type[S] = CommonSettings, /, **overrides: Any) -> S:  # type: ignore[assignment]
    """Settings from a command's flags over the environment, logging set up; a bad value exits 2."""
    try:
        settings = load_settings(cls, **overrides)
    except FulmenError as e:
        raise error_exit(str(e)) from None
    setup_logging(settings.log_level)
    return settings


def error_exit(message: str, code: int = 2) -> typer.Exit:
    """Say ``message`` as the error it is and give the exit to raise: 2 for what the user passed
    (a bad flag, setting or file), 1 for what went wrong while running. One line, never wrapped:
    scripts and logs search it."""
    err.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


class Stopped(Exception):
    """``stop`` was set while the service was still starting (waiting for Redis, importing its agent,
    loading its model): nothing is in hand, so it ends as a stopped service does, exit 0."""


@contextlib.asynccontextmanager
async def opened_store(settings: CommonSettings, stop: asyncio.Event | None = None) -> AsyncIterator[RedisStore]:
    """The experiment's store on clients of its own, closed on the way out. The connection waits
    (with backoff and a log line) for Redis to come up, up to redis_wait_s; ``stop`` set meanwhile
    raises `Stopped`."""

    async def both() -> tuple[Any, Any]:
        client = await connect(settings)
        try:
            return client, await connect_weights(settings)
        except BaseException:
            await client.aclose()
            raise

    client, weights = await (both() if stop is None else before_stop(both(), stop, "waiting for Redis"))
    try:
        yield RedisStore(client, settings.experiment, max_record_bytes=settings.max_record_bytes,
                         weights_redis=weights)
    finally:
        await client.aclose()
        if weights is not None:
            await weights.aclose()


def run_on_store(settings: CommonSettings, work: Callable[[RedisStore], Awaitable[T]]) -> T:
    """Connect, run one piece of work on the experiment's store, and turn Fulmen errors into exit 1."""

    async def main() -> T:
        async with opened_store(settings) as store:
            return await work(store)

    try:
        return asyncio.run(main())
    except FulmenError as e:
        raise error_exit(str(e), 1) from None


# --- settings as flags -----------------------------------------------------------------------------


def own_fields(cls: type[CommonSettings]) -> list[str]:
    """The fields ``cls`` adds to the common base, secrets left out (they never go in a flag, which
    `ps` would show). Those ``cls`` declares itself come first, then those of its mixins."""
    names = [
        name for name, info in cls.model_fields.items()
        if name not in CommonSettings.model_fields and SecretStr not in _members(info.annotation)
    ]
    declared = set(vars(cls).get("__annotations__", {}))
    return sorted(names, key=lambda name: name not in declared)


def _members(annotation: Any) -> tuple[Any, ...]:
    return get_args(annotation) if get_origin(annotation) in (Union, type(int | None)) else (annotation,)


def _help(cls: type[CommonSettings], field: str) -> str:
    info = cls.model_fields[field]
    default = info.default
    shown = f"; default {default}" if default is not None and not isinstance(default, bool) else ""
    if isinstance(default, str):  # quoted: an empty default, or one named "default", reads as one
        shown = f"; default {default!r}"
    if isinstance(default, bool):
        shown = f"; default {'on' if default else 'off'}"
    # parentheses, not brackets: typer renders help as rich markup, where [...] is a style tag
    return f"{info.description} (env {env_name(field)}{shown})"


def flag(cls: type[CommonSettings], field: str, names: Sequence[str] = ()) -> Any:
    """The typer option of one settings field: ``Annotated[type | None, typer.Option(...)]``."""
    (kind, *_) = [t for t in _members(cls.model_fields[field].annotation) if t is not type(None)]
    dashed = "--" + field.replace("_", "-")
    if kind is bool:
        dashed = f"{dashed}/--no-{field.replace('_', '-')}"
    decls = list(names) or [dashed]
    if field in SHORT_NAMES and SHORT_NAMES[field] not in decls:
        decls.append(SHORT_NAMES[field])
    return Annotated[kind | None, typer.Option(*decls, help=_help(cls, field), case_sensitive=field not in ANY_CASE,
                                               rich_help_panel=group_title(field_group(cls, field)))]


def settings_command(
    cls: type[S],
    *,
    fields: Sequence[str] | None = None,
    also: Sequence[str] = (),
    names: Mapping[str, Sequence[str]] | None = None,
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Give a command one option per settings field and call it with the loaded settings.

    The decorated function takes the settings first, then its own options (those that are not
    settings, such as `--hook`). ``fields``: which fields become flags (default: the experiment and
    every field of ``cls`` beyond the common base); ``also``: common fields to add to those;
    ``names``: option names other than ``--field-name``."""
    chosen = [*(fields if fields is not None else [*ALWAYS_FLAGS, *own_fields(cls)]), *also]
    names = names or {}

    def decorate(func: Callable[..., T]) -> Callable[..., T]:
        hints = get_type_hints(func, include_extras=True)
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation))
            for p in list(inspect.signature(func).parameters.values())[1:]
        ]
        flags = [
            inspect.Parameter(f, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=flag(cls, f, names.get(f, ())))
            for f in chosen
        ]

        @functools.wraps(func)
        def command(**kwargs: Any) -> T:
            settings = settings_from_flags(cls, **{f: kwargs.pop(f) for f in chosen})
            result = func(settings, **kwargs)
            leave(0)  # stopped cleanly (SIGTERM included): exit now, not after seconds of teardown
            return result

        parameters = [*[p for p in own if p.default is inspect.Parameter.empty], *flags,
                      *[p for p in own if p.default is not inspect.Parameter.empty]]
        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        return command

    return decorate


ExperimentOpt = flag(CommonSettings, "experiment")
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


# --- services ----------------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # honcho stops a process with SIGTERM, a terminal with Ctrl-C
MODEL_POLL_S = 0.5
MODEL_HINT_EVERY_S = 30.0  # the demo's warm start takes minutes: say what is awaited, not often


@dataclass(frozen=True)
class Service(Generic[S]):
    """A long-running service: its name (its command's and its Procfile line's), its settings class,
    and ``async run(settings, stop, **options)``, which works until ``stop`` is set. `fulmen <name>`
    runs it as a process (`run_service`, its options from the command's own flags); `fulmen dev`
    runs it as a task, with the options' defaults."""

    name: str
    settings: type[S]
    run: Callable[..., Awaitable[object]]


def service_command(service: Service[S], **flags: Any) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """`settings_command` for the command that runs ``service`` (``flags``: its arguments). The
    command carries the service as ``command.service``: `fulmen dev` finds it there."""

    def decorate(func: Callable[..., T]) -> Callable[..., T]:
        command = settings_command(service.settings, **flags)(func)
        command.service = service  # type: ignore[attr-defined]
        return command

    return decorate


def stop_on_signals(stop: Callable[[], object]) -> None:
    """Call ``stop`` on SIGTERM and SIGINT, in the running loop."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)


def run_service(service: Service[S], settings: S, *, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
                **options: Any) -> None:
    """Run ``service`` as this process until SIGTERM or SIGINT. Bad input (InvalidInput) exits 2,
    another Fulmen error 1. Leaves as soon as ``run`` returns (`leave`): asyncio.run would first wait
    for a thread still inside a blocking call (a model's load, a sync agent, a validation pass), whose
    work is in the store and is taken up again."""

    async def main() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop.set)
        try:
            await service.run(settings, stop, **options)
        except Stopped as e:
            log.info("%s %s", service.name, e)
        leave(0)

    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
    except InvalidInput as e:
        raise error_exit(str(e)) from None
    except FulmenError as e:
        raise error_exit(str(e), 1) from None


def when_stopped(stop: asyncio.Event, action: Callable[[], object]) -> asyncio.Task[None]:
    """Call ``action`` once ``stop`` is set (for work stopped by a method, not an event)."""

    async def wait() -> None:
        await stop.wait()
        action()

    return asyncio.create_task(wait())


async def before_stop(work: Awaitable[T], stop: asyncio.Event, what: str) -> T:
    """What ``work`` (a start-up step) gives, unless ``stop`` is set first: then `Stopped`, saying
    ``what`` was under way."""
    done = await unless_stopped(work, stop)
    if done is None:
        raise Stopped(f"stopped while {what}")
    return done.result()


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> asyncio.Future[T] | None:
    """Await ``work`` (a model's load: seconds; the demo's warm start: minutes) unless ``stop`` is set
    first, which cancels it (a thread it waits on runs on, left behind). Its finished future, or None
    if stopped first; what it raised, raised."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()
        return task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def wait_for_model(folder: Path | None, stop: asyncio.Event) -> bool:
    """Wait for a model folder (the demo writes its model after the warm start) without blocking the
    loop, saying now and then what is awaited; False if stopped first."""
    from fulmen.versions.model_version import model_dir_hint

    said = -MODEL_HINT_EVERY_S
    while folder is not None and not (Path(folder) / "config.json").exists():
        if stop.is_set():
            return False
        if time.monotonic() - said >= MODEL_HINT_EVERY_S:
            log.warning("%s", model_dir_hint(Path(folder)))
            said = time.monotonic()
        await asyncio.sleep(MODEL_POLL_S)
    return not stop.is_set()


async def serve_http(server: Any, sock: Any, stop: asyncio.Event) -> None:
    """Run a uvicorn server on ``sock`` until ``stop`` is set; the signals stay with whoever sets
    ``stop`` (uvicorn's ``serve`` would take SIGINT and SIGTERM over and raise them again when it
    ends). Stopped while still starting (a model loading: seconds), it returns at once: nothing is
    served or registered yet, so there is nothing to drain."""
    server.capture_signals = contextlib.nullcontext
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not serving.done() and not server.started:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        return
    server.should_exit = True
    await serving
