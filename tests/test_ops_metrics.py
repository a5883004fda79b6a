"""A short run with every service as a real process, each on its own $PORT (as under honcho): scrape
`/healthz`, `/readyz` and `/metrics` of each and find the named series with plausible values."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from ops_helpers import get, samples, service_env, start, stop, value, wait_for

from fulmen.demo import arithmetic
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import ServiceBeat, TrainStep
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port

pytestmark = pytest.mark.slow

SERVICES = ("runner", "adapter", "trainer", "algorithm", "evaluator", "watchdog")


async def test_every_service_serves_health_readiness_and_metrics(
    real_store: RedisStore, redis_url: str, tmp_path: Path
) -> None:
    """Runner counts claims, completions and spans; the adapter samples; the trainer its steps; every
    service the pipeline gauges and its process metrics; the proxy its latency histogram."""
    model = build_tiny_model(tmp_path / "tiny")
    tasks = arithmetic.write_jsonl(tmp_path / "train.jsonl", arithmetic.make_tasks("train", 20, seed=2))
    await real_store.resources.add_resources(
        {"llm": {"kind": "llm", "model": "tiny", "model_version": "base", "sampling_parameters": {"temperature": 1.0}}},
        resources_id="policy",
    )
    env = service_env(
        redis_url, real_store.experiment, tmp_path, FULMEN_GROUPS_PER_STEP="2", FULMEN_N_SAMPLES="4",
        FULMEN_CHECKPOINT_DIR=str(tmp_path / "ck"), FULMEN_METRICS_FILE=str(tmp_path / "metrics.jsonl"),
        FULMEN_TORCH_THREADS="1", FULMEN_MODEL_DIR=str(model),
    )
    ports = {name: free_port() for name in SERVICES}
    procs = [
        start(["llm-proxy", "--backend", "torch", "--model-dir", str(model), "--port", "0"], env),
        start(["runner", "--agent", "examples.arithmetic_agent:agent", "--concurrency", "8"], env, ports["runner"]),
        start(["adapter"], env, ports["adapter"]),
        start(["trainer", "--model-dir", str(model)], env, ports["trainer"]),
        start(["evaluator"], env, ports["evaluator"]),
        start(["watchdog"], env, ports["watchdog"]),
        # more steps than the test waits for: the algorithm must still be up when it is scraped
        start(["algorithm", "--train-data", str(tasks), "--total-steps", "50"], env, ports["algorithm"]),
    ]
    try:
        def trainer_stepped() -> bool:
            status, text = get(ports["trainer"], "/metrics")
            return status == 200 and (value(samples(text), "fulmen_trainer_step", rank="0") or 0) >= 1

        wait_for(trainer_stepped, 180, "a trainer step on the trainer's /metrics")
        assert all(p.poll() is None for p in procs), "a service died during the run"

        for name in SERVICES:
            port = ports[name]
            assert get(port, "/healthz") == (200, '{"status":"ok"}'), name
            assert get(port, "/readyz") == (200, '{"ready": true}'), name
            status, text = get(port, "/metrics")
            assert status == 200, name
            m = samples(text)
            assert value(m, "fulmen_redis_up") == 1, name
            assert (value(m, "fulmen_queue_depth") or 0) >= 0 and ("fulmen_queue_depth", frozenset()) in m, name
            assert value(m, "fulmen_rollouts", status="succeeded") >= 8, name  # two groups of 4 trained on
            assert value(m, "fulmen_dead_letters") == 0, name
            assert value(m, "fulmen_stream_length", stream="samples") >= 8, name
            assert value(m, "fulmen_pending_entries", stream="samples", group="trainers") is not None, name
            assert value(m, "fulmen_consumer_lag_seconds", stream="queue", group="runners") >= 0, name
            assert value(m, "fulmen_model_version") >= 1, name  # the trainer published v1
            assert value(m, "process_cpu_seconds_total") > 0, name

        runner = samples(get(ports["runner"], "/metrics")[1])
        assert value(runner, "fulmen_runner_claims_total") >= 8
        assert value(runner, "fulmen_runner_attempts_ended_total", outcome="ended") >= 8
        assert value(runner, "fulmen_runner_attempts_ended_total", outcome="crashed") == 0
        assert value(runner, "fulmen_runner_spans_written_total") > 0
        adapter = samples(get(ports["adapter"], "/metrics")[1])
        assert value(adapter, "fulmen_adapter_rollouts_total") >= 8
        assert value(adapter, "fulmen_adapter_samples_total") >= 8
        trainer = samples(get(ports["trainer"], "/metrics")[1])
        assert value(trainer, "fulmen_trainer_loss_total", rank="0") is not None
        assert value(trainer, "fulmen_trainer_perf_samples", rank="0") >= 8

        (proxy,) = await real_store.registry.query_proxies()
        proxy_port = urlsplit(proxy.base_url).port
        assert proxy_port is not None
        assert get(proxy_port, "/healthz")[0] == 200 and get(proxy_port, "/readyz")[0] == 200
        p = samples(get(proxy_port, "/metrics")[1])
        assert value(p, "fulmen_proxy_request_seconds_count", endpoint="/chat/completions") >= 8
        assert value(p, "fulmen_proxy_tokens_total", kind="completion") > 0
        assert value(p, "process_cpu_seconds_total") > 0

        steps = await real_store.redis.xrange(real_store.keys.trainer_steps)  # the curve `fulmen top` draws
        first = TrainStep.from_wire(steps[0][1][b"m"])
        assert first.step == 1 and first.model_version == "v1" and first.reward_mean is not None

        beats = [ServiceBeat.from_wire(v) for v in (await real_store.redis.hgetall(real_store.keys.services)).values()]
        assert {b.service for b in beats} == set(SERVICES)
        assert {b.service: b.port for b in beats} == ports
    finally:
        stop(procs, kill=procs[-1:])  # the algorithm would write its run report first
