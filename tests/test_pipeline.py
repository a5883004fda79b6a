"""The whole pipeline as real processes, plumbing only: proxy → runner → adapter → trainer → algorithm,
with validation passes (an rq job on `fulmen evaluator`, and a final one).

A random tiny model learns nothing in three steps; what is checked is that every service plays its
part: the algorithm paces groups, the trainer steps on the adapter's samples and publishes versions,
the proxy serves them, and the run ends by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from procs import stop

from fulmen.demo import arithmetic
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.store import RedisStore
from fulmen.versions.model_version import ModelVersion

pytestmark = pytest.mark.slow
FULMEN = str(Path(sys.executable).with_name("fulmen"))
ROOT = Path(__file__).resolve().parents[1]


async def test_a_short_run_goes_through_every_service(real_store: RedisStore, redis_url: str, tmp_path: Path) -> None:
    """The algorithm ends the run after 3 trainer versions; samples were trained on; the proxy served v3."""
    model = build_tiny_model(tmp_path / "tiny")
    tasks = arithmetic.write_jsonl(tmp_path / "train.jsonl", arithmetic.make_tasks("train", 20, seed=1))
    val = arithmetic.write_jsonl(tmp_path / "val.jsonl", arithmetic.make_tasks("val", 6, seed=1))
    await real_store.resources.add_resources(
        {"llm": {"kind": "llm", "model": "tiny", "model_version": "base", "sampling_parameters": {"temperature": 1.0}}},
        resources_id="policy",
    )
    env = {**os.environ, "REDIS_URL": redis_url, "FULMEN_EXPERIMENT": real_store.experiment,
           "PYTHONPATH": str(ROOT), "FULMEN_GROUPS_PER_STEP": "2", "FULMEN_N_SAMPLES": "4",
           "FULMEN_CHECKPOINT_DIR": str(tmp_path / "ck"), "FULMEN_METRICS_FILE": str(tmp_path / "metrics.jsonl"),
           "FULMEN_TORCH_THREADS": "1", "FULMEN_DATA_DIR": str(tmp_path / "data"), "FULMEN_MODEL_DIR": str(model)}
    services = [
        subprocess.Popen([FULMEN, "llm-proxy", "--backend", "torch", "--model-dir", str(model), "--port", "0"], env=env),
        subprocess.Popen([FULMEN, "runner", "--agent", "examples.arithmetic_agent:agent", "--concurrency", "8"],
                         env=env, cwd=ROOT),
        subprocess.Popen([FULMEN, "adapter"], env=env),
        subprocess.Popen([FULMEN, "trainer", "--model-dir", str(model)], env=env),
        subprocess.Popen([FULMEN, "evaluator"], env=env),
    ]
    try:
        algorithm = subprocess.run(
            [FULMEN, "algorithm", "--train-data", str(tasks), "--total-steps", "3", "--val-data", str(val),
             "--val-every", "2"],
            env=env, capture_output=True, text=True, timeout=240,
        )
        assert algorithm.returncode == 0, algorithm.stderr[-2000:]
        summary = json.loads(algorithm.stdout.strip().splitlines()[-1])
        assert summary["steps"] >= 3 and summary["groups"] >= 6
        assert 0.0 <= summary["final_val_accuracy"] <= 1.0
        labels = [v["label"] for v in summary["validations"]]
        # v0 and v2 are rq jobs on the evaluator: the run waits for them before its final pass
        assert labels[-1] == "final" and "v0" in labels and "v2" in labels
        # the run's report: a PNG, a JSON summary, the final model as a loadable Hugging Face folder
        assert Path(summary["curve"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert json.loads(Path(summary["summary"]).read_text())["steps"] == summary["steps"]
        from fulmen.demo.tiny_model import load_tiny_model

        final_model, _ = load_tiny_model(summary["final_model"])
        assert final_model is not None
        # `fulmen eval CHECKPOINT`: published as a new version, served, validated through the same services
        trainer = services[3]  # stopped first: a version it published mid-pass would serve part of it
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=30) == 0
        trained = (await real_store.resources.get_resources("policy")).resources["llm"]["model_version"]
        evaluation = subprocess.run([FULMEN, "eval", summary["final_model"], "--val-data", str(val)],
                                    env=env, capture_output=True, text=True, timeout=180)
        assert evaluation.returncode == 0, evaluation.stderr[-2000:]
        result = json.loads(evaluation.stdout.strip().splitlines()[-1])
        evaluated = result["label"].removeprefix("eval-")
        assert ModelVersion.parse(evaluated).number > ModelVersion.parse(trained).number
        assert result["tasks"] == result["finished"] == 6 and 0.0 <= result["accuracy"] <= 1.0
        assert result["served_by"] == {evaluated: 6}  # every answer came from the evaluated weights
        assert all(p.poll() is None for p in services if p is not trainer), "a service died during the run"
    finally:
        stop(services)
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) >= 3 and all(s["perf/samples"] > 0 for s in steps)
    latest = await real_store.resources.get_resources("policy")
    assert ModelVersion.parse(latest.resources["llm"]["model_version"]).number >= ModelVersion.parse(evaluated).number
    assert latest.resources["llm"]["sampling_parameters"] == {"temperature": 1.0}  # carried over by publishing
