"""LaTeX math as plain expression text (``\\frac{1}{2}`` → ``((1)/(2))``), for `parse`.

A small normaliser, not a LaTeX parser: fractions, roots, the usual operators, functions, Greek
letters and constants; text commands keep their content; anything else is a `ParseError`.
"""

from __future__ import annotations

import re

from fulmen.rewards.expressions.parse import ParseError

_COMMAND = re.compile(r"\\([A-Za-z]+|.)")
FRACTIONS = frozenset({"frac", "dfrac", "tfrac", "cfrac"})
TEXT = frozenset({"text", "textrm", "mathrm", "mathbf", "mathit", "boldsymbol", "operatorname", "mbox"})
DROPPED = frozenset({"left", "right", "displaystyle", "textstyle", "bigl", "bigr", "Bigl", "Bigr", "big", "Big",
                     "limits", "!", ",", ";", ":", " ", "quad", "qquad", "%", "$"})
OPERATORS = {"cdot": "*", "times": "*", "div": "/", "ast": "*", "pm": None, "mp": None}
NAMES = {"pi": "pi", "infty": "oo", "ln": "ln", "log": "log", "exp": "exp", "sin": "sin", "cos": "cos",
         "tan": "tan", "sqrt": "sqrt", "e": "e"}
GREEK = frozenset({"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
                   "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi",
                   "chi", "psi", "omega"})
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def plain(text: str) -> str:
    """``text`` with its LaTeX turned into expression text; plain text passes through."""
    text = text.strip()
    for left, right in _DELIMITERS:
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
            text = text[len(left): len(text) - len(right)].strip()
            break
    if "\\" not in text and "{" not in text:
        return text
    try:
        return _convert(text)
    except RecursionError:
        raise ParseError("LaTeX nested too deeply") from None


def _convert(s: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            piece, i = _command(s, i)
            out.append(piece)
        elif c == "{":
            group, i = _argument(s, i)
            out.append(f"({_convert(group)})")
        elif c == "}":
            raise ParseError("unbalanced braces")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _command(s: str, i: int) -> tuple[str, int]:
    """One command at ``s[i]`` (a backslash) as text, and where it ends."""
    match = _COMMAND.match(s, i)
    if match is None:
        raise ParseError("a lone backslash")
    name, i = match.group(1), match.end()
    if name in FRACTIONS:
        numerator, i = _argument(s, i)
        denominator, i = _argument(s, i)
        return f"(({_convert(numerator)})/({_convert(denominator)}))", i
    if name == "sqrt":
        return _root(s, i)
    if name in TEXT:
        content, i = _argument(s, i)
        return _convert(content), i
    if name in DROPPED:
        return " ", i
    if name in OPERATORS:
        if OPERATORS[name] is None:
            raise ParseError(f"\\{name}: an answer with several values")
        return str(OPERATORS[name]), i
    if name in NAMES or name in GREEK:
        return f" {NAMES.get(name, name)} ", i
    raise ParseError(f"LaTeX command \\{name} not understood")


def _root(s: str, i: int) -> tuple[str, int]:
    """``\\sqrt{x}`` or ``\\sqrt[n]{x}`` after the command's name."""
    degree = None
    if s.startswith("[", i):
        end = s.find("]", i)
        if end < 0:
            raise ParseError("\\sqrt[ without ]")
        degree, i = s[i + 1: end], end + 1
    radicand, i = _argument(s, i)
    if degree is None:
        return f"sqrt({_convert(radicand)})", i
    return f"(({_convert(radicand)})^(1/({_convert(degree)})))", i


def _argument(s: str, i: int) -> tuple[str, int]:
    """A command's argument at ``s[i]``: a braced group's content, a command, or one character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ParseError("a command without its argument")
    if s[i] == "\\":
        match = _COMMAND.match(s, i)
        assert match is not None
        return match.group(0), match.end()
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1: j], j + 1
    raise ParseError("unbalanced braces")
