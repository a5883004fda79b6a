"""End to end with real processes: proxy (torch backend, tiny model) → runner → adapter → samples,
and one trace per rollout across runner and proxy."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import stop

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.store import RedisStore
from fulmen.store.samples import decode_sample
from fulmen.telemetry import semconv

pytestmark = pytest.mark.slow
FULMEN = str(Path(sys.executable).with_name("fulmen"))


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    stop(started, timeout_s=10)


async def test_each_successful_rollout_yields_its_samples_once_with_the_proxys_token_ids(
    real_store: RedisStore, redis_url: str, tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    """Every rollout's one sample holds exactly the token ids the proxy returned to the agent."""
    model = build_tiny_model(tmp_path / "tiny")
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "FULMEN_EXPERIMENT": real_store.experiment,
        "PYTHONPATH": str(Path(__file__).parent),
    }
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny"}}, resources_id="policy")
    ids = [(await real_store.rollouts.enqueue_rollout({"q": f"{i}+{i}="})).rollout_id for i in range(6)]
    for command in (
        ["llm-proxy", "--backend", "torch", "--model-dir", str(model), "--port", "0"],
        ["runner", "--agent", "e2e_agents:chat_once", "--concurrency", "3"],
        ["adapter"],
    ):
        processes.append(subprocess.Popen([FULMEN, *command], env=env, text=True))
    for _ in range(1200):
        if (await real_store.samples.adapter_stats()).get("rollouts", 0) >= len(ids):
            break
        assert all(p.poll() is None for p in processes), "a service exited early"
        await asyncio.sleep(0.05)
    entries = [decode_sample(f[b"m"], real_store.max_record_bytes)
               for _, f in await real_store.redis.xrange(real_store.keys.samples)]
    assert sorted(e.rollout_id for e in entries) == sorted(ids)  # exactly one sample per rollout
    for sample in entries:
        assert isinstance(sample, Sample)
        (returned,) = await real_store.spans.query_spans(sample.rollout_id, name=semconv.OBJECT_SPAN)
        ids_seen = json.loads(returned.attributes[semconv.OBJECT_JSON])
        assert sample.prompt_token_ids == ids_seen["prompt_token_ids"]
        assert sample.response_token_ids == ids_seen["token_ids"]
        assert len(sample.response_logprobs) == len(sample.response_token_ids)
        assert sample.reward in (1.0, 0.5)
        assert sample.model_version is not None
        # the trace context travelled with the call: the proxy's span sits under the attempt's root span
        spans = await real_store.spans.query_spans(sample.rollout_id)
        (root,) = [s for s in spans if s.name == semconv.ROLLOUT_SPAN]
        (call,) = [s for s in spans if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL]
        assert (call.trace_id, call.parent_id) == (root.trace_id, root.span_id)
