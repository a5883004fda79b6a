"""`code_passes`: the verifier over `run_code`: a program scored by its tests, either Python
assertions run after it or input/output cases (its stdout for each stdin, compared line by line).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from fulmen.errors import InvalidInput
from fulmen.rewards.sandbox.limits import Limits
from fulmen.rewards.sandbox.process import CodeResult, program_text, run_program
from fulmen.rewards.verdict import Verdict

Tests = str | Sequence[Mapping[str, str]]


def code_passes(code: str, tests: Tests, *, limits: Limits | None = None) -> Verdict:
    """Score ``code`` by ``tests``, each run in the sandbox under ``limits`` (`Limits()` by default).

    ``tests`` is Python (assertions; 1.0 when the program with them exits 0) or a list of cases
    ``{"input": ..., "output": ...}``: the score is the share of cases whose stdout equals the
    expected output (trailing whitespace of each line and trailing blank lines ignored)."""
    limits = limits or Limits()
    if isinstance(tests, str):
        result = run_program(program_text(code, tests), None, limits)
        return Verdict.of(result.passed, _why(result))
    cases = _cases(tests)
    failures = []
    for i, (stdin, expected) in enumerate(cases):
        result = run_program(code, stdin, limits)
        if not result.passed:
            failures.append(f"case {i + 1}: {_why(result)}")
        elif _lines(result.stdout) != _lines(expected):
            failures.append(f"case {i + 1}: wrong output {result.stdout[:80]!r}, expected {expected[:80]!r}")
    passed = len(cases) - len(failures)
    reason = f"{passed}/{len(cases)} cases passed" + (f"; first failure: {failures[0]}" if failures else "")
    return Verdict(passed / len(cases), reason)


async def code_passes_async(code: str, tests: Tests, *, limits: Limits | None = None) -> Verdict:
    """`code_passes` in a worker thread, for async agents."""
    return await asyncio.to_thread(code_passes, code, tests, limits=limits)


def _cases(tests: Any) -> list[tuple[str, str]]:
    if not isinstance(tests, Sequence) or not tests:
        raise InvalidInput("tests must be Python source or a non-empty list of {'input': ..., 'output': ...}")
    cases = []
    for case in tests:
        if not isinstance(case, Mapping) or not isinstance(case.get("output"), str):
            raise InvalidInput(f"a test case is {{'input': str, 'output': str}}, got {case!r}"[:200])
        stdin = case.get("input", "")
        if not isinstance(stdin, str):
            raise InvalidInput(f"a test case's input is a string, got {type(stdin).__name__}")
        cases.append((stdin, case["output"]))
    return cases


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _why(result: CodeResult) -> str:
    return "passed" if result.passed else result.reason
