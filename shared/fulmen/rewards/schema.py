"""`json_schema`: the JSON value in an answer (the whole text, a fenced block, or the first object or
array in it) validated against a JSON Schema. Needs ``jsonschema`` (``pip install 'fulmen[rewards]'``).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from fulmen.errors import InvalidInput
from fulmen.rewards.verdict import Verdict

_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL)
MAX_ANSWER_CHARS = 1_000_000
MAX_STARTS = 32


def json_in(text: str) -> Any:
    """The JSON value ``text`` holds; ValueError when it holds none."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    for block in _FENCE.findall(text):
        try:
            return json.loads(block)
        except ValueError:
            continue
    decoder = json.JSONDecoder()
    starts = (i for i, c in enumerate(text) if c in "{[")
    for start in itertools.islice(starts, MAX_STARTS):  # each try may read to the end: bounded
        try:
            return decoder.raw_decode(text, start)[0]
        except ValueError:
            continue
    raise ValueError("no JSON object or array in the answer")


def json_schema(answer: str | None, schema: dict[str, Any]) -> Verdict:
    """1.0 when the answer holds JSON that ``schema`` accepts (the validator its ``$schema`` names,
    draft 2020-12 by default); else 0.0 with the first error. A schema that is not valid is an error
    of the caller's (`InvalidInput`), not a score."""
    validator = _validator(schema)
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return Verdict(0.0, "no answer" if answer is None else f"answer over {MAX_ANSWER_CHARS} characters")
    try:
        value = json_in(answer)
    except ValueError as e:
        return Verdict(0.0, str(e))
    except RecursionError:
        return Verdict(0.0, "JSON nested too deeply")
    import jsonschema

    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return Verdict(1.0, "valid")
    where = "/".join(str(p) for p in error.absolute_path) or "the value"
    return Verdict(0.0, f"{where}: {error.message}"[:300])


def _validator(schema: dict[str, Any]) -> Any:
    try:
        import jsonschema
    except ImportError:
        raise ImportError("fulmen.rewards.json_schema needs jsonschema: pip install 'fulmen[rewards]'") from None
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        raise InvalidInput(f"the JSON schema is not valid: {e.message}") from None
    return cls(schema)
