"""Mathematical answers compared: `math_equal`. Text → tree (`parse`, after `latex.plain`), exact
rational arithmetic (`rational`), and sympy in a worker process for the rest (`symbolic`)."""

from fulmen.rewards.expressions.equal import math_equal
from fulmen.rewards.expressions.parse import ParseError, parse

__all__ = ["ParseError", "math_equal", "parse"]
