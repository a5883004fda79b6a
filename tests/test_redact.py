"""`redact`: no form of a Redis URL's password reaches a log line."""

from __future__ import annotations

import logging
import socket

import pytest

from fulmen.errors import RedisUnavailable
from fulmen.settings import CommonSettings
from fulmen.store.redis.connection import connect, redact

SECRET = "s3cr"  # every password below contains it, with the characters a URL parser stops at


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://alice:s3cret@db:6379/0", "redis://alice:***@db:6379/0"),
        ("redis://alice:s3cr/et@db:6379/0", "redis://alice:***@db:6379/0"),
        ("redis://alice:s3cr#et@db:6379/0", "redis://alice:***@db:6379/0"),
        ("redis://alice:s3cr@et@db:6379/0", "redis://alice:***@db:6379/0"),
        ("redis://:s3cr?x/#@et@db", "redis://:***@db"),
        ("redis://db:6379/0?password=s3cret", "redis://db:6379/0?password=***"),
        ("redis://db/0?db=1&password=s3cr#et&socket_timeout=5", "redis://db/0?db=1&password=***&socket_timeout=5"),
        ("redis://db/0?password=s3cr@et", "redis://db/0?password=***"),
        ("rediss://db/0?ssl_password=s3cret", "rediss://db/0?ssl_password=***"),
        ("unix://:s3cret@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
    ],
)
def test_every_password_form_is_hidden(url: str, shown: str) -> None:
    """Passwords with "/", "#", "@", "?" and query-string passwords are replaced; the rest stays readable."""
    assert redact(url) == shown


@pytest.mark.parametrize("url", ["redis://db:6379/0?password=s3cr@et", "redis://u:s3cr?password=x@db/0"])
def test_overlapping_secrets_hide_more_never_less(url: str) -> None:
    """An "@" inside a query password may hide the host too, but never shows a piece of the secret."""
    assert SECRET not in redact(url) and "et" not in redact(url).split("***")[-1]


def test_urls_without_a_secret_are_unchanged() -> None:
    """A URL with no password (a user name only, a db, options) is logged as it is."""
    for url in ("redis://localhost:6379/0", "rediss://alice@db:6380/2?socket_timeout=5", "redis://db"):
        assert redact(url) == url


async def test_a_query_password_never_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """Waiting for an unreachable Redis named with ?password=: neither the log nor the error shows it."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = CommonSettings(redis_url=f"redis://127.0.0.1:{port}/0?password=s3cret", redis_wait_s=0.3)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(RedisUnavailable) as raised:
        await connect(settings)
    assert "password=***" in str(raised.value)
    assert SECRET not in str(raised.value) and SECRET not in caplog.text
