"""`fulmen config SERVICE`: a service's effective settings, grouped, each with where its value came
from (the environment, the .env file, the default), secrets masked. The classes are in
`fulmen.settings.services`; the groups are metadata on their fields (docs/design/settings.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import SecretStr
from rich.table import Table

from fulmen.cli.dev import read_dotenv
from fulmen.cli.service import JsonOpt, err, out
from fulmen.errors import FulmenError
from fulmen.settings import CommonSettings, env_name, load_settings
from fulmen.settings.base import field_group, group_title
from fulmen.settings.run_file import read_run_file
from fulmen.settings.services import SERVICES
from fulmen.store.redis.connection import REDACTED, redact

DEFAULT_ENV_FILE = Path(".env")


def effective_settings(cls: type[CommonSettings], dotenv: dict[str, str],
                       run_file: Path | None = None) -> list[dict[str, Any]]:
    """One row per field of ``cls``: its group, variable, value (secrets masked) and source; the
    service's own fields first, then those every process shares."""
    settings = load_settings(cls, dotenv=dotenv, config=run_file)
    from_file = read_run_file(settings.config).where if settings.config is not None else {}
    rows = []
    for field in sorted(cls.model_fields, key=lambda f: f in CommonSettings.model_fields):
        name = env_name(field)
        source = ("environment" if name in os.environ else ".env" if name in dotenv
                  else f"{settings.config} ({from_file[field]})" if field in from_file else "default")
        rows.append({"group": field_group(cls, field), "setting": field, "env": name,
                     "value": _shown(getattr(settings, field)), "source": source})
    return rows


def _shown(value: Any) -> Any:
    """A value fit for the terminal: a secret masked (a URL keeps all but its password), a path as text."""
    if isinstance(value, SecretStr):
        secret = value.get_secret_value()
        return redact(secret) if "://" in secret else REDACTED
    if isinstance(value, Path):
        return str(value)
    return value


def config_command(
    service: Annotated[str, typer.Argument(help=f"The service: {', '.join(SERVICES)}.", show_default=False)],
    env_file: Annotated[Path | None, typer.Option(
        help="Settings file read as honcho reads it, under the environment (default: .env when present).")] = None,
    run_file: Annotated[Path | None, typer.Option(
        "--config", help="A run file (YAML), read under the environment and .env (default: $FULMEN_CONFIG).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a service's effective settings by group: value and source (environment, .env, run file, default)."""
    cls = SERVICES.get(service.replace("_", "-"))
    if cls is None:
        err.print(f"[red]error:[/red] no service {service!r}; one of {', '.join(SERVICES)}")
        raise typer.Exit(2)
    if env_file is not None and not env_file.is_file():
        err.print(f"[red]error:[/red] --env-file {env_file} does not exist")
        raise typer.Exit(2)
    path = env_file if env_file is not None else DEFAULT_ENV_FILE
    # with a run file, .env is read only when named: `fulmen start` reads none
    with_run_file = run_file is not None or env_name("config") in os.environ
    dotenv = read_dotenv(path) if path.is_file() and (env_file is not None or not with_run_file) else {}
    try:
        rows = effective_settings(cls, dotenv, run_file)
    except FulmenError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    if as_json:
        out.print_json(json.dumps({"service": service, "env_file": str(path) if dotenv else None, "settings": rows}))
        return
    for group in dict.fromkeys(row["group"] for row in rows):
        table = Table(title=group_title(group), title_justify="left", show_edge=False)
        for column in ("setting", "value", "source"):
            table.add_column(column)
        for row in (r for r in rows if r["group"] == group):
            value = "(unset)" if row["value"] is None else str(row["value"])
            table.add_row(row["env"], value, row["source"], style="dim" if row["source"] == "default" else None)
        out.print(table)
