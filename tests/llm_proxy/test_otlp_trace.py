"""Runner and proxy processes both export to one OTLP collector: each rollout is one trace holding
the runner's spans and the proxy's LLM-call spans, each call under the runner span that made it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.otlp_receiver import OtlpReceiver, ReceivedSpan

from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import rollout_trace_id

pytestmark = pytest.mark.slow
FULMEN = str(Path(sys.executable).with_name("fulmen"))
HERE = Path(__file__).resolve().parent
RUNNER, PROXY = "fulmen-runner", "fulmen-llm-proxy"


class Child:
    """One `fulmen <command>` process, its output in files (read when an assertion fails)."""

    def __init__(self, args: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = args[0]
        self.stderr_path = logs / f"{self.name}.stderr"
        with self.stderr_path.open("w") as err:
            self.popen = subprocess.Popen([FULMEN, *args], env=env, stdout=subprocess.DEVNULL, stderr=err)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()[-6000:]

    def stop(self) -> int:
        """SIGTERM, then the exit code (SIGKILL if it hangs: the test then fails on the code)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.stop()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def _env(redis_url: str, experiment: str, endpoint: str) -> dict[str, str]:
    # Nothing from the test's own shell that configures Fulmen or OTel leaks into the children.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FULMEN_", "OTEL_")) and k != "REDIS_URL"}
    env.update(
        REDIS_URL=redis_url,
        FULMEN_EXPERIMENT=experiment,
        PYTHONPATH=str(HERE),
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        # Nothing leaves on the export schedule during the test: every span must come from the
        # flush each service does on SIGTERM, the proxy's included.
        OTEL_BSP_SCHEDULE_DELAY="60000",
    )
    return env


async def test_each_rollout_is_one_trace_across_runner_and_proxy(
    real_store: RedisStore,
    redis_url: str,
    tiny_model: Path,
    tmp_path: Path,
    receiver: OtlpReceiver,
    children: list[Child],
) -> None:
    """Per rollout: one trace id, = rollout_trace_id, holding runner spans and the proxy's call spans
    whose parents are runner spans (the root for the first call, the operation for the second)."""
    env = _env(redis_url, real_store.experiment, receiver.endpoint)
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny"}}, resources_id="policy")
    ids = [(await real_store.rollouts.enqueue_rollout({"q": f"{i}+{i}="})).rollout_id for i in range(3)]
    for args in (
        ["llm-proxy", "--backend", "torch", "--model-dir", str(tiny_model), "--port", "0"],
        ["runner", "--agent", "otlp_trace_agents:two_calls", "--concurrency", "3"],
    ):
        children.append(Child(args, env, tmp_path))
    waiting = asyncio.ensure_future(real_store.finished.wait_for_rollouts(ids, timeout_s=240))
    while not waiting.done():  # a child that dies must fail the test now, not after the timeout
        for child in children:
            assert child.popen.poll() is None, f"{child.name} exited early: {child.stderr}"
        await asyncio.sleep(0.2)
    finished = waiting.result()
    assert sorted(r.rollout_id for r in finished) == sorted(ids)
    assert {r.status for r in finished} == {"succeeded"}, [(r.rollout_id, r.status) for r in finished]
    for child in children:
        assert child.stop() == 0, f"{child.name}: {child.stderr}"

    spans = receiver.snapshot()
    by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    for rid in ids:
        mine = [s for s in spans if s.attributes.get(semconv.ROLLOUT_ID) == rid]
        # Every span of the rollout, from either service, is in exactly one trace: the rollout's.
        (trace_id,) = {s.trace_id for s in mine}
        assert int(trace_id, 16) == rollout_trace_id(rid)
        assert {s.resource.get("service.name") for s in by_trace[trace_id]} == {RUNNER, PROXY}
        assert all(s.attributes.get(semconv.ROLLOUT_ID) == rid for s in by_trace[trace_id])
        runner_spans = {s.span_id: s for s in by_trace[trace_id] if s.resource.get("service.name") == RUNNER}
        calls = [s for s in by_trace[trace_id] if s.resource.get("service.name") == PROXY]
        assert len(calls) == 2, [s.name for s in calls]
        for call in calls:
            assert call.attributes[semconv.SPAN_KIND] == semconv.KIND_LLM_CALL
            assert call.attributes[semconv.GEN_AI_REQUEST_MODEL] == "tiny"
            assert semconv.PROMPT_TOKEN_IDS not in call.attributes  # training data stays in the store
        parents = sorted(runner_spans[c.parent_span_id].name for c in calls if c.parent_span_id in runner_spans)
        assert parents == sorted([semconv.ROLLOUT_SPAN, "second-turn"]), "a call's parent is not a runner span"
        # The trace viewer shows what the store holds: the same call spans, same ids.
        stored = await real_store.spans.query_spans(rid)
        stored_calls = {s.span_id for s in stored if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL}
        assert stored_calls == {c.span_id for c in calls}
    assert len({s.trace_id for s in spans}) == len(ids)  # one trace per rollout, nothing else
