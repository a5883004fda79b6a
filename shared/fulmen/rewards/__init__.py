"""Rewards an agent computes: verifiers that score an answer in [0, 1] (`exact`, `numeric`,
`math_equal`, `json_schema`, `code_passes`), untrusted code run under limits (`run_code`), and an LLM
judge of a group of trajectories (`judge`). Every verifier returns a `Verdict`: a float (return it as
the reward) with its ``reason``. Guide: docs/guides/rewards.md.
"""

from fulmen.rewards.expressions import math_equal
from fulmen.rewards.judging import DEFAULT_RUBRIC, JudgeError, judge
from fulmen.rewards.numbers import numeric
from fulmen.rewards.sandbox import (
    CodeResult,
    Limits,
    code_passes,
    code_passes_async,
    run_code,
    run_code_async,
)
from fulmen.rewards.schema import json_schema
from fulmen.rewards.text import exact
from fulmen.rewards.verdict import Verdict

__all__ = [
    "DEFAULT_RUBRIC",
    "CodeResult",
    "JudgeError",
    "Limits",
    "Verdict",
    "code_passes",
    "code_passes_async",
    "exact",
    "json_schema",
    "judge",
    "math_equal",
    "numeric",
    "run_code",
    "run_code_async",
]
