"""`fulmen adapter` and `fulmen replay`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from fulmen import keys as k
from fulmen.cli.service import error_exit, run_on_store, run_service, service_command, settings_command
from fulmen.errors import FulmenError, InvalidInput
from fulmen.settings import AdapterSettings
from fulmen.store import RedisStore
from fulmen_adapter.main import DEFAULT_BATCH, MAX_BATCH, SERVICE


@service_command(SERVICE)
def command(
    settings: AdapterSettings,
    batch: Annotated[
        int, typer.Option(min=1, max=MAX_BATCH, help="Completions handled per round trip (8 batches in flight).")
    ] = DEFAULT_BATCH,
) -> None:
    """Turn every finished rollout's spans into training samples on the samples stream.

    Each succeeded rollout yields one (prompt, response, reward) triplet per LLM call, with the token
    ids and log-probabilities the proxy recorded, plus one trajectory sample per multi-turn
    conversation; any other rollout yields a skip record with the reason. Once per rollout, however
    often a completion is delivered. Several adapters may run (one consumer group)."""
    run_service(SERVICE, settings, batch=batch, tune_process=True)  # collector and allocator: this process only


@settings_command(AdapterSettings)
def replay(
    settings: AdapterSettings,
    source: Annotated[Path | None, typer.Option(
        "--from", help="An archive directory of this experiment, or one file of it (`fulmen archive`). "
        "Unset: the spans still in Redis.")] = None,
    to_file: Annotated[Path | None, typer.Option(
        help="Write the records to this file (an offline set for `fulmen export`) instead of the samples stream.")] = None,
    name: Annotated[str, typer.Option(
        help="The replay's name: replaying again under it appends nothing; a new name appends again.")] = "replay",
) -> None:
    """Turn archived or live spans into samples again, with this adapter's code and settings.

    After an adapter change (or with other --llm-call-match, --agent-match, ... settings), or to build
    an offline SFT set. Each finished rollout gives the records the adapter would write for it now:
    with unchanged code and settings, the live adapter's records byte for byte. Written to the
    samples stream (the trainer reads them; once per rollout and --name, so a second run adds
    nothing) or, with --to-file, to one file (written whole, atomically; no Redis needed with --from)."""
    from fulmen_adapter.config import adapter_config
    from fulmen_adapter.replay import ReplayReport
    from fulmen_adapter.replay import replay as run_replay

    try:
        config = adapter_config(settings)
        replay_name = k.check_id("replay name", name)
    except (ValueError, InvalidInput) as e:
        raise error_exit(str(e)) from None

    def show(report: ReplayReport) -> None:
        where = str(to_file) if to_file else f"the samples stream (replay {replay_name!r}: {report.appended} appended)"
        typer.echo(f"replayed {report.rollouts} rollouts: {report.samples} samples, {report.skipped} skipped, to {where}")

    if source is not None and to_file is not None:  # file to file: no Redis
        try:
            show(asyncio.run(run_replay(None, source, config, settings.max_record_bytes, to_file=to_file)))
        except FulmenError as e:
            raise error_exit(str(e), 1) from None
        return

    async def work(store: RedisStore) -> None:
        show(await run_replay(store, source, config, store.max_record_bytes, to_file=to_file, name=replay_name))

    run_on_store(settings, work)
