"""What this machine offers to isolate untrusted code, found once per process: namespaces
(``unshare``: no network, its own process tree, its own process count), the user it runs as, the
interpreter that runs it. Whatever is missing is said in `Isolation.notes`, never assumed.

Used by `fulmen.rewards.sandbox.process`; the limits: docs/guides/rewards.md.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

# A user namespace mapping the caller to root inside (unprivileged callers may create one), with an
# empty network namespace (only a loopback, down) and its own PID namespace: when its first process
# dies the kernel kills every other one, wherever it moved to (setsid escapes a process group, not
# this). A process count (RLIMIT_NPROC) set inside counts this namespace's processes only.
UNSHARE_ARGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
NOBODY = 65534
PROBE_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Isolation:
    """How programs run here; `fulmen.rewards.sandbox.process` builds each command from it."""

    prefix: tuple[str, ...]  # the command that puts a program in its namespaces (empty: none)
    python: str  # the interpreter that runs the program
    user: tuple[int, int] | None  # (uid, gid) it runs as when the caller is root; None: the caller's
    network: bool  # True only when the program has no network at all
    processes_contained: bool  # True when the process limit binds (it does not bind root)
    notes: tuple[str, ...] = ()  # what is missing, and why

    def popen_user(self) -> dict[str, Any]:
        """``subprocess.Popen`` arguments that switch to the sandbox user (in the child, before exec)."""
        if self.user is None:
            return {}
        return {"user": self.user[0], "group": self.user[1], "extra_groups": []}


def clean_environment(home: str) -> dict[str, str]:
    """The program's whole environment: no FULMEN_*, no API key, nothing of the caller's."""
    return {"PATH": SANDBOX_PATH, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


@functools.cache
def isolation() -> Isolation:
    """Found on first use (a few short probe processes), then the same for the process's life."""
    if os.name != "posix":
        raise NotImplementedError("running untrusted code needs a POSIX system (resource limits)")
    notes: list[str] = []
    user = _sandbox_user() if os.geteuid() == 0 else None
    python = sys.executable
    if user is not None:
        python, user = _python_for(user, notes)
    contained = user is not None or os.geteuid() != 0
    if not contained:
        notes.append("the program runs as root, whom RLIMIT_NPROC does not bind: a fork bomb is not contained")
    prefix: tuple[str, ...] = ()
    if sys.platform != "linux":
        failure: str | None = f"Linux namespaces only, this is {sys.platform}"
    elif (unshare := shutil.which("unshare", path=SANDBOX_PATH)) is None:
        failure = "`unshare` (util-linux) not found"
    else:
        prefix = (unshare, *UNSHARE_ARGS)
        failure = _probe([*prefix, python, "-I", "-c", "pass"], user)
    if failure is None:
        return Isolation(prefix, python, user, True, contained, tuple(notes))
    notes.append(f"no network isolation: {failure}")
    if contained:
        notes.append("without a user namespace the process limit counts every process of the sandbox's user")
    return Isolation((), python, user, False, contained, tuple(notes))


def _sandbox_user() -> tuple[int, int]:
    """Root's programs run as nobody: root ignores RLIMIT_NPROC and may write anywhere."""
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return NOBODY, NOBODY


def _python_for(user: tuple[int, int], notes: list[str]) -> tuple[str, tuple[int, int] | None]:
    """This interpreter if the sandbox user can run it (one installed under /root cannot), else the
    system's python3, else root's own (said in the notes)."""
    if _probe([sys.executable, "-I", "-c", "pass"], user) is None:
        return sys.executable, user
    system = shutil.which("python3", path=SANDBOX_PATH)
    if system is not None and _probe([system, "-I", "-c", "pass"], user) is None:
        notes.append(f"{sys.executable} cannot be run by uid {user[0]}: programs run with {system} "
                     "(the standard library, not this environment's packages)")
        return system, user
    notes.append(f"no interpreter uid {user[0]} can run: programs run as root")
    return sys.executable, None


def _probe(command: list[str], user: tuple[int, int] | None) -> str | None:
    """None when ``command`` runs and exits 0 (as ``user``), else why not."""
    extra = {} if user is None else {"user": user[0], "group": user[1], "extra_groups": []}
    try:
        done = subprocess.run(command, env=clean_environment("/"), cwd="/", stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=PROBE_TIMEOUT_S, check=False, **extra)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if done.returncode != 0:
        return done.stderr.decode(errors="replace").strip()[-200:] or f"exit code {done.returncode}"
    return None
