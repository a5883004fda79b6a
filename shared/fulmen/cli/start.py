"""`fulmen start RUN.yaml`: a run file's run under honcho. Every process gets ``FULMEN_CONFIG`` (so
each reads the file under its environment and flags), the file's ``processes:`` become honcho's
``-c``, and nothing starts unless every service's settings load from it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from fulmen.cli.service import err, error_exit, out
from fulmen.errors import InvalidInput
from fulmen.settings import env_name, load_settings
from fulmen.settings.run_file import RunFile, read_run_file
from fulmen.settings.services import SERVICES

DEFAULT_PROCFILE = Path("Procfile")


def procfile_names(path: Path) -> set[str]:
    """The process names of a Procfile (``name: command`` lines; comments and blanks skipped)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and ":" in line:
            names.add(line.split(":", 1)[0].strip())
    return names


def parse_counts(specs: list[str], names: set[str]) -> dict[str, int]:
    """``-c runner=8,adapter=2`` (repeatable) as counts; an unknown process is an error."""
    counts = {}
    for spec in specs:
        for item in filter(None, spec.split(",")):
            name, sep, count = item.partition("=")
            if not sep or not count.strip().isdigit():
                raise InvalidInput(f"-c {item!r}: write process=count, as in -c runner=8")
            if name.strip() not in names:
                raise InvalidInput(f"-c {item!r}: no process {name.strip()!r} in the Procfile ({', '.join(sorted(names))})")
            counts[name.strip()] = int(count)
    return counts


def check_run(run_file: Path, procfile: Path | None) -> tuple[RunFile, Path]:
    """The checked run file and its Procfile; every service's settings loaded from it once, so a bad
    value fails here, naming its setting, rather than in one process after the others started."""
    if not run_file.is_file():
        raise InvalidInput(f"no run file {run_file} (examples/runs/ has some to start from)")
    first = read_run_file(run_file)
    chosen = procfile or first.procfile or DEFAULT_PROCFILE
    if not chosen.is_file():
        raise InvalidInput(f"no Procfile {chosen}: run from the repository's folder, or name one with "
                           "--procfile or the run file's procfile: key")
    run = read_run_file(run_file, procfile_names(chosen))
    for cls in dict.fromkeys(SERVICES.values()):
        load_settings(cls, config=run_file)
    return run, chosen


def honcho_argv(procfile: Path, counts: dict[str, int]) -> list[str]:
    """honcho's command line: the Procfile, no .env (the run file replaces it; the environment still
    wins over both), the process counts."""
    honcho = shutil.which("honcho") or str(Path(sys.executable).with_name("honcho"))
    argv = [honcho, "start", "-f", str(procfile), "-d", ".", "-e", os.devnull]
    if counts:
        argv += ["-c", ",".join(f"{name}={count}" for name, count in counts.items())]
    return argv


def start_command(
    run_file: Annotated[Path, typer.Argument(help="The run file (YAML): settings grouped by service.",
                                             show_default=False)],
    concurrency: Annotated[list[str] | None, typer.Option(
        "-c", "--concurrency", help="Processes of one kind, as honcho's -c (runner=8); over the file's processes:.")] = None,
    procfile: Annotated[Path | None, typer.Option(
        "-f", "--procfile", help="The Procfile (default: the file's procfile:, else ./Procfile).")] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Check the file and every service's settings, print the run, start nothing.")] = False,
) -> None:
    """Start a run from one YAML file: every process of the Procfile under honcho, each reading the
    file (flag > environment > run file > default). `fulmen config SERVICE --config RUN.yaml` shows
    one service's effective settings."""
    try:
        run, chosen = check_run(run_file, procfile)
        counts = {**run.processes, **parse_counts(concurrency or [], procfile_names(chosen))}
    except InvalidInput as e:
        raise error_exit(str(e)) from None
    argv = honcho_argv(chosen, counts)
    if check:
        out.print(f"run file {run_file}: {len(run.values)} settings, Procfile {chosen}")
        for name, place in sorted(run.where.items(), key=lambda item: item[1]):
            out.print(f"  {place} = {run.values[name]!r}")
        out.print("would run: " + " ".join(argv))
        return
    env = {**os.environ, env_name("config"): str(run_file.resolve())}
    err.print(f"fulmen start: {run_file} with {chosen} ({' '.join(argv[1:])})")
    os.execvpe(argv[0], argv, env)
