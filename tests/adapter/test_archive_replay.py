"""Archive, trim, replay, export on the real Redis, with the store in 3 shards: the archive holds what
retention then deletes, and replaying it gives the live adapter's records byte for byte."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis_cluster import store_url
from typer.testing import CliRunner

from fulmen import keys as k
from fulmen.archive.export import archived_records, export
from fulmen.archive.files import list_chunks, read_file
from fulmen.archive.write import archive
from fulmen.cli.main import _add_service_commands, app
from fulmen.records import Span
from fulmen.retention.trim import RetentionPolicy, TrimReport, trim
from fulmen.store import RedisStore
from fulmen.store.experiments import delete_experiment
from fulmen.telemetry import semconv
from fulmen_adapter.adapter import Adapter
from fulmen_adapter.replay import replay
from fulmen_adapter.triplets import AdapterConfig

SHARDS = 3


@pytest.fixture(params=["single", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """On one node and on a real 3-master Redis Cluster (where the 3 shards live on 3 masters)."""
    return store_url(request, request.param)


@pytest.fixture
async def store(real_store: RedisStore) -> AsyncIterator[RedisStore]:
    """The experiment's store split in 3 shards (on one node: each shard has its own hash tag)."""
    yield RedisStore(real_store.redis, real_store.experiment, shards=SHARDS)


def _ids(prefix: str, n: int) -> list[str]:
    """``n`` rollout ids that cover every shard (round robin over the shards)."""
    by_shard: dict[int, list[str]] = {s: [] for s in range(SHARDS)}
    i = 0
    while min(len(v) for v in by_shard.values()) * SHARDS < n:
        rid = f"{prefix}{i}"
        by_shard[k.shard_of(rid, SHARDS)].append(rid)
        i += 1
    return [by_shard[j % SHARDS][j // SHARDS] for j in range(n)]


async def _finish(store: RedisStore, rid: str, *, calls: int = 2, status: str = "succeeded",
                  reward: float | None = 0.75) -> None:
    """A rollout that ran ``calls`` chained LLM calls (one trajectory), then a reward span."""
    claimed = await store.rollouts.start_rollout({"q": rid}, "w1", rollout_id=rid, metadata={"group_key": "g", "group_size": 2})
    aid = claimed.attempt.attempt_id
    spans = []
    prompt: list[int] = [1, 2, 3]
    for i in range(calls):
        request = {"model": "m", "messages": [{"role": "user", "content": f"{rid} turn {i}"}]}
        answer = {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}
        spans.append(Span(rid, aid, f"c{i}", "chat tiny", start_time=10.0 + i, end_time=10.5 + i, attributes={
            semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.PROMPT_TOKEN_IDS: prompt,
            semconv.RESPONSE_TOKEN_IDS: [7, 8], semconv.RESPONSE_LOGPROBS: [-0.5, -0.25],
            semconv.MODEL_VERSION: "v1", semconv.REQUEST_JSON: json.dumps(request),
            semconv.RESPONSE_JSON: json.dumps(answer)}))
        prompt = [*prompt, 7, 8, 9]
    if reward is not None:
        spans.append(Span(rid, aid, "w", semconv.REWARD_SPAN, start_time=30.0, end_time=30.0,
                          attributes={semconv.SPAN_KIND: semconv.KIND_REWARD, semconv.REWARD: reward}))
    await store.spans.add_spans(spans)
    await store.rollouts.update_attempt(rid, aid, status=status, reward=reward)


async def _adapt(store: RedisStore) -> None:
    await Adapter(store).run(asyncio.Event(), until_idle=True, lanes=1)


async def _samples(store: RedisStore) -> list[bytes]:
    return [f[b"m"] for _, f in await store.redis.xrange(store.keys.samples)]


async def _trim_everything_consumed(store: RedisStore) -> TrimReport:
    """The one call into retention: everything every group acknowledged goes, rollouts included."""
    return await trim(store, RetentionPolicy(max_count=0, delete_rollouts=True))


def _archived_rollout_ids(directory: Path) -> list[str]:
    out = []
    for chunk in list_chunks(directory, "rollouts"):
        out += [r["rollout_id"] for r in read_file(chunk.path, "rollouts")[1]]
    return out


async def test_archive_trim_replay_gives_the_live_adapters_records(store: RedisStore, tmp_path: Path) -> None:
    """Rollouts on every shard, adapted live; archived; trimmed (and then the whole experiment deleted,
    so only the archive is left); replayed from the archive: the same records, byte for byte, skips too."""
    first, second = _ids("a", 6), _ids("b", 3)
    for rid in first:
        await _finish(store, rid)
    await _finish(store, "failed-1", status="failed")  # a skip record
    await _adapt(store)
    directory = tmp_path / "archive"
    report = await archive(store, directory)
    assert (report.rollouts, report.samples) == (7, len(await _samples(store)))
    assert {c.shard for c in list_chunks(directory, "rollouts")} == set(range(SHARDS))

    # more rollouts finish and are adapted after the archive ran: trim must keep them (not archived yet)
    for rid in second:
        await _finish(store, rid)
    await _adapt(store)
    live = await _samples(store)
    await _trim_everything_consumed(store)
    assert [await store.redis.exists(store.keys.spans(rid)) for rid in second] == [1, 1, 1]
    assert [await store.redis.exists(store.keys.spans(rid)) for rid in first] == [0] * 6  # archived, trimmed

    again = await archive(store, directory)  # incremental: only the newcomers
    assert (again.rollouts, again.samples) == (3, len(live) - report.samples)
    await _trim_everything_consumed(store)
    assert [await store.redis.exists(store.keys.spans(rid)) for rid in second] == [0, 0, 0]
    assert sorted(_archived_rollout_ids(directory)) == sorted([*first, "failed-1", *second])

    await delete_experiment(store.redis, store.experiment)
    out = tmp_path / "replayed.msgpack.gz"
    replayed = await replay(None, directory, AdapterConfig(), store.max_record_bytes, to_file=out)
    assert (replayed.rollouts, replayed.skipped) == (10, 1)
    records = [r for _, r in read_file(out, "samples")[1]]
    assert sorted(records) == sorted(live)  # shard order differs from the live interleaving
    assert [r for r in archived_records([directory])] == live  # the archived stream, in its order

    # replayed into the samples stream of the (now empty) experiment: the same records, once
    fresh = RedisStore(store.redis, store.experiment, shards=SHARDS)
    first_run = await replay(fresh, directory, AdapterConfig(), fresh.max_record_bytes, name="after-trim")
    assert first_run.appended == len(live)
    assert sorted(await _samples(fresh)) == sorted(live)
    second_run = await replay(fresh, directory, AdapterConfig(), fresh.max_record_bytes, name="after-trim")
    assert second_run.appended == 0 and len(await _samples(fresh)) == len(live)


async def test_replay_of_live_spans_is_idempotent_and_follows_the_settings(store: RedisStore, tmp_path: Path) -> None:
    """Live spans replayed into the stream under one name add their records once; another adapter
    configuration (no trajectories) makes other records; a file written twice is the same file."""
    for rid in _ids("r", 3):
        await _finish(store, rid)
    await _adapt(store)
    live = await _samples(store)
    run = await replay(store, None, AdapterConfig(), store.max_record_bytes, name="v2")
    assert run.appended == len(live) == 9
    assert (await replay(store, None, AdapterConfig(), store.max_record_bytes, name="v2")).appended == 0
    assert sorted((await _samples(store))[len(live):]) == sorted(live)
    assert await store.redis.scard(store.keys.replayed("v2")) == 3

    no_traj = await replay(store, None, AdapterConfig(trajectories=False), store.max_record_bytes, name="v3")
    assert no_traj.appended == 6  # two triplets a rollout, no trajectory

    one, two = tmp_path / "one.msgpack.gz", tmp_path / "two.msgpack.gz"
    await replay(store, None, AdapterConfig(), store.max_record_bytes, to_file=one)
    await replay(store, None, AdapterConfig(), store.max_record_bytes, to_file=two)
    assert one.read_bytes() == two.read_bytes()
    assert sorted(r for _, r in read_file(one)[1]) == sorted(live)


async def test_archive_after_a_crash_neither_loses_nor_duplicates(
    store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash before a file's rename leaves no file and the entries for the next run; a crash after
    the rename, before the acknowledgement, is recovered from the file names without a second copy."""
    import fulmen.archive.files as files

    ids = _ids("c", 6)
    for rid in ids[:3]:
        await _finish(store, rid)
    directory = tmp_path / "archive"

    def no_rename(src: object, dst: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(files.os, "replace", no_rename)
    with pytest.raises(OSError):
        await archive(store, directory, samples=False)
    monkeypatch.undo()
    assert list_chunks(directory) == [] and list(directory.iterdir()) == []  # the temporary file went too

    real_xack = store.redis.xack
    calls = 0

    async def crash_on_second_ack(*args: object) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ConnectionError("killed")
        return await real_xack(*args)

    monkeypatch.setattr(store.redis, "xack", crash_on_second_ack)
    with pytest.raises(ConnectionError):
        await archive(store, directory, samples=False)
    monkeypatch.undo()
    (directory / ".tmp-1-rollouts-s0-1-0_2-0.msgpack.gz").write_bytes(b"half")  # a crash mid-write

    for rid in ids[3:]:
        await _finish(store, rid)
    report = await archive(store, directory, samples=False)
    assert report.recovered >= 1
    assert sorted(_archived_rollout_ids(directory)) == sorted(ids)  # each once
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert (await archive(store, directory, samples=False)).files == []  # nothing new: nothing written
    for shard in store.keys.shards:
        assert (await store.redis.xpending(shard.finished, k.ARCHIVE_GROUP))["pending"] == 0


async def test_export_writes_a_dataset_with_one_schema(store: RedisStore, tmp_path: Path) -> None:
    """Every line has the same columns with the same types, and Hugging Face `datasets` loads the file
    as it is; skips left out; a sample met in two sources written once; filters apply."""
    for rid in _ids("e", 2):
        await _finish(store, rid)
    await _finish(store, "e-low", reward=0.0)
    await _finish(store, "e-failed", status="failed")
    await _adapt(store)
    directory = tmp_path / "archive"
    await archive(store, directory)
    replayed = tmp_path / "replayed.msgpack.gz"
    await replay(store, None, AdapterConfig(), store.max_record_bytes, to_file=replayed)

    out = tmp_path / "set.jsonl"
    report = export(archived_records([directory, replayed]), out, store.max_record_bytes)
    assert (report.rows, report.duplicates, report.skips) == (9, 9, 2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    types = {key: type(value) for key, value in rows[0].items()} | {"turn_reward": float}
    assert types["reward"] is float and types["messages"] is list and types["turn_index"] is int
    for row in rows:
        assert set(row) == set(types)
        # one type per column; only turn_reward may be null (a call no reward span was matched to)
        wrong = {key: v for key, v in row.items() if type(v) is not types[key] and not (v is None and key == "turn_reward")}
        assert wrong == {}
        for message in row["messages"]:
            assert set(message) == {"role", "content"} and all(type(v) is str for v in message.values())
    triplet = next(r for r in rows if r["shape"] == "triplet" and r["turn_index"] == 1)
    assert triplet["messages"] == [{"role": "user", "content": f"{triplet['rollout_id']} turn 1"},
                                   {"role": "assistant", "content": "answer 1"}]

    import datasets  # the loader users will call, with its own schema inference

    loaded = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == 9 and loaded[0]["messages"] == rows[0]["messages"]
    assert loaded.features["reward"].dtype == "float64"

    kept = export(archived_records([directory]), tmp_path / "good.jsonl", store.max_record_bytes,
                  shape="trajectory", min_reward=0.5)
    assert kept.rows == 2  # the two rollouts rewarded 0.75, one trajectory each


async def test_export_token_ids_carries_the_tokens_and_the_loss_mask(store: RedisStore, tmp_path: Path) -> None:
    """`fulmen export --token-ids`: each record holds its sample's prompt and response token ids and its
    loss mask (0 for the tokens between turns), and `datasets` loads them as integer lists."""
    from fulmen.store.samples import decode_sample

    for rid in _ids("tok", 2):
        await _finish(store, rid)
    await _adapt(store)
    samples = {s.sample_id: s for s in (decode_sample(r, store.max_record_bytes) for r in await _samples(store))}
    directory, out = tmp_path / "archive", tmp_path / "tokens.jsonl"
    await archive(store, directory)
    _add_service_commands()
    result = await asyncio.to_thread(CliRunner().invoke, app, ["export", str(out), "--from", str(directory), "--token-ids"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(samples) == 6
    for row in rows:
        sample = samples[row["sample_id"]]
        assert row["prompt_token_ids"] == list(sample.prompt_token_ids)  # type: ignore[union-attr]
        assert row["response_token_ids"] == list(sample.response_token_ids)  # type: ignore[union-attr]
        assert row["response_mask"] == list(sample.response_mask)  # type: ignore[union-attr]
    trajectory = next(r for r in rows if r["shape"] == "trajectory")
    assert trajectory["response_token_ids"] == [7, 8, 9, 7, 8] and trajectory["response_mask"] == [1, 1, 0, 1, 1]

    import datasets

    loaded = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.features["response_mask"].feature.dtype == "int64"
    assert loaded[0]["prompt_token_ids"] == rows[0]["prompt_token_ids"]
    plain = tmp_path / "plain.jsonl"
    export(archived_records([directory]), plain, store.max_record_bytes)
    assert "prompt_token_ids" not in json.loads(plain.read_text().splitlines()[0])


def test_the_commands_explain_themselves(tmp_path: Path) -> None:
    _add_service_commands()
    runner = CliRunner()
    for command, words in [("archive", "consumer group"), ("replay", "byte for byte"), ("export", "load_dataset")]:
        result = runner.invoke(app, [command, "--help"], terminal_width=400)
        assert result.exit_code == 0, result.output
        assert words in " ".join(result.output.split()), result.output
    bad = tmp_path / "not-an-archive.msgpack.gz"
    bad.write_bytes(b"plain text")
    result = runner.invoke(app, ["export", str(tmp_path / "out.jsonl"), "--from", str(bad)])
    assert result.exit_code == 1 and "not a Fulmen archive" in result.output
    assert not (tmp_path / "out.jsonl").exists()


async def test_the_commands_end_to_end(redis_server: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """archive, replay (to a file, then to the stream twice) and export (from files and from Redis)
    as a user runs them, with the shard count from the environment."""
    import uuid

    from fulmen.store.redis.connection import async_client

    experiment = f"t-cli-{uuid.uuid4().hex[:10]}"
    url = redis_server.url  # type: ignore[attr-defined]
    monkeypatch.setenv("REDIS_URL", url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)
    monkeypatch.setenv(k.SHARDS_ENV, str(SHARDS))
    client = async_client(url)
    try:
        store = RedisStore(client, experiment, shards=SHARDS)
        for rid in _ids("u", 3):
            await _finish(store, rid)
        await _adapt(store)
        live = await _samples(store)
    finally:
        await client.aclose()
    _add_service_commands()
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(app, list(args), terminal_width=400)
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    directory, replayed, dataset = tmp_path / "a", tmp_path / "r.msgpack.gz", tmp_path / "d.jsonl"
    assert "archived 3 rollouts and 9 samples" in await asyncio.to_thread(run, "archive", "--to", str(directory))
    assert "archived 0 rollouts and 0 samples" in await asyncio.to_thread(run, "archive", "--to", str(directory))
    other = await asyncio.to_thread(runner.invoke, app, ["archive", "--to", str(directory), "-e", "another"])
    assert other.exit_code == 1 and "one directory per experiment" in " ".join(other.output.split())
    assert "replayed 3 rollouts: 9 samples" in await asyncio.to_thread(
        run, "replay", "--from", str(directory), "--to-file", str(replayed))
    assert sorted(r for _, r in read_file(replayed)[1]) == sorted(live)
    assert "9 appended" in await asyncio.to_thread(run, "replay", "--name", "again")
    assert "0 appended" in await asyncio.to_thread(run, "replay", "--name", "again")
    assert "exported 9 samples" in await asyncio.to_thread(run, "export", str(dataset), "--from", str(replayed))
    assert "exported 9 samples" in await asyncio.to_thread(run, "export", str(dataset))  # the stream: 18, 9 twice
    assert len(dataset.read_text().splitlines()) == 9
