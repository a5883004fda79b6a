"""A small validator for the subset of JSON Schema that tool ``parameters`` use.

`validate` returns the first violation, naming where it is (``$.a.b[2]``), or None; unknown keywords
are ignored (it accepts more than a full validator, never less). The subset and why: docs/design/proxy.md.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 32  # schemas and arguments nested deeper are refused rather than walked


def _is_type(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if isinstance(value, bool):  # JSON's true is not a number
        return False
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, int | float)
    return True  # a type name JSON Schema does not define: not ours to refuse


def validate(value: Any, schema: Any, where: str = "$", depth: int = 0) -> str | None:
    """The first way ``value`` breaks ``schema`` (the subset above), or None when it does not."""
    if not isinstance(schema, dict) or not schema:
        return None  # {} or true: anything goes
    if depth > MAX_DEPTH:
        return f"{where}: nested deeper than {MAX_DEPTH}"
    problem = _any_value(value, schema, where, depth)
    if problem is not None:
        return problem
    if isinstance(value, dict):
        return _object(value, schema, where, depth)
    if isinstance(value, list):
        return _array(value, schema, where, depth)
    if isinstance(value, str):
        return _bounds(len(value), schema, "minLength", "maxLength", where, "characters")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _number(value, schema, where)
    return None


def _any_value(value: Any, schema: dict[str, Any], where: str, depth: int) -> str | None:
    """The keywords for a value of any type: type, enum, const, anyOf and oneOf."""
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_is_type(value, str(t)) for t in names):
            return f"{where}: expected {' or '.join(map(str, names))}, got {_json_type(value)}"
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        return f"{where}: {value!r} is not one of {schema['enum']!r}"
    if "const" in schema and value != schema["const"]:
        return f"{where}: must be {schema['const']!r}"
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches and all(
            validate(value, b, where, depth + 1) is not None for b in branches
        ):
            return f"{where}: matches none of {key}"
    return None


def _number(value: float, schema: dict[str, Any], where: str) -> str | None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if isinstance(low, int | float) and value < low:
        return f"{where}: {value} is below the minimum {low}"
    if isinstance(high, int | float) and value > high:
        return f"{where}: {value} is above the maximum {high}"
    return None


def _object(value: dict[str, Any], schema: dict[str, Any], where: str, depth: int) -> str | None:
    required = schema.get("required")
    if isinstance(required, list):
        for name in required:
            if name not in value:
                return f"{where}: missing required property {name!r}"
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in properties:
            problem = validate(item, properties[name], f"{where}.{name}", depth + 1)
        elif extra is False:
            problem = f"{where}: unexpected property {name!r}"
        elif isinstance(extra, dict):
            problem = validate(item, extra, f"{where}.{name}", depth + 1)
        else:
            problem = None
        if problem is not None:
            return problem
    return None


def _array(value: list[Any], schema: dict[str, Any], where: str, depth: int) -> str | None:
    problem = _bounds(len(value), schema, "minItems", "maxItems", where, "items")
    if problem is not None:
        return problem
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            problem = validate(item, items, f"{where}[{i}]", depth + 1)
            if problem is not None:
                return problem
    return None


def _bounds(size: int, schema: dict[str, Any], low_key: str, high_key: str, where: str, unit: str) -> str | None:
    low, high = schema.get(low_key), schema.get(high_key)
    if isinstance(low, int) and size < low:
        return f"{where}: {size} {unit}, fewer than {low_key} {low}"
    if isinstance(high, int) and size > high:
        return f"{where}: {size} {unit}, more than {high_key} {high}"
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
