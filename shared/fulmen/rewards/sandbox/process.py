"""One run of untrusted Python: `run_code` runs it in a fresh directory under `Limits`, with a clean
environment and, where the machine allows it, no network (`fulmen.rewards.sandbox.isolation`); its
whole process tree is killed when the run ends, and the result says what stopped it. It contains
what model-written code does by mistake; it is no container (no seccomp, no mount namespace).
More: docs/guides/rewards.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fulmen.rewards.sandbox.isolation import Isolation, clean_environment, isolation
from fulmen.rewards.sandbox.limits import Limits

# The first stage in the child: the limits, then the program in a fresh interpreter (so its
# tracebacks and modules are its own). It runs before any of the program's code.
BOOT = (
    "import json, os, resource, sys\n"
    "for name, (soft, hard) in json.loads(sys.argv[1]).items():\n"
    "    resource.setrlimit(getattr(resource, name), (soft, hard))\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-B', *sys.argv[2:]])\n"
)
PROGRAM = "main.py"
STDIN = ".stdin"
# After the program exits, how long its output may still take to arrive (a child of it that holds
# the pipes open is killed then, with the rest of the tree).
DRAIN_S = 0.2
POLL_S = 0.05
READ_BYTES = 1 << 16
KILL_WAIT_S = 5.0  # for a namespace of processes to die (a fork bomb's take milliseconds)

# The last line of a Python traceback that tells which limit the kernel enforced.
_LIMIT_ERRORS = (
    ("MemoryError", "memory"),
    ("[Errno 12]", "memory"),  # ENOMEM: a mapping, a fork or a thread refused under RLIMIT_AS
    ("BlockingIOError: [Errno 11]", "processes"),  # EAGAIN from fork under RLIMIT_NPROC
    ("can't start new thread", "processes"),
    ("[Errno 27]", "file_size"),  # EFBIG under RLIMIT_FSIZE (Python ignores SIGXFSZ)
)


@dataclass(frozen=True)
class CodeResult:
    """How one run ended. ``killed_for`` names the limit that stopped it: "timeout" (wall clock),
    "output" (the harness killed it), "cpu" (the kernel did), or "memory", "processes", "file_size"
    (the kernel refused, the program failed: read from its last error line, so a program may fake
    these); None when no limit was met."""

    passed: bool  # exit code 0 and no limit met
    exit_code: int | None  # negative: the signal that ended it; None: killed by the harness
    timed_out: bool
    killed_for: str | None
    stdout: str
    stderr: str
    truncated: bool  # the output went over ``output_bytes`` and was cut there
    seconds: float
    network_isolated: bool  # False: this machine could not isolate it (see ``notes``)
    notes: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """One line for people: passed, or what went wrong."""
        if self.passed:
            return "passed"
        if self.killed_for is not None:
            return f"stopped by the {self.killed_for} limit"
        lines = self.stderr.strip().splitlines()
        return f"exit code {self.exit_code}" + (f": {lines[-1][:200]}" if lines else "")


def program_text(code: str, tests: str | None) -> str:
    """The program: the code, then the tests (assertions that exit non-zero when they fail)."""
    return code if not tests else f"{code}\n\n# --- tests ---\n{tests}\n"


def run_code(
    code: str,
    *,
    tests: str | None = None,
    stdin: str | None = None,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    output_bytes: int = 64 * 1024,
    processes: int = 32,
    file_mb: int = 16,
) -> CodeResult:
    """Run untrusted Python ``code`` (then ``tests``, Python appended after it) with ``stdin`` as its
    input, under the limits; `CodeResult.passed` when it exits 0 within them. Blocks for up to
    ``timeout_s``: from async code, `run_code_async`."""
    limits = Limits(timeout_s, memory_mb, output_bytes, processes, file_mb)
    return run_program(program_text(code, tests), stdin, limits)


async def run_code_async(code: str, **options: object) -> CodeResult:
    """`run_code` in a worker thread, for async agents (the event loop goes on meanwhile)."""
    return await asyncio.to_thread(run_code, code, **options)  # type: ignore[arg-type]


def run_program(source: str, stdin: str | None, limits: Limits) -> CodeResult:
    """`run_code`'s work, with the program's source and the limits made."""
    where = isolation()
    workdir = tempfile.mkdtemp(prefix="fulmen-code-")
    try:
        _prepare(Path(workdir), source, stdin, where)
        command = [*where.prefix, where.python, "-I", "-c", BOOT, json.dumps(limits.rlimits()), PROGRAM]
        start = time.monotonic()
        with open(Path(workdir) / STDIN, "rb") as stdin_file:
            child = subprocess.Popen(command, cwd=workdir, env=clean_environment(workdir), stdin=stdin_file,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     **where.popen_user())
        try:
            output = _collect(child, limits, start + limits.timeout_s)
        finally:
            _kill_tree(child, where)
        return _result(child.returncode, output, time.monotonic() - start, where)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _prepare(workdir: Path, source: str, stdin: str | None, where: Isolation) -> None:
    """The program and its input in the working directory, which the sandbox user owns."""
    (workdir / PROGRAM).write_text(source, encoding="utf-8")
    (workdir / STDIN).write_text(stdin or "", encoding="utf-8")
    if where.user is not None:
        for path in (workdir, workdir / PROGRAM):
            os.chown(path, *where.user)


@dataclass
class _Output:
    stdout: bytearray
    stderr: bytearray
    total: int = 0
    killed_for: str | None = None


def _collect(child: subprocess.Popen[bytes], limits: Limits, deadline: float) -> _Output:
    """Read stdout and stderr until both close, the deadline passes or the output goes over its limit;
    a program that exited while something it started still holds the pipes is waited for `DRAIN_S`."""
    assert child.stdout is not None and child.stderr is not None
    output = _Output(bytearray(), bytearray())
    buffers = {child.stdout.fileno(): output.stdout, child.stderr.fileno(): output.stderr}
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                output.killed_for = "timeout"
                break
            if exited_at is None and child.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_S:
                break
            for key, _ in selector.select(min(deadline - now, POLL_S)):
                chunk = _read(key.fd)
                if chunk is None:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                room = limits.output_bytes - output.total
                buffers[key.fd] += chunk[: max(room, 0)]
                output.total += len(chunk)
                if output.total > limits.output_bytes:
                    output.killed_for = "output"
                    return output
    return output


def _read(fd: int) -> bytes | None:
    try:
        return os.read(fd, READ_BYTES)
    except BlockingIOError:
        return None


def _kill_tree(child: subprocess.Popen[bytes], where: Isolation) -> None:
    """Kill everything the program started, and return only once it is gone.

    In a PID namespace: SIGKILL its first process; the kernel kills every other process in the
    namespace and that first one exits last, when the namespace is empty; ``unshare``, which waits for
    it, exits then. Without one: SIGKILL the process group (a process that left it is not found)."""
    if where.prefix:
        for pid in _children(child.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(KILL_WAIT_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    for stream in (child.stdout, child.stderr):
        if stream is not None:
            stream.close()


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _result(returncode: int, output: _Output, seconds: float, where: Isolation) -> CodeResult:
    stderr = output.stderr.decode("utf-8", errors="replace")
    killed_for = output.killed_for
    harness_killed = killed_for is not None
    if killed_for is None and returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        killed_for = "cpu"  # SIGXCPU at the soft CPU limit, SIGKILL at the hard one
    elif killed_for is None and returncode != 0:
        killed_for = _limit_in(stderr)
    return CodeResult(
        passed=returncode == 0 and killed_for is None,
        exit_code=None if harness_killed else returncode,
        timed_out=killed_for == "timeout",
        killed_for=killed_for,
        stdout=output.stdout.decode("utf-8", errors="replace"),
        stderr=stderr,
        truncated=output.total > len(output.stdout) + len(output.stderr),
        seconds=seconds,
        network_isolated=where.network,
        notes=where.notes,
    )


def _limit_in(stderr: str) -> str | None:
    lines = stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    return next((limit for marker, limit in _LIMIT_ERRORS if marker in last), None)
