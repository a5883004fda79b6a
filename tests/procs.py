"""Stopping the service processes a test started, so none outlives it."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence
from typing import Any


def stop(procs: Sequence[subprocess.Popen[Any]], kill: Sequence[subprocess.Popen[Any]] = (),
         timeout_s: float = 15.0) -> None:
    """SIGTERM each still running (SIGKILL those in ``kill``: their clean exit is not under test and
    takes long); any that has not exited ``timeout_s`` later is killed."""
    for p in kill:
        if p.poll() is None:
            p.kill()
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
