"""Progress bars (`fulmen.progress`): each long command's bar reaches its total on a fake terminal and
vanishes; nothing is drawn where stderr is no terminal (a pipe, a log, CI with FORCE_COLOR)."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fulmen import progress
from fulmen.archive.write import archive
from fulmen.cli.main import app
from fulmen.records import RolloutFinished, Sample
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore

runner = CliRunner()
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ERASE = "\x1b[2K"  # what a transient bar leaves last: its lines erased


@pytest.fixture
def screen() -> Iterator[io.StringIO]:
    """What a terminal would show: bars drawn on a console that takes itself for one."""
    shown = io.StringIO()
    with progress.drawn_on(Console(file=shown, force_terminal=True, width=120)):
        yield shown


@pytest.fixture
def env(redis_url: str, experiment: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)
    return experiment


def frames(shown: io.StringIO) -> list[str]:
    """The text of every frame drawn, escape codes removed."""
    return [ANSI.sub("", frame).strip() for frame in shown.getvalue().split("\r") if ANSI.sub("", frame).strip()]


def last_frame(shown: io.StringIO, what: str) -> str:
    """The last frame of the bar labelled ``what`` (the one drawn as it stopped)."""
    drawn = [f for f in frames(shown) if f.startswith(what)]
    assert drawn, shown.getvalue()
    return drawn[-1]


def test_a_bar_reaches_its_total_then_vanishes(screen: io.StringIO) -> None:
    """Its last frame reads n/n with its text; then its line is erased (the summary after it stays)."""
    with progress.bar("work", 4) as bar:
        for i in range(4):
            bar.advance()
            bar.update(note=f"item {i}")
    assert re.fullmatch(r"work .*4/4 \S+ item 3", last_frame(screen, "work"))
    assert screen.getvalue().endswith(ERASE)


def test_nothing_is_drawn_when_stderr_is_no_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A console that is no terminal gets nothing; nor does stderr as a pipe, even with FORCE_COLOR set
    (which rich takes for a terminal, and CI systems set)."""
    plain = io.StringIO()
    with progress.drawn_on(Console(file=plain)), progress.bar("work", 3) as bar:
        assert not bar.drawn
        bar.advance(3)
    assert plain.getvalue() == ""
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert Console(stderr=True).is_terminal and progress.terminal() is None


def test_one_bar_at_a_time_and_log_lines_above_it(screen: io.StringIO) -> None:
    """A second bar while one is drawn (another service's, in `fulmen dev`) stays silent; a log line
    written meanwhile goes above the bar, and the handler writes to its stream again after."""
    stream = sys.stderr
    handler = logging.StreamHandler(stream)
    logging.getLogger().addHandler(handler)
    try:
        with progress.bar("first", 2) as first, progress.bar("second", 2) as second:
            assert first.drawn and not second.drawn
            logging.getLogger("fulmen.test").warning("a line above the bar")
            first.advance(2)
        assert handler.stream is stream
    finally:
        logging.getLogger().removeHandler(handler)
    assert "a line above the bar" in ANSI.sub("", screen.getvalue())
    assert not any(f.startswith("second") for f in frames(screen))


def test_push_bar(env: str, screen: io.StringIO, tmp_path: Path) -> None:
    """`fulmen push`: a bar of the file's lines, bad ones included, then the summary."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"id": "t{i}", "question": "{i}+1="}}\n' for i in range(5)) + "not json\n")
    result = runner.invoke(app, ["push", str(tasks), "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert "6/6" in last_frame(screen, "push")
    assert "queued 5 rollout(s)" in result.stdout


def test_push_draws_nothing_into_a_pipe(env: str, tmp_path: Path) -> None:
    """Without a terminal (CliRunner's streams, as honcho's pipes) the output is the summary alone."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "question": "1+1="}\n')
    result = runner.invoke(app, ["push", str(tasks)])
    assert result.exit_code == 0, result.output
    assert result.output == f"queued 1 rollout(s) in experiment {env!r}\n"


def _sample(n: int) -> bytes:
    return Sample(sample_id=f"a{n}/t0", shape="triplet", rollout_id=f"r{n}", attempt_id=f"a{n}", group_key="g",
                  turn_index=0, prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5],
                  response_mask=[1], reward=1.0, final_reward=1.0, model_version="v1").to_wire()


async def _history(store: RedisStore, finished: int, samples: int) -> None:
    """Finished entries (their rollouts long gone: archived as they are) and samples."""
    for n in range(finished):
        wire = RolloutFinished(f"r{n}", RolloutStatus.SUCCEEDED, f"a{n}").to_wire()
        await store.redis.xadd(store.keys.shards[0].finished, {"m": wire})
    for n in range(samples):
        await store.redis.xadd(store.keys.samples, {"m": _sample(n)})


async def test_archive_restore_and_export_bars(env: str, real_store: RedisStore, screen: io.StringIO,
                                               tmp_path: Path) -> None:
    """`fulmen archive` (a bar of the finished and samples entries), `fulmen restore` (every entry put
    back), `fulmen export` from the archive and from Redis (its read, then its rows): each to its total."""
    await _history(real_store, finished=3, samples=4)
    directory = tmp_path / "archive"

    def invoke(*args: str) -> str:
        result = runner.invoke(app, list(args))
        assert result.exit_code == 0, result.output
        return result.stdout

    assert "3 rollouts and 4 samples" in await asyncio.to_thread(invoke, "archive", "--to", str(directory))
    assert "7/7" in last_frame(screen, "archive")
    restored = await asyncio.to_thread(invoke, "restore", "--from", str(directory), "-e", real_store.experiment + "-r")
    assert "3 rollouts, 4 samples" in restored and "7/7" in last_frame(screen, "restore")
    assert "exported 4 samples" in await asyncio.to_thread(
        invoke, "export", str(tmp_path / "a.jsonl"), "--from", str(directory))
    assert "4/4" in last_frame(screen, "export")
    screen.seek(0)
    screen.truncate()
    assert "exported 4 samples" in await asyncio.to_thread(invoke, "export", str(tmp_path / "b.jsonl"))
    assert "4/4" in last_frame(screen, "read samples") and "4/4" in last_frame(screen, "export")


async def test_a_later_archive_pass_counts_what_is_new(real_store: RedisStore, screen: io.StringIO,
                                                       tmp_path: Path) -> None:
    """A second pass's bar counts the entries since the first (an unknown total where Redis 6 cannot
    say, the count still moving): the pass's report is unchanged by the bar."""
    await _history(real_store, finished=2, samples=0)
    await archive(real_store, tmp_path)
    await real_store.redis.xadd(real_store.keys.samples, {"m": _sample(9)})
    with progress.bar("archive") as bar:
        report = await archive(real_store, tmp_path, bar=bar)
    assert (report.rollouts, report.samples) == (0, 1)
    assert re.search(r"1/(1|\?)", last_frame(screen, "archive"))


def test_warm_start_bar(screen: io.StringIO) -> None:
    """The demos' warm start: SFT steps of max_steps, with the last loss and accuracy."""
    import torch

    from fulmen.demo.warm_start import WarmStartPlan, warm_start

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
            return type("Out", (), {"logits": self.embed(input_ids)})()

    plan = WarmStartPlan(until=2.0, max_steps=5, batch_size=2, lr=1e-2, check_every=2, log_every=2)
    examples = [([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])]
    steps, accuracy = warm_start(Tiny(), examples, 0, lambda: 0.25, plan, seed=0)
    assert (steps, accuracy) == (5, 0.25)
    assert re.fullmatch(r"warm start .*5/5 \S+ loss \d\.\d{3}, train accuracy 0\.25", last_frame(screen, "warm start"))


async def test_eval_bar(real_store: RedisStore, screen: io.StringIO, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`fulmen eval`: rollouts finished of the pass's total, the accuracy so far in the bar's text."""
    import torch
    from safetensors.torch import save_file

    from fulmen.settings import EvalSettings
    from fulmen_algorithm import evaluate

    async def served(*_: object, **__: object) -> bool:
        return True

    monkeypatch.setattr(evaluate, "wait_until_served", served)  # no proxy here: the runner below answers
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny"}}, resources_id="policy")
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / evaluate.WEIGHTS_FILE))
    tasks = [{"id": f"q{i}", "question": f"{i}+1="} for i in range(4)]

    async def answer() -> None:  # a runner: rewards 1, 0, 1, 0
        done = 0
        while done < len(tasks):
            for claimed in await real_store.queue.dequeue_rollouts("runner", 4, block_s=0.5):
                reward = 1.0 if claimed.rollout.rollout_id.endswith(("q0", "q2")) else 0.0
                await real_store.rollouts.update_attempt(claimed.rollout.rollout_id, claimed.attempt.attempt_id,
                                                         status="succeeded", reward=reward)
                done += 1
                await asyncio.sleep(0.05)

    answering = asyncio.create_task(answer())
    result = await evaluate.evaluate_checkpoint(real_store, tmp_path, tasks, EvalSettings(val_timeout_s=30))
    await asyncio.wait_for(answering, 5)
    assert result["finished"] == 4 and result["accuracy"] == 0.5, result
    assert re.fullmatch(r"eval .*4/4 \S+ accuracy 0\.50", last_frame(screen, "eval"))


class Recorded(progress.Bar):
    """A drawn bar that keeps what it was told."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[int | None, str | None]] = []

    @property
    def drawn(self) -> bool:
        return True

    def update(self, *, total: int | None = None, completed: int | None = None, what: str | None = None,
               note: str | None = None) -> None:
        self.told.append((completed, note))


async def test_the_eval_bar_moves_as_rollouts_finish(real_store: RedisStore) -> None:
    """`follow_pass` moves the bar a step per rollout of its pass as each finishes, the accuracy so
    far its text; another pass's rollouts are not counted."""
    from fulmen_algorithm.evaluate import follow_pass

    store = real_store
    cursors = [await stream.cursor() for stream in store.finished.streams]
    ids = ["val-eval-v1-q0", "val-other-q0", "val-eval-v1-q1", "val-eval-v1-q2"]
    await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout({"id": rid}, rollout_id=rid) for rid in ids])
    claimed = {c.rollout.rollout_id: c for c in await store.queue.dequeue_rollouts("runner", 4, block_s=1)}
    bar = Recorded()

    async def told(n: int) -> None:
        while len(bar.told) < n:
            await asyncio.sleep(0.01)

    following = asyncio.create_task(follow_pass(store, cursors, "eval-v1", bar))
    try:
        for rid, reward, n in zip(ids, (1.0, 1.0, 0.0, 1.0), (1, 1, 2, 3), strict=True):
            c = claimed[rid]
            await store.rollouts.update_attempt(rid, c.attempt.attempt_id, status="succeeded", reward=reward)
            await asyncio.wait_for(told(n), 10)
    finally:
        following.cancel()
    assert bar.told == [(1, "accuracy 1.00"), (2, "accuracy 0.50"), (3, "accuracy 0.67")]


def test_final_model_export_bar(screen: io.StringIO, tmp_path: Path) -> None:
    """The final model's weights: a bar of the shards written."""
    import torch
    from safetensors.torch import load_file

    from fulmen_algorithm.export import write_weights

    full = {f"layer{i}.weight": torch.zeros(64, 64) for i in range(3)}  # 16 KiB each
    write_weights(full, tmp_path, max_shard_size=20_000)
    assert "3/3" in last_frame(screen, "write model")
    assert sum(len(load_file(str(p))) for p in tmp_path.glob("*.safetensors")) == 3
