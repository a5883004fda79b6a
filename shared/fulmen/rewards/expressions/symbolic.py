"""Whether two trees (`fulmen.rewards.expressions.parse`) are the same expression, by sympy in a
worker process, so each check is bounded in time (sympy cannot be interrupted in a thread, and
``simplify`` or ``9^9^9`` can run for ever): a check over its time kills the worker, the next starts
another. The worker reads ``{"a": tree, "b": tree}`` lines and answers ``{"equal", "why"}`` lines; it
builds sympy objects from the trees itself, so no text reaches sympy's parser (which calls ``eval``).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from typing import Any

from fulmen.rewards.expressions.parse import Node

STARTUP_S = 60.0  # importing sympy on a loaded machine
WORKER_MEMORY_MB = 2048
READY = "ready"


class Symbolic:
    """The worker process, started on first use; checks from several threads wait for each other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = b""

    def equal(self, a: Node, b: Node, timeout_s: float) -> tuple[bool | None, str]:
        """(True | False | None for "could not tell", why)."""
        with self._lock:
            try:
                process = self._started()
            except (OSError, TimeoutError, ValueError) as e:
                self.stop()
                return None, f"the symbolic check could not start: {e}"
            assert process.stdin is not None
            process.stdin.write(json.dumps({"a": a, "b": b}).encode() + b"\n")
            process.stdin.flush()
            try:
                answer = json.loads(self._line(time.monotonic() + timeout_s))
            except (TimeoutError, ValueError):
                self.stop()
                return None, f"the symbolic check took over {timeout_s:g} s"
            return answer.get("equal"), str(answer.get("why", ""))

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._buffer = b""
        self._process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        line = self._line(time.monotonic() + STARTUP_S)
        if line != READY:
            raise ValueError(line[:200] or "the worker ended")
        return self._process

    def _line(self, deadline: float) -> str:
        """The worker's next line, or TimeoutError at ``deadline``."""
        assert self._process is not None and self._process.stdout is not None
        fd = self._process.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    raise TimeoutError
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise ValueError("the worker ended")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for stream in (self._process.stdin, self._process.stdout):
                if stream is not None:
                    stream.close()
            self._process = None


SYMBOLIC = Symbolic()
atexit.register(SYMBOLIC.stop)


# --- the worker ---------------------------------------------------------------------------------


def build(node: Node, sympy: Any) -> Any:
    """The sympy object of a tree (the worker's side)."""
    kind = node[0]
    if kind == "n":
        numerator, _, denominator = node[1].partition("/")
        return sympy.Rational(int(numerator), int(denominator or 1))
    if kind == "s":
        return sympy.Symbol(node[1])
    if kind == "c":
        return {"pi": sympy.pi, "e": sympy.E, "oo": sympy.oo}[node[1]]
    if kind == "f":
        functions = {"sqrt": sympy.sqrt, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "log": sympy.log,
                     "ln": sympy.log, "exp": sympy.exp, "abs": sympy.Abs, "asin": sympy.asin, "acos": sympy.acos,
                     "atan": sympy.atan}
        return functions[node[1]](build(node[2], sympy))
    if kind == "-":
        return -build(node[1], sympy)
    if kind == "!":
        return sympy.factorial(build(node[1], sympy))
    left, right = build(node[1], sympy), build(node[2], sympy)
    operations = {"+": lambda: left + right, "*": lambda: left * right, "/": lambda: left / right,
                  "^": lambda: left ** right}
    return operations[kind]()


def same(a: Any, b: Any, sympy: Any) -> tuple[bool | None, str]:
    difference = a - b
    if difference == 0 or sympy.expand(difference) == 0:
        return True, "equal"
    if sympy.simplify(difference) == 0:
        return True, "equal after simplifying"
    equals = difference.equals(0)  # numeric evaluation at random points when simplify cannot tell
    if equals is None:
        return None, "sympy could not tell"
    return bool(equals), "equal" if equals else "different"


def main() -> None:
    import resource

    limit = WORKER_MEMORY_MB << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        import sympy
    except ImportError:
        print("math_equal needs sympy: pip install 'fulmen[rewards]'", flush=True)  # instead of READY
        return
    print(READY, flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            equal, why = same(build(request["a"], sympy), build(request["b"], sympy), sympy)
        except (ValueError, TypeError, KeyError, ArithmeticError, MemoryError, RecursionError) as e:
            equal, why = None, f"{type(e).__name__}: {e}"[:200]
        print(json.dumps({"equal": equal, "why": why}), flush=True)


if __name__ == "__main__":
    main()
