"""TensorBoard: the event files of a run and its restart, read back with tensorboard's own reader."""

from __future__ import annotations

from pathlib import Path

from tracker_runs import two_runs

from fulmen.store import RedisStore
from fulmen.telemetry.trackers.tensorboard import TensorBoardTracker


async def test_a_run_and_its_restart_are_one_tensorboard_run(real_store: RedisStore, tmp_path: Path) -> None:
    """Every step once, in order, in one run folder; the passes at the steps they validated; the config once."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    run_id = await two_runs(real_store, lambda: TensorBoardTracker(tmp_path))
    runs = list((tmp_path / "tensorboard").iterdir())
    assert [p.name for p in runs] == [run_id]
    events = ea.EventAccumulator(str(runs[0]), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    events.Reload()
    loss = events.Scalars("loss/total")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]
    assert [round(e.value, 4) for e in loss] == [round(1 / s, 4) for s in range(1, 7)]
    for tag in ("loss/kl", "loss/entropy", "loss/clip_frac", "rollout/reward_mean", "rollout/staleness_mean",
                "perf/tokens_per_s", "comm/bytes", "comm/cosine"):
        assert [e.step for e in events.Scalars(tag)] == [1, 2, 3, 4, 5, 6], tag
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [(0, 0.25), (5, 0.75)]
    assert [e.step for e in events.Scalars("val/pass@4")] == [5]
    assert events.Scalars("rollouts/queuing")  # the rollouts per status, with the steps
    config = events.Tensors("config")
    assert len(config) == 1 and b"objective.kl_coef | 0.1" in config[0].tensor_proto.string_val[0]
