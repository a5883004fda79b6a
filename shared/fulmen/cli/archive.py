"""`fulmen archive` and `fulmen export` (`fulmen replay` is the adapter's: it runs the adapter's code)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fulmen.cli.service import ExperimentOpt, err, out, run_on_store, settings_from_flags
from fulmen.errors import FulmenError
from fulmen.store import RedisStore

EXPORT_PAGE = 1000  # samples-stream entries per read


def archive(
    directory: Annotated[Path | None, typer.Option(
        "--to", help="The experiment's archive directory (default: <data dir>/archive/<experiment>).")] = None,
    experiment: ExperimentOpt = None,
    chunk: Annotated[int, typer.Option(min=1, max=100_000, help="Entries per file.")] = 1000,
    samples: Annotated[bool, typer.Option(help="Archive the samples stream too.")] = True,
) -> None:
    """Write finished rollouts (with their attempts and spans) and samples to files, before `fulmen trim`.

    Incremental: each run writes only what earlier runs have not (its cursor is the consumer group
    "archive" on every finished stream, every store shard's, and on the samples stream), and from its
    first run on, `fulmen trim` keeps every entry not yet archived: run archive, then trim, as often
    as you like, and nothing is lost or written twice. Files are gzip-compressed msgpack, each
    written under a temporary name and renamed: a crash leaves whole files only, and the next run
    goes on where the last file ends. `fulmen replay --from DIR` turns the archived spans into
    samples again; `fulmen export --from DIR` makes a dataset of the archived samples."""
    settings = settings_from_flags(experiment=experiment)
    target = directory or settings.data_dir / "archive" / settings.experiment

    async def work(store: RedisStore) -> None:
        from fulmen.archive.write import archive as run_archive

        report = await run_archive(store, target, chunk=chunk, samples=samples)
        note = f" ({report.recovered} entries a crashed run had written, acknowledged)" if report.recovered else ""
        out.print(f"archived {report.rollouts} rollouts and {report.samples} samples in {len(report.files)} "
                  f"file(s) to {target}{note}")

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
    from fulmen.archive.export import SHAPES, archived_records
    from fulmen.archive.export import export as run_export

    if shape not in SHAPES:
        err.print(f"[red]error:[/red] --shape {shape!r} is none of {', '.join(SHAPES)}")
        raise typer.Exit(2)
    settings = settings_from_flags(experiment=experiment)
    if sources:
        try:
            report = run_export(archived_records(sources), output, settings.max_record_bytes, shape=shape,
                                min_reward=min_reward, token_ids=token_ids)
        except (FulmenError, OSError) as e:  # not an archive file; cannot write
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
    else:
        async def work(store: RedisStore) -> list[bytes]:
            records, start = [], "-"
            while entries := await store.redis.xrange(store.keys.samples, min=start, count=EXPORT_PAGE):
                records += [fields[b"m"] for _, fields in entries if b"m" in fields]
                start = "(" + entries[-1][0].decode()
            return records

        records = run_on_store(settings, work)
        try:
            report = run_export(records, output, settings.max_record_bytes, shape=shape, min_reward=min_reward,
                                token_ids=token_ids)
        except OSError as e:
            err.print(f"[red]error:[/red] cannot write {output}: {e.strerror}")
            raise typer.Exit(1) from None
    out.print(f"exported {report.rows} samples to {output} ({report.skips} skip records, {report.duplicates} "
              f"duplicates, {report.filtered} filtered out, {report.unreadable} unreadable)")


COMMANDS = {"archive": archive, "export": export}
