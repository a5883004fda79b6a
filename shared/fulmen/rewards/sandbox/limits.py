"""The limits a sandboxed program runs under, and the resource limits (`setrlimit`) they become.

Used by `fulmen.rewards.sandbox.process`; what each limit protects against: docs/guides/rewards.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fulmen.errors import InvalidInput

MB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one run of untrusted code may use; the run is stopped when it asks for more."""

    timeout_s: float = 10.0  # wall clock; CPU time is limited to the same number of seconds
    memory_mb: int = 512  # address space of each process (RLIMIT_AS)
    output_bytes: int = 64 * 1024  # stdout and stderr together; the program is killed beyond it
    processes: int = 32  # processes and threads at once (RLIMIT_NPROC): a fork bomb stops there
    file_mb: int = 16  # the largest file the program may write (RLIMIT_FSIZE)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise InvalidInput(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        for name in ("memory_mb", "output_bytes", "processes", "file_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
        if self.memory_mb < 64:
            raise InvalidInput(f"memory_mb must be at least 64 (the interpreter alone needs about 30), got {self.memory_mb}")
        if self.processes < 4:
            raise InvalidInput(f"processes must be at least 4 (the sandbox's own take 2), got {self.processes}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """``resource`` limit name → (soft, hard), set in the sandbox before the program starts."""
        cpu_s = math.ceil(self.timeout_s)
        return {
            "RLIMIT_CPU": (cpu_s, cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
            "RLIMIT_AS": (self.memory_mb * MB, self.memory_mb * MB),
            "RLIMIT_NPROC": (self.processes, self.processes),
            "RLIMIT_FSIZE": (self.file_mb * MB, self.file_mb * MB),
            "RLIMIT_CORE": (0, 0),  # a crash writes no core file into the working directory
            "RLIMIT_NOFILE": (256, 256),
        }
