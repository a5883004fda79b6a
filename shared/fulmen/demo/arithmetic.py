"""Arithmetic tasks with an exactly checked reward: the task of the end-to-end demo and the trainer tests.

Entry points `make_tasks` and `reward(task, completion)`; train and validation are
disjoint by a hash of the operand pair. Why, and the reward's rules: docs/design/demo.md; the recipe:
bench/recipe_search.py.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "OPS",
    "Task",
    "carryless_sum",
    "demonstrations",
    "make_tasks",
    "parse_answer",
    "reward",
    "split_of",
    "write_jsonl",
]

Task = dict[str, Any]

OPS = {"+": "add", "-": "sub", "*": "mul"}
SPLITS = ("train", "val")
DEFAULT_VAL_PERMILLE = 200  # 20% of all operand pairs are reserved for validation

_LEADING_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ENUMERATE_LIMIT = 200_000  # operand spaces up to this size are listed, larger ones sampled


def _compute(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operation {op!r}; expected one of {sorted(OPS)}")


def split_of(a: int, op: str, b: int, *, val_permille: int = DEFAULT_VAL_PERMILLE) -> str:
    """The split ("train" or "val") that the pair ``a op b`` belongs to, by a hash of the pair."""
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}; expected one of {sorted(OPS)}")
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") % 1000 < val_permille else "train"


def make_task(a: int, op: str, b: int, split: str) -> Task:
    return {
        "id": f"{split}-{OPS[op]}-{a}-{b}",
        "question": f"{a}{op}{b}=",
        "answer": str(_compute(a, op, b)),
        "a": a,
        "b": b,
        "op": op,
        "split": split,
    }


def make_tasks(
    split: str,
    n: int,
    *,
    seed: int = 0,
    digits: int = 2,
    ops: str | Sequence[str] = "+",
    val_permille: int = DEFAULT_VAL_PERMILLE,
) -> list[Task]:
    """``n`` distinct tasks of ``split``, in a random order fixed by ``seed``.

    Operands have exactly ``digits`` digits (`operand_range`). Raises ValueError when the split
    holds fewer than ``n`` pairs (2-digit addition, 8,100 pairs: 6,457 train and 1,643 validation
    with the default 20% reserve). Spaces of more than 200,000 pairs are sampled, not listed."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if not 0 < val_permille < 1000:
        raise ValueError(f"val_permille must be in 1..999, got {val_permille}")
    ops = list(ops)
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r}; expected one of {sorted(OPS)}")
    low, limit = operand_range(digits)
    rng = random.Random(f"fulmen-arithmetic:{seed}:{split}")
    if len(ops) * (limit - low) ** 2 > _ENUMERATE_LIMIT:
        # Too many pairs to list: draw pairs until n distinct ones of this split are found (the
        # split holds about val_permille/1000 of a space far larger than any n asked for).
        seen: set[tuple[int, str, int]] = set()
        chosen: list[tuple[int, str, int]] = []
        while len(chosen) < n:
            pair = (rng.randrange(low, limit), rng.choice(ops), rng.randrange(low, limit))
            if pair not in seen and split_of(*pair, val_permille=val_permille) == split:
                seen.add(pair)
                chosen.append(pair)
        return [make_task(a, op, b, split) for a, op, b in chosen]
    pairs = [
        (a, op, b)
        for op in ops
        for a in range(low, limit)
        for b in range(low, limit)
        if split_of(a, op, b, val_permille=val_permille) == split
    ]
    if n > len(pairs):
        raise ValueError(
            f"the {split} split of {digits}-digit {''.join(ops)} holds {len(pairs)} tasks, asked for {n}"
        )
    chosen = rng.sample(pairs, n)
    return [make_task(a, op, b, split) for a, op, b in chosen]


def operand_range(digits: int) -> tuple[int, int]:
    """Operands have exactly ``digits`` digits: ``range(*operand_range(2))`` is 10..99 (1 digit: 0..9)."""
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits


def parse_answer(completion: str | None) -> str | None:
    """The number a completion starts with (after leading spaces), or None if it starts with none."""
    match = _LEADING_NUMBER.match((completion or "").lstrip(" "))
    return match.group(0) if match else None


def reward(task: Task, completion: str | None) -> float:
    """1.0 if ``completion`` starts with exactly ``task["answer"]`` as a whole number, else 0.0."""
    return 1.0 if parse_answer(completion) == str(task["answer"]) else 0.0


def carryless_sum(a: int, b: int) -> int:
    """``a + b`` with every carry dropped (each column added modulo 10): 58+67 -> 15, 27+48 -> 65."""
    result, place = 0, 1
    while a or b:
        result += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def demonstrations(tasks: Iterable[Task], *, carry_slip: float = 0.0, seed: int = 0) -> list[dict[str, Any]]:
    """One supervised example per task, in both the chat and the plain-completion shape.

    ``messages`` is the conversation to fine-tune on (the user asks ``question``, the assistant
    replies and ends its turn); ``prompt``/``completion`` are the same as plain text.

    ``carry_slip`` models a careless teacher: each addition demonstration whose true sum needs a
    carry is, with that probability (drawn from ``random.Random(seed)``), answered with the
    carry-less sum instead (`carryless_sum`; ``"teacher_error": true`` marks it). With the default
    0.0 every demonstration is correct."""
    if not 0.0 <= carry_slip <= 1.0:
        raise ValueError(f"carry_slip must be in [0, 1], got {carry_slip}")
    rng = random.Random(f"fulmen-demonstrations:{seed}")
    demos = []
    for task in tasks:
        answer = str(task["answer"])
        slipped = False
        if task.get("op") == "+" and rng.random() < carry_slip:
            wrong = str(carryless_sum(int(task["a"]), int(task["b"])))
            slipped, answer = wrong != answer, wrong
        demos.append(
            {
                "id": f"demo-{task['id']}",
                "messages": [
                    {"role": "user", "content": task["question"]},
                    {"role": "assistant", "content": answer},
                ],
                "prompt": task["question"],
                "completion": answer,
                "teacher_error": slipped,
            }
        )
    return demos


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> Path:
    """Write one JSON object per line (tasks for ``fulmen push``, or demonstrations); returns path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    return path
