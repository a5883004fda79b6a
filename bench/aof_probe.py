"""What the main Redis's append-only file did during a timed publish (issue 16, bench/weight_sync.py).

A slow publish → serving repeat through the main Redis has three suspects: an AOF rewrite running
meanwhile (a forked child writing the whole dataset, on the cores the publish needs), the fsync of
the file lagging (with ``appendfsync everysec`` Redis postpones its writes while the last fsync is
not done, then writes anyway and counts an ``aof_delayed_fsync``), or plain CPU starvation. So
`AofProbe` samples ``INFO persistence`` (and the server's CPU) every ``interval_s`` on a connection
of its own while a repeat is timed, and `AofProbe.summary` says, per repeat, how long a rewrite
overlapped it, how many fsyncs were delayed, how long the server took to answer INFO (a stalled main
thread answers late), and the CPU the server and its rewrite child used.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

FIELDS = ("aof_rewrite_in_progress", "aof_delayed_fsync", "aof_pending_bio_fsync", "aof_buffer_length",
          "aof_rewrite_buffer_length", "aof_current_size")


class AofProbe:
    """``async with AofProbe(client):`` around one timed repeat; then `summary`."""

    def __init__(self, client: Any, interval_s: float = 0.05) -> None:
        self.client, self.interval_s = client, interval_s
        self.samples: list[tuple[float, float, dict[str, Any]]] = []  # (at, INFO latency, persistence)
        self.cpu: list[dict[str, Any]] = []
        self.task: asyncio.Task[None] | None = None
        self.started = self.ended = 0.0
        self.load: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.client_cpu = 0.0

    async def __aenter__(self) -> AofProbe:
        self.cpu.append(await self.client.info("cpu"))
        self.load = os.getloadavg()
        self.client_cpu = _own_cpu()
        self.started = time.perf_counter()
        await self._sample()
        self.task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.ended = time.perf_counter()
        self.client_cpu = _own_cpu() - self.client_cpu
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self._sample()
        self.cpu.append(await self.client.info("cpu"))

    async def _sample(self) -> None:
        asked = time.perf_counter()
        info = await self.client.info("persistence")
        now = time.perf_counter()
        self.samples.append((now, now - asked, {k: int(info.get(k, 0)) for k in FIELDS}))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._sample()

    def summary(self) -> dict[str, Any]:
        """Per repeat: seconds a rewrite overlapped the window (and whether one was already running at
        its start), fsyncs delayed, the largest pending fsync / AOF buffers, the AOF's growth, the
        slowest INFO reply, the server's CPU seconds (main process; rewrite children) and this process's
        (publisher and followers), and the load average when it started."""
        first, last = self.samples[0][2], self.samples[-1][2]
        rewrite_s = 0.0
        for (at, _, info), (nxt, _, _) in zip(self.samples, self.samples[1:], strict=False):
            if info["aof_rewrite_in_progress"]:
                rewrite_s += nxt - at

        def cpu(key: str) -> float:
            return round(sum(float(c.get(f"{key}_{m}", 0.0)) * s for c, s in ((self.cpu[-1], 1), (self.cpu[0], -1))
                             for m in ("user", "sys")), 2)

        return {
            "s": round(self.ended - self.started, 3),
            "rewrite_overlap_s": round(rewrite_s, 2),
            "rewrite_at_start": bool(first["aof_rewrite_in_progress"]),
            "delayed_fsyncs": last["aof_delayed_fsync"] - first["aof_delayed_fsync"],
            "max_pending_fsync": max(s[2]["aof_pending_bio_fsync"] for s in self.samples),
            "max_aof_buffer_mb": round(max(s[2]["aof_buffer_length"] for s in self.samples) / 1e6, 1),
            "max_rewrite_buffer_mb": round(max(s[2]["aof_rewrite_buffer_length"] for s in self.samples) / 1e6, 1),
            "aof_growth_mb": round((last["aof_current_size"] - first["aof_current_size"]) / 1e6, 1),
            "max_info_s": round(max(s[1] for s in self.samples), 3),
            "server_cpu_s": cpu("used_cpu"),
            "children_cpu_s": cpu("used_cpu_children"),
            "client_cpu_s": round(self.client_cpu, 2),
            "load1": round(self.load[0], 2),
        }


def _own_cpu() -> float:
    """CPU seconds of this process (the publisher and the followers of the bench), all threads."""
    t = os.times()
    return t.user + t.system
