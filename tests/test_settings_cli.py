"""The settings seen from the command line: variables every command accepts, and `fulmen config`."""

from __future__ import annotations

import json
import os
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
