"""One task id for push, the algorithm and the adapter (fulmen.tasks)."""

from __future__ import annotations

import io
from pathlib import Path

import fakeredis.aioredis
import pytest

from fulmen.cli.tasks_file import BadLine, parse_tasks
from fulmen.errors import InvalidInput
from fulmen.records import Rollout
from fulmen.store import RedisStore
from fulmen.tasks import content_id, parse_task_lines, task_id
from fulmen_adapter.adapter import group_key
from fulmen_algorithm.dataset import load_tasks
from fulmen_algorithm.dataset import task_id as group_task_id

TASK = {"question": "2+2=", "answer": "4"}
# `fulmen push` named id-less tasks so before the library had task_id: stored experiments hold it.
PUSHED_ID = "task-3e856d4f11205c2b"


def test_content_id_is_the_id_push_always_gave() -> None:
    """A task without an id is named by its content, exactly as `fulmen push` named it before."""
    assert task_id(TASK) == content_id(TASK) == PUSHED_ID
    assert task_id(dict(reversed(TASK.items()))) == PUSHED_ID  # key order does not matter


def test_own_id_wins_when_usable() -> None:
    """A string or integer id field is the id; a bool, an empty string or another type is not."""
    assert task_id({**TASK, "id": 7}) == "7"
    assert task_id({**TASK, "key": "k1"}, "key") == "k1"
    for unusable in (True, "", 1.5, None):
        assert task_id({**TASK, "id": unusable}).startswith("task-")


def test_push_the_algorithm_and_the_adapter_agree() -> None:
    """Push's rollout id, the algorithm's group id part and the adapter's fallback group key are the same."""
    store = RedisStore(fakeredis.aioredis.FakeRedis(), "t-ids")
    (pushed,) = parse_tasks(io.StringIO('{"question": "2+2=", "answer": "4"}\n'), store, id_field="id", defaults={})
    assert isinstance(pushed, Rollout) and pushed.rollout_id == PUSHED_ID
    assert group_task_id(TASK) == PUSHED_ID
    assert group_key(Rollout("r", TASK)) == PUSHED_ID
    assert group_task_id({**TASK, "id": "a b"}) == "a_b"  # inside rollout ids: no spaces


def test_push_copies_and_bad_lines() -> None:
    """The n-th copy of the same task gets its own id; bad lines say why."""
    store = RedisStore(fakeredis.aioredis.FakeRedis(), "t-ids")
    text = '{"q": 1}\n{"q": 1}\n[1]\n{"id": true}\n'
    results = list(parse_tasks(io.StringIO(text), store, id_field="id", defaults={}))
    assert [r.rollout_id for r in results[:2] if isinstance(r, Rollout)] == [content_id({"q": 1}), content_id({"q": 1}) + "-2"]
    assert results[2] == BadLine(3, "a task must be a JSON object, got list")
    assert isinstance(results[3], BadLine) and "must be a string or an integer" in results[3].reason


def test_line_parsing_is_shared(tmp_path: Path) -> None:
    """The algorithm's loader reports the same reason as push, with the file and line."""
    assert list(parse_task_lines(["{", "", '"x"'])) == [
        (1, "not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        (3, "a task must be a JSON object, got str"),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n"x"\n')
    with pytest.raises(InvalidInput, match=r"bad\.jsonl:2: a task must be a JSON object, got str"):
        load_tasks(bad)
