"""Answers as text. `exact`: the answer equals the expected text (or one of several), after normalising both."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

from fulmen.rewards.verdict import Verdict

_SPACES = re.compile(r"\s+")
_EDGES = " \t\n\"'`.,;:!"


def normalised(text: str) -> str:
    """Unicode NFKC, case folded, whitespace collapsed, quotes and final punctuation trimmed."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _SPACES.sub(" ", text).strip(_EDGES)


def exact(answer: str | None, expected: str | Iterable[str], *, normalise: bool = True) -> Verdict:
    """1.0 when ``answer`` equals ``expected`` (or any of them, given several), else 0.0.
    ``normalise=False`` compares the texts exactly as they are."""
    options = [expected] if isinstance(expected, str) else list(expected)
    if answer is None:
        return Verdict(0.0, "no answer")
    prepare = normalised if normalise else (lambda text: text)
    got = prepare(answer)
    if any(got == prepare(option) for option in options):
        return Verdict(1.0, "matches")
    return Verdict(0.0, f"got {answer[:80]!r}, expected {options[0][:80]!r}" + (" or another" if len(options) > 1 else ""))
