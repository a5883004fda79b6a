"""Chaos runs: every service as its own process, one of them SIGKILLed mid-run and started again with
the same command, then the store is checked for lost and double-counted work.

Used by tests/test_chaos.py (runner, trainer, algorithm, in CI) and bench/chaos.py (every service).

Services run as systemd or Kubernetes would run them: each `fulmen <service>` is a process of its
own with the same environment, and a supervisor restarts any that exits unexpectedly (like
``Restart=always``), recording it, so a crash the kill provokes elsewhere is reported, not hidden.
The run is short (a tiny model, a few trainer versions, small GRPO groups) and ends when the
algorithm process exits 0 with its summary.

What `check_store` verifies after the run (`Verdict`):

- nothing lost: the train rollouts in the store are exactly the ids the scheduler's deterministic
  order gives for the groups it recorded (every group's n rollouts, ``<run>-e<epoch>-<task>-<k>``),
  and each reached a terminal status;
- nothing counted twice: each train rollout appears once in the completions stream, once in the
  algorithm's done set, has one adapter write (samples or a skip) and no sample id twice;
- the trainer trained on each sample at most once (its metrics lines list the sample ids of each
  step, written only after the checkpoint that covers them), its steps are 1..N each once, and the
  run reached its final model version;
- no rollout succeeded twice (one succeeded attempt at most), no trained sample came from a retried
  LLM call recorded twice (samples per attempt ≤ its distinct logical calls), none was more versions
  behind the trainer's weights than the staleness bound, and every live proxy serves the newest
  version.

`random_fault_case` is the random version: seeded, time-bounded, it SIGKILLs or SIGTERMs random
services (Redis included) at random moments, starts each again after 0.5–3 s, and measures how long
the pipeline takes to make progress again after each fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from fulmen.demo import arithmetic
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.errors import NotFound
from fulmen.records import RolloutFinished, Sample, SampleSkip
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port, wait_for_port
from fulmen.store.samples import decode_sample
from fulmen.versions.model_version import ModelVersion
from fulmen_algorithm.dataset import load_tasks, task_id
from fulmen_algorithm.scheduler import Scheduler, SchedulerOptions

REPO = Path(__file__).resolve().parents[1]
FULMEN = str(Path(sys.executable).with_name("fulmen"))
RUN = "run"  # the scheduler's run name: train rollout ids are "<RUN>-e<epoch>-<task>-<k>"
TERMINAL = {RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED}
SERVICES = ("redis", "watchdog", "llm-proxy", "runner", "adapter", "trainer", "evaluator", "algorithm")


@dataclass(frozen=True)
class ChaosConfig:
    """A run that ends in well under a minute on two busy cores."""

    total_steps: int = 4
    groups_per_step: int = 2
    n_samples: int = 4
    train_tasks: int = 40
    val_tasks: int = 0  # 0: no validation passes and no evaluator
    val_every: int = 2
    runner_concurrency: int = 8
    max_staleness: int = 1  # the trainer's bound (drop beyond): the pacing's 0 plus a proxy's loading lag
    # short, so a killed runner's attempts come back within seconds; still well above the runner's
    # heartbeat interval (a third of it), so a busy machine does not end live attempts
    unresponsive_s: float = 6.0
    seed: int = 1


@dataclass
class Service:
    """One `fulmen` command as a child process; started again with the very same command."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    killed: int = 0
    unexpected_exits: list[int] = field(default_factory=list)
    down: bool = False  # stopped on purpose: the supervisor leaves it down until the fault is over
    exit_logs: list[str] = field(default_factory=list)  # the stderr tail of each unexpected exit

    def start(self) -> None:
        self.starts += 1
        # one log per start: the algorithm's summary is the last stdout line of its last start
        out = (self.log_dir / f"{self.name}.{self.starts}.out").open("wb")
        err = (self.log_dir / f"{self.name}.{self.starts}.err").open("wb")
        with out, err:
            self.process = subprocess.Popen(self.argv, env=self.env, cwd=REPO, stdout=out, stderr=err)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """SIGKILL: no handler runs, nothing is flushed, sockets close mid-request. SIGTERM: the
        service's own shutdown, which must end within 30 s (else SIGKILL, as systemd would)."""
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.killed += 1

    def summary(self) -> dict[str, Any] | None:
        """The last stdout line as JSON (the algorithm's summary), or None."""
        lines = self.stdout.strip().splitlines()
        with contextlib.suppress(ValueError):
            return json.loads(lines[-1]) if lines else None
        return None

    @property
    def stdout(self) -> str:
        return (self.log_dir / f"{self.name}.{self.starts}.out").read_text(errors="replace")

    def stderr_tail(self, chars: int = 3000) -> str:
        return (self.log_dir / f"{self.name}.{self.starts}.err").read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def reap(self, timeout_s: float = 15.0) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@dataclass
class Fault:
    """One fault of a random run: when (run time, s), which service, which signal, how long it stayed
    down, and how long after its restart the pipeline made progress again (None: not within the wait)."""

    at_s: float
    service: str
    signal: str
    down_s: float
    resume_s: float | None = None


@dataclass
class Verdict:
    """What the store says after the run. ``problems`` empty means: nothing lost, nothing twice."""

    service: str
    finished: bool = False
    steps: int = 0
    rollouts: int = 0
    expected: int = 0
    lost: int = 0
    duplicated: int = 0
    not_terminal: int = 0
    failed: int = 0
    retried: int = 0
    trained_samples: int = 0
    trained_twice: int = 0
    succeeded_twice: int = 0
    from_retried_calls: int = 0
    max_staleness: int = 0
    from_base_after_v1: int = 0  # train samples of the base weights from rollouts enqueued once v1 existed
    failed_by_proxy: int = 0  # train rollouts failed because a proxy was unreachable (a restart, not the agent)
    dead_letters: int = 0
    resume_s: float | None = None  # after the kill, until the pipeline made progress again
    restarts: dict[str, int] = field(default_factory=dict)
    unexpected_exits: dict[str, list[int]] = field(default_factory=dict)
    exit_logs: dict[str, list[str]] = field(default_factory=dict)  # what each one wrote before it exited
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.finished and not self.problems

    def line(self) -> str:
        state = "ok" if self.ok else "FAIL"
        text = (f"{self.service:<10} {state:<4} steps {self.steps}  rollouts {self.rollouts}/{self.expected}  "
                f"lost {self.lost}  duplicated {self.duplicated}  not terminal {self.not_terminal}  "
                f"failed {self.failed}  retried {self.retried}  trained {self.trained_samples} "
                f"(twice {self.trained_twice})  succeeded twice {self.succeeded_twice}  "
                f"from retried calls {self.from_retried_calls}  max staleness {self.max_staleness}  "
                f"base after v1 {self.from_base_after_v1}  failed by a proxy {self.failed_by_proxy}  "
                f"dead letters {self.dead_letters}  {self.wall_s:.0f} s")
        if self.resume_s is not None:
            text += f"  resumed {self.resume_s:.2f} s after the restart"
        if self.unexpected_exits:  # restarted by the supervisor, as systemd would: worth a look
            text += f"  exited on their own (restarted): {self.unexpected_exits}"
        return text + "".join(f"\n    - {p}" for p in self.problems)


class ChaosRun:
    """Every service of a short training run as its own process, on one experiment.

    ``redis_url``: a Redis to use (the tests' session server); None: `fulmen redis` runs the
    embedded server as one more process (on a free port, AOF in the work folder), so it can be
    killed too."""

    def __init__(self, workdir: Path, experiment: str, config: ChaosConfig | None = None,
                 redis_url: str | None = None) -> None:
        self.workdir = workdir
        self.experiment = experiment
        self.config = config or ChaosConfig()
        self.redis_url = redis_url
        self.redis_port = free_port() if redis_url is None else None
        self.services: dict[str, Service] = {}
        self.started = 0.0
        self.summary: dict[str, Any] | None = None
        self._supervising = False
        self.client: aioredis.Redis | None = None
        self.store: RedisStore | None = None
        self._samples_of = Counter[str]()  # train attempt -> its samples (filled by check_store)

    # --- setup ------------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        c, w = self.config, self.workdir
        env = {name: value for name, value in os.environ.items()
               if not name.startswith(("FULMEN_", "OTEL_")) and name != "REDIS_URL"}
        env.update(
            # the repository for the example agent, before whatever the caller's path already had
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            FULMEN_EXPERIMENT=self.experiment, FULMEN_LOG_LEVEL="INFO",
            FULMEN_GROUPS_PER_STEP=str(c.groups_per_step), FULMEN_N_SAMPLES=str(c.n_samples),
            FULMEN_CHECKPOINT_DIR=str(w / "ck"), FULMEN_METRICS_FILE=str(w / "metrics.jsonl"),
            FULMEN_TORCH_THREADS="1", FULMEN_DATA_DIR=str(w / "data"), FULMEN_MODEL_DIR=str(w / "tiny"),
            FULMEN_SEED=str(c.seed), FULMEN_ROLLOUT_UNRESPONSIVE_S=str(c.unresponsive_s),
            FULMEN_REDIS_WAIT_S="120", COLUMNS="200", PYTHONFAULTHANDLER="1",
            FULMEN_MAX_STALENESS=str(c.max_staleness),
        )
        if self.redis_url is not None:
            env["REDIS_URL"] = self.redis_url
        else:
            env["FULMEN_REDIS_PORT"] = str(self.redis_port)
        return env

    def _commands(self) -> dict[str, list[str]]:
        c, w = self.config, self.workdir
        algorithm = [FULMEN, "algorithm", "--train-data", str(w / "train.jsonl"), "--total-steps", str(c.total_steps)]
        if c.val_tasks:
            algorithm += ["--val-data", str(w / "val.jsonl"), "--val-every", str(c.val_every)]
        commands = {
            "watchdog": [FULMEN, "watchdog"],
            # a fixed port for this run, so the restarted proxy is where the store says it is
            "llm-proxy": [FULMEN, "llm-proxy", "--backend", "torch", "--model-dir", str(w / "tiny"),
                          "--port", str(free_port())],
            "runner": [FULMEN, "runner", "--agent", "examples.arithmetic_agent:agent",
                       "--concurrency", str(c.runner_concurrency)],
            "adapter": [FULMEN, "adapter"],
            "trainer": [FULMEN, "trainer"],
            "algorithm": algorithm,
        }
        if c.val_tasks:
            commands["evaluator"] = [FULMEN, "evaluator"]
        if self.redis_url is None:
            commands = {"redis": [FULMEN, "redis"], **commands}
        return commands

    async def start(self) -> None:
        c, w = self.config, self.workdir
        (w / "logs").mkdir(parents=True, exist_ok=True)
        build_tiny_model(w / "tiny")
        arithmetic.write_jsonl(w / "train.jsonl", arithmetic.make_tasks("train", c.train_tasks, seed=c.seed))
        if c.val_tasks:
            arithmetic.write_jsonl(w / "val.jsonl", arithmetic.make_tasks("val", c.val_tasks, seed=c.seed))
        env = self._env()
        for name, argv in self._commands().items():
            self.services[name] = Service(name, argv, env, w / "logs")
        if "redis" in self.services:
            self.services["redis"].start()
            assert self.redis_port is not None
            await asyncio.to_thread(wait_for_port, self.redis_port, 30.0)
        url = self.redis_url or f"redis://127.0.0.1:{self.redis_port}/0"
        self.client = aioredis.from_url(url)
        self.store = RedisStore(self.client, self.experiment)
        # the policy the runners use: the tiny model's base weights, sampled at temperature 1
        await self.store.resources.add_resources(
            {"llm": {"kind": "llm", "model": "tiny", "model_version": "base",
                     "sampling_parameters": {"temperature": 1.0}}},
            resources_id="policy",
        )
        self.started = time.monotonic()
        for name, service in self.services.items():
            if name not in ("redis", "algorithm"):
                service.start()
        self._supervising = True
        # The algorithm last, once a proxy serves: on a busy machine the proxy takes tens of seconds
        # to load torch, and attempts that find no proxy for 30 s fail (NoProxy) and shrink groups —
        # a start-up race, not what this run is about.
        store = self.store

        async def proxy_registered() -> bool:
            return bool(await store.registry.query_proxies())

        await self.wait_for("an LLM proxy registered", proxy_registered, 240.0)
        self.services["algorithm"].start()

    async def close(self) -> None:
        self._supervising = False
        for name, service in self.services.items():
            if name != "redis":
                service.stop()
        for name, service in self.services.items():
            if name != "redis":
                await asyncio.to_thread(service.reap)
        if self.client is not None:
            await self.client.aclose()
        if "redis" in self.services:  # last: the others flush to it on the way out
            self.services["redis"].stop()
            await asyncio.to_thread(self.services["redis"].reap)

    # --- during the run -------------------------------------------------------------------------------

    def supervise(self) -> None:
        """Restart any service that exited on its own (systemd's Restart=always), and record it. The
        algorithm exiting 0 is the end of the run, not a crash."""
        if not self._supervising:
            return
        for name, service in self.services.items():
            code = service.process.poll() if service.process is not None else None
            if code is None or service.down or (name == "algorithm" and self._run_ended(service)):
                continue
            service.unexpected_exits.append(code)
            service.exit_logs.append(service.stderr_tail(3000))
            service.start()

    @staticmethod
    def _run_ended(algorithm: Service) -> bool:
        """The algorithm exited 0 with a summary of a finished run (a SIGTERMed one says "stopped")."""
        if algorithm.process is None or algorithm.process.poll() != 0:
            return False
        summary = algorithm.summary()
        return summary is not None and not summary.get("stopped")

    @property
    def ended(self) -> bool:
        return "algorithm" in self.services and self._run_ended(self.services["algorithm"])

    async def wait_for(self, what: str, condition: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
        """Supervise until ``condition`` holds; fail with the services' state if it never does."""
        deadline = time.monotonic() + timeout_s
        while not await self._holds(condition):
            self.supervise()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f} s\n{self.describe()}")
            await asyncio.sleep(0.05)  # some moments last a second or two (a trainer holding samples)

    @staticmethod
    async def _holds(condition: Callable[[], Awaitable[bool]]) -> bool:
        """A condition read from Redis is false while Redis is down (a fault can restart it)."""
        try:
            return await condition()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            return False
        except redis.exceptions.ResponseError as e:  # LOADING: the restarted server reads its AOF
            if "LOADING" in str(e):
                return False
            raise

    async def pause(self, seconds: float) -> None:
        """Sleep, supervising."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.supervise()
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    async def progress(self) -> tuple[int, int, int]:
        """What grows while the pipeline works: completions, samples, trainer steps."""
        assert self.store is not None
        keys = self.store.keys
        pipe = self.store.redis.pipeline(transaction=False)
        for key in (keys.finished, keys.samples, keys.trainer_steps):
            pipe.xlen(key)
        finished, samples, steps = await pipe.execute()
        return int(finished), int(samples), int(steps)

    async def fault(self, name: str, sig: int, down_s: float, resume_timeout_s: float = 60.0) -> Fault:
        """Stop ``name`` with ``sig``, keep it down ``down_s``, start it again; then wait (at most
        ``resume_timeout_s``) until the pipeline makes progress. Returns what happened."""
        service = self.services[name]
        at = time.monotonic() - self.started
        service.down = True
        try:
            await asyncio.to_thread(service.kill, sig)
            if name == "redis":  # clients see their connection drop; the server comes back from its AOF
                assert self.client is not None
                await self.client.connection_pool.disconnect()
            await self.pause(down_s)
            service.start()
            if name == "redis":
                assert self.redis_port is not None
                await asyncio.to_thread(wait_for_port, self.redis_port, 30.0)
        finally:
            service.down = False
        back = time.monotonic()
        fault = Fault(round(at, 2), name, signal.Signals(sig).name, round(down_s, 2))
        before: tuple[int, int, int] | None = None
        while time.monotonic() - back < resume_timeout_s and not self.ended:
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                now = await self.progress()
                if before is None:
                    before = now
                elif any(b > a for a, b in zip(before, now, strict=True)):
                    fault.resume_s = round(time.monotonic() - back, 2)
                    break
            await self.pause(0.05)
        return fault

    async def version(self) -> int:
        assert self.store is not None
        try:
            update = await self.store.resources.get_resources("policy")
        except NotFound:
            return 0
        return ModelVersion.of(update).number

    async def count_status(self, *statuses: RolloutStatus) -> int:
        assert self.store is not None
        return sum([await self.store.redis.scard(self.store.keys.status(s.value)) for s in statuses])

    async def trainer_pending(self) -> int:
        assert self.store is not None
        from fulmen import keys as k

        with contextlib.suppress(Exception):  # no group yet: nothing pending
            return int((await self.store.redis.xpending(self.store.keys.samples, k.TRAINERS_GROUP))["pending"])
        return 0

    async def chaos(self, name: str, moment: Callable[[ChaosRun], Awaitable[bool]], timeout_s: float = 180.0) -> Fault:
        """Wait for ``moment``, SIGKILL ``name``, start it again with the same command at once; then
        wait for the pipeline to make progress. Returns the fault, with the time it took to resume."""
        async def moment_or_end() -> bool:
            if self.ended:  # the moment can never come now: say so rather than wait for the deadline
                raise TimeoutError(f"the moment to kill {name}: the run ended first\n{self.describe()}")
            return await moment(self)

        await self.wait_for(f"the moment to kill {name}", moment_or_end, timeout_s)
        return await self.fault(name, signal.SIGKILL, 0.0)

    async def finish(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Wait for the algorithm to end the run (exit 0), supervising; returns its summary."""
        algorithm = self.services["algorithm"]

        async def ended() -> bool:
            return self._run_ended(algorithm)

        await self.wait_for("the run's end", ended, timeout_s)
        self.summary = algorithm.summary()
        assert self.summary is not None
        return self.summary

    async def settle(self, timeout_s: float = 120.0) -> None:
        """After the run: let the rollouts still in flight end and the adapter take in every
        completion, so the checks see the pipeline at rest (the services keep running meanwhile)."""
        assert self.store is not None
        store = self.store
        from fulmen import keys as k

        async def at_rest() -> bool:
            busy = (RolloutStatus.QUEUING, RolloutStatus.REQUEUING, RolloutStatus.PREPARING, RolloutStatus.RUNNING)
            if await self.count_status(*busy):
                return False
            # Redis 6.2 has no group "lag": compare the group's last delivered id with the stream's last
            groups = await store.redis.xinfo_groups(store.keys.finished)
            adapter = [g for g in groups if g["name"] == k.ADAPTER_GROUP.encode()]
            last = await store.redis.xrevrange(store.keys.finished, count=1)
            return (bool(adapter) and adapter[0]["pending"] == 0
                    and (not last or adapter[0]["last-delivered-id"] == last[0][0]))

        await self.wait_for("the pipeline at rest after the run", at_rest, timeout_s)
        if self.config.val_tasks:
            await self.wait_for("the validation jobs run", self._validation_jobs_done, timeout_s)

    def _eval_queue(self) -> Any:
        import redis
        from rq import Queue
        from rq.serializers import JSONSerializer

        from fulmen.keys import Keys

        url = self.redis_url or f"redis://127.0.0.1:{self.redis_port}/0"
        return Queue(Keys(self.experiment).eval_queue, connection=redis.Redis.from_url(url), serializer=JSONSerializer)

    async def _validation_jobs_done(self) -> bool:
        def done() -> bool:
            queue = self._eval_queue()
            try:
                return not queue.job_ids and not queue.started_job_registry.get_job_ids(cleanup=False)
            finally:
                queue.connection.close()

        return await asyncio.to_thread(done)

    def describe(self) -> str:
        lines = []
        for name, s in self.services.items():
            code = s.process.poll() if s.process is not None else None
            lines.append(f"--- {name}: starts {s.starts}, exit {code}, unexpected exits {s.unexpected_exits}\n"
                         f"{s.stderr_tail(1500)}")
        return "\n".join(lines)

    # --- after the run ---------------------------------------------------------------------------------

    async def check_store(self, killed: str) -> Verdict:
        """The store and the trainer's metrics against what the run must have done (see the module doc)."""
        assert self.store is not None
        store, c = self.store, self.config
        v = Verdict(killed, wall_s=time.monotonic() - self.started)
        v.restarts = {n: s.starts - 1 for n, s in self.services.items() if s.starts > 1}
        v.unexpected_exits = {n: s.unexpected_exits for n, s in self.services.items() if s.unexpected_exits}
        v.exit_logs = {n: s.exit_logs for n, s in self.services.items() if s.exit_logs}
        v.finished = self.summary is not None
        v.steps = await self.version()
        if v.steps < c.total_steps:
            v.problems.append(f"the run ended at version {v.steps}, before {c.total_steps}")

        # the ids the scheduler must have enqueued: its order is a pure function of seed and epoch
        state = {key.decode(): int(value) for key, value in (await store.redis.hgetall(store.keys.algorithm_state)).items()
                 if key in (b"epoch", b"cursor", b"groups", b"enqueued")}
        tasks = load_tasks(self.workdir / "train.jsonl")
        order = Scheduler(store, tasks, SchedulerOptions(n_samples=c.n_samples, seed=c.seed), run=RUN)
        expected: list[str] = []
        for g in range(state.get("groups", 0)):
            epoch, position = divmod(g, len(tasks))
            tid = task_id(tasks[order.order(epoch)[position]])
            expected += [f"{RUN}-e{epoch}-{tid}-{i}" for i in range(c.n_samples)]
        v.expected = len(expected)
        if state.get("enqueued") != len(expected):
            v.problems.append(f"the algorithm recorded {state.get('enqueued')} rollouts enqueued for "
                              f"{state.get('groups')} groups of {c.n_samples}")

        indexed = [rid.decode() for rid in await store.redis.zrange(store.keys.rollout_index, 0, -1)]
        train = [rid for rid in indexed if rid.startswith(f"{RUN}-e")]
        v.rollouts = len(train)
        missing, extra = set(expected) - set(train), set(train) - set(expected)
        v.lost = len(missing)
        if missing:
            v.problems.append(f"{len(missing)} rollouts never enqueued, e.g. {sorted(missing)[:3]}")
        if extra:
            v.problems.append(f"{len(extra)} rollouts the run's groups do not account for, e.g. {sorted(extra)[:3]}")

        rollouts = await store.rollouts.get_rollouts(train)
        for r in rollouts:
            assert r is not None
            if r.status not in TERMINAL:
                v.not_terminal += 1
            v.failed += r.status is RolloutStatus.FAILED
        pipe = store.redis.pipeline(transaction=False)
        for rid in train:
            pipe.hget(store.keys.rollout(rid), "attempt_n")
        v.retried = sum(1 for n in await pipe.execute() if int(n or 0) > 1)
        if v.not_terminal:
            stuck = [(r.rollout_id, r.status.value) for r in rollouts if r is not None and r.status not in TERMINAL]
            v.problems.append(f"{v.not_terminal} train rollouts never ended, e.g. {stuck[:3]}")

        # completions: once per terminal rollout; the algorithm's done set counts each once
        completions = Counter[str]()
        for _, fields in await store.redis.xrange(store.keys.finished):
            completions[RolloutFinished.from_wire(fields[b"m"]).rollout_id] += 1
        twice = {rid: n for rid, n in completions.items() if rid.startswith(f"{RUN}-e") and n > 1}
        unreported = [r.rollout_id for r in rollouts if r is not None and r.status in TERMINAL
                      and completions[r.rollout_id] == 0]
        done = {x.decode() for x in await store.redis.smembers(store.keys.algorithm_done)}
        if twice:
            v.problems.append(f"{len(twice)} rollouts completed more than once: {dict(list(twice.items())[:3])}")
        if unreported:
            v.problems.append(f"{len(unreported)} terminal rollouts never reached the completions stream")
        # the algorithm stops reading when the run ends: what it has not read yet is either after its
        # group's last delivered entry or pending; with those, its done set is every terminal rollout
        from fulmen import keys as k

        groups = {g["name"]: g for g in await store.redis.xinfo_groups(store.keys.finished)}
        last_read = groups[k.ALGORITHM_GROUP.encode()]["last-delivered-id"].decode()
        pending = {e["message_id"].decode() for e in await store.redis.xpending_range(
            store.keys.finished, k.ALGORITHM_GROUP, "-", "+", 10_000)}
        unread = {RolloutFinished.from_wire(fields[b"m"]).rollout_id
                  for eid, fields in await store.redis.xrange(store.keys.finished)
                  if _after(eid.decode(), last_read) or eid.decode() in pending}
        terminal = {r.rollout_id for r in rollouts if r is not None and r.status in TERMINAL}
        if not done <= terminal or (terminal - done) - unread:
            v.problems.append(f"the algorithm's done set ({len(done)}) is not the terminal train rollouts "
                              f"({len(terminal)}) less the {len(unread & terminal)} completions it never read")

        # samples: one adapter write per rollout (HSETNX 'sampled'); no sample id twice on the stream
        sample_ids = Counter[str]()
        sample_versions: dict[str, int] = {}  # sample id -> the version that generated it
        base_rollouts: list[str] = []  # train rollout of each sample the base weights generated
        samples_of = Counter[str]()  # train attempt -> its samples
        self._samples_of = samples_of
        entries_of = Counter[str]()  # train rollout -> samples-stream entries (samples or a skip)
        attempts_of: dict[str, set[str | None]] = {}  # train rollout -> the attempts they came from
        for _, fields in await store.redis.xrange(store.keys.samples):
            item: Sample | SampleSkip = decode_sample(fields[b"m"], store.max_record_bytes)
            if isinstance(item, Sample):
                sample_ids[item.sample_id] += 1
                sample_versions[item.sample_id] = ModelVersion.parse(item.model_version).number
                if item.rollout_id.startswith(f"{RUN}-e"):
                    samples_of[item.attempt_id] += 1
                    if sample_versions[item.sample_id] == 0:
                        base_rollouts.append(item.rollout_id)
            if item.rollout_id.startswith(f"{RUN}-e"):
                entries_of[item.rollout_id] += 1
                attempts_of.setdefault(item.rollout_id, set()).add(item.attempt_id)
        several = {rid: sorted(map(str, a)) for rid, a in attempts_of.items() if len(a) > 1}
        doubled = {sid: n for sid, n in sample_ids.items() if n > 1}
        if doubled:
            v.problems.append(f"{len(doubled)} sample ids on the samples stream twice, e.g. {list(doubled)[:3]}")
        if several:
            v.problems.append(f"{len(several)} rollouts adapted from more than one attempt, e.g. "
                              f"{list(several.items())[:3]}")
        unsampled = [rid for rid in done if entries_of[rid] == 0]
        v.duplicated = len(twice) + len(doubled) + len(several)

        # the trainer: steps 1..N once each, every sample trained at most once and known to the stream
        lines = [json.loads(x) for x in (self.workdir / "metrics.jsonl").read_text().splitlines()] \
            if (self.workdir / "metrics.jsonl").exists() else []
        steps = [line["step"] for line in lines]
        if steps != list(range(1, len(steps) + 1)):
            v.problems.append(f"trainer steps logged are not 1..N once each: {steps}")
        trained = Counter(sid for line in lines for sid in line["sample_ids"])
        v.trained_samples = sum(trained.values())
        v.trained_twice = sum(1 for n in trained.values() if n > 1)
        if v.trained_twice:
            v.problems.append(f"{v.trained_twice} samples trained on twice, e.g. "
                              f"{[s for s, n in trained.items() if n > 1][:3]}")
        await self._check_attempts_and_calls(v, rollouts)
        await self._check_infrastructure_faults(v, rollouts, base_rollouts)
        self._check_staleness(v, lines, sample_versions)
        unknown = set(trained) - set(sample_ids)
        if unknown:
            v.problems.append(f"{len(unknown)} trained sample ids are not on the samples stream")
        v.duplicated += v.trained_twice
        v.lost += len(unsampled)
        if unsampled:
            # a skip record is written for a rollout with nothing to train on, so none may be silent
            pending = await self._adapter_pending()
            v.problems.append(f"{len(unsampled)} terminal train rollouts have no samples and no skip record "
                              f"(adapter pending {pending}), e.g. {sorted(unsampled)[:3]}")
        if c.val_tasks:
            await self._check_validations(v)
        if "llm-proxy" in self.services:  # not when only the store is checked (the checker's own tests)
            await self._check_proxies_serve_newest(v)
        v.dead_letters = len(await store.redis.xrange(store.keys.dead_letters))
        if v.dead_letters:
            v.problems.append(f"{v.dead_letters} dead letters")
        return v

    async def _check_attempts_and_calls(self, v: Verdict, rollouts: list[Any]) -> None:
        """One succeeded attempt per rollout at most; an attempt's samples come from distinct logical
        LLM calls (a client's retry of a call is recorded once, so it is not a second sample)."""
        from fulmen.records.status import AttemptStatus
        from fulmen.telemetry.semconv import CALL_KEY, KIND_LLM_CALL, SPAN_KIND

        assert self.store is not None
        for r in rollouts:
            attempts = await self.store.rollouts.query_attempts(r.rollout_id)
            if sum(a.status is AttemptStatus.SUCCEEDED for a in attempts) > 1:
                v.succeeded_twice += 1
        for attempt_id, samples in self._samples_of.items():
            rollout_id = attempt_id.rsplit(".", 1)[0]
            spans = await self.store.spans.query_spans(rollout_id, attempt_id)
            calls = [sp for sp in spans if sp.attributes.get(SPAN_KIND) == KIND_LLM_CALL]
            keyed = Counter(sp.attributes[CALL_KEY] for sp in calls if sp.attributes.get(CALL_KEY))
            logical = len(keyed) + sum(1 for sp in calls if not sp.attributes.get(CALL_KEY))
            if samples > logical or any(n > 1 for n in keyed.values()):
                v.from_retried_calls += 1
        if v.succeeded_twice:
            v.problems.append(f"{v.succeeded_twice} rollouts with more than one succeeded attempt")
        if v.from_retried_calls:
            v.problems.append(f"{v.from_retried_calls} attempts with a retried LLM call recorded or sampled twice")

    async def _check_infrastructure_faults(self, v: Verdict, rollouts: list[Any], base_rollouts: list[str]) -> None:
        """A fault of the infrastructure costs no rollout and no sample: none of the train rollouts
        enqueued once v1 was published was answered by the base weights (a proxy that lost its version
        serves none until it has it back), and none failed because a proxy was unreachable."""
        assert self.store is not None
        policy = [u for u in await self.store.resources.query_resources() if u.resources_id == "policy"]
        v1_at = min((u.create_time for u in policy if ModelVersion.of(u).number >= 1), default=None)
        enqueued = {r.rollout_id: r.enqueue_time for r in rollouts if r is not None}
        if v1_at is not None:
            v.from_base_after_v1 = sum(1 for rid in base_rollouts if (enqueued.get(rid) or 0) > v1_at)
        for r in rollouts:
            if r is None or r.status is not RolloutStatus.FAILED:
                continue
            attempt = await self.store.rollouts.get_latest_attempt(r.rollout_id)
            message = str((attempt.error or {}).get("message", "")) if attempt is not None else ""
            if "unreachable" in message:
                v.failed_by_proxy += 1
        if v.from_base_after_v1:
            v.problems.append(f"{v.from_base_after_v1} train samples from the base weights, of rollouts enqueued "
                              "after v1 was published")
        if v.failed_by_proxy:
            v.problems.append(f"{v.failed_by_proxy} train rollouts failed because a proxy was unreachable")

    def _check_staleness(self, v: Verdict, lines: list[dict[str, Any]], sample_versions: dict[str, int]) -> None:
        """Step s trains the weights the step before published (base at step 1): no sample it trains
        on may be more versions behind them than the trainer's bound."""
        held = 0
        for line in lines:
            for sid in line["sample_ids"]:
                if sid in sample_versions:
                    v.max_staleness = max(v.max_staleness, held - sample_versions[sid])
            held = ModelVersion.parse(line.get("model_version")).number
        if v.max_staleness > self.config.max_staleness:
            v.problems.append(f"a sample {v.max_staleness} versions behind the weights that trained on it "
                              f"(bound {self.config.max_staleness})")

    async def _check_proxies_serve_newest(self, v: Verdict, timeout_s: float = 30.0) -> None:
        """Every live proxy serves the newest version (a restarted one catches up within seconds)."""
        newest = ModelVersion.numbered(await self.version()).name

        async def all_newest() -> bool:
            assert self.store is not None
            proxies = await self.store.registry.query_proxies()
            return bool(proxies) and all(p.model_version == newest for p in proxies)

        try:
            await self.wait_for(f"every proxy serving {newest}", all_newest, timeout_s)
        except TimeoutError:
            assert self.store is not None
            served = {p.proxy_id: p.model_version for p in await self.store.registry.query_proxies()}
            v.problems.append(f"proxies do not all serve the newest version {newest}: {served}")

    async def _check_validations(self, v: Verdict) -> None:
        """Every validation job the algorithm queued ran to the end and its pass was recorded."""
        from fulmen_algorithm.validation import recorded

        assert self.store is not None

        def jobs() -> tuple[list[str], list[str]]:
            queue = self._eval_queue()
            try:
                return queue.finished_job_registry.get_job_ids(), queue.failed_job_registry.get_job_ids()
            finally:
                queue.connection.close()

        finished, failed = await asyncio.to_thread(jobs)
        labels = {r["label"] for r in await recorded(self.store)}
        missing = [job for job in finished if job.rsplit("-", 1)[-1] not in labels]  # val-<experiment>-v<N>
        if failed or missing or "final" not in labels:
            v.problems.append(f"validation passes lost: failed jobs {failed}, finished but unrecorded {missing}, "
                              f"recorded {sorted(labels)}")

    async def _adapter_pending(self) -> int:
        assert self.store is not None
        from fulmen import keys as k

        with contextlib.suppress(Exception):
            return int((await self.store.redis.xpending(self.store.keys.finished, k.ADAPTER_GROUP))["pending"])
        return 0


def _after(entry_id: str, other: str) -> bool:
    """Stream entry ids compare as (milliseconds, sequence) pairs."""
    a, b = entry_id.split("-"), other.split("-")
    return (int(a[0]), int(a[1])) > (int(b[0]), int(b[1]))


# --- when to kill: one moment per service, each chosen so the kill lands on work in hand ------------------


async def after_first_version(run: ChaosRun) -> bool:
    """The trainer has published v1: every service has done its part at least once."""
    return await run.version() >= 1


async def runner_busy(run: ChaosRun) -> bool:
    """After v1, with attempts claimed and not finished: the runner dies holding them."""
    return await run.version() >= 1 and await run.count_status(RolloutStatus.PREPARING, RolloutStatus.RUNNING) > 0


async def trainer_holding_samples(run: ChaosRun) -> bool:
    """After v1, with samples read and not yet covered by a checkpoint: they must be trained once."""
    return await run.version() >= 1 and await run.trainer_pending() > 0


async def rollouts_in_flight(run: ChaosRun) -> bool:
    """After v1, with train rollouts queued or running: the algorithm dies mid-run."""
    busy = (RolloutStatus.QUEUING, RolloutStatus.PREPARING, RolloutStatus.RUNNING)
    return await run.version() >= 1 and await run.count_status(*busy) > 0


async def validation_running(run: ChaosRun) -> bool:
    """A periodic validation pass has its rollouts out: the evaluator dies inside its rq job (the
    baseline's rollouts are queued by the algorithm before the evaluator takes its job)."""
    assert run.store is not None
    indexed = await run.store.redis.zrange(run.store.keys.rollout_index, 0, -1)
    return any(rid.startswith(b"val-v") and not rid.startswith(b"val-v0-") for rid in indexed)


MOMENTS: dict[str, Callable[[ChaosRun], Awaitable[bool]]] = {
    "redis": rollouts_in_flight,
    "watchdog": after_first_version,
    "llm-proxy": runner_busy,
    "runner": runner_busy,
    "adapter": rollouts_in_flight,
    "trainer": trainer_holding_samples,
    "evaluator": validation_running,
    "algorithm": rollouts_in_flight,
}


async def chaos_case(service: str, workdir: Path, experiment: str, config: ChaosConfig | None = None,
                     redis_url: str | None = None, timeout_s: float = 300.0) -> Verdict:
    """One whole case: start the run, kill ``service`` at its moment and restart it (several, joined
    by "+": each in turn, at its own moment), let the run finish, check the store."""
    run = ChaosRun(workdir, experiment, config, redis_url)
    try:
        await run.start()
        faults = [await run.chaos(name, MOMENTS[name], timeout_s=timeout_s)
                  for name in service.split("+") if name != "none"]
        await run.finish(timeout_s=timeout_s)
        await run.settle()
        verdict = await run.check_store(service)
        verdict.resume_s = max((f.resume_s for f in faults if f.resume_s is not None), default=None)
        verdict.wall_s = time.monotonic() - run.started
        return verdict
    except TimeoutError as e:
        verdict = Verdict(service, wall_s=time.monotonic() - run.started, problems=[str(e)[:4000]])
        return verdict
    finally:
        await run.close()


# --- random faults ---------------------------------------------------------------------------------------

SIGNALS = (signal.SIGKILL, signal.SIGTERM)


async def random_faults(run: ChaosRun, seed: int, faults_s: float, *, services: tuple[str, ...] | None = None,
                        gap_s: tuple[float, float] = (1.0, 4.0),
                        down_s: tuple[float, float] = (0.5, 3.0)) -> list[Fault]:
    """Until ``faults_s`` of run time have passed or the run ends: wait a random gap, stop a random
    service with a random signal, start it again after a random pause, wait for progress. A Redis
    fault is followed by a proxy fault (weights stay out of the AOF: the restarted proxy finds its
    version's chunks gone). Every choice comes from ``random.Random(seed)``, so a seed names one
    sequence of faults."""
    rng = random.Random(seed)
    names = services or tuple(run.services)
    faults: list[Fault] = []
    while time.monotonic() - run.started < faults_s and not run.ended:
        await run.pause(rng.uniform(*gap_s))
        name, sig, down = rng.choice(names), rng.choice(SIGNALS), rng.uniform(*down_s)
        if run.ended:
            break
        faults.append(await run.fault(name, sig, down))
        if name == "redis" and "llm-proxy" in run.services and not run.ended:
            faults.append(await run.fault("llm-proxy", rng.choice(SIGNALS), rng.uniform(*down_s)))
    return faults


async def random_fault_case(seed: int, workdir: Path, experiment: str, config: ChaosConfig | None = None,
                            faults_s: float = 45.0, timeout_s: float = 400.0,
                            services: tuple[str, ...] | None = None) -> tuple[Verdict, list[Fault]]:
    """A whole random-fault run on its own embedded Redis (killed too): start, faults for
    ``faults_s``, let the run finish, check the store. Returns the verdict and the faults."""
    run = ChaosRun(workdir, experiment, config, redis_url=None)
    faults: list[Fault] = []
    try:
        await run.start()
        faults = await random_faults(run, seed, faults_s, services=services)
        await run.finish(timeout_s=timeout_s)
        await run.settle()
        verdict = await run.check_store(f"seed {seed}")
        verdict.wall_s = time.monotonic() - run.started
        return verdict, faults
    except TimeoutError as e:
        return Verdict(f"seed {seed}", wall_s=time.monotonic() - run.started, problems=[str(e)[:4000]]), faults
    finally:
        await run.close()
