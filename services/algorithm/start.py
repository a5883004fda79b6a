"""What a run needs before it starts, for `fulmen algorithm` / `fulmen demo` and their `fulmen dev`
tasks alike: the settings checked, the datasets read, and the setup that names the policy the
rollouts use (without the ``policy`` resources every rollout fails)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fulmen.errors import InvalidInput
from fulmen.settings import AlgorithmSettings, DemoSettings
from fulmen.store import RedisStore


@dataclass
class RunInputs:
    settings: AlgorithmSettings
    tasks: list[dict[str, Any]]
    val_tasks: list[dict[str, Any]]
    setup: Callable[[RedisStore], Awaitable[None]]


def algorithm_inputs(settings: AlgorithmSettings) -> RunInputs:
    """A run on the user's tasks and model; InvalidInput says what is missing."""
    from fulmen_algorithm.dataset import load_tasks
    from fulmen_algorithm.demo import publish_base_policy

    if settings.train_data is None:
        raise InvalidInput("no training data: pass --train-data tasks.jsonl or a dataset (or FULMEN_TRAIN_DATA)")
    if settings.total_steps is None and settings.epochs is None:
        raise InvalidInput("the run needs an end: --total-steps or --epochs")
    if settings.model_dir is None:
        raise InvalidInput("the run needs the policy's model folder: --model-dir (or FULMEN_MODEL_DIR), as the trainer's")
    tasks = load_tasks(settings.train_data, settings.train_split, settings.task_columns)
    val_tasks = load_tasks(settings.val_data, settings.val_split, settings.task_columns) if settings.val_data else []
    model_name = settings.model_name or settings.model_dir.resolve().name  # what the proxies serve it as

    async def setup(store: RedisStore) -> None:
        await publish_base_policy(store, model_name, sampling=None)

    return RunInputs(settings, tasks, val_tasks, setup)


def demo_inputs(settings: DemoSettings) -> RunInputs:
    """The demo: arithmetic tasks (or, with task "tools", calculator tasks) and a tiny Llama warmed up
    by SFT (prepared on the first start: minutes)."""
    from fulmen_algorithm.dataset import load_tasks
    from fulmen_algorithm.demo import DEMO_SAMPLING, prepare_demo, publish_base_policy

    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    tools = settings.task == "tools"
    default = settings.data_dir / ("demo-tools" if tools else "demo")
    folder = settings.model_dir.parent if settings.model_dir is not None else default
    if tools:
        from fulmen_algorithm.tool_demo import TOOL_SAMPLING, prepare_tool_demo

        paths, sampling = prepare_tool_demo(folder, seed=settings.seed), TOOL_SAMPLING
    else:
        paths, sampling = prepare_demo(folder, seed=settings.seed), DEMO_SAMPLING
    settings = settings.model_copy(update={"train_data": paths.train, "val_data": paths.val, "model_dir": paths.model})

    async def setup(store: RedisStore) -> None:
        await publish_base_policy(store, paths.model.name, sampling=sampling)

    return RunInputs(settings, load_tasks(paths.train), load_tasks(paths.val), setup)
