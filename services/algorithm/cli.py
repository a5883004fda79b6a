"""`fulmen algorithm`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import typer

from fulmen import keys as k
from fulmen.cli import run_on_store, settings_from_flags
from fulmen.settings import Settings
from fulmen.store import RedisStore

log = logging.getLogger("fulmen.algorithm")


def _tasks_or_exit(path: Path) -> list[dict[str, object]]:
    """The tasks of a dataset, or a clear error and exit code 2."""
    from fulmen.errors import FulmenError
    from fulmen_algorithm.dataset import load_tasks

    try:
        return load_tasks(path)
    except FulmenError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def command(
    train_data: Annotated[Path | None, typer.Option(help="Training tasks (.jsonl or a datasets folder).")] = None,
    n_samples: Annotated[int | None, typer.Option(help="Rollouts per task, the GRPO group [default 8].")] = None,
    max_inflight: Annotated[int | None, typer.Option(help="Most train rollouts unfinished [default 256].")] = None,
    staleness: Annotated[int | None, typer.Option(help="Versions a rollout may lag; 0 = synchronous.")] = None,
    epochs: Annotated[int | None, typer.Option(help="Passes over the tasks.")] = None,
    total_steps: Annotated[int | None, typer.Option(help="End when the trainer reaches this version.")] = None,
    val_data: Annotated[Path | None, typer.Option(help="Held-out validation tasks (.jsonl).")] = None,
    val_every: Annotated[int | None, typer.Option(help="Validate every V versions (rq job on `fulmen evaluator`).")] = None,
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Experiment (FULMEN_EXPERIMENT).")] = None,
) -> None:
    """Drive a training run: enqueue GRPO groups of train rollouts, paced by the trainer, until done.

    The run's position lives in the store: killed and started again, it continues where it was and
    never enqueues a task twice. Ends (and, under honcho, ends the run) after --total-steps trainer
    versions or --epochs passes, printing a summary."""
    settings = settings_from_flags(
        train_data=train_data, n_samples=n_samples, max_inflight=max_inflight, staleness=staleness,
        epochs=epochs, total_steps=total_steps, val_data=val_data, val_every=val_every, experiment=experiment,
    )

    if settings.train_data is None:
        typer.echo("error: no training data: pass --train-data tasks.jsonl (or FULMEN_TRAIN_DATA)", err=True)
        raise typer.Exit(2)
    if settings.total_steps is None and settings.epochs is None:
        typer.echo("error: the run needs an end: --total-steps or --epochs", err=True)
        raise typer.Exit(2)
    tasks = _tasks_or_exit(settings.train_data)
    val_tasks = _tasks_or_exit(settings.val_data) if settings.val_data is not None else []
    _run_algorithm(settings, tasks, val_tasks)


def _run_algorithm(settings: Settings, tasks: list[dict[str, object]], val_tasks: list[dict[str, object]],
                   setup: Callable[[RedisStore], Awaitable[None]] | None = None) -> None:
    from fulmen_algorithm.scheduler import Scheduler, recoverable_rollout_config
    from fulmen_algorithm.validation import reached_target, recorded, validate

    def enqueue_validation(version: int) -> None:
        """A validation pass as an rq job (JSON serializer): the `fulmen evaluator` worker runs it."""
        import redis
        from rq import Queue
        from rq.serializers import JSONSerializer

        from fulmen.keys import Keys

        connection = redis.Redis.from_url(settings.redis_url_value())
        queue = Queue(Keys(settings.experiment).eval_queue, connection=connection, serializer=JSONSerializer)
        queue.enqueue("fulmen_algorithm.validation.validation_job", settings.experiment, str(settings.val_data),
                      f"v{version}", settings.val_timeout_s, version, job_id=f"val-v{version}",
                      job_timeout=int(settings.val_timeout_s) + 60)
        log.info("validation of version %d queued", version)

    async def work(store: RedisStore) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if setup is not None:
            await setup(store)
        scheduler = Scheduler(
            store, tasks, n_samples=settings.n_samples, groups_per_step=settings.groups_per_step,
            max_inflight=settings.max_inflight, staleness=settings.staleness, epochs=settings.epochs,
            seed=settings.seed,
            rollout_config=recoverable_rollout_config(settings.rollout_unresponsive_s, settings.rollout_max_attempts),
        )
        await scheduler.load()
        started, last_line = time.monotonic(), 0.0
        done_at_start = await store.redis.scard(store.keys.algorithm_done)
        # the first pass validates the starting weights: the curve's baseline (the warm start in the demo)
        next_val = int(await store.redis.hget(store.keys.algorithm_state, "next_val") or 0)
        while not stop.is_set():
            await scheduler.fill()
            version = await scheduler.trainer_step()
            inflight = await scheduler.inflight()
            if val_tasks and settings.val_every and version >= next_val:
                await asyncio.to_thread(enqueue_validation, version)
                next_val = version + settings.val_every
                await store.redis.hset(store.keys.algorithm_state, "next_val", next_val)
            if settings.total_steps is not None and version >= settings.total_steps:
                break
            if settings.target_accuracy is not None and reached_target(await recorded(store), settings.target_accuracy):
                log.info("validation reached %.2f twice in a row: ending the run at step %d",
                         settings.target_accuracy, version)
                break
            if scheduler.exhausted and inflight == 0:
                break
            if time.monotonic() - last_line > 2.0:
                done = await store.redis.scard(store.keys.algorithm_done) - done_at_start
                rate = done / max(time.monotonic() - started, 1e-9)
                stats = await store.statistics()
                vals = await recorded(store)
                val = f"{vals[-1]['accuracy']:.2f} ({vals[-1]['label']})" if vals else "-"
                log.info("step %d | epoch %d | val accuracy %s | %d in flight | queue %d | %.1f rollouts/s",
                         version, scheduler.state.epoch, val, inflight, stats["queue_depth"], rate)
                last_line = time.monotonic()
            await scheduler.count_finished(block_s=0.5)
        summary: dict[str, object] = {"steps": await scheduler.trainer_step(), **scheduler.snapshot(),
                                      "wall_s": round(time.monotonic() - started, 1)}
        if val_tasks and not stop.is_set():
            final = await validate(store, val_tasks, label="final", step=await scheduler.trainer_step(),
                                   timeout_s=settings.val_timeout_s, config=scheduler.rollout_config)
            summary["final_val_accuracy"] = final["accuracy"]
            summary["final_val_reward"] = final["mean_reward"]
            summary["validations"] = [{k: v.get(k) for k in ("label", "step", "accuracy", "mean_reward")}
                                      for v in await recorded(store)]
        summary.update(await _report(store, summary))
        print(json.dumps(summary), flush=True)
        log.info("run finished: curve %s, metrics %s, final model %s",
                 summary.get("curve"), summary.get("metrics"), summary.get("final_model"))

    async def _report(store: RedisStore, summary: dict[str, object]) -> dict[str, object]:
        """The curve (PNG), the summary (JSON) and the final model, in the data folder's run/."""
        from fulmen.train_steps import read_curve
        from fulmen_algorithm.report import export_final_model, plot_curve

        out = settings.data_dir / "run"
        steps = await read_curve(store.redis, store.keys)
        paths: dict[str, object] = {"metrics": str(settings.metrics_file)}
        paths["curve"] = str(plot_curve(out / "reward-curve.png", steps, await recorded(store)))
        if settings.model_dir is not None:
            final = await export_final_model(store, settings.model_dir, out / "final-model")
            paths["final_model"] = str(final) if final else None
        (out / "summary.json").write_text(json.dumps({**summary, **paths}, indent=2))
        paths["summary"] = str(out / "summary.json")
        return paths

    from fulmen.ops_http import start_ops

    with start_ops(settings, "algorithm", groups=[("finished", k.ALGORITHM_GROUP)]):
        run_on_store(settings, work)


async def _wait_for_redis(settings: Settings) -> None:
    from fulmen.connection import connect

    await (await connect(settings)).aclose()


def evaluator(
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Experiment (FULMEN_EXPERIMENT).")] = None,
) -> None:
    """Run validation jobs (an rq worker on the experiment's eval queue, JSON serializer — never pickle).

    The algorithm enqueues a validation pass every --val-every versions; this worker runs it (greedy
    val-mode rollouts through the normal pipeline) while the run goes on."""
    settings = settings_from_flags(experiment=experiment)
    import redis
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    from fulmen.keys import Keys

    asyncio.run(_wait_for_redis(settings))  # services start in any order: rq would exit at once
    connection = redis.Redis.from_url(settings.redis_url_value())
    queue = Queue(Keys(settings.experiment).eval_queue, connection=connection, serializer=JSONSerializer)
    log.info("evaluator on queue %s", queue.name)
    from fulmen_algorithm.validation import requeue_abandoned

    requeue_abandoned(queue)  # a pass an evaluator was killed in is run again, not lost
    from fulmen.ops_http import start_ops

    with start_ops(settings, "evaluator"):
        SimpleWorker([queue], connection=connection, serializer=JSONSerializer).work(with_scheduler=False)


def eval_command(
    checkpoint: Annotated[Path, typer.Argument(help="A Hugging Face model folder (safetensors) to evaluate.")],
    val_data: Annotated[Path | None, typer.Option(help="Validation tasks [env FULMEN_VAL_DATA].")] = None,
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Experiment (FULMEN_EXPERIMENT).")] = None,
) -> None:
    """Evaluate a checkpoint now: publish it as a model version, wait for the proxies to serve it, run
    the validation pass, print mean reward and accuracy as JSON."""
    settings = settings_from_flags(val_data=val_data, experiment=experiment)
    from fulmen_algorithm.validation import validate

    if settings.val_data is None:
        typer.echo("error: pass --val-data val.jsonl (or FULMEN_VAL_DATA)", err=True)
        raise typer.Exit(2)
    weights = checkpoint / "model.safetensors"
    if not weights.exists():
        typer.echo(f"error: {checkpoint} has no model.safetensors (a Hugging Face folder is expected)", err=True)
        raise typer.Exit(2)
    tasks = _tasks_or_exit(settings.val_data)

    async def work(store: RedisStore) -> None:
        from safetensors.torch import load_file

        from fulmen.model_versions import (
            POLICY_RESOURCES_ID,
            SERVE_TIMEOUT_S,
            ModelVersion,
            publish_model_version,
            wait_until_served,
        )

        policy = await store.get_resources(POLICY_RESOURCES_ID)
        model = (policy.resources.get("llm") or {}).get("model", checkpoint.name)
        update = await publish_model_version(store, load_file(str(weights)), model=model)
        version = ModelVersion.of(update)
        if not await wait_until_served(store, version):
            typer.echo(f"error: no proxy loaded {version} within {SERVE_TIMEOUT_S:.0f} s; "
                       "is `fulmen llm-proxy` running?", err=True)
            raise typer.Exit(1)
        from fulmen_algorithm.scheduler import recoverable_rollout_config

        config = recoverable_rollout_config(settings.rollout_unresponsive_s, settings.rollout_max_attempts)
        result = await validate(store, tasks, label=f"eval-{version}", timeout_s=settings.val_timeout_s, config=config)
        print(json.dumps(result), flush=True)

    run_on_store(settings, work)


def apo(
    template: Annotated[str, typer.Option("--template", help="The initial prompt template, e.g. 'Solve: {question}'.")],
    train_data: Annotated[Path | None, typer.Option(help="Tasks to score templates on (.jsonl).")] = None,
    critic_base_url: Annotated[str | None, typer.Option(help="OpenAI-compatible critic endpoint (FULMEN_CRITIC_BASE_URL).")] = None,
    critic_model: Annotated[str | None, typer.Option(help="Critic model name (FULMEN_CRITIC_MODEL).")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Beam-search rounds.")] = 2,
    beam_width: Annotated[int, typer.Option(min=1, help="Templates kept per round.")] = 2,
    branch_factor: Annotated[int, typer.Option(min=1, help="Edits asked of the critic per template.")] = 2,
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Experiment (FULMEN_EXPERIMENT).")] = None,
) -> None:
    """Automatic prompt optimisation: a beam search over prompt templates, scored by rollouts.

    A critic model reads each template and the tasks it failed, criticises it, and proposes edits;
    the runners score every edit with a `@fulmen.prompt_rollout` agent; the best template is
    published as resources `apo-best-<digest>` and printed. The critic's key comes from FULMEN_CRITIC_API_KEY."""
    settings = settings_from_flags(train_data=train_data, critic_base_url=critic_base_url,
                                   critic_model=critic_model, experiment=experiment)
    from fulmen_algorithm.apo import APO

    if settings.train_data is None or not settings.critic_base_url or not settings.critic_model:
        typer.echo("error: APO needs --train-data, --critic-base-url and --critic-model", err=True)
        raise typer.Exit(2)
    tasks = _tasks_or_exit(settings.train_data)

    async def work(store: RedisStore) -> None:
        import openai

        key = settings.critic_api_key.get_secret_value() if settings.critic_api_key else "none"
        critic = openai.AsyncOpenAI(base_url=settings.critic_base_url, api_key=key)
        search = APO(store, tasks, critic, settings.critic_model or "", beam_width=beam_width,
                     branch_factor=branch_factor, rounds=rounds)
        best = await search.run(template)
        await store.add_resources({"prompt_template": {"template": best.template}}, resources_id=f"apo-best-{best.digest}")
        print(json.dumps({"template": best.template, "score": best.score,
                          "history": [{"template": c.template, "score": c.score, "round": c.round}
                                      for c in search.history]}), flush=True)

    run_on_store(settings, work)


def demo(
    total_steps: Annotated[int, typer.Option(help="Trainer versions to train for.")] = 300,
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Experiment (FULMEN_EXPERIMENT).")] = None,
) -> None:
    """The demo's driver: prepare arithmetic tasks and a tiny Llama warmed up by SFT (first start
    only), publish it, then run the training like `fulmen algorithm`, validating as it goes.

    The proxy and the trainer in the demo's Procfile wait for the model folder this writes."""
    settings = settings_from_flags(experiment=experiment)
    from fulmen_algorithm.demo import prepare_demo

    folder = settings.model_dir.parent if settings.model_dir is not None else settings.data_dir / "demo"
    paths = prepare_demo(folder, seed=settings.seed)
    settings = settings.model_copy(update={
        "train_data": paths.train, "val_data": paths.val, "model_dir": paths.model,
        "total_steps": settings.total_steps or total_steps, "val_every": settings.val_every or 25,
    })

    async def publish_base(store: RedisStore) -> None:
        from fulmen.errors import NotFound
        from fulmen.model_versions import BASE_VERSION, POLICY_RESOURCES_ID

        try:
            await store.get_resources(POLICY_RESOURCES_ID)
        except NotFound:
            await store.add_resources({"llm": {
                "kind": "llm", "model": paths.model.name, "model_version": BASE_VERSION.name,
                "sampling_parameters": {"temperature": 1.0, "max_tokens": 5},
            }}, resources_id=POLICY_RESOURCES_ID)

    _run_algorithm(settings, _tasks_or_exit(paths.train), _tasks_or_exit(paths.val), setup=publish_base)
