"""pass@k and maj@k of a validation pass that samples each task k times: pure functions of the samples.

`validation.validate` collects one `Sample` (answer, success) per rollout and calls `pass_scores`.
The rules (which answer votes, ties, no answer at all): docs/guides/evaluation.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class Sample(NamedTuple):
    """One sampled rollout of a task: the answer it gave (None: none recorded) and whether it succeeded
    (reward ≥ 1)."""

    answer: str | None
    succeeded: bool


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` succeeded (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), computed as the product 1 - prod(1 - k/i, i = n-c+1..n), which stays
    exact in floats where the binomials would overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every choice of k samples holds a success
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def pass_levels(k: int) -> list[int]:
    """The k's a pass of ``k`` samples per task reports: the powers of two up to ``k``, and ``k``."""
    levels = [1 << e for e in range(k.bit_length()) if 1 << e <= k]
    return levels if levels[-1] == k else [*levels, k]


def majority_solved(samples: Sequence[Sample]) -> bool:
    """maj@k of one task: the answer given most often wins (ties: the one given first), and the task
    counts as solved when that answer's first sample succeeded. Samples without an answer do not vote;
    when none has one, the vote is over success itself: solved when more than half succeeded."""
    answers = [s.answer for s in samples if s.answer is not None]
    if not answers:
        return sum(s.succeeded for s in samples) * 2 > len(samples)
    votes = Counter(answers)  # counts in first-seen order: most_common keeps it on ties
    winner = votes.most_common(1)[0][0]
    return next(s.succeeded for s in samples if s.answer == winner)


def pass_scores(per_task: Sequence[Sequence[Sample]], k: int) -> dict[str, float]:
    """``pass@j`` for every j of `pass_levels` (averaged over tasks) and ``maj@k``, from ``k`` samples
    per task; a task with fewer samples (rollouts that never finished) counts its missing ones as failed."""
    if not per_task:
        return {**{f"pass@{j}": 0.0 for j in pass_levels(k)}, f"maj@{k}": 0.0}
    scores: dict[str, float] = {}
    for j in pass_levels(k):
        scores[f"pass@{j}"] = sum(pass_at_k(k, sum(s.succeeded for s in t), j) for t in per_task) / len(per_task)
    padded = [[*t, *[Sample(None, False)] * (k - len(t))] for t in per_task]
    scores[f"maj@{k}"] = sum(majority_solved(t) for t in padded) / len(per_task)
    return scores


def score_fields(result: Mapping[str, Any]) -> dict[str, Any]:
    """The k-sample fields of a validation record (samples, then `score_columns` order); empty for a
    greedy pass."""
    return {k: result[k] for k in ("samples", *score_columns([result])) if k in result}


def score_columns(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pass@j and maj@k keys any of ``results`` holds, pass@ first, each family by increasing j:
    the columns of a table of validation passes (none when every pass was greedy)."""
    keys = {k for r in results for k in r if _score_order(k) is not None}
    return sorted(keys, key=lambda k: _score_order(k) or (0, 0))


def _score_order(key: str) -> tuple[int, int] | None:
    for family, prefix in enumerate(("pass@", "maj@")):
        if key.startswith(prefix) and key[len(prefix):].isdigit():
            return family, int(key[len(prefix):])
    return None
