"""`math_equal`: whether a free-text answer holds the expected mathematical expression, whatever
form it is written in: "\\frac{1}{2}", "0.5" and "1/2"; "x^2+2x+1" and "(x+1)^2".

The answer's expression is the last ``\\boxed{}`` if it has one, else the whole text, else its last
``$...$``, else what follows "answer is", else its last number. Rational arithmetic is compared
exactly here (`rational`); anything else by sympy in a worker process, bounded in time (`symbolic`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from fulmen.rewards.expressions.latex import plain
from fulmen.rewards.expressions.parse import Node, ParseError, parse
from fulmen.rewards.expressions.rational import rational
from fulmen.rewards.expressions.symbolic import SYMBOLIC
from fulmen.rewards.numbers import NUMBER
from fulmen.rewards.text import exact
from fulmen.rewards.verdict import Verdict

_INLINE_MATH = re.compile(r"\$([^$]+)\$")
_ANSWER_IS = re.compile(r"answer(?: is)?\s*[:=]?\s*(.+?)\s*\.?\s*$", re.IGNORECASE | re.DOTALL)
MAX_ANSWER_CHARS = 100_000


def math_equal(answer: str | None, expected: str | float, *, timeout_s: float = 5.0) -> Verdict:
    """1.0 when ``answer`` holds an expression equal to ``expected``, else 0.0 (with why). A
    symbolic check over ``timeout_s`` scores 0.0 and says so. An expected answer that is no
    expression (a name, a choice "(B)") is compared as text, by `exact`."""
    try:
        target = parse(plain(str(expected)))
    except ParseError:
        verdict = exact(answer, str(expected))
        return Verdict(verdict, f"compared as text: {verdict.reason}")
    if answer is None:
        return Verdict(0.0, "no answer")
    tree = _expression_in(answer[-MAX_ANSWER_CHARS:])
    if tree is None:
        return Verdict(0.0, "no expression found in the answer")
    got, want = rational(tree), rational(target)
    if got is not None and want is not None:
        return Verdict.of(got == want, "equal" if got == want else f"{got} is not {want}")
    equal, why = SYMBOLIC.equal(tree, target, timeout_s)
    return Verdict.of(equal is True, why)


def _expression_in(answer: str) -> Node | None:
    for text in _candidates(answer):
        try:
            return parse(plain(text))
        except ParseError:
            continue
    return None


def _candidates(answer: str) -> Iterator[str]:
    boxed = _last_boxed(answer)
    if boxed is not None:
        yield boxed
        return
    yield answer
    inline = _INLINE_MATH.findall(answer)
    if inline:
        yield inline[-1]
    said = _ANSWER_IS.search(answer)
    if said:
        yield said.group(1)
    numbers = list(NUMBER.finditer(answer))
    if numbers:
        yield numbers[-1].group(0)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces matched), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1: i]
    return None
