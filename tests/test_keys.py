"""Ids and experiment names: what `fulmen.keys` accepts before any key is built from them."""

from __future__ import annotations

import pytest

from fulmen import keys as k
from fulmen.errors import InvalidInput


@pytest.mark.parametrize("value", ["r1\n", "r1\r", "a\nb", "r1 ", "", "x" * 129, "r/1", "r{1}", 7, None])
def test_check_id_refuses_what_could_forge_a_key_or_a_log_line(value: object) -> None:
    """A trailing newline (which "$" lets through), spaces, slashes, braces, the empty id, non-strings."""
    with pytest.raises(InvalidInput):
        k.check_id("rollout_id", value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["exp\n", "exp:1", "", "e" * 65])
def test_check_experiment_refuses_a_bad_name(value: str) -> None:
    """Experiment names are stricter: no colon, and no trailing newline either."""
    with pytest.raises(InvalidInput):
        k.check_experiment(value)


@pytest.mark.parametrize("value", ["r1", "ro-0123abcd", "task-9.1:2", "x" * 128])
def test_check_id_accepts_ids_fulmen_makes(value: str) -> None:
    """Ids as push, the algorithm and the store write them are accepted unchanged."""
    assert k.check_id("rollout_id", value) == value
