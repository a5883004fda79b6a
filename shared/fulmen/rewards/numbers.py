"""`numeric`: the last number written in a free-text answer, compared with the expected one within a
tolerance. Numbers as people write them: "1,000", "-2.5e3", "3/4", ".5"; a comma separates thousands
only in groups of three ("1,2" is two numbers).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from fulmen.errors import InvalidInput
from fulmen.rewards.verdict import Verdict

# An integer part (thousands grouped by commas, or plain digits), a fraction part, an exponent, and
# an optional "/denominator" (an integer). Not preceded by a letter or digit: "x2" holds no number.
NUMBER = re.compile(
    r"(?<![\w.])(?P<number>[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+−]?\.\d+(?:[eE][-+]?\d+)?)"
    r"(?:\s*/\s*(?P<denominator>\d+)(?![\d.]))?"
)
_EXPONENT = re.compile(r"[eE]([-+]?\d+)")
MAX_EXPONENT = 400
MAX_TEXT_CHARS = 100_000  # the tail of a longer answer is searched (the last number is near its end)


def numbers_in(text: str) -> list[Fraction]:
    """Every number in ``text``, in order, exactly (a decimal as the fraction it writes)."""
    found = []
    for match in NUMBER.finditer(text[-MAX_TEXT_CHARS:]):
        number = match.group("number").replace(",", "").replace("−", "-")
        exponent = _EXPONENT.search(number)
        if exponent and abs(int(exponent.group(1))) > MAX_EXPONENT:
            continue  # Fraction would build a 10**exponent integer: "1e999999999" is not an answer
        try:
            value = Fraction(number)
            if match.group("denominator"):
                denominator = int(match.group("denominator"))
                value = value / denominator if denominator else value
        except (ValueError, ZeroDivisionError, OverflowError):
            continue
        found.append(value)
    return found


def last_number(text: str | None) -> Fraction | None:
    """The last number in ``text``, or None."""
    found = numbers_in(text or "")
    return found[-1] if found else None


def numeric(answer: str | None, expected: float | str | Fraction, *, rel_tol: float = 1e-6,
            abs_tol: float = 1e-9) -> Verdict:
    """1.0 when the last number in ``answer`` is ``expected`` within ``rel_tol`` (relative) or
    ``abs_tol`` (absolute), as `math.isclose` compares; else 0.0."""
    target = _expected(expected)
    got = last_number(answer)
    if got is None:
        return Verdict(0.0, "no number in the answer")
    if got == target or math.isclose(_float(got), _float(target), rel_tol=rel_tol, abs_tol=abs_tol):
        return Verdict(1.0, f"{_show(got)} equals {_show(target)}")
    return Verdict(0.0, f"{_show(got)} is not {_show(target)}")


def _expected(expected: float | str | Fraction) -> Fraction:
    if isinstance(expected, bool):
        raise InvalidInput("the expected number is a number or a numeric string, got a bool")
    if isinstance(expected, str):
        value = last_number(expected)
        if value is None or NUMBER.fullmatch(expected.strip()) is None:
            raise InvalidInput(f"the expected answer {expected!r} is not one number")
        return value
    if isinstance(expected, float) and not math.isfinite(expected):
        raise InvalidInput(f"the expected number must be finite, got {expected}")
    return Fraction(expected)


def _float(value: Fraction) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.copysign(math.inf, value)


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):g}"
