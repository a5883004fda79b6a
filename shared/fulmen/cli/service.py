"""What every `fulmen` command shares: its settings as flags, logging, and running work on the store.

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
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, get_type_hints

import typer
from pydantic import SecretStr
from rich.console import Console

from fulmen.errors import FulmenError
from fulmen.settings import CommonSettings, env_name, load_settings
from fulmen.settings.base import field_group, group_title
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect, connect_weights

out = Console()
err = Console(stderr=True)

T = TypeVar("T")
S = TypeVar("S", bound=CommonSettings)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log a line per HTTP request: at INFO they drown the services' own lines.
CHATTY_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai")
# Every command takes the experiment, with its short form; a service's own fields follow.
ALWAYS_FLAGS = ("experiment",)
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
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    setup_logging(settings.log_level)
    return settings


def run_on_store(settings: CommonSettings, work: Callable[[RedisStore], Awaitable[T]]) -> T:
    """Connect, run one piece of work on the experiment's store, and turn Fulmen errors into exit 1.

    The connection waits (with backoff and a log line) for Redis to come up, up to redis_wait_s."""

    async def main() -> T:
        client = await connect(settings)
        weights = await connect_weights(settings)
        try:
            return await work(RedisStore(client, settings.experiment, max_record_bytes=settings.max_record_bytes,
                                         weights_redis=weights))
        finally:
            await client.aclose()
            if weights is not None:
                await weights.aclose()

    try:
        return asyncio.run(main())
    except FulmenError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None


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
