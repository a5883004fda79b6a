"""A judge-rewarded run of the tool-use demo, shortened to its plumbing, in this process: the
calculator agent on the demo's model behind a proxy (torch backend), train groups as the algorithm
enqueues them, and the adapter's group judge served by a SECOND proxy on the tiny model.

The tiny model's judgement is junk: the judge sends it back once, then gives up, and the groups keep
their own rewards. The judge's calls are recorded apart: stored in the group's
first rollout under the adapter's judge span, marked with their purpose, counted, never a sample
(also when the rollouts are adapted again with those calls stored). A fake judge that answers
valid scores then shows the rewards really replaced, and the run completes: the trainer takes a step
on the three groups, the judged rewards among them, and publishes the version.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.fake_openai import FakeOpenAI

from fulmen import keys as k
from fulmen.demo import calculator
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import RolloutMode, RolloutStatus, Sample
from fulmen.sdk.agent import load_agent
from fulmen.settings import RunnerSettings, TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.store.samples import decode_sample
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import setup_tracing
from fulmen_adapter.adapter import Adapter, adapt_rollout
from fulmen_adapter.judge import JudgeConfig
from fulmen_adapter.triplets import SKIPPED_JUDGE_CALLS
from fulmen_runner.runner import Runner
from fulmen_trainer.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent / "llm_proxy"))
from proxy_helpers import RunningProxy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE = 2


@pytest.fixture
def proxies(tmp_path: Path, redis_url: str, experiment: str) -> Iterator[tuple[RunningProxy, RunningProxy]]:
    """The policy's proxy on the tool demo's (untrained) model, the judge's on the tiny model: two
    torch proxies of one experiment, so the judge's proxy stores its calls with the rollouts."""
    from fulmen_algorithm.demos.tools import build_tool_model

    build_tool_model(tmp_path / "tools-policy", seed=0)
    build_tiny_model(tmp_path / "tiny-judge")
    common = {"redis_url": redis_url, "experiment": experiment, "proxy_backend": "torch"}
    policy = RunningProxy(model_dir=tmp_path / "tools-policy", **common)
    try:
        judge = RunningProxy(model_dir=tmp_path / "tiny-judge", **common)
    except BaseException:
        policy.stop()
        raise
    yield policy, judge
    judge.stop()
    policy.stop()


async def _run_groups(store: RedisStore, policy: RunningProxy, groups: int, seed: int) -> list[list[str]]:
    """``groups`` train groups of the calculator task, enqueued as the algorithm enqueues them, run
    to their end by an in-process runner; the rollout ids per group."""
    ids = []
    for i, task in enumerate(calculator.make_tasks("train", groups, seed=seed)):
        key = f"run-s{seed}-g{i}"
        rollouts = [store.rollouts.new_rollout(task, rollout_id=f"{key}-{j}", mode=RolloutMode.TRAIN,
                                               metadata={"group_key": key, "group_size": GROUP_SIZE})
                    for j in range(GROUP_SIZE)]
        await store.rollouts.enqueue_rollouts(rollouts)
        ids.append([r.rollout_id for r in rollouts])
    _, buffer = setup_tracing("test-runner", set_global=False)
    runner = Runner(store, load_agent("examples.calculator_agent:agent"), buffer,
                    RunnerSettings(llm_base_url=f"{policy.url}/v1", concurrency=4))
    await asyncio.wait_for(runner.run(max_rollouts=groups * GROUP_SIZE), 60)
    return ids


async def _records(store: RedisStore) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for _, fields in await store.redis.xrange(store.keys.samples):
        record = decode_sample(fields[b"m"], store.max_record_bytes)
        out.setdefault(record.rollout_id, []).append(record)  # type: ignore[arg-type]
    return out


async def test_a_judged_tool_demo_run_completes_and_records_the_judges_calls_apart(
    real_store: RedisStore, proxies: tuple[RunningProxy, RunningProxy], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Two groups judged by the tiny model (junk twice each: own rewards), their judge calls stored,
    marked and never sampled; then one group judged by a fake with valid scores: rewards replaced;
    then the trainer's step on all three groups, published."""
    monkeypatch.syspath_prepend(str(ROOT))  # examples.calculator_agent
    policy, judge_proxy = proxies
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tools-policy"}}, resources_id="policy")
    groups = await _run_groups(real_store, policy, 2, seed=1)
    rollouts = [rid for group in groups for rid in group]
    for rollout in await real_store.rollouts.get_rollouts(rollouts):
        assert rollout is not None and rollout.status is RolloutStatus.SUCCEEDED, rollout
    config = JudgeConfig(f"{judge_proxy.url}/v1", "tiny-judge", max_tokens=32, timeout_s=30.0)
    adapter = Adapter(real_store, judge=config)
    await adapter.run(asyncio.Event(), until_idle=True)

    # the run completed: every rollout's samples written, with its own reward, nothing left pending
    records = await _records(real_store)
    assert sorted(records) == sorted(rollouts)
    own = {r.rollout_id: r.reward for r in await real_store.rollouts.get_rollouts(rollouts) if r is not None}
    assert all(s.final_reward == own[rid] for rid, samples in records.items() for s in samples)
    stats = await real_store.samples.adapter_stats()
    assert stats["judge/groups_failed"] == 2 and "judge/rollouts_rescored" not in stats
    # the judge's calls: in each group's first rollout, under the adapter's judge span, marked; tried twice
    for group in groups:
        spans = await real_store.spans.query_spans(sorted(group)[0])
        (judgement,) = [s for s in spans if s.name == "fulmen.judge"]
        calls = [s for s in spans if s.attributes.get(semconv.CALL_PURPOSE) == semconv.PURPOSE_JUDGE]
        assert judgement.status_code == "ERROR" and len(calls) == 2, judgement.status_message
        assert all(c.parent_id == judgement.span_id and c.trace_id == judgement.trace_id for c in calls)
        assert all(c.attributes[semconv.SPAN_KIND] == semconv.KIND_LLM_CALL for c in calls)
    # never a sample: not in the stream, and adapting the rollouts again (with those calls now stored)
    # gives the very records the stream has, the judge's calls counted
    assert not any("You judge attempts" in (s.request_json or "") for samples in records.values() for s in samples)
    read = await real_store.samples.read_for_samples(rollouts)
    again = [adapt_rollout(r, adapter.config, real_store.max_record_bytes) for r in read if r is not None]
    live = {rid: [s.to_wire() for s in samples] for rid, samples in records.items()}
    assert {a.rollout_id: a.records for a in again} == live
    assert sum(a.stats.get(SKIPPED_JUDGE_CALLS, 0) for a in again) == 4

    # a judge that answers: the group's rewards are its scores
    fake = FakeOpenAI(replies=[json.dumps({"scores": [{"trajectory": 1, "score": 0.25, "reason": "x"},
                                                      {"trajectory": 2, "score": 0.75, "reason": "y"}]})])
    fake.start_in_thread()
    try:
        (group,) = await _run_groups(real_store, policy, 1, seed=2)
        await Adapter(real_store, judge=JudgeConfig(f"{fake.base_url}/v1", "judge")).run(asyncio.Event(),
                                                                                          until_idle=True)
    finally:
        fake.stop()
    records = await _records(real_store)
    assert [{s.final_reward for s in records[rid]} for rid in sorted(group)] == [{0.25}, {0.75}]

    # the run completes: the trainer's step over the three groups trains the judged rewards
    # (and no judge call, which is no sample), and publishes its version
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    settings = load_settings(TrainerSettings, model_dir=tmp_path / "tools-policy", algorithm="grpo",
                             groups_per_step=3, max_steps=1, learning_rate=1e-3, checkpoint_dir=tmp_path / "ck",
                             metrics_file=tmp_path / "metrics.jsonl", experiment=real_store.experiment)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    await asyncio.wait_for(trainer.run(asyncio.Event()), 120)
    assert trainer.step == 1
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = {sid.split("/")[0].rsplit(".", 1)[0] for sid in line["sample_ids"]}
    assert trained == set(rollouts) | set(group)
    latest = await real_store.resources.get_latest_resources()
    assert latest is not None and latest.version == 2, latest  # the trainer's, after the test's own
    assert latest.resources["llm"]["model_version"] == "v1", latest
