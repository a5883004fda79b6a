"""A finished run built in-process through the real writers: the algorithm's `Run` to its end (its
state and validation passes), stand-ins for the runner, proxy and trainer that store spans with an
LLM call and a reward, the adapter's samples and counters, the trainer's step records, resources
versions and a dead letter. What the archive must carry across the loss of Redis."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

from fulmen import tokens
from fulmen.records import ProxyEndpoint, Span
from fulmen.settings import AlgorithmSettings
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.steps import append_step, summarize
from fulmen_adapter.adapter import Adapter
from fulmen_algorithm.run import Run

TASKS = [{"id": f"t{i}", "question": f"{i}+1="} for i in range(6)]
VAL = [{"id": "v0", "question": "1+1="}, {"id": "v1", "question": "2+1="}]
PROXY = "proxy-1"
GROUPS_PER_STEP, GROUP_SIZE, STEPS = 2, 2, 3


def _spans(rollout_id: str, attempt_id: str, version: str, reward: float) -> list[Span]:
    """A rollout span, one LLM call under it (tokens and log-probabilities, as the proxy records) and a reward."""
    now = time.time()
    root = Span(rollout_id, attempt_id, f"root-{attempt_id}", semconv.ROLLOUT_SPAN, start_time=now - 1, end_time=now,
                attributes={semconv.SPAN_KIND: semconv.KIND_ROLLOUT})
    request = {"model": "policy", "messages": [{"role": "user", "content": f"task of {rollout_id}"}]}
    call = Span(rollout_id, attempt_id, f"llm-{attempt_id}", "chat policy", parent_id=root.span_id,
                start_time=now - 0.5, end_time=now - 0.4, attributes={
                    semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.MODEL_VERSION: version,
                    semconv.REQUEST_JSON: json.dumps(request),
                    semconv.RESPONSE_JSON: json.dumps({"role": "assistant", "content": "42"}),
                    semconv.PROMPT_TOKEN_IDS: tokens.pack_ids([5, 6, 7]),
                    semconv.RESPONSE_TOKEN_IDS: tokens.pack_ids([11, 12]),
                    semconv.RESPONSE_LOGPROBS: tokens.pack_floats([-0.25, -0.5])})
    score = Span(rollout_id, attempt_id, f"reward-{attempt_id}", semconv.REWARD_SPAN, parent_id=root.span_id,
                 start_time=now, end_time=now, attributes={semconv.SPAN_KIND: semconv.KIND_REWARD, semconv.REWARD: reward})
    return [root, call, score]


class Pipeline:
    """Stand-ins for the runner, a torch proxy and the trainer: each queued rollout runs one LLM call
    (the first rollout's attempt fails, and the rollout with it: no retry on a plain failure), the adapter samples the finished ones,
    and the trainer steps (a step record, a policy version) each time enough groups are complete."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.step = 0
        self.done: Counter[str] = Counter()
        self.failed_once = False
        self.stopping = False  # the run is over: the loop ends after its pass in hand

    @property
    def version(self) -> str:
        return f"v{self.step}" if self.step else "base"

    async def serve(self) -> None:
        store = self.store
        while not self.stopping:
            await store.registry.register_proxy(ProxyEndpoint(PROXY, "http://proxy:1", "m", self.version,
                                                              metadata={"backend": "torch"}))
            for claimed in await store.queue.dequeue_rollouts("worker-1", 100):
                await self._attempt(claimed.rollout.rollout_id, claimed.attempt.attempt_id, claimed.rollout.metadata)
            await Adapter(store).run(asyncio.Event(), until_idle=True, lanes=1)
            complete = sum(1 for n in self.done.values() if n == GROUP_SIZE)
            while complete >= (self.step + 1) * GROUPS_PER_STEP:
                await self._train()
            await asyncio.sleep(0.02)

    async def _attempt(self, rollout_id: str, attempt_id: str, metadata: dict) -> None:
        store = self.store
        reward = 1.0 if rollout_id.endswith(("0", "2", "4", "6", "8")) else 0.0
        await store.spans.add_spans(_spans(rollout_id, attempt_id, self.version, reward))
        if not self.failed_once and metadata.get("group_key"):
            self.failed_once = True  # a failed rollout, in the status counts and the adapter's skips
            await store.rollouts.update_attempt(rollout_id, attempt_id, status="failed")
            return
        await store.rollouts.update_attempt(rollout_id, attempt_id, status="succeeded", reward=reward)
        if metadata.get("group_key"):
            self.done[metadata["group_key"]] += 1

    async def _train(self) -> None:
        self.step += 1
        version = f"v{self.step}"
        policy = await self.store.resources.get_resources("policy")
        llm = {**policy.resources["llm"], "model_version": version}
        await self.store.resources.update_resources("policy", {**policy.resources, "llm": llm})
        metrics = {"model_version": version, "rollout/reward_mean": 0.25 * self.step, "loss/total": 1.0 / self.step,
                   "loss/kl": 0.01 * self.step, "perf/samples": 4}
        await append_step(self.store.redis, self.store.keys, summarize(self.step, metrics, time.time()))


async def finished_run(store: RedisStore, data_dir: Path) -> dict:
    """Run an experiment to its end in ``store``; the algorithm's summary."""
    await store.resources.add_resources({"llm": {"kind": "llm", "model": "m", "model_version": "base"}},
                                        resources_id="policy")
    settings = AlgorithmSettings(
        experiment=store.experiment, data_dir=data_dir, metrics_file=data_dir / "m.jsonl", n_samples=GROUP_SIZE,
        groups_per_step=GROUPS_PER_STEP, max_inflight=100, staleness=1, total_steps=STEPS, val_timeout_s=20,
    )
    pipeline = Pipeline(store)
    serving = asyncio.create_task(pipeline.serve())
    try:
        summary = await asyncio.wait_for(Run(settings, TASKS, VAL).run(store), 60)
        await asyncio.sleep(0.3)  # the final pass's last rollouts sampled
    finally:
        # a flag, not a cancel: a cancel that lands inside the adapter's pass can be absorbed by it,
        # and awaiting the loop then waited forever (seen once under CI load)
        pipeline.stopping = True
        done, _ = await asyncio.wait({serving}, timeout=30)  # its last writes land before the proxy goes below
        if not done:
            serving.cancel()  # not awaited: see above
    await store.dead_letters.dead_letter(store.keys.samples, "1-0", "sample record unreadable", {b"m": b"\x00garbage"})
    await store.registry.unregister_proxy(PROXY)  # the services stopped with the run
    return summary
