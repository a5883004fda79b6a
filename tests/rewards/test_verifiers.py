"""The verifiers: exact, numeric, math_equal, json_schema, and the Verdict they return."""

from __future__ import annotations

import pytest

from fulmen.errors import InvalidInput
from fulmen.rewards import Verdict, exact, json_schema, math_equal, numeric
from fulmen.sdk.emit import check_reward


def test_verdict_is_a_float_reward_with_a_reason() -> None:
    """A Verdict is accepted as a reward as it is, keeps its reason, and refuses scores outside [0, 1]."""
    verdict = Verdict(0.5, "half")
    assert check_reward(verdict) == 0.5 and type(check_reward(verdict)) is float
    assert verdict.reason == "half" and "half" in repr(verdict)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(InvalidInput):
            Verdict(bad)


def test_exact_normalises_unless_told_not_to() -> None:
    """Case, spacing, quotes and a final period are ignored; normalise=False compares as is."""
    assert exact("  The  Eiffel Tower. ", "the eiffel tower") == 1.0
    assert exact("Rome", ["Paris", "rome"]) == 1.0
    assert exact("Lyon", "Paris") == 0.0 and "Lyon" in exact("Lyon", "Paris").reason
    assert exact("Paris", "paris", normalise=False) == 0.0
    assert exact(None, "x") == 0.0


@pytest.mark.parametrize(("answer", "expected"), [
    ("The total is 1,000 apples.", 1000), ("3/4", 0.75), ("so x = -2.5e3", -2500), ("first 7, then 12", 12),
    (".5", "0.5"), ("−3", -3), ("1 / 3", "1/3"),
])
def test_numeric_reads_the_last_number(answer: str, expected: float | str) -> None:
    """Thousands separators, fractions, exponents and signs are read; the last number counts."""
    assert numeric(answer, expected) == 1.0


def test_numeric_tolerances_and_misses() -> None:
    """rel_tol / abs_tol widen the match; no number, or a different one, scores 0 with the reason."""
    assert numeric("3.14", 3.14159) == 0.0
    assert numeric("3.14", 3.14159, rel_tol=1e-3) == 1.0
    assert numeric("0.0000001", 0, abs_tol=1e-6) == 1.0
    assert numeric("no idea", 4).reason == "no number in the answer"
    assert numeric("1,2", 12) == 0.0  # a comma groups thousands only by three
    assert numeric("1e999999999 or 5", 5) == 1.0  # an absurd exponent is skipped, not computed
    with pytest.raises(InvalidInput):
        numeric("4", "four")


@pytest.mark.parametrize(("answer", "expected"), [
    ("\\frac{1}{2}", "0.5"), ("1/2", "\\frac12"), ("0.5", "1/2"),
    ("x^2+2x+1", "(x+1)^2"), ("The answer is $\\boxed{\\frac{\\sqrt{2}}{2}}$.", "1/sqrt(2)"),
    ("\\sin^2 x + \\cos^2 x", "1"), ("x = 3", "3"), ("so the answer is 1,000.", "1000"),
    ("\\sqrt[3]{8}", "2"), ("2\\pi r", "r \\cdot 2\\pi"),
])
def test_math_equal_accepts_equivalent_forms(answer: str, expected: str) -> None:
    """Fractions, decimals, LaTeX, expanded and factored forms, boxed answers are compared by value."""
    assert math_equal(answer, expected) == 1.0


def test_math_equal_refuses_different_values_and_words() -> None:
    """A different expression scores 0; prose holds no expression; an expected name is compared as text."""
    assert math_equal("2x", "x + x + 1") == 0.0
    assert math_equal("1/3", "0.333") == 0.0
    assert math_equal("I have no idea", "(x+1)^2").reason == "no expression found in the answer"
    assert math_equal("Paris", "Paris") == 1.0 and "text" in math_equal("Paris", "Paris").reason
    assert math_equal("__import__('os').system('true')", "0") == 0.0  # read, never evaluated


def test_math_equal_is_bounded_in_time() -> None:
    """An expression sympy cannot finish with scores 0 with the reason, after the timeout."""
    verdict = math_equal("9^9^9^9", "1", timeout_s=1.0)
    assert verdict == 0.0 and "took over 1 s" in verdict.reason
    assert math_equal("(x+1)^2", "x^2+2x+1") == 1.0  # the next check gets a fresh worker


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


def test_json_schema_finds_and_validates_the_json() -> None:
    """The JSON is found bare, fenced or inside prose; the first error is the reason."""
    assert json_schema('{"name": "Ada", "age": 36}', SCHEMA) == 1.0
    assert json_schema('Here it is:\n```json\n{"name": "Ada", "age": 36}\n```', SCHEMA) == 1.0
    assert json_schema('Sure: {"name": "Ada", "age": 36} done', SCHEMA) == 1.0
    low = json_schema('{"name": "Ada", "age": -1}', SCHEMA)
    assert low == 0.0 and "age" in low.reason and "minimum" in low.reason
    assert json_schema('{"name": "Ada"}', SCHEMA) == 0.0
    assert json_schema("no json here", SCHEMA).reason == "no JSON object or array in the answer"
    assert json_schema("[" * 100_000, SCHEMA) == 0.0
    with pytest.raises(InvalidInput, match="schema is not valid"):
        json_schema("{}", {"type": "no such type"})
