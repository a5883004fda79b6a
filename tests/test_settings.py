"""Settings precedence and secret handling."""

from __future__ import annotations

import pytest

from fulmen.connection import redact
from fulmen.errors import InvalidInput
from fulmen.settings import load_settings


def test_flag_over_environment_over_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag beats the environment, which beats the default."""
    monkeypatch.delenv("FULMEN_EXPERIMENT", raising=False)
    assert load_settings().experiment == "default"
    monkeypatch.setenv("FULMEN_EXPERIMENT", "from-env")
    assert load_settings().experiment == "from-env"
    assert load_settings(experiment="from-flag").experiment == "from-flag"
    assert load_settings(experiment=None).experiment == "from-env"  # None means "flag not given"


def test_embedded_default_and_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """No REDIS_URL selects the embedded server; REDIS_URL selects any other."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("FULMEN_REDIS_PORT", "7001")
    settings = load_settings()
    assert settings.embedded and settings.redis_url_value() == "redis://127.0.0.1:7001/0"
    monkeypatch.setenv("REDIS_URL", "rediss://alice:s3cret@db.example:6380/2")
    settings = load_settings()
    assert not settings.embedded and settings.redis_url_value() == "rediss://alice:s3cret@db.example:6380/2"


def test_password_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither repr nor str of the settings, nor a redacted URL, shows the password."""
    monkeypatch.setenv("REDIS_URL", "redis://alice:s3cret@db:6379/0")
    settings = load_settings()
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)
    assert redact(settings.redis_url_value()) == "redis://alice:***@db:6379/0"
    assert redact("redis://localhost:6379/0") == "redis://localhost:6379/0"


def test_invalid_values_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad values and unknown names are refused with the name in the message."""
    with pytest.raises(InvalidInput, match="redis_port"):
        load_settings(redis_port=0)
    with pytest.raises(InvalidInput, match="experiment name"):
        load_settings(experiment="has space")
    monkeypatch.setenv("FULMEN_REDIS_URL", "redis://x")  # the URL is REDIS_URL, nothing else
    with pytest.raises(InvalidInput, match="FULMEN_REDIS_URL"):
        load_settings()
