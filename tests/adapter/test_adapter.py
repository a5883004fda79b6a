"""The adapter against a real Redis: samples once per rollout, skips with reasons, poison, takeover."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fulmen import keys as k
from fulmen.records import Sample, SampleSkip, Span
from fulmen.serving.rewards import rewards_by_version
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen_adapter.adapter import Adapter, group_key


async def _rollout_with_spans(store: RedisStore, task: object, *, reward: float | None = 1.0, calls: int = 1,
                              status: str = "succeeded", metadata: dict | None = None,
                              stored_reward: float | None = None) -> str:
    """A rollout with LLM-call spans and a reward span; ``stored_reward``: the final reward reported
    with the status, as a runner does."""
    claimed = await store.rollouts.start_rollout(task, "w1", metadata=metadata or {})
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    spans = []
    for i in range(calls):
        spans.append(Span(rid, aid, f"c{i}", "chat tiny", parent_id=None, start_time=10.0 + i, end_time=10.5 + i,
                          attributes={semconv.SPAN_KIND: semconv.KIND_LLM_CALL,
                                      semconv.PROMPT_TOKEN_IDS: [1, 2, 3] if i == 0 else [1, 2, 3, 4, 5, 6],
                                      semconv.RESPONSE_TOKEN_IDS: [4, 5] if i == 0 else [7],
                                      semconv.RESPONSE_LOGPROBS: [-0.1, -0.2] if i == 0 else [-0.3],
                                      semconv.MODEL_VERSION: "v3"}))
    if reward is not None:
        spans.append(Span(rid, aid, "w", semconv.REWARD_SPAN, start_time=20.0, end_time=20.0,
                          attributes={semconv.SPAN_KIND: semconv.KIND_REWARD, semconv.REWARD: reward}))
    await store.spans.add_spans(spans)
    await store.rollouts.update_attempt(rid, aid, status=status, reward=stored_reward)
    return rid


async def _entries(store: RedisStore) -> list[Sample | SampleSkip]:
    from fulmen.store.samples import decode_sample

    return [decode_sample(f[b"m"], store.max_record_bytes) for _, f in await store.redis.xrange(store.keys.samples)]


async def test_each_succeeded_rollout_yields_its_samples_once(real_store: RedisStore) -> None:
    """Samples carry the recorded ids; a second pass over the same completions writes nothing."""
    rid = await _rollout_with_spans(real_store, {"q": "1+2"}, calls=2, metadata={"group_key": "g1", "group_size": 4})
    adapter = Adapter(real_store)
    await adapter.run(asyncio.Event(), until_idle=True)
    samples = await _entries(real_store)
    assert [(s.sample_id, s.shape) for s in samples] == [
        (f"{rid}.1/t0", "triplet"), (f"{rid}.1/t1", "triplet"), (f"{rid}.1/traj0", "trajectory")
    ]
    first = samples[0]
    assert isinstance(first, Sample)
    assert (first.prompt_token_ids, first.response_token_ids) == ([1, 2, 3], [4, 5])
    assert first.response_logprobs == pytest.approx([-0.1, -0.2])
    assert (first.group_key, first.group_size, first.model_version, first.final_reward) == ("g1", 4, "v3", 1.0)
    # redelivered: the completions group is rewound, as after a crash before the acknowledgement
    await real_store.redis.xgroup_setid(real_store.keys.finished, k.ADAPTER_GROUP, "0")
    again = Adapter(real_store)
    await again.run(asyncio.Event(), until_idle=True)
    assert len(await _entries(real_store)) == 3
    assert again.counters.rollouts == 0
    stats = await real_store.samples.adapter_stats()
    assert stats == {"rollouts": 1, "samples": 3, "version:train:v3:rollouts": 1, "version:train:v3:reward_u": 1_000_000}
    assert rewards_by_version(stats) == {"train": {"v3": {"rollouts": 1, "mean_reward": 1.0}}}


async def test_the_final_reward_is_the_one_stored_with_the_rollout(real_store: RedisStore) -> None:
    """The runner's stored reward is every sample's final reward; the per-call reward comes from the spans."""
    await _rollout_with_spans(real_store, "a", reward=1.0, stored_reward=0.5)
    await Adapter(real_store).run(asyncio.Event(), until_idle=True)
    (sample,) = await _entries(real_store)
    assert isinstance(sample, Sample) and (sample.reward, sample.final_reward) == (1.0, 0.5)


async def test_failed_and_unrewarded_rollouts_are_skipped_with_reasons(real_store: RedisStore) -> None:
    """A failed rollout and one without a reward yield skip records, counted per reason."""
    failed = await _rollout_with_spans(real_store, "a", status="failed")
    silent = await _rollout_with_spans(real_store, "b", reward=None)
    await Adapter(real_store).run(asyncio.Event(), until_idle=True)
    skips = {s.rollout_id: s for s in await _entries(real_store)}
    assert isinstance(skips[failed], SampleSkip) and skips[failed].reason == "rollout failed"
    assert isinstance(skips[silent], SampleSkip) and skips[silent].reason == "no reward"
    assert skips[silent].group_key == group_key(await real_store.rollouts.get_rollout(silent))
    assert await real_store.samples.adapter_stats() == {"rollouts": 2, "skipped": 2, "skip:failed": 1, "skip:no_reward": 1}


async def test_poison_completion_and_malformed_span_do_not_stop_the_adapter(real_store: RedisStore) -> None:
    """A garbage completion is dead-lettered, a garbage span skips its rollout, the rest is adapted."""
    await real_store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    await real_store.redis.xadd(real_store.keys.finished, {"m": b"\xc1garbage"})
    broken = await _rollout_with_spans(real_store, "c")
    await real_store.redis.xadd(real_store.keys.spans(broken), {"m": b"\x93not a span"}, id="99-0")
    good = await _rollout_with_spans(real_store, "d")
    await Adapter(real_store).run(asyncio.Event(), until_idle=True)
    entries = {s.rollout_id: s for s in await _entries(real_store)}
    assert isinstance(entries[good], Sample)
    assert isinstance(entries[broken], SampleSkip) and entries[broken].reason.startswith("malformed span record")
    (dead,) = await real_store.dead_letters.query_dead_letters()
    assert dead.source == real_store.keys.finished
    pending = await real_store.redis.xpending(real_store.keys.finished, k.ADAPTER_GROUP)
    assert pending["pending"] == 0


async def test_completions_of_a_dead_adapter_are_taken_over(real_store: RedisStore) -> None:
    """Completions read but never acknowledged are adapted by another adapter once idle."""
    rid = await _rollout_with_spans(real_store, "e")
    await real_store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    await real_store.finished.read_finished(k.ADAPTER_GROUP, "dead-adapter", count=10)  # read, then "died"
    survivor = Adapter(real_store, consumer="survivor", reclaim_idle_s=0.05)
    await asyncio.sleep(0.1)
    await survivor.run(asyncio.Event(), until_idle=True)
    assert [s.rollout_id for s in await _entries(real_store)] == [rid]
    assert (await real_store.redis.xpending(real_store.keys.finished, k.ADAPTER_GROUP))["pending"] == 0


async def test_fulmen_adapter_process_adapts_and_stops_on_sigterm(real_store: RedisStore, redis_url: str) -> None:
    """`fulmen adapter` as a process: adapts what is there, then exits 0 on SIGTERM."""
    rid = await _rollout_with_spans(real_store, "f")
    env = {**os.environ, "REDIS_URL": redis_url, "FULMEN_EXPERIMENT": real_store.experiment}
    fulmen_bin = str(Path(sys.executable).with_name("fulmen"))
    proc = subprocess.Popen([fulmen_bin, "adapter"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            if await real_store.redis.xlen(real_store.keys.samples):
                break
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert [s.rollout_id for s in await _entries(real_store)] == [rid]
    assert "adapter stopped: 1 rollouts, 1 samples" in stderr


def test_group_key_prefers_the_algorithms_metadata() -> None:
    """The group is the algorithm's group_key, else a stable hash of the task."""
    from fulmen.records import Rollout

    assert group_key(Rollout("r", {"q": 1}, metadata={"group_key": "task-7"})) == "task-7"
    a, b = Rollout("r1", {"q": 1, "x": [1]}), Rollout("r2", json.loads('{"x": [1], "q": 1}'))
    assert group_key(a) == group_key(b) != group_key(Rollout("r3", {"q": 2}))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_batch_freed_and_made_again_faults_in_no_pages() -> None:
    """Once the adapter's process is tuned, a megabyte-sized buffer freed and allocated again (a
    batch's reply, its write) is served from the heap kept: no page faults, where glibc's defaults
    give it back and fault it in again page by page (in a child: the setting is process-wide)."""
    child = textwrap.dedent("""
        import resource, hiredis
        from fulmen_adapter.adapter import keep_freed_memory
        assert keep_freed_memory()
        payload = bytes(2 << 20)
        hiredis.pack_command(("SET", "k", payload))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            hiredis.pack_command(("SET", "k", payload))
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 50  # each of the 20 would be ~512 faults (2 MiB, twice) untuned
