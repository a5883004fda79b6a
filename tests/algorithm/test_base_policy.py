"""`fulmen algorithm` names the policy before the first rollout: without the "policy" resources every
rollout fails ("the rollout names resources 'policy', which do not exist"), as a first run on a
user's own model did under `fulmen dev --tasks`."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fulmen.cli.main import _add_service_commands, app
from fulmen.store import RedisStore
from fulmen.versions.model_version import llm_resource
from fulmen_algorithm.start import publish_base_policy


async def test_the_base_policy_is_published_once(real_store: RedisStore) -> None:
    await publish_base_policy(real_store, "my-model", sampling=None)
    first = await real_store.resources.get_resources("policy")
    assert llm_resource(first) == {"kind": "llm", "model": "my-model", "model_version": "base"}
    await publish_base_policy(real_store, "other", sampling=None)  # a restarted run keeps what is there
    assert (await real_store.resources.get_resources("policy")).version == first.version


def test_the_algorithm_needs_the_model_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FULMEN_MODEL_DIR", raising=False)
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"question": "1+1=", "answer": "2"}\n')
    _add_service_commands()
    result = CliRunner().invoke(app, ["algorithm", "--train-data", str(tasks), "--total-steps", "1"])
    assert result.exit_code == 2 and "--model-dir" in result.output
