"""`fulmen status`, `top`, `rollouts`, `spans`, `dead-letters`: read-only views of an experiment."""

from __future__ import annotations

import json
import re
from typing import Annotated

import typer
from rich.table import Table

from fulmen.cli.service import ExperimentOpt, JsonOpt, err, out, run_on_store, settings_from_flags
from fulmen.records.status import RolloutMode, RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.connection import redact
from fulmen.telemetry import semconv

# Seconds a read-only view waits on Redis before it says Redis is unreachable.
REDIS_TIMEOUT_S = 5.0
TOP_INTERVAL_S = 2.0
# Rows a listing shows unless told otherwise, and the characters of a JSON cell before it is cut.
LIST_LIMIT = 20
CELL_CHARS = 60
# Validation passes `fulmen status` shows (the newest), and the entries of the stream it reads for them.
STATUS_PASSES = 5
PASSES_READ = 200
# The fields of a pass it shows: the record's own, then the k-sample scores (pass@j, maj@k) it holds.
PASS_FIELDS = ("label", "step", "accuracy", "mean_reward", "tasks", "samples")


def status(experiment: ExperimentOpt = None, as_json: JsonOpt = False) -> None:
    """One screen: queue depth, rollouts per status, pending per consumer, dead letters, resources."""
    from fulmen.serving.lag import served_by
    from fulmen.serving.rewards import version_report

    settings = settings_from_flags(experiment=experiment)

    async def read(store: RedisStore) -> dict:
        return {**await store.statistics(), "model_versions": await version_report(store),
                "served_by": await served_by(store), "validations": await _validations(store)}

    stats = run_on_store(settings, read)
    if as_json:
        out.print_json(json.dumps(stats))
        return
    table = Table(title=f"experiment {stats['experiment']}", show_header=False)
    table.add_row("queue depth", str(stats["queue_depth"]))
    table.add_row("  by lane", ", ".join(f"{lane} {n}" for lane, n in stats["queue_depth_by_lane"].items()))
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
    versions = stats["model_versions"]
    rollback = versions["rollback"]
    serving = versions["serving"] or "base"
    table.add_row("model version", f"{serving} (rolled back from {rollback['from']})" if rollback else serving)
    for row in stats["served_by"]:
        state = "" if row["ready"] else f" — not ready: {row['reason'] or '?'}"
        lora = " (LoRA adapter)" if row["lora_adapter"] else ""
        table.add_row(f"  served by {row['kind']}", f"{row['server']}: {row['model_version']}{lora}{state}")
    if versions["ab"]:
        table.add_row("A/B test", f"{versions['ab']['b']} for {versions['ab']['split']:.0%} of rollouts")
    stored = versions["stored"]
    table.add_row("stored versions", ", ".join(stored[-8:]) + (f" (+{len(stored) - 8} older)" if len(stored) > 8 else "")
                  if stored else "none")
    for mode, by in versions["reward_by_version"].items():
        cells = ", ".join(f"{v} {r['mean_reward']:.3f} ({r['rollouts']})" for v, r in by.items())
        table.add_row(f"{mode} reward by version", cells)
    for result in stats["validations"]:
        table.add_row(f"validation {result['label']}", _pass_cells(result))
    out.print(table)


async def _validations(store: RedisStore) -> list[dict]:
    """The newest `STATUS_PASSES` validation passes, oldest first, one per label (a pass recorded twice
    counts once), with `PASS_FIELDS` and their pass@j and maj@k."""
    passes = await store.validations.passes(newest=PASSES_READ)
    return [{**{k: r[k] for k in PASS_FIELDS if k in r}, **{k: r[k] for k in _score_keys(r)}}
            for r in passes[-STATUS_PASSES:]]


def _score_keys(result: dict) -> list[str]:
    """pass@j by increasing j, then maj@k."""
    def order(key: str) -> tuple[int, int]:
        family, _, k = key.partition("@")
        return (0 if family == "pass" else 1), int(k)

    return sorted((k for k in result if re.fullmatch(r"(pass|maj)@\d+", k)), key=order)


def _pass_cells(result: dict) -> str:
    """One pass as `fulmen status` prints it: accuracy, then each k-sample score, then where it stands."""
    def num(value: object) -> str:
        return f"{value:.3f}" if isinstance(value, int | float) else "-"

    cells = [f"accuracy {num(result.get('accuracy'))}", *(f"{k} {num(result[k])}" for k in _score_keys(result))]
    what = f"step {result.get('step')}" if result.get("step") is not None else ""
    if "samples" in result:
        what += f"{', ' if what else ''}{result['samples']} samples per task"
    return ", ".join(cells) + (f" ({what})" if what else "")


def top(
    experiment: ExperimentOpt = None,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = TOP_INTERVAL_S,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit (for scripts).")] = False,
) -> None:
    """A live view of the whole pipeline, refreshed in place until Ctrl-C.

    Services and their live replicas (from heartbeats), queue depth, active attempts, rollouts per
    end status, completions, samples and dead letters with their rates (between refreshes), pending
    entries and lag per consumer group, the reward curve as a sparkline (the trainer's step log) and
    the model version being served. Reads only Redis: run it from any machine that reaches it."""
    settings = settings_from_flags(experiment=experiment)
    import redis as redis_sync

    from fulmen.cli.top import run
    from fulmen.store.redis.connection import sync_client

    client = sync_client(settings.redis_url_value(), socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        code = run(client, settings.experiment, interval, once, out)
    except (redis_sync.RedisError, OSError) as e:
        err.print(f"[red]error:[/red] Redis at {redact(settings.redis_url_value())} unreachable: {type(e).__name__}")
        raise typer.Exit(1) from None
    finally:
        client.close()
    raise typer.Exit(code)


def rollouts(
    experiment: ExperimentOpt = None,
    status_: Annotated[
        list[RolloutStatus] | None, typer.Option("--status", help="Only these statuses (repeatable).")
    ] = None,
    mode: Annotated[RolloutMode | None, typer.Option(help="Only this mode.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many.")] = LIST_LIMIT,
    offset: Annotated[int, typer.Option(min=0, help="Skip this many first.")] = 0,
    oldest_first: Annotated[bool, typer.Option(help="Oldest first (default: newest first).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List rollouts, newest first, with their status and attempts."""
    settings = settings_from_flags(experiment=experiment)
    found = run_on_store(
        settings,
        lambda store: store.rollouts.query_rollouts(
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
            r.rollout_id, r.status.value, r.mode.value if r.mode else "", str(r.attempt_count), text[:CELL_CHARS]
        )
    out.print(table)
    if not found:
        out.print("no rollouts match")


def spans(
    rollout_id: Annotated[str, typer.Argument(help="The rollout whose spans to show.")],
    experiment: ExperimentOpt = None,
    attempt: Annotated[str, typer.Option(help="'latest', 'all', or an attempt id.")] = "all",
    as_json: JsonOpt = False,
) -> None:
    """Show a rollout's spans in sequence order."""
    settings = settings_from_flags(experiment=experiment)
    found = run_on_store(settings, lambda store: store.spans.query_spans(rollout_id, None if attempt == "all" else attempt))
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
        table.add_row(str(s.sequence_id), s.attempt_id, s.name, s.span_id, s.parent_id or "", attrs[:CELL_CHARS])
    out.print(table)
    if not found:
        out.print(f"rollout {rollout_id} has no spans")


def dead_letters(
    experiment: ExperimentOpt = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = LIST_LIMIT,
) -> None:
    """Show poison messages and why they were set aside."""
    settings = settings_from_flags(experiment=experiment)
    letters = run_on_store(settings, lambda store: store.dead_letters.query_dead_letters(limit))
    table = Table("id", "source", "entry", "reason")
    for d in letters:
        table.add_row(d.dead_letter_id, d.source, d.entry_id, d.reason)
    out.print(table)


COMMANDS = {"status": status, "top": top, "rollouts": rollouts, "spans": spans, "dead-letters": dead_letters}
