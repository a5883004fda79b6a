"""Convergence parity (issue 6): 2 trainer ranks with top-k at 1% plus error feedback against 2
uncompressed ranks, by replaying one recorded sample stream of the arithmetic task.

1. Record, once (cached in ``--cache``, default ``.fulmen/convergence-parity``): the demo's tiny Llama
   (hidden 64, 2 layers, ``initializer_range`` 0.02), an SFT warm start on demonstrations until
   greedy accuracy on 200 training tasks reaches ``--warm-until`` (as `fulmen demo` does), then
   ``--steps × --groups-per-step`` tasks, each sampled ``--n`` times in-process by that model
   (temperature 1, up to 5 tokens). Each completion is a `fulmen.records.Sample` as the adapter
   writes it: prompt and response token ids, the sampling policy's log-probabilities (the behaviour
   log-probs the proxy would record), reward by `fulmen.demo.arithmetic.reward`. Saved as msgpack (the
   samples' wire records), never pickle. Nothing is downloaded.
2. Replay, per seed and config (``none``, ``topk`` at ``--density`` with error feedback): a fresh
   experiment on an embedded Redis, the recorded groups pushed in an order shuffled by the seed (both
   configs of a seed see the same order), and 2 trainer ranks — the trainer's own rank code, both in
   this process, one torch thread each — train ``--steps`` steps of ``--groups-per-step`` groups
   (GRPO, PPO-clip with ``--ppo-epochs`` updates per batch).
3. Reward of the final policy: greedy accuracy (= mean exact reward) on ``--val`` held-out
   validation tasks, also measured for the warm start.

Prints one line per seed, the means, and as its last line one JSON object. The acceptance criterion
is ``reward_gap`` (|mean none − mean topk|) ≤ 0.05 after the same number of steps.

    python bench/convergence_parity.py                      # ~4 min with the recording, ~2.5 min after
    python bench/convergence_parity.py --rerecord           # record the stream again
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import torch

from fulmen.demo import arithmetic
from fulmen.errors import RecordError
from fulmen.records import Sample

log = logging.getLogger("convergence_parity")
FORMAT = 1  # of the cache file below; bump when what it holds changes
MAX_TOKENS = 5  # 3 digits, the eos and one spare (the demo's max_tokens)


# --- the policy, sampled and evaluated in-process --------------------------------------------------


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@torch.no_grad()
def decode(model: Any, prompts: list[list[int]], *, eos: int, greedy: bool, generator: torch.Generator | None = None,
           batch: int = 256) -> list[tuple[list[int], list[float]]]:
    """Up to MAX_TOKENS tokens per prompt, ending at the eos (kept): (token ids, their log-probs).
    The arithmetic prompts of one digit count have one length, so no padding is needed; a batch
    holds prompts of one length."""
    out: list[tuple[list[int], list[float]]] = []
    was_training = model.training
    model.eval()
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo : lo + batch]
        assert len({len(p) for p in chunk}) == 1, "prompts of one batch must have one length"
        ids = torch.tensor(chunk)
        done = torch.zeros(len(chunk), dtype=torch.bool)
        tokens: list[list[int]] = [[] for _ in chunk]
        logps: list[list[float]] = [[] for _ in chunk]
        for _ in range(MAX_TOKENS):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
            nxt = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
            chosen = logp.gather(1, nxt[:, None])[:, 0]
            for i in range(len(chunk)):
                if not done[i]:
                    tokens[i].append(int(nxt[i]))
                    logps[i].append(float(chosen[i]))
            done |= nxt == eos
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], 1)
        out += list(zip(tokens, logps, strict=True))
    model.train(was_training)
    return out


def greedy_accuracy(model: Any, tokenizer: Any, tasks: list[dict[str, Any]]) -> float:
    answers = decode(model, [prompt_ids(tokenizer, t["question"]) for t in tasks], eos=tokenizer.eos_token_id,
                     greedy=True)
    texts = tokenizer.batch_decode([ids for ids, _ in answers], skip_special_tokens=True)
    return sum(arithmetic.reward(t, a) for t, a in zip(tasks, texts, strict=True)) / len(tasks)


def warm_start(folder: Path, train: list[dict[str, Any]], *, seed: int, until: float) -> dict[str, Any]:
    """The demo's warm start: SFT on demonstrations (batch 64, AdamW 3e-3) until greedy accuracy on
    200 training tasks reaches ``until`` — its curve is too steep for a fixed step count."""
    from fulmen.demo.tiny_model import TinyModelSpec, build_tiny_model, load_tiny_model
    from fulmen.demo.warm_start import sft_step  # the step both demos' warm starts take

    torch.manual_seed(seed)
    build_tiny_model(folder, TinyModelSpec(initializer_range=0.02), seed=seed)
    model, tokenizer = load_tiny_model(folder)
    model.train()
    demos = arithmetic.demonstrations(train, seed=seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99))
    eos = tokenizer.eos_token_id
    accuracy, step = 0.0, 0
    for step in range(1, 1001):
        batch = []
        for d in rng.sample(demos, 64):
            prompt = prompt_ids(tokenizer, d["prompt"])
            answer = [*tokenizer(d["completion"], add_special_tokens=False).input_ids, eos]
            batch.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
        sft_step(model, optimizer, batch, tokenizer.pad_token_id)
        if step % 4 == 0:
            accuracy = greedy_accuracy(model, tokenizer, train[:200])
            if accuracy >= until:
                break
    model.save_pretrained(folder, safe_serialization=True)
    return {"sft_steps": step, "sft_train_accuracy": accuracy}


# --- recording the stream once -----------------------------------------------------------------------


def record(cache: Path, args: argparse.Namespace) -> tuple[list[list[Sample]], dict[str, Any]]:
    """The recorded groups (each: the n samples of one task) and what was recorded, from the cache
    when it holds a stream recorded with the same arguments."""
    from fulmen.demo.tiny_model import load_tiny_model

    wanted = {"format": FORMAT, "seed": args.record_seed, "groups": args.steps * args.groups_per_step,
              "n": args.n, "warm_until": args.warm_until}
    stream = cache / "stream.msgpack"
    if stream.exists() and not args.rerecord:
        try:
            saved = msgpack.unpackb(stream.read_bytes())
            if saved["meta"]["key"] == wanted:
                groups = [[Sample.from_wire(b) for b in g] for g in saved["groups"]]
                log.info("replaying the stream recorded in %s (%d groups)", stream, len(groups))
                return groups, saved["meta"]
        except (RecordError, KeyError, ValueError) as e:  # an older Sample format: record again
            log.info("cached stream unusable (%s): recording again", e)
    started = time.perf_counter()
    model_dir = cache / "model"
    train = arithmetic.make_tasks("train", 4000, seed=args.record_seed)
    warm_key = {"format": FORMAT, "seed": args.record_seed, "warm_until": args.warm_until}
    marker = model_dir / "warm_start.json"
    warm = json.loads(marker.read_text()) if marker.exists() and not args.rerecord else {}
    if warm.get("key") != warm_key:  # the warm start (a minute of SFT) is kept apart from the stream
        shutil.rmtree(cache, ignore_errors=True)
        warm = {"key": warm_key, **warm_start(model_dir, train, seed=args.record_seed, until=args.warm_until)}
        marker.write_text(json.dumps(warm))
    model, tokenizer = load_tiny_model(model_dir)
    tasks = random.Random(args.record_seed).sample(train, wanted["groups"])
    prompts = [prompt_ids(tokenizer, t["question"]) for t in tasks for _ in range(args.n)]
    generator = torch.Generator().manual_seed(args.record_seed)
    completions = decode(model, prompts, eos=tokenizer.eos_token_id, greedy=False, generator=generator)
    groups: list[list[Sample]] = []
    for g, task in enumerate(tasks):
        group = []
        for i in range(args.n):
            ids, logps = completions[g * args.n + i]
            reward = arithmetic.reward(task, tokenizer.decode(ids, skip_special_tokens=True))
            rollout = f"{task['id']}-r{i}"
            group.append(Sample(f"{rollout}.1/t0", "triplet", rollout, f"{rollout}.1", task["id"], 0,
                                prompts[g * args.n + i], ids, logps, [1] * len(ids), reward, reward, "base",
                                mode="train", group_size=args.n))
        groups.append(group)
    rewards = [s.reward or 0.0 for g in groups for s in g]
    meta = {"key": wanted, "sft_steps": warm["sft_steps"], "sample_reward_mean": sum(rewards) / len(rewards),
            "record_s": round(time.perf_counter() - started, 1)}
    stream.write_bytes(msgpack.packb({"meta": meta, "groups": [[s.to_wire() for s in g] for g in groups]}))
    log.info("recorded %d groups (%d samples, reward %.3f) in %.0f s: %s", len(groups), len(rewards),
             meta["sample_reward_mean"], meta["record_s"], stream)
    return groups, meta


# --- replaying it through 2 trainer ranks --------------------------------------------------------------


async def replay(redis_url: str, model_dir: Path, groups: list[list[Sample]], *, codec: str, seed: int,
                 args: argparse.Namespace, out: Path) -> Any:
    """Train 2 Redis ranks on ``groups`` (in this seed's order) for ``args.steps`` steps; the leader's
    model (both ranks hold the same weights)."""
    import redis.asyncio as aioredis

    from fulmen.settings import TrainerSettings, load_settings
    from fulmen.store import RedisStore
    from fulmen_trainer.distributed.exchange import Exchange
    from fulmen_trainer.distributed.gradients import RankCodec
    from fulmen_trainer.distributed.membership import Membership
    from fulmen_trainer.distributed.rank_group import RankGroup
    from fulmen_trainer.trainer import Trainer

    client = aioredis.from_url(redis_url)
    store = RedisStore(client, f"parity-{codec}-{seed}-{uuid.uuid4().hex[:6]}")
    settings = load_settings(TrainerSettings,
        model_dir=model_dir, experiment=store.experiment, world_size=2, codec=codec, codec_density=args.density,
        groups_per_step=args.groups_per_step, ppo_epochs=args.ppo_epochs, learning_rate=args.lr,
        lr_warmup_steps=args.warmup, max_steps=args.steps, seed=seed, torch_threads=1,
        checkpoint_dir=out / "ck", checkpoint_every=10_000, publish_every=10_000, metrics_file=out / "m.jsonl",
        rank_timeout_s=60,
    )
    trainers, beats = [], []
    try:
        for _ in range(2):
            members = Membership(store, 2, settings.rank_timeout_s)
            rank = await members.claim()
            beats.append(asyncio.create_task(members.heartbeat()))
            exchange = Exchange(store, members)
            await exchange.start_reading()
            ranks = RankGroup(store, members, exchange, RankCodec(codec, density=args.density, seed=seed))
            trainers.append(Trainer(store, settings, rank=rank, ranks=ranks))
        for trainer in trainers:
            await trainer.setup()
            await trainer.ranks.members.mark_ready()
        order = list(range(len(groups)))
        random.Random(seed).shuffle(order)
        pipe = store.redis.pipeline(transaction=False)
        for g in order:
            for s in groups[g]:
                pipe.xadd(store.keys.samples, {"m": s.to_wire()})
        await pipe.execute()
        leader, follower = trainers
        stop = asyncio.Event()
        # as `fulmen trainer` runs a Redis rank: rank 0 takes the leader's lease, rank 1 follows
        following = asyncio.create_task(follower.ranks.serve(follower, stop))
        await leader.ranks.serve(leader, asyncio.Event())
        while follower.step < leader.step and not following.done():
            await asyncio.sleep(0.05)
        stop.set()
        await following
        for a, b in zip(leader.model.parameters(), follower.model.parameters(), strict=True):
            assert torch.equal(a, b), "the two ranks must hold the same weights"
        return leader.model
    finally:
        for beat in beats:
            beat.cancel()
        for trainer in trainers:
            await trainer.ranks.members.release()
        await client.aclose()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from fulmen.demo.tiny_model import load_tiny_model
    from fulmen.store.redis.embedded import EmbeddedRedis

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    cache = Path(args.cache)
    groups, meta = record(cache, args)
    _, tokenizer = load_tiny_model(cache / "model")
    val = arithmetic.make_tasks("val", args.val, seed=args.record_seed)
    warm_model, _ = load_tiny_model(cache / "model")
    warm_accuracy = greedy_accuracy(warm_model, tokenizer, val)
    log.info("warm start: greedy accuracy %.3f on %d validation tasks", warm_accuracy, len(val))
    results: dict[str, list[float]] = {"none": [], "topk": []}
    replay_s = []
    with tempfile.TemporaryDirectory(prefix="fulmen-parity-") as tmp, EmbeddedRedis(tmp, port=None) as server:
        for seed in args.seeds:
            for codec in ("none", "topk"):
                t0 = time.perf_counter()
                model = asyncio.run(replay(server.url, cache / "model", groups, codec=codec, seed=seed, args=args,
                                           out=Path(tmp) / f"{codec}-{seed}"))
                torch.set_num_threads(args.threads)  # the trainers set 1 for the whole process
                results[codec].append(greedy_accuracy(model, tokenizer, val))
                replay_s.append(time.perf_counter() - t0)
            gap = results["none"][-1] - results["topk"][-1]
            print(f"seed {seed}: reward none {results['none'][-1]:.3f}  topk{args.density:.0%}+EF "
                  f"{results['topk'][-1]:.3f}  gap {gap:+.3f}", flush=True)
    none_mean, topk_mean = statistics.mean(results["none"]), statistics.mean(results["topk"])
    print(f"means over {len(args.seeds)} seeds: none {none_mean:.3f}  topk {topk_mean:.3f}  "
          f"(warm start {warm_accuracy:.3f})", flush=True)
    return {
        "reward_none_mean": round(none_mean, 4), "reward_topk1_mean": round(topk_mean, 4),
        "reward_gap": round(abs(none_mean - topk_mean), 4),
        "reward_none": [round(x, 4) for x in results["none"]], "reward_topk1": [round(x, 4) for x in results["topk"]],
        "reward_warm_start": round(warm_accuracy, 4), "steps": args.steps,
        "samples_per_step": args.groups_per_step * args.n, "ppo_epochs": args.ppo_epochs, "density": args.density,
        "seeds": list(args.seeds), "val_tasks": len(val), "sample_reward_mean": round(meta["sample_reward_mean"], 4),
        "sft_steps": meta["sft_steps"], "replay_s_mean": round(statistics.mean(replay_s), 1),
        "total_s": round(time.perf_counter() - started, 1),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="trainer steps per replay")
    p.add_argument("--groups-per-step", type=int, default=16, help="task groups per step")
    p.add_argument("--n", type=int, default=4, help="samples per task (the GRPO group)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="replay orders (and torch seeds)")
    p.add_argument("--density", type=float, default=0.01, help="top-k density")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--warmup", type=int, default=2, help="learning-rate warm-up steps")
    p.add_argument("--ppo-epochs", type=int, default=2, help="updates per batch (the demo recipe's)")
    p.add_argument("--val", type=int, default=500, help="held-out validation tasks for the reward")
    p.add_argument("--warm-until", type=float, default=0.4, help="SFT warm start until this train accuracy")
    p.add_argument("--record-seed", type=int, default=0, help="seed of the model, the tasks and the sampling")
    p.add_argument("--cache", default=".fulmen/convergence-parity", help="where the recorded stream is kept")
    p.add_argument("--rerecord", action="store_true", help="record the stream again")
    p.add_argument("--threads", type=int, default=2, help="torch threads for recording and evaluation")
    return p


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for noisy in ("fulmen", "fulmen_trainer", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    print(json.dumps(run(parser().parse_args())), flush=True)


if __name__ == "__main__":
    main()
