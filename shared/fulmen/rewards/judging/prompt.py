"""The judge's prompt: every trajectory of a group, numbered, in one message (as ART's RULER asks),
the messages all of them share shown once, before them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

MAX_TRAJECTORY_CHARS = 20_000  # each one's text; the rest is cut, and the cut is marked

DEFAULT_RUBRIC = """\
- A trajectory that achieves the task's goal scores higher than one that does not.
- Of two that achieve it, the one that gets there more directly, with fewer mistakes, scores higher.
- A trajectory that makes progress scores higher than one that makes none.
- Compare the trajectories with each other and use the whole range: the best near 1, the worst near 0."""

SYSTEM = """\
You judge attempts of an AI agent at the same task. You are shown {n} trajectories, numbered 1 to {n}.
Score each one from 0 to 1 by this rubric:

{rubric}

Answer with one JSON object and nothing else:
{{"scores": [{{"trajectory": 1, "reason": "<one short sentence>", "score": <a number from 0 to 1>}}, ...]}}
with exactly one entry per trajectory."""


def messages_for(trajectories: Sequence[Any], rubric: str, task: str | None) -> list[dict[str, str]]:
    """The chat messages of the judge's call."""
    turns = [_turns(t) for t in trajectories]
    shared = _shared_prefix(turns)
    parts = []
    if task:
        parts.append(f"# The task\n{task}")
    if shared:
        parts.append("# What every trajectory starts with\n" + _render(turns[0][:shared]))
    for i, trajectory in enumerate(turns, 1):
        parts.append(f"# Trajectory {i}\n" + _cut(_render(trajectory[shared:]) or "(nothing more)"))
    return [{"role": "system", "content": SYSTEM.format(n=len(trajectories), rubric=rubric.strip())},
            {"role": "user", "content": "\n\n".join(parts)}]


def _turns(trajectory: Any) -> list[Any]:
    """A trajectory as a list of turns: its chat messages, or one piece of text."""
    if isinstance(trajectory, Mapping) and isinstance(trajectory.get("messages"), Sequence):
        return list(trajectory["messages"])
    if isinstance(trajectory, Sequence) and not isinstance(trajectory, str):
        return list(trajectory)
    return [trajectory if isinstance(trajectory, str) else _json(trajectory)]


def _shared_prefix(turns: list[list[Any]]) -> int:
    """How many leading messages every trajectory has in common (0 for a group of one)."""
    if len(turns) < 2:
        return 0
    shortest = min(len(t) for t in turns)
    count = 0
    while count < shortest - 1 and all(t[count] == turns[0][count] for t in turns):  # each keeps its last turn
        count += 1
    return count


def _render(turns: list[Any]) -> str:
    lines = []
    for turn in turns:
        if isinstance(turn, Mapping) and "role" in turn:
            lines.append(f"[{turn['role']}] {_message_text(turn)}")
        else:
            lines.append(turn if isinstance(turn, str) else _json(turn))
    return "\n".join(lines)


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    text = content if isinstance(content, str) else _json(content) if content else ""
    calls = message.get("tool_calls")
    if calls:
        text += (" " if text else "") + "calls " + _json(calls)
    return text


def _cut(text: str) -> str:
    if len(text) <= MAX_TRAJECTORY_CHARS:
        return text
    return text[:MAX_TRAJECTORY_CHARS] + f"\n[... {len(text) - MAX_TRAJECTORY_CHARS} more characters cut]"


def _json(value: Any) -> str:
    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)
