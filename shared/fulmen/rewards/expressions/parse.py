"""Expression text → a small tree of JSON lists, by a recursive-descent parser: no ``eval`` of
anything, no sympy. ``x^2+2x+1`` → ``["+", ["+", ["^", ["s", "x"], ["n", "2"]], ...], ["n", "1"]]``.

Nodes: ``["n", "p/q"]`` a number (exact), ``["s", name]`` a symbol, ``["c", name]`` a constant (pi,
e, oo), ``["f", name, arg]`` a function, ``["+", a, b]``, ``["*", a, b]``, ``["/", a, b]``,
``["^", a, b]``, ``["-", a]`` (negation), ``["!", a]``. Bounded: `MAX_CHARS`, `MAX_DEPTH`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

Node = list[Any]
MAX_CHARS = 1000
MAX_DEPTH = 100

FUNCTIONS = frozenset({"sqrt", "sin", "cos", "tan", "log", "ln", "exp", "abs", "asin", "acos", "atan"})
CONSTANTS = {"pi": "pi", "e": "e", "oo": "oo", "inf": "oo", "infty": "oo", "infinity": "oo"}
GREEK = frozenset({"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
                   "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi",
                   "chi", "psi", "omega"})
_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d{1,3}(?!\d))?|\.\d+(?:[eE][-+]?\d{1,3}(?!\d))?)"
    r"|(?P<name>[A-Za-z]+(?:_\{?[A-Za-z0-9]+\}?)?)|(?P<op>\*\*|[-+*/^()!=]))"
)
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d,])")
_UNICODE = str.maketrans({"−": "-", "×": "*", "·": "*", "÷": "/", "π": "pi", "√": "sqrt", "∞": "oo", "–": "-"})
_STARTS_ATOM = frozenset({"number", "name", "("})


class ParseError(ValueError):
    """The text is not an expression this parser reads (the message says what it met)."""


def parse(text: str) -> Node:
    """The tree of ``text``; ``x = 5`` (one symbol on the left) is read as ``5``."""
    text = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text.translate(_UNICODE)).strip().rstrip(".")
    if not text:
        raise ParseError("empty")
    if len(text) > MAX_CHARS:
        raise ParseError(f"over {MAX_CHARS} characters")
    parser = _Parser(_tokens(text))
    tree = parser.expression()
    if parser.peek() == "=" and tree[0] == "s":
        parser.take()
        tree = parser.expression()
    if parser.peek() is not None:
        raise ParseError(f"unexpected {parser.peek()!r}")
    return tree


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        if text[position:].isspace():
            break
        match = _TOKEN.match(text, position)
        if match is None:
            raise ParseError(f"cannot read {text[position:position + 12]!r}")
        position = match.end()
        kind = match.lastgroup or "op"
        value = match.group(kind)
        if kind == "name":
            tokens += _names(value)
        else:
            tokens.append((kind if kind == "number" else value, value))
    return tokens


def _names(name: str) -> list[tuple[str, str]]:
    """A name as tokens: a function, a constant, a Greek letter, a subscripted symbol, or letters
    written together (``xy`` is x times y); a longer word is not an expression."""
    lowered = name.lower()
    if lowered in FUNCTIONS or lowered in CONSTANTS:
        return [("name", lowered)]
    if name in GREEK or len(name) == 1 or "_" in name:
        return [("name", name.replace("{", "").replace("}", ""))]
    if len(name) <= 3:
        return [("name", letter) for letter in name]
    raise ParseError(f"the word {name!r}")


class _Parser:
    """expression := term (("+" | "-") term)*; term := unary (("*" | "/" | nothing) unary)*;
    unary := ("-" | "+") unary | power; power := postfix ("^" unary)?; postfix := atom "!"*"""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens = tokens
        self.at = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.at][0] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.at >= len(self.tokens):
            raise ParseError("ends too early")
        self.at += 1
        return self.tokens[self.at - 1]

    def expression(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError(f"nested over {MAX_DEPTH} deep")
        tree = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[0]
            right = self.term()
            tree = ["+", tree, right if op == "+" else ["-", right]]
        self.depth -= 1
        return tree

    def term(self) -> Node:
        tree = self.unary()
        while self.peek() in ("*", "/") or self.peek() in _STARTS_ATOM:
            op = self.take()[0] if self.peek() in ("*", "/") else "*"
            tree = [op, tree, self.unary()]
        return tree

    def unary(self) -> Node:
        if self.peek() in ("-", "+"):
            sign = self.take()[0]
            self._deeper()
            operand = self.unary()
            self.depth -= 1
            return ["-", operand] if sign == "-" else operand
        return self.power()

    def power(self) -> Node:
        base = self.postfix()
        if self.peek() in ("^", "**"):
            self.take()
            self._deeper()
            exponent = self.unary()
            self.depth -= 1
            return ["^", base, exponent]
        return base

    def postfix(self) -> Node:
        tree = self.atom()
        while self.peek() == "!":
            self.take()
            tree = ["!", tree]
        return tree

    def atom(self) -> Node:
        kind, value = self.take()
        if kind == "number":
            return ["n", str(Fraction(value))]
        if kind == "(":
            tree = self.expression()
            if self.take()[0] != ")":
                raise ParseError("a parenthesis not closed")
            return tree
        if kind == "name":
            if value in FUNCTIONS:
                return self.function(value)
            if value in CONSTANTS:
                return ["c", CONSTANTS[value]]
            return ["s", value]
        raise ParseError(f"unexpected {value!r}")

    def function(self, name: str) -> Node:
        """``sin(x)``, ``sin x``, and ``sin^2 x`` as (sin x)^2, as mathematicians write it."""
        exponent = None
        if self.peek() in ("^", "**"):
            self.take()
            exponent = self.postfix()
        tree = ["f", name, self.power()]
        return tree if exponent is None else ["^", tree, exponent]

    def _deeper(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError(f"nested over {MAX_DEPTH} deep")
