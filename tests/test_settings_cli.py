"""The settings seen from the command line: variables every command accepts, and `fulmen config`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fulmen.errors import InvalidInput
from fulmen.settings import env_setting

FULMEN = str(Path(sys.executable).with_name("fulmen"))


def _env(**extra: str) -> dict[str, str]:
    """Our environment minus anything that configures Fulmen, plus ``extra``."""
    env = {n: v for n, v in os.environ.items() if not n.startswith(("FULMEN_", "OTEL_")) and n != "REDIS_URL"}
    env.update(COLUMNS="200", **extra)
    return env


def _fulmen(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FULMEN, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_weights_in_aof_is_a_setting_every_command_accepts(redis_url: str, experiment: str) -> None:
    """FULMEN_WEIGHTS_IN_AOF=1 fulmen status runs (exit 0): the variable is a setting, not an unknown name."""
    env = _env(REDIS_URL=redis_url, FULMEN_EXPERIMENT=experiment, FULMEN_WEIGHTS_IN_AOF="1")
    result = _fulmen("status", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert "total_rollouts" in json.loads(result.stdout)
    result = _fulmen("status", env={**env, "FULMEN_WEIGHTS_IN_AOF": "maybe"})
    assert result.returncode == 2 and "weights_in_aof (FULMEN_WEIGHTS_IN_AOF)" in result.stderr


def test_a_value_read_deep_inside_is_validated_as_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """env_setting reads one field from the environment, with its default and its checks."""
    monkeypatch.delenv("FULMEN_WEIGHTS_IN_AOF", raising=False)
    monkeypatch.delenv("FULMEN_STORE_SHARDS", raising=False)
    assert (env_setting("weights_in_aof"), env_setting("store_shards"), env_setting("proxy_port")) == (False, 1, None)
    monkeypatch.setenv("FULMEN_WEIGHTS_IN_AOF", "true")
    monkeypatch.setenv("FULMEN_STORE_SHARDS", "4")
    assert (env_setting("weights_in_aof"), env_setting("store_shards")) == (True, 4)
    monkeypatch.setenv("FULMEN_STORE_SHARDS", "65")
    with pytest.raises(InvalidInput, match=r"FULMEN_STORE_SHARDS='65' is invalid: .*64"):
        env_setting("store_shards")


def test_config_shows_each_value_and_where_it_came_from(tmp_path: Path) -> None:
    """`fulmen config trainer`: the environment beats .env beats the default, each row says which; secrets masked."""
    (tmp_path / ".env").write_text(
        "# read as honcho reads it\nFULMEN_LEARNING_RATE=0.25\nFULMEN_CODEC=topk\nFULMEN_PROXY_API_KEYS='k-secret-1'\n"
    )
    env = _env(FULMEN_CODEC="dgc", REDIS_URL="redis://alice:s3cret@db.example:6380/0")
    result = _fulmen("config", "trainer", "--json", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = {row["setting"]: row for row in report["settings"]}
    assert (rows["learning_rate"]["value"], rows["learning_rate"]["source"]) == (0.25, ".env")
    assert (rows["codec"]["value"], rows["codec"]["source"]) == ("dgc", "environment")
    assert (rows["max_grad_norm"]["value"], rows["max_grad_norm"]["source"]) == (1.0, "default")
    assert rows["redis_url"] == {"group": "redis", "setting": "redis_url", "env": "REDIS_URL",
                                 "value": "redis://alice:***@db.example:6380/0", "source": "environment"}
    assert rows["learning_rate"]["group"] == "optimizer" and report["env_file"] == ".env"
    assert "s3cret" not in result.stdout

    proxy = _fulmen("config", "llm-proxy", "--json", env=env, cwd=tmp_path)
    rows = {row["setting"]: row for row in json.loads(proxy.stdout)["settings"]}
    assert (rows["proxy_api_keys"]["value"], rows["proxy_api_keys"]["source"]) == ("***", ".env")
    assert "k-secret-1" not in proxy.stdout

    table = _fulmen("config", "trainer", env=env, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    optimizer = table.stdout.split("Optimizer", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"FULMEN_LEARNING_RATE\s*│\s*0\.25\s*│\s*\.env", optimizer), table.stdout
    assert "s3cret" not in table.stdout


def test_config_refuses_a_bad_value_or_an_unknown_service(tmp_path: Path) -> None:
    """A bad choice in the .env file fails naming the allowed values; an unknown service lists the known ones."""
    (tmp_path / "run.env").write_text("FULMEN_PARALLEL=mpi\n")
    result = _fulmen("config", "trainer", "--env-file", "run.env", env=_env(), cwd=tmp_path)
    assert result.returncode == 2 and "parallel (FULMEN_PARALLEL)" in result.stderr
    assert "'redis', 'ddp' or 'fsdp', got 'mpi'" in result.stderr
    result = _fulmen("config", "trainr", env=_env(), cwd=tmp_path)
    assert result.returncode == 2 and "trainer" in result.stderr
