"""When the algorithm may end a run early: two periodic validation passes in a row at the target."""

from __future__ import annotations

from fulmen_algorithm.validation import reached_target


def _passes(*pairs: tuple[str, float]) -> list[dict[str, object]]:
    return [{"label": label, "accuracy": accuracy} for label, accuracy in pairs]


def test_two_passes_in_a_row_at_the_target_end_the_run() -> None:
    """The last two periodic passes ≥ target: reached (equality counts)."""
    assert reached_target(_passes(("v0", 0.4), ("v20", 0.88), ("v40", 0.9), ("v60", 0.93)), 0.9)


def test_one_lucky_pass_is_not_enough() -> None:
    """A pass at the target followed by one below it, or a single pass, is not a reached target."""
    assert not reached_target(_passes(("v0", 0.4), ("v20", 0.92), ("v40", 0.89)), 0.9)
    assert not reached_target(_passes(("v0", 0.4), ("v20", 0.95)), 0.9)


def test_the_warm_start_and_other_labels_do_not_count() -> None:
    """v0 (the starting weights), `final` and `fulmen eval` passes are not periodic passes of the run."""
    assert not reached_target(_passes(("v0", 0.95), ("v20", 0.95)), 0.9)
    assert not reached_target(_passes(("v0", 0.4), ("v20", 0.95), ("eval-v21", 0.95), ("final", 0.95)), 0.9)
