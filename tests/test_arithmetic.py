"""The arithmetic task generator: determinism, disjoint splits, exact reward parsing, demonstrations."""

from __future__ import annotations

import json

import pytest

from fulmen.demo import arithmetic
from fulmen.demo.arithmetic import (
    carryless_sum,
    demonstrations,
    make_tasks,
    parse_answer,
    reward,
    split_of,
    write_jsonl,
)
from fulmen.demo.tiny_model import DEFAULT_ALPHABET


def test_same_arguments_give_the_same_tasks() -> None:
    assert make_tasks("train", 200, seed=3) == make_tasks("train", 200, seed=3)
    assert make_tasks("val", 50, seed=3, digits=3, ops="+-*") == make_tasks(
        "val", 50, seed=3, digits=3, ops="+-*"
    )
    assert make_tasks("train", 200, seed=3) != make_tasks("train", 200, seed=4)


def test_tasks_are_distinct_well_formed_and_json_serialisable() -> None:
    tasks = make_tasks("train", 500, seed=1, ops="+-*")
    assert len({t["id"] for t in tasks}) == 500
    for t in tasks:
        assert json.loads(json.dumps(t)) == t
        assert t["question"] == f"{t['a']}{t['op']}{t['b']}="
        expected = {"+": t["a"] + t["b"], "-": t["a"] - t["b"], "*": t["a"] * t["b"]}[t["op"]]
        assert t["answer"] == str(expected)
        assert 10 <= t["a"] <= 99 and 10 <= t["b"] <= 99
        assert t["split"] == "train" == split_of(t["a"], t["op"], t["b"])
        assert set(t["question"] + t["answer"]) <= set(DEFAULT_ALPHABET)
        assert "+" not in t["id"] and "/" not in t["id"] and "*" not in t["id"]


def test_train_and_validation_are_disjoint_by_construction() -> None:
    # every 2-digit addition pair is in exactly one split, whatever the seeds
    train = {(t["a"], t["b"]) for t in make_tasks("train", 6457, seed=0)}
    val = {(t["a"], t["b"]) for t in make_tasks("val", 1643, seed=9)}
    assert not train & val
    assert len(train | val) == 90 * 90
    with pytest.raises(ValueError, match="holds 1643"):
        make_tasks("val", 1644)


def test_split_reserve_is_about_the_requested_share_and_large_spaces_are_sampled() -> None:
    share = sum(split_of(a, "+", b) == "val" for a in range(1000) for b in range(0, 1000, 7)) / (1000 * 143)
    assert 0.19 < share < 0.21
    tasks = make_tasks("val", 300, seed=2, digits=4, ops="*")
    assert len({t["id"] for t in tasks}) == 300
    assert all(t["split"] == "val" == split_of(t["a"], "*", t["b"]) and 1000 <= t["a"] <= 9999 for t in tasks)


def test_one_digit_operands_include_zero() -> None:
    tasks = make_tasks("train", 50, digits=1)
    assert all(0 <= t["a"] <= 9 for t in tasks)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("71", 1.0),
        (" 71", 1.0),
        ("71\n", 1.0),
        ("71<eos>", 1.0),
        ("71 is the answer", 1.0),
        ("71=71", 1.0),
        ("712", 0.0),  # the whole leading number must match
        ("071", 0.0),
        ("71.", 1.0),  # a full stop ends the number
        ("71.0", 0.0),  # a decimal part belongs to the number
        ("71.5", 0.0),
        ("7 1", 0.0),
        ("\n71", 0.0),  # only spaces are skipped before the answer
        ("The answer is 71", 0.0),
        ("-71", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_reward_parses_the_leading_number_exactly(completion: str | None, expected: float) -> None:
    assert reward({"answer": "71"}, completion) == expected


def test_negative_answers() -> None:
    task = {"answer": "-5"}
    assert reward(task, "-5") == 1.0
    assert reward(task, "5") == 0.0
    assert parse_answer("-5x") == "-5"
    assert parse_answer("- 5") is None
    sub = make_tasks("train", 300, ops="-")
    negative = next(t for t in sub if t["a"] < t["b"])
    assert reward(negative, negative["answer"]) == 1.0 and negative["answer"].startswith("-")


def test_carryless_sum() -> None:
    assert carryless_sum(58, 67) == 15
    assert carryless_sum(27, 48) == 65
    assert carryless_sum(12, 34) == 46
    assert carryless_sum(55, 50) == 5


def test_demonstrations_are_correct_by_default_and_slips_are_marked() -> None:
    tasks = make_tasks("train", 400, seed=5)
    demos = demonstrations(tasks)
    for d, t in zip(demos, tasks, strict=True):
        assert d["messages"] == [
            {"role": "user", "content": t["question"]},
            {"role": "assistant", "content": t["answer"]},
        ]
        assert (d["prompt"], d["completion"], d["teacher_error"]) == (t["question"], t["answer"], False)
    sloppy = demonstrations(tasks, carry_slip=1.0)
    for d, t in zip(sloppy, tasks, strict=True):
        assert d["completion"] == str(carryless_sum(t["a"], t["b"]))
        assert d["teacher_error"] == (d["completion"] != t["answer"])
    assert demonstrations(tasks, carry_slip=0.5, seed=1) == demonstrations(tasks, carry_slip=0.5, seed=1)
    with pytest.raises(ValueError):
        demonstrations(tasks, carry_slip=1.5)


def test_write_jsonl_round_trips(tmp_path) -> None:
    tasks = make_tasks("val", 20)
    path = write_jsonl(tmp_path / "sub" / "val.jsonl", tasks)
    assert [json.loads(line) for line in path.read_text().splitlines()] == tasks


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        make_tasks("test", 1)
    with pytest.raises(ValueError):
        make_tasks("train", 1, ops="/")
    with pytest.raises(ValueError):
        split_of(1, "/", 2)
    assert arithmetic.OPS == {"+": "add", "-": "sub", "*": "mul"}
