"""The exact value of a tree (`fulmen.rewards.expressions.parse`) made of numbers and arithmetic
only, with `fractions.Fraction`: "1/2", "0.5" and "\\frac{1}{2}" compared without sympy, at once.
None for anything else (a symbol, a root, a power too large to compute here)."""

from __future__ import annotations

import math
from fractions import Fraction

from fulmen.rewards.expressions.parse import Node

MAX_POWER_BITS = 100_000  # a power whose result would be larger is left to the bounded symbolic check
MAX_FACTORIAL = 1000


def rational(node: Node) -> Fraction | None:
    """The value, or None when the tree is not rational arithmetic (or too large to compute here)."""
    kind = node[0]
    if kind == "n":
        return Fraction(node[1])
    if kind == "-":
        value = rational(node[1])
        return None if value is None else -value
    if kind == "!":
        value = rational(node[1])
        if value is None or value.denominator != 1 or not 0 <= value <= MAX_FACTORIAL:
            return None
        return Fraction(math.factorial(int(value)))
    if kind not in ("+", "*", "/", "^"):
        return None
    left, right = rational(node[1]), rational(node[2])
    if left is None or right is None:
        return None
    if kind == "+":
        return left + right
    if kind == "*":
        return left * right
    if kind == "/":
        return None if right == 0 else left / right
    return _power(left, right)


def _power(base: Fraction, exponent: Fraction) -> Fraction | None:
    if exponent.denominator != 1 or (base == 0 and exponent < 0):
        return None  # a root, or 0 to a negative power: the symbolic check says what it is
    size = max(base.numerator.bit_length(), base.denominator.bit_length(), 1)
    if size * abs(exponent.numerator) > MAX_POWER_BITS:
        return None
    return base ** int(exponent)
