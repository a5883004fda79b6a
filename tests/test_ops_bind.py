"""The ops endpoints' exposure: the address they bind (loopback by default) and /metrics' optional token."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from fulmen.errors import InvalidInput
from fulmen.settings import load_settings
from fulmen.telemetry.http import OpsServer, start_ops


def _get(port: int, path: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def test_loopback_by_default_and_the_setting_wins(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the endpoints listen on 127.0.0.1 only; FULMEN_METRICS_HOST=0.0.0.0 opens them (containers)."""
    monkeypatch.delenv("FULMEN_METRICS_HOST", raising=False)
    with OpsServer(load_settings(redis_url=redis_url), "watchdog", port=0) as ops:
        assert ops._http is not None and ops._http.server_address[0] == "127.0.0.1"
    monkeypatch.setenv("FULMEN_METRICS_HOST", "0.0.0.0")
    with OpsServer(load_settings(redis_url=redis_url), "watchdog", port=0) as ops:
        assert ops._http is not None and ops._http.server_address[0] == "0.0.0.0"
        assert _get(ops.port, "/healthz") == 200


def test_metrics_token_guards_metrics_not_the_probes(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FULMEN_METRICS_TOKEN, /metrics needs the bearer token (401 otherwise); /healthz, /readyz do not."""
    monkeypatch.setenv("FULMEN_METRICS_TOKEN", "t0ken")
    settings = load_settings(redis_url=redis_url)
    assert "t0ken" not in repr(settings)
    with OpsServer(settings, "watchdog", port=0) as ops:
        assert _get(ops.port, "/metrics") == 401
        assert _get(ops.port, "/metrics", token="wrong") == 401
        assert _get(ops.port, "/metrics", token="t0ken") == 200
        assert _get(ops.port, "/healthz") == 200
        assert _get(ops.port, "/readyz") == 200


def test_no_token_no_auth(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, /metrics is open, as Prometheus scrapes it by default."""
    monkeypatch.delenv("FULMEN_METRICS_TOKEN", raising=False)
    with OpsServer(load_settings(redis_url=redis_url), "watchdog", port=0) as ops:
        assert _get(ops.port, "/metrics") == 200


def test_a_taken_honcho_port_falls_back_to_a_free_one_a_chosen_one_is_an_error(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second `honcho start` hands out the same $PORTs: the service serves on a free port instead
    (its heartbeat names it); a FULMEN_METRICS_PORT someone else holds fails, naming the setting."""
    with OpsServer(load_settings(redis_url=redis_url), "watchdog", port=0) as first:
        monkeypatch.delenv("FULMEN_METRICS_PORT", raising=False)
        monkeypatch.setenv("PORT", str(first.port))
        with start_ops(load_settings(redis_url=redis_url), "watchdog") as second:
            assert second.port not in (None, first.port)
            assert _get(second.port, "/healthz") == 200
        monkeypatch.setenv("FULMEN_METRICS_PORT", str(first.port))
        with pytest.raises(InvalidInput, match="FULMEN_METRICS_PORT"):
            start_ops(load_settings(redis_url=redis_url), "watchdog")
