"""`fulmen runner` and `fulmen run-once`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from fulmen.cli.service import error_exit, run_on_store, run_service, service_command, settings_command
from fulmen.errors import InvalidInput
from fulmen.settings import RunnerSettings
from fulmen.store import RedisStore
from fulmen_runner.main import SERVICE, load_agent

out = Console()
err = Console(stderr=True)

HookOpt = Annotated[
    list[str] | None, typer.Option("--hook", help="A fulmen.Hook as module:Class (repeatable).")
]
# How much of a message span `run-once` prints.
MESSAGE_CHARS = 100
TEXT_CHARS = 300  # of a call's prompt or response
SHORT_NAMES = {"agent": ("--agent", "-a"), "concurrency": ("--concurrency", "-c")}


def _load(agent_spec: str | None, hook_specs: list[str] | None) -> tuple[Any, list[Any]]:
    """The agent and hooks, checked before anything connects: a wrong --agent fails at once (exit 2)."""
    try:
        return load_agent(agent_spec, hook_specs or [])
    except InvalidInput as e:
        raise error_exit(str(e)) from None


@service_command(SERVICE, names=SHORT_NAMES)
def command(settings: RunnerSettings, hook: HookOpt = None) -> None:
    """Claim rollouts and run the agent on them, N at a time; scale with more processes.

    Each attempt gets the resources its rollout names and an LLM on a registered proxy; its spans go
    to the store (and to OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set). SIGTERM: stop claiming,
    let in-flight rollouts finish for --grace-s, hand back the rest."""
    run_service(SERVICE, settings, hooks=hook or [])


def _parse_task(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip()[:1] in "{[\"":
            raise error_exit(f"--task is not valid JSON: {e}") from None
        return text  # a plain string task


@settings_command(RunnerSettings, fields=("agent", "experiment", "llm_base_url"), names=SHORT_NAMES)
def run_once(
    settings: RunnerSettings,
    task: Annotated[str, typer.Option("--task", "-t", help="The task, as JSON (or a plain string).")] = "",
    resources_id: Annotated[
        str | None, typer.Option(help="Resources to use (default: the latest in the store).")
    ] = None,
    model_dir: Annotated[
        Path | None, typer.Option(help="Serve this Hugging Face model folder for the run (default, when no "
                                       "proxy is running: the tiny model, built in the data folder).")
    ] = None,
    upstream_url: Annotated[
        str | None, typer.Option(help="Serve an OpenAI-compatible server (its base URL) through a proxy for the run.")
    ] = None,
    model_name: Annotated[
        str | None, typer.Option(help="The model name to serve (with --upstream-url: the upstream's model).")
    ] = None,
    hook: HookOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the spans and reward as JSON.")] = False,
) -> None:
    """Run one task through the agent, in this process, and print its LLM calls, spans and reward.

    The way to debug an agent before training it, with no set-up: it uses the running Redis or starts
    the embedded one, and the running LLM proxy or serves one itself (the tiny model, --model-dir or
    --upstream-url). The rollout goes through the store, so the proxy records every LLM call, but skips
    the queue. Exit code 0 if it succeeded, 1 otherwise."""
    the_agent, hooks = _load(settings.agent, hook)
    the_task = _parse_task(task)
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise error_exit(f"--model-dir {model_dir} is not a Hugging Face model folder (no config.json)")
    from fulmen.cli.standalone import ensure_redis
    from fulmen.telemetry.tracing import setup_tracing

    _, buffer = setup_tracing("fulmen-run-once")
    serve = _Serve(model_dir, upstream_url, model_name)
    with contextlib.ExitStack() as stack:
        ensure_redis(settings, stack, say=_say)
        ok = run_on_store(settings, lambda store: _run_once(store, settings, the_agent, hooks, buffer, the_task,
                                                           resources_id, serve, as_json))
    raise typer.Exit(0 if ok else 1)


def _say(text: str) -> None:
    err.print(f"[dim]{escape(text)}[/dim]")


class _Serve:
    """What run-once serves when it must serve a model itself."""

    def __init__(self, model_dir: Path | None, upstream_url: str | None, model_name: str | None) -> None:
        self.model_dir, self.upstream_url, self.model_name = model_dir, upstream_url, model_name

    @property
    def asked(self) -> bool:
        return self.model_dir is not None or self.upstream_url is not None

    def served_name(self, folder: Path | None) -> str | None:
        if self.model_name or self.upstream_url:
            return self.model_name
        return folder.resolve().name if folder is not None else None


async def _needs_proxy(store: RedisStore, settings: RunnerSettings, serve: _Serve, resources_id: str | None,
                       the_agent: Any) -> bool:
    """Whether run-once must serve a model itself: asked to, or the agent takes an `llm` and nothing would
    answer its calls."""
    if serve.asked:
        return True
    if not the_agent.wants("llm") or settings.llm_base_url or await store.registry.query_proxies():
        return False
    update = await (store.resources.get_resources(resources_id) if resources_id else store.resources.get_latest_resources())
    llm = (update.resources.get("llm") if update else None) or {}
    return not (isinstance(llm, dict) and llm.get("endpoint"))


async def _run_once(store: RedisStore, settings: RunnerSettings, the_agent: Any, hooks: list[Any], buffer: Any,
                    the_task: Any, resources_id: str | None, serve: _Serve, as_json: bool) -> bool:
    from fulmen.cli.standalone import proxy_command, running_proxy, tiny_model_dir
    from fulmen.sdk.resources import close_async_pool
    from fulmen.store.redis.embedded import free_port
    from fulmen_runner.execute import AttemptContext, execute
    from fulmen_runner.heartbeats import Heartbeats
    from fulmen_runner.inputs import InputResolver
    from fulmen_runner.runner import default_worker_id
    from fulmen_runner.span_writer import SpanWriter

    async with contextlib.AsyncExitStack() as stack:
        base_url, model = settings.llm_base_url, None
        if await _needs_proxy(store, settings, serve, resources_id, the_agent):
            folder = None if serve.upstream_url else (serve.model_dir or tiny_model_dir(settings))
            model = serve.served_name(folder)
            what = serve.upstream_url or str(folder)
            _say(f"no LLM proxy is running: serving {what} through `fulmen llm-proxy` for this run")
            command = proxy_command(settings.experiment, free_port(), folder, serve.upstream_url, serve.model_name)
            base_url = await stack.enter_async_context(running_proxy(store, command, say=_say))
        worker_id = default_worker_id().replace("runner-", "run-once-")
        claimed = await store.rollouts.start_rollout(
            the_task, worker_id, resources_id=resources_id, metadata={"run_once": True}
        )
        heartbeats = Heartbeats(store)
        resolver = InputResolver(store, llm_base_url=base_url, api_key=settings.proxy_key(), model=model)
        ctx = AttemptContext(store, the_agent, hooks, resolver, SpanWriter(store, buffer), heartbeats, worker_id)
        beating = asyncio.create_task(heartbeats.run())
        try:
            outcome = await execute(ctx, claimed)
        finally:
            beating.cancel()
            await close_async_pool()
        spans = await store.spans.query_spans(claimed.rollout.rollout_id)
    _print_run(claimed.rollout.rollout_id, outcome, spans, as_json)
    return outcome.status is not None and outcome.status.value == "succeeded"


NO_CALL_WARNING = (
    "warning: the agent made no LLM call that Fulmen recorded, so this rollout cannot train the model. "
    "Usually one of: the agent's client was not built from the `llm` it was handed (use "
    "base_url=llm.base_url and model=llm.model; a client made at import time, or one that reads "
    "OPENAI_BASE_URL, goes around the proxy); the call failed before it reached the proxy (see the "
    "error above); or the agent never called the model for this task."
)


def _ids(ids: list[int], shown: int = 16) -> str:
    """Token ids as `run-once` prints them: the first few, and how many in all."""
    head = ", ".join(str(i) for i in ids[:shown])
    return f"[{head}{', …' if len(ids) > shown else ''}] ({len(ids)})"


def _clip(text: str) -> str:
    """One line of at most TEXT_CHARS: a call's text as `run-once` prints it."""
    line = " ".join(text.split())
    return line if len(line) <= TEXT_CHARS else line[: TEXT_CHARS - 1] + "…"


def _print_run(rollout_id: str, outcome: Any, spans: list[Any], as_json: bool) -> None:
    from fulmen.telemetry import semconv
    from fulmen.telemetry.llm_calls import describe

    if not any(s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL for s in spans):
        err.print(f"[yellow]{escape(NO_CALL_WARNING)}[/yellow]")
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "rollout_id": rollout_id,
                    "status": outcome.status.value if outcome.status else None,
                    "reward": outcome.reward,
                    "error": repr(outcome.error) if outcome.error else None,
                    "spans": [
                        {"sequence_id": s.sequence_id, "name": s.name, "span_id": s.span_id,
                         "parent_id": s.parent_id, "attributes": semconv.readable(s.attributes)}
                        for s in spans
                    ],
                },
                default=str,
            )
        )
        return
    out.print(f"rollout [bold]{rollout_id}[/bold]: {len(spans)} span(s)")
    for s in spans:
        kind = s.attributes.get(semconv.SPAN_KIND, "")
        detail = ""
        if kind == semconv.KIND_LLM_CALL:
            call = describe(s.attributes)
            detail = (f"{call.prompt_tokens} prompt + {call.response_tokens} response tokens, "
                      f"model version {call.model_version or '?'}")
            out.print(f"  {s.sequence_id:>3}  {escape(s.name):<28} {escape(detail)}")
            out.print(f"       [dim]prompt:[/dim]   {escape(_clip(call.prompt_text))}")
            out.print(f"       [dim]response:[/dim] {escape(_clip(call.response_text))}")
            out.print(f"       [dim]response token ids:[/dim] {_ids(call.response_token_ids)}")
            for tool_call in call.tool_calls:
                out.print(f"       [dim]tool call:[/dim] {escape(_clip(json.dumps(tool_call, default=str)))}")
            continue
        elif kind == semconv.KIND_REWARD:
            detail = f"reward {s.attributes.get(semconv.REWARD)}"
        elif kind == semconv.KIND_EXCEPTION:
            detail = f"{s.attributes.get(semconv.EXCEPTION_TYPE)}: {s.attributes.get(semconv.EXCEPTION_MESSAGE)}"
        elif kind == semconv.KIND_MESSAGE:
            detail = str(s.attributes.get(semconv.MESSAGE))[:MESSAGE_CHARS]
        out.print(f"  {s.sequence_id:>3}  {escape(s.name):<28} {escape(detail)}")
    status = outcome.status.value if outcome.status else "abandoned"
    out.print(f"status: [bold]{status}[/bold]  reward: [bold]{outcome.reward}[/bold]")
    if outcome.error:
        out.print(f"error: {type(outcome.error).__name__}: {escape(str(outcome.error))}")
