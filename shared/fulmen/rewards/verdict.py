"""`Verdict`: what every verifier returns, a float in [0, 1] that also says why.

It is a float: an agent returns it as its reward as it is (``return fulmen.rewards.text(...)``).
"""

from __future__ import annotations

import math

from fulmen.errors import InvalidInput


class Verdict(float):
    """A score in [0, 1] (a float) with its ``reason``: ``Verdict(1.0, "matches")``."""

    __slots__ = ("reason",)
    reason: str

    def __new__(cls, score: float, reason: str = "") -> Verdict:
        value = float(score)
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise InvalidInput(f"a verdict's score is in [0, 1], got {score!r}")
        verdict = super().__new__(cls, value)
        verdict.reason = reason
        return verdict

    def __repr__(self) -> str:
        return f"Verdict({float(self)!r}, {self.reason!r})"

    @classmethod
    def of(cls, ok: bool, reason: str) -> Verdict:
        """1.0 or 0.0."""
        return cls(1.0 if ok else 0.0, reason)
