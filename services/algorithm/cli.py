"""`fulmen algorithm`, `demo`, `evaluator`, `eval`, `apo`: argument parsing only, the work lives in
`main` (the services), `evaluate` and `apo`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fulmen.cli.service import (
    error_exit,
    own_fields,
    run_on_store,
    run_service,
    service_command,
    settings_command,
)
from fulmen.settings import AlgorithmSettings, ApoSettings, DemoSettings, EvalSettings, EvaluatorSettings
from fulmen.store import RedisStore
from fulmen_algorithm.main import ALGORITHM, DEMO, EVALUATOR

# APO's beam search, unless told otherwise: small enough for a first try on a laptop.
APO_ROUNDS = 2
APO_BEAM_WIDTH = 2
APO_BRANCH_FACTOR = 2
# The demo writes its own datasets: no flag for them (nor for reading other ones).
DEMO_WRITES = ("train_data", "val_data", "train_split", "val_split", "task_columns")


def _tasks_or_exit(path: Path, split: str | None, columns: str | None) -> list[dict[str, object]]:
    """The tasks of a dataset, or a clear error and exit code 2."""
    from fulmen.errors import FulmenError
    from fulmen_algorithm.dataset import load_tasks

    try:
        return load_tasks(path, split, columns)
    except FulmenError as e:
        raise error_exit(str(e)) from None


@service_command(ALGORITHM)
def command(settings: AlgorithmSettings) -> None:
    """Drive a training run: enqueue GRPO groups of train rollouts, paced by the trainer, until done.

    The run's position lives in the store: killed and started again, it continues where it was and
    never enqueues a task twice. Ends (and, under honcho, ends the run) after --total-steps trainer
    versions or --epochs passes, printing a summary."""
    run_service(ALGORITHM, settings)


@service_command(DEMO, fields=("experiment", *(f for f in own_fields(DemoSettings) if f not in DEMO_WRITES)))
def demo(settings: DemoSettings) -> None:
    """The demo's driver: prepare arithmetic tasks and a tiny Llama warmed up by SFT (first start
    only), publish it, then run the training like `fulmen algorithm`, validating as it goes.

    The proxy and the trainer in the demo's Procfile wait for the model folder this writes."""
    run_service(DEMO, settings)


@service_command(EVALUATOR, fields=("experiment",))
def evaluator(settings: EvaluatorSettings) -> None:
    """Run validation jobs (an rq worker on the experiment's eval queue, JSON serializer — never pickle).

    The algorithm enqueues a validation pass every --val-every versions; this worker runs it (greedy
    val-mode rollouts through the normal pipeline) while the run goes on."""
    run_service(EVALUATOR, settings)


@settings_command(EvalSettings, fields=("val_data", "val_split", "task_columns", "val_samples", "val_temperature",
                                       "experiment"))
def eval_command(
    settings: EvalSettings,
    checkpoint: Annotated[Path, typer.Argument(help="A Hugging Face model folder (safetensors) to evaluate.")],
) -> None:
    """Evaluate a checkpoint now: publish it as a model version, wait for the proxies to serve it, run
    the validation pass, print mean reward and accuracy as JSON (with --val-samples k > 1, also
    pass@1, pass@2, ... pass@k and maj@k)."""
    from fulmen_algorithm.evaluate import evaluate_checkpoint, weights_of

    if settings.val_data is None:
        raise error_exit("pass --val-data val.jsonl (or FULMEN_VAL_DATA)")
    if weights_of(checkpoint) is None:
        raise error_exit(f"{checkpoint} has no model.safetensors (a Hugging Face folder is expected)")
    tasks = _tasks_or_exit(settings.val_data, settings.val_split, settings.task_columns)

    async def work(store: RedisStore) -> None:
        print(json.dumps(await evaluate_checkpoint(store, checkpoint, tasks, settings)), flush=True)

    run_on_store(settings, work)


@settings_command(ApoSettings)
def apo(
    settings: ApoSettings,
    template: Annotated[str, typer.Option("--template", help="The initial prompt template, e.g. 'Solve: {question}'.")],
    rounds: Annotated[int, typer.Option(min=1, help="Beam-search rounds.")] = APO_ROUNDS,
    beam_width: Annotated[int, typer.Option(min=1, help="Templates kept per round.")] = APO_BEAM_WIDTH,
    branch_factor: Annotated[int, typer.Option(min=1, help="Edits asked of the critic per template.")] = APO_BRANCH_FACTOR,
) -> None:
    """Automatic prompt optimisation: a beam search over prompt templates, scored by rollouts.

    A critic model reads each template and the tasks it failed, criticises it, and proposes edits;
    the runners score every edit with a `@fulmen.prompt_rollout` agent; the best template is
    published as resources `apo-best-<digest>` and printed. The critic's key comes from FULMEN_CRITIC_API_KEY."""
    from fulmen_algorithm.apo import optimise

    if settings.train_data is None or not settings.critic_base_url or not settings.critic_model:
        raise error_exit("APO needs --train-data, --critic-base-url and --critic-model")
    tasks = _tasks_or_exit(settings.train_data, settings.train_split, settings.task_columns)

    async def work(store: RedisStore) -> None:
        result = await optimise(store, tasks, settings, template, rounds=rounds, beam_width=beam_width,
                                branch_factor=branch_factor)
        print(json.dumps(result), flush=True)

    run_on_store(settings, work)
