"""run_code and code_passes: limits that stop a program, a clean environment, no network, and a
process tree that is gone when the call returns. Each test runs programs of a second or two at most."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from fulmen.rewards import Limits, code_passes, run_code
from fulmen.rewards.sandbox import isolation, process

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs POSIX resource limits")
needs_namespaces = pytest.mark.skipif(not (os.name == "posix" and isolation().network),
                                      reason="no user and network namespaces here (unshare)")


def _alive_in(workdir: str) -> list[int]:
    """The processes whose working directory is ``workdir`` (the sandbox's, deleted after the run)."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd").startswith(workdir):
                    alive.append(int(entry))
            except OSError:
                continue
    return alive


def test_a_correct_solution_passes_its_tests() -> None:
    """Code and its assertions pass; a failing assertion does not, and says why."""
    code = "def add(a, b):\n    return a + b\n"
    passed = run_code(code, tests="assert add(2, 3) == 5\nprint('ok')")
    assert passed.passed and passed.exit_code == 0 and passed.stdout == "ok\n" and passed.killed_for is None
    failed = run_code(code, tests="assert add(2, 2) == 5")
    assert not failed.passed and failed.exit_code == 1 and "AssertionError" in failed.reason


def test_the_environment_is_clean_and_stdin_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """No FULMEN_* or API key variable reaches the program; it reads the stdin it is given."""
    monkeypatch.setenv("FULMEN_PROXY_API_KEY", "secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    result = run_code("import os, sys\nprint(sorted(os.environ))\nprint(sys.stdin.read()[::-1])", stdin="abc")
    assert result.passed
    names, reversed_input = result.stdout.splitlines()
    assert "FULMEN" not in names and "API_KEY" not in names and reversed_input == "cba"


def test_an_infinite_loop_is_stopped_at_the_timeout() -> None:
    """A loop that never ends is killed at timeout_s and reported as a timeout."""
    result = run_code("while True:\n    pass\n", timeout_s=1.0)
    assert result.timed_out and result.killed_for == "timeout" and not result.passed
    assert result.exit_code is None and result.reason == "stopped by the timeout limit"


def test_a_memory_hog_is_stopped() -> None:
    """An allocation over memory_mb fails, and the result names the memory limit."""
    result = run_code("blob = bytearray(1 << 30)\n", memory_mb=128)
    assert not result.passed and result.killed_for == "memory" and "MemoryError" in result.stderr


def test_an_output_flood_is_truncated_and_killed() -> None:
    """Output past output_bytes is cut there and the program killed."""
    result = run_code("while True:\n    print('x' * 1000)\n", output_bytes=10_000)
    assert result.killed_for == "output" and result.truncated and not result.passed
    assert len(result.stdout) + len(result.stderr) == 10_000


def test_a_large_file_is_refused() -> None:
    """Writing a file over file_mb fails, and the result names the file size limit."""
    result = run_code("open('big', 'wb').write(b'x' * (3 << 20))\n", file_mb=1)
    assert not result.passed and result.killed_for == "file_size"


@pytest.fixture
def listening() -> Iterator[int]:
    """A TCP server on this machine's loopback: reachable by anything that has the network."""
    server = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=lambda: [server.accept()[0].close() for _ in range(1)], daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()


CONNECT = "import socket, sys\nsocket.create_connection(('127.0.0.1', int(sys.stdin.read())), timeout=2)\nprint('connected')"


@needs_namespaces
def test_network_is_refused(listening: int) -> None:
    """In its network namespace the program cannot reach a server this machine listens on."""
    result = run_code(CONNECT, stdin=str(listening))
    assert not result.passed and result.network_isolated
    assert "OSError" in result.stderr and "connected" not in result.stdout


def test_without_isolation_the_result_says_so(monkeypatch: pytest.MonkeyPatch, listening: int) -> None:
    """Where namespaces are unavailable the program has the network, and the result says it was not isolated."""
    bare = dataclasses.replace(isolation(), prefix=(), network=False, notes=("no network isolation: test",))
    monkeypatch.setattr(process, "isolation", lambda: bare)
    result = run_code(CONNECT, stdin=str(listening))
    assert result.passed and result.stdout == "connected\n"
    assert not result.network_isolated and "no network isolation: test" in result.notes


@needs_namespaces
def test_a_fork_bomb_is_contained() -> None:
    """A fork bomb meets the process limit (the result says so); one that ignores the failures runs
    to the timeout; either way no process of it is left when run_code returns."""
    assert isolation().processes_contained
    bomb = "import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    os.fork()\n"
    result = run_code(bomb, timeout_s=2.0, processes=16)
    assert result.killed_for == "processes" and "Resource temporarily unavailable" in result.stderr
    assert _alive_in(result.stdout.splitlines()[0]) == []
    stubborn = "import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_code(stubborn, timeout_s=1.5, processes=16)
    assert result.timed_out
    assert _alive_in(result.stdout.splitlines()[0]) == []


def test_code_passes_scores_assertions_and_io_cases() -> None:
    """Assertions score 1 or 0; input/output cases score the share that match, naming the first miss."""
    square = "n = int(input())\nprint(n * n)\n"
    assert code_passes("def f(x):\n    return x * 2\n", "assert f(2) == 4") == 1.0
    assert code_passes("def f(x):\n    return x\n", "assert f(2) == 4") == 0.0
    cases = [{"input": "3\n", "output": "9\n"}, {"input": "4", "output": "16"}, {"input": "5", "output": "26"}]
    verdict = code_passes(square, cases, limits=Limits(timeout_s=5))
    assert verdict == pytest.approx(2 / 3) and "case 3" in verdict.reason
    assert code_passes("while True:\n    pass\n", cases[:1], limits=Limits(timeout_s=0.5)) == 0.0
