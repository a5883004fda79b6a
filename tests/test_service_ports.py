"""Ports the services listen on: honcho's $PORT is a wish for the dashboard, a port the user chose is a
requirement, and a taken port is an error that names it and the setting."""

from __future__ import annotations

import socket

import pytest

from fulmen.settings import DashboardSettings
from fulmen_dashboard.server import listen


@pytest.fixture
def taken_port():
    """A loopback port another process (here: this socket) is listening on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield holder.getsockname()[1]


def test_a_taken_port_from_honcho_gives_way_to_a_free_one(taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under honcho a dashboard that exits stops the whole run: a taken $PORT means another port."""
    monkeypatch.setenv("PORT", str(taken_port))
    with listen(DashboardSettings(dashboard_host="127.0.0.1")) as sock:
        port = sock.getsockname()[1]
        assert port not in (0, taken_port)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # it is really listening there


def test_a_taken_port_the_user_chose_is_a_clear_error(taken_port: int) -> None:
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{taken_port} .*FULMEN_DASHBOARD_PORT"):
        listen(DashboardSettings(dashboard_host="127.0.0.1", dashboard_port=taken_port))


def test_the_proxy_names_its_taken_port_and_the_setting(taken_port: int) -> None:
    from fulmen_llm_proxy.server import bind

    with pytest.raises(OSError, match=f"proxy cannot listen on 127.0.0.1:{taken_port} .*FULMEN_PROXY_PORT"):
        bind("127.0.0.1", taken_port)
