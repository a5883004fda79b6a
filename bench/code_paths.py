"""Which of Fulmen's own files (under shared/ and services/) three paths run through, measured by tracing.

The paths, run once each in this process on an embedded Redis: a chat call through the LLM proxy (torch
backend, tiny model); a rollout from the queue through runner, agent, proxy and adapter to samples; a model
version from the trainer to the proxy's follower, and to a fake vLLM through `fulmen vllm-sync`.
How the files are attributed: docs/design/layout.md, "Three paths, file by file". Last line: ONE JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextvars
import functools
import importlib
import json
import os
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACKED = ("shared", "services")  # the project's own source; examples/, tests/ and bench/ are not listed
sys.path.insert(0, str(ROOT))  # `examples.arithmetic_agent`, the rollout's agent

# Who a frame works for: each component is started in a context carrying its owner, which its tasks,
# callbacks and `asyncio.to_thread` calls inherit; a thread that inherits nothing (the torch engine's) is THREAD.
THREAD = "thread"
OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("code_paths_owner", default=THREAD)
TASK_OWNERS: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()

# tests/fakes/fake_vllm.py in a process of its own (as vLLM is), on a free port; prints its URL
FAKE_VLLM = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from fakes.fake_vllm import FakeVllm
async def main():
    fake = FakeVllm(Path(sys.argv[1]))
    print(await fake.start(), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


STARTED = time.monotonic()


def log(message: str, *args: Any) -> None:
    print(f"[code_paths {time.monotonic() - STARTED:5.1f}s] {message % args}", file=sys.stderr, flush=True)


@dataclass
class Window:
    """One traced stretch: the owners whose frames count, and tasks left out (others' background loops)."""

    owners: frozenset[str]
    excluded: set[asyncio.Task[Any]] = field(default_factory=set)
    files: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.files = {owner: set() for owner in self.owners}

    def listed(self, *owners: str) -> list[str]:
        found = set().union(*(self.files[o] for o in owners))
        return sorted({os.path.relpath(os.path.realpath(p), os.path.realpath(ROOT)) for p in found})


class CallTracer:
    """The global trace function of every thread. On a call (a coroutine's resumption included) into a
    tracked file not yet listed for the frame's owner, if the owner counts, the frame's task is not
    excluded and no import is running it (a module or class body, or what those call), it traces that
    frame's lines; the first line run lists the file. So a frame resumed only to pass a value through
    to the coroutine it awaits (a service's wrapper around its loop) lists nothing."""

    def __init__(self) -> None:
        roots = {str(ROOT), os.path.realpath(ROOT)}
        self.prefixes = tuple(os.path.join(r, d) + os.sep for r in roots for d in TRACKED)
        self.window: Window | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        window = self.window
        if window is None:
            return None
        path = frame.f_code.co_filename
        if not path.startswith(self.prefixes):
            return None
        listed = window.files.get(OWNER.get())
        if listed is None or path in listed:
            return None
        if (
            window.excluded
            and asyncio._get_running_loop() is not None
            and asyncio.current_task() in window.excluded
        ):
            return None
        if self._importing(frame):
            return None

        def on_line(frame: FrameType, event: str, arg: Any) -> None:
            if event == "line" and self.window is window:
                listed.add(path)
                frame.f_trace = None  # listed: no more lines to watch in this frame
            return None

        return on_line

    def _importing(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "<module>" and frame.f_code.co_filename.startswith(self.prefixes):
                return True
            frame = frame.f_back
        return False

    def install(self) -> None:
        threading.settrace(self)
        sys.settrace(self)

    def uninstall(self) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]


def attribute_pool_work() -> None:
    """A thread pool's work item runs in a copy of its submitter's context (as `asyncio.to_thread`'s
    already does), so what a service hands to a pool of its own counts for that service."""
    submit = concurrent.futures.ThreadPoolExecutor.submit

    @functools.wraps(submit)
    def in_context(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return submit(self, contextvars.copy_context().run, fn, *args, **kwargs)

    concurrent.futures.ThreadPoolExecutor.submit = in_context  # type: ignore[method-assign]


def task_factory(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, Any],
    context: contextvars.Context | None = None,
) -> asyncio.Task[Any]:
    """Tasks as usual, each remembered with its owner (to leave a service's background loops out)."""
    task = asyncio.Task(coro, loop=loop, context=context)
    TASK_OWNERS[task] = context.get(OWNER, THREAD) if context is not None else OWNER.get()
    return task


def start_as(owner: str, work: Awaitable[Any], name: str | None = None) -> asyncio.Task[Any]:
    """``work`` as a task owned by ``owner``, as are the tasks and threads it starts."""
    context = contextvars.copy_context()
    context.run(OWNER.set, owner)
    return asyncio.get_running_loop().create_task(work, name=name or owner, context=context)  # type: ignore[arg-type]


def run_service(package: str, stop: asyncio.Event, **settings: Any) -> Coroutine[Any, Any, object]:
    """A service as `fulmen dev` runs it: its `Service` (``fulmen_<package>.main.SERVICE``) on settings
    from the environment, ``settings`` over them."""
    from fulmen.settings import load_settings

    service = importlib.import_module(f"fulmen_{package}.main").SERVICE
    return service.run(load_settings(service.settings, **settings), stop)  # type: ignore[no-any-return]


async def open_store(settings: Any) -> Any:
    """The experiment's store on a client of its own, as a service opens it."""
    from fulmen.store import RedisStore
    from fulmen.store.redis.connection import connect, connect_weights

    return RedisStore(
        await connect(settings),
        settings.experiment,
        max_record_bytes=settings.max_record_bytes,
        weights_redis=await connect_weights(settings),
    )


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Bench:
    """The services of one experiment in this loop, each its `Service` as `fulmen dev` runs it (proxy,
    runner, adapter), a trainer, and a fake vLLM server with its `fulmen vllm-sync`."""

    def __init__(self, tracer: CallTracer, folder: Path, redis_url: str, timeout_s: float) -> None:
        self.tracer = tracer
        self.folder = folder
        self.redis_url = redis_url
        self.timeout_s = timeout_s
        self.experiment = f"paths-{os.getpid()}"
        self.stop = asyncio.Event()
        self.services: list[asyncio.Task[Any]] = []
        self.fake_vllm: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        import redis.asyncio as aioredis

        from fulmen.demo.tiny_model import build_tiny_model
        from fulmen.store import RedisStore

        # what the proxy and vLLM start from, and the trainer's (other) weights
        self.base = build_tiny_model(self.folder / "served" / "tiny", seed=0)
        # started first: its torch import overlaps the start below
        fake = (sys.executable, "-c", FAKE_VLLM, str(self.base), str(ROOT / "tests"))
        self.fake_vllm = await asyncio.create_subprocess_exec(*fake, stdout=asyncio.subprocess.PIPE)
        self.trained = build_tiny_model(self.folder / "trainer" / "tiny", seed=1)
        os.environ.pop("PORT", None)  # else every service would serve /metrics on it
        os.environ.update({
            "REDIS_URL": self.redis_url, "FULMEN_EXPERIMENT": self.experiment, "FULMEN_DATA_DIR": str(self.folder),
            "FULMEN_PROXY_BACKEND": "torch", "FULMEN_MODEL_DIR": str(self.base), "FULMEN_PROXY_PORT": "0",
            "FULMEN_AGENT": "examples.arithmetic_agent:agent", "FULMEN_LOG_LEVEL": "WARNING",
        })  # fmt: skip
        self.store = RedisStore(aioredis.from_url(self.redis_url), self.experiment)  # this script's own reads
        llm = {"llm": {"kind": "llm", "model": "tiny"}}
        await self.store.resources.add_resources(llm, resources_id="policy")
        for owner, package in (("proxy", "llm_proxy"), ("runner", "runner"), ("adapter", "adapter")):
            self.services.append(start_as(owner, run_service(package, self.stop)))
        await self._start_trainer()
        await self._start_vllm_sync()
        await until(self._proxy_registered, "the proxy to register", self.timeout_s)
        (proxy,) = await self.store.registry.query_proxies()
        self.proxy_url = proxy.base_url
        await until(lambda: self._replica_serves("base"), "vllm-sync to take over the server", self.timeout_s)
        log(
            "started: proxy at %s, runner, adapter, trainer, vllm-sync beside a fake vLLM at %s",
            self.proxy_url,
            self.vllm_url,
        )

    async def _start_trainer(self) -> None:
        from fulmen.settings import TrainerSettings, load_settings
        from fulmen_trainer.trainer import Trainer

        settings = load_settings(
            TrainerSettings, model_dir=self.trained, model_name="tiny", device="cpu",
            checkpoint_dir=self.folder / "checkpoints", metrics_file=self.folder / "trainer-metrics.jsonl",
        )  # fmt: skip
        self.trainer = Trainer(await open_store(settings), settings)
        await start_as("trainer", self.trainer.setup())

    async def _start_vllm_sync(self) -> None:
        assert self.fake_vllm is not None and self.fake_vllm.stdout is not None
        line = await asyncio.wait_for(self.fake_vllm.stdout.readline(), self.timeout_s)
        if not line:
            raise RuntimeError("the fake vLLM server did not start")
        self.vllm_url = line.decode().strip()
        sync = run_service("vllm_sync", self.stop, vllm_url=self.vllm_url, model_name="tiny",
                           sync_dir=self.folder / "vllm-sync")  # fmt: skip
        self.services.append(start_as("vllm-sync", sync))

    async def _proxy_registered(self) -> bool:
        self._check_services()
        return bool(await self.store.registry.query_proxies())

    def _check_services(self) -> None:
        for task in self.services:
            if task.done():
                raise RuntimeError(
                    f"{task.get_name()} ended early: {task.exception() if not task.cancelled() else 'cancelled'}"
                )

    async def traced(self, window: Window, work: Callable[[], Awaitable[Any]]) -> Any:
        self.tracer.window = window
        try:
            return await work()
        finally:
            self.tracer.window = None

    # --- 1. one chat call -----------------------------------------------------------------------------

    async def chat_call(self) -> Window:
        import httpx

        from fulmen.telemetry import semconv

        body = {"model": "tiny", "messages": [{"role": "user", "content": "23+48="}], "max_tokens": 6}

        async def call() -> tuple[str, httpx.Response]:
            started = await self.store.rollouts.start_rollout({"question": "23+48="}, "code-paths")
            url = f"{self.proxy_url}/rollout/{started.rollout.rollout_id}/attempt/{started.attempt.attempt_id}/v1"
            # a new client: the call opens its connection, as an agent's first call does
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                response = await client.post(f"{url}/chat/completions", json=body)
            return started.rollout.rollout_id, response

        await call()  # warm-up, not traced: the steady path, without first-call caches
        # every task there is now is left out: the proxy's own loops (registry, control, follower)
        window = Window(frozenset({"proxy", THREAD}), excluded=set(asyncio.all_tasks()))
        rollout_id, response = await self.traced(window, call)
        response.raise_for_status()
        spans = await self.store.spans.query_spans(rollout_id)
        assert any(s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL for s in spans), spans
        log("chat call: %d, its span recorded", response.status_code)
        return window

    # --- 2. one rollout -------------------------------------------------------------------------------

    async def rollout(self) -> Window:
        from fulmen.records.status import RolloutStatus

        samples_key = self.store.keys.samples
        before = len(await self.store.redis.xrange(samples_key))
        # the proxy's own loops, and the runner's report of itself, are not the rollout's
        tasks = asyncio.all_tasks()
        excluded = {t for t in tasks if TASK_OWNERS.get(t) == "proxy" or t.get_name() == "worker-heartbeat"}
        window = Window(frozenset({"algorithm", "runner", "adapter", "proxy", THREAD}), excluded=excluded)

        async def one() -> str:
            task = {"question": "23+48=", "answer": "71"}
            rollout_id = (await start_as("algorithm", self.store.rollouts.enqueue_rollout(task))).rollout_id

            async def sampled() -> bool:  # raw reads: the waiting is not on the path
                self._check_services()
                return len(await self.store.redis.xrange(samples_key)) > before

            await until(sampled, "the rollout's samples", self.timeout_s)
            return rollout_id

        rollout_id = await self.traced(window, one)
        rollout = await self.store.rollouts.get_rollout(rollout_id)
        assert rollout.status is RolloutStatus.SUCCEEDED, rollout
        log("rollout %s: %s, samples written", rollout_id, rollout.status.value)
        return window

    # --- 3. a model version, trainer to proxy (and to vLLM) -------------------------------------------------

    async def model_version(self) -> Window:
        from fulmen.versions.model_version import next_model_version

        trainer = self.trainer

        async def publish() -> None:  # what a publishing step does, less its checkpoint
            trainer.version = await next_model_version(trainer.store, shared_dir=trainer.s.weights_dir)
            await trainer.publish()

        async def travel() -> None:
            await start_as("trainer", publish())
            version = trainer.version.name
            await until(lambda: self._proxy_serves(version), f"the proxy to serve {version}", self.timeout_s)
            await until(lambda: self._replica_serves(version), f"vLLM to serve {version}", self.timeout_s)
            # the publisher's last step, once every server serves the version
            rewrite = getattr(trainer, "aof_rewrite", None)
            if rewrite is not None:
                await asyncio.wait_for(asyncio.shield(rewrite), self.timeout_s)

        window = Window(frozenset({"trainer", "proxy", THREAD, "vllm-sync"}))
        await self.traced(window, travel)
        log("model version %s served by the proxy and by vLLM", trainer.version.name)
        return window

    async def _proxy_serves(self, version: str) -> bool:
        self._check_services()
        return any(p.model_version == version for p in await self.store.registry.query_proxies())

    async def _replica_serves(self, version: str) -> bool:
        self._check_services()
        state = (await self.store.registry.query_replicas()).get(self.vllm_url)
        return state is not None and state.ready and state.model_version == version

    async def close(self) -> None:
        self.stop.set()
        _, late = await asyncio.wait(self.services, timeout=15) if self.services else (set(), set())
        for task in late:
            task.cancel()
        await asyncio.gather(*self.services, return_exceptions=True)
        if getattr(self, "trainer", None) is not None:
            await self.trainer.store.redis.aclose()
        if self.fake_vllm is not None and self.fake_vllm.returncode is None:
            self.fake_vllm.terminate()
            await self.fake_vllm.wait()
        if getattr(self, "store", None) is not None:
            await self.store.redis.aclose()


def report(title: str, files: list[str]) -> None:
    print(f"{title}: {len(files)} files")
    for path in files:
        print(f"  {path}")
    print()


async def measure(timeout_s: float) -> dict[str, list[str]]:
    from fulmen.store.redis.embedded import EmbeddedRedis

    asyncio.get_running_loop().set_task_factory(task_factory)  # type: ignore[arg-type]
    OWNER.set("driver")  # this script's own calls are never on a path
    tracer = CallTracer()
    attribute_pool_work()
    tracer.install()  # before any service starts, so that every thread they start has it
    with (
        tempfile.TemporaryDirectory(prefix="code-paths-") as tmp,
        EmbeddedRedis(Path(tmp) / "redis", port=None) as redis,
    ):
        bench = Bench(tracer, Path(tmp), redis.url, timeout_s)
        try:
            await bench.start()
            chat = await bench.chat_call()
            rollout = await bench.rollout()
            version = await bench.model_version()
        finally:
            tracer.uninstall()
            await bench.close()
    return {
        "chat_call": chat.listed("proxy", THREAD),
        "rollout": rollout.listed("algorithm", "runner", "adapter", "proxy", THREAD),
        "model_version": version.listed("trainer", "proxy", THREAD),
        "vllm_sync": version.listed("vllm-sync"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each path's files go to stdout, sorted; progress to stderr.",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="the longest any one wait may take (default 60)"
    )
    args = parser.parse_args()
    # the heavy imports (torch, transformers) before the clock starts
    import fulmen_llm_proxy.server  # noqa: F401
    import fulmen_trainer.trainer  # noqa: F401

    started = time.monotonic()
    paths = asyncio.run(measure(args.timeout_s))
    log("measured in %.1f s", time.monotonic() - started)
    report("1. one chat call (POST /v1/chat/completions, torch backend, its span)", paths["chat_call"])
    report("2. one rollout (queue, runner, agent, proxy, spans, adapter to samples)", paths["rollout"])
    report("3. one model version, trainer to the proxy's follower", paths["model_version"])
    report("3'. the same version, the vLLM side (fulmen vllm-sync against a fake vLLM)", paths["vllm_sync"])
    counts = {f"{name}_files": len(files) for name, files in paths.items()}
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
