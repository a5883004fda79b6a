"""What a run needs before it starts, for `fulmen algorithm` / `fulmen demo` and their `fulmen dev`
tasks alike: the settings checked, the datasets read, and the setup that names the policy the
rollouts use (without the ``policy`` resources every rollout fails)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fulmen.errors import InvalidInput, NotFound
from fulmen.settings import AlgorithmSettings, DemoSettings
from fulmen.store import RedisStore
from fulmen.versions.model_version import BASE_VERSION, POLICY_RESOURCES_ID


@dataclass
class RunInputs:
    settings: AlgorithmSettings
    tasks: list[dict[str, Any]]
    val_tasks: list[dict[str, Any]]
    setup: Callable[[RedisStore], Awaitable[None]]


def algorithm_inputs(settings: AlgorithmSettings) -> RunInputs:
    """A run on the user's tasks and model; InvalidInput says what is missing."""
    from fulmen_algorithm.dataset import load_tasks

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
    from fulmen_algorithm.demos.arithmetic import DEMO_SAMPLING, prepare_demo

    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    tools = settings.task == "tools"
    default = settings.data_dir / ("demo-tools" if tools else "demo")
    folder = settings.model_dir.parent if settings.model_dir is not None else default
    if tools:
        from fulmen_algorithm.demos.tools import TOOL_SAMPLING, prepare_tool_demo

        paths, sampling = prepare_tool_demo(folder, seed=settings.seed), TOOL_SAMPLING
    else:
        paths, sampling = prepare_demo(folder, seed=settings.seed), DEMO_SAMPLING
    settings = settings.model_copy(update={"train_data": paths.train, "val_data": paths.val, "model_dir": paths.model})

    async def setup(store: RedisStore) -> None:
        await publish_base_policy(store, paths.model.name, sampling=sampling)

    return RunInputs(settings, load_tasks(paths.train), load_tasks(paths.val), setup)


async def publish_base_policy(store: RedisStore, model_name: str,
                              sampling: dict[str, Any] | None) -> None:
    """The policy's first resources (the model as it starts, version "base"), unless a run published
    some before: a restarted run continues with the trainer's latest version. Rollouts name these
    resources; without them every rollout fails."""
    try:
        await store.resources.get_resources(POLICY_RESOURCES_ID)
    except NotFound:
        llm: dict[str, Any] = {"kind": "llm", "model": model_name, "model_version": BASE_VERSION.name}
        if sampling:
            llm["sampling_parameters"] = dict(sampling)
        await store.resources.add_resources({"llm": llm}, resources_id=POLICY_RESOURCES_ID)
