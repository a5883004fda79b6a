"""Ports the services listen on: honcho's $PORT is a wish for the dashboard, a port the user chose is a
requirement, and a taken port is an error that names it and the setting."""

from __future__ import annotations

import socket
from pathlib import Path

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


def test_free_ports_are_never_where_outgoing_connections_take_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port picked for a server lies under the kernel's ephemeral range (a client's connect takes its
    local port there, and once took a port picked for a proxy before the proxy bound it); it is free,
    and no port is picked twice in one process even before either is bound."""
    from fulmen.store.redis import embedded

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [embedded.free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(embedded.LOWEST_PORT <= p < low and embedded.port_is_free(p) for p in ports)
    assert all(p < 12_000 for p in (embedded.free_port(below=12_000) for _ in range(20)))
    monkeypatch.setattr(embedded, "_ephemeral_low", lambda: embedded.LOWEST_PORT + 10)  # no room below it
    assert embedded.free_port() >= low  # asked of the OS instead


def test_a_taken_port_is_not_picked(taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from fulmen.store.redis import embedded

    picks = iter([taken_port, *range(embedded.LOWEST_PORT, embedded.LOWEST_PORT + 50)])
    monkeypatch.setattr(embedded._random, "randrange", lambda *_: next(picks))
    assert embedded.free_port() != taken_port
