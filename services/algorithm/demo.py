"""The demo's preparation: arithmetic tasks, a tiny Llama from scratch, and a brief SFT warm start.

The model folder appears last (renamed into place), so nobody reads half a model. Why the warm
start stops at ``until``: docs/design/demo.md.
"""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen.demo import arithmetic
from fulmen.demo.warm_start import install_model, sft_step
from fulmen.errors import NotFound
from fulmen.store import RedisStore
from fulmen.versions.model_version import BASE_VERSION, POLICY_RESOURCES_ID

log = logging.getLogger(__name__)

# An answer is at most 4 digits and the end token: 5 tokens are enough, more only cost time.
ANSWER_TOKENS = 5
# The policy samples at temperature 1 during training (GRPO needs different answers within a group).
TRAIN_TEMPERATURE = 1.0
DEMO_SAMPLING = {"temperature": TRAIN_TEMPERATURE, "max_tokens": ANSWER_TOKENS}
N_TRAIN, N_VAL = 4000, 300
# The warm start: batches of demonstrations until greedy accuracy on the first CHECK_TASKS training
# tasks reaches UNTIL (checked every CHECK_EVERY steps: it is the slow part), at most MAX_SFT_STEPS.
UNTIL = 0.4
MAX_SFT_STEPS = 1000
SFT_BATCH = 64
SFT_LR = 3e-3
CHECK_TASKS = 200
CHECK_EVERY = 2
LOG_EVERY = 20
# With the tiny model kit's 0.2, GRPO stays flat (bench/RESULTS.md, recipe search).
INITIALIZER_RANGE = 0.02


@dataclass(frozen=True)
class DemoPaths:
    model: Path
    train: Path
    val: Path


def _greedy_accuracy(model, tokenizer, tasks: list[dict], max_tokens: int = ANSWER_TOKENS) -> float:  # type: ignore[no-untyped-def]
    import torch

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": t["question"]}], add_generation_prompt=True,
                                           tokenize=False) for t in tasks]
    ids = [tokenizer(x, add_special_tokens=False).input_ids for x in texts]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    batch = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    answers = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train()
    return sum(arithmetic.reward(t, a) for t, a in zip(tasks, answers, strict=True)) / len(tasks)


def prepare_demo(folder: Path, *, seed: int = 0, n_train: int = N_TRAIN, n_val: int = N_VAL, until: float = UNTIL,
                 max_sft_steps: int = MAX_SFT_STEPS) -> DemoPaths:
    """Idempotent: a folder prepared before is reused as it is."""
    paths = DemoPaths(folder / "model", folder / "train.jsonl", folder / "val.jsonl")
    if (paths.model / "config.json").exists() and paths.train.exists() and paths.val.exists():
        log.info("demo prepared before in %s", folder)
        return paths
    import torch

    from fulmen.demo.tiny_model import build_tiny_model, load_tiny_model

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    train = arithmetic.make_tasks("train", n_train, seed=seed)
    arithmetic.write_jsonl(paths.train, train)
    arithmetic.write_jsonl(paths.val, arithmetic.make_tasks("val", n_val, seed=seed))
    staging = folder / ".model-staging"
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(staging, seed=seed, initializer_range=INITIALIZER_RANGE)
    model, tokenizer = load_tiny_model(staging)
    demos = arithmetic.demonstrations(train, seed=seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.99))
    check = train[:CHECK_TASKS]
    eos = tokenizer.eos_token_id
    model.train()
    accuracy, step = 0.0, 0
    for step in range(1, max_sft_steps + 1):
        batch = rng.sample(demos, SFT_BATCH)
        seqs, masks = [], []
        for d in batch:
            prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": d["prompt"]}],
                                                             add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False).input_ids
            answer = [*tokenizer(d["completion"], add_special_tokens=False).input_ids, eos]
            seqs.append(prompt + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
        sft_step(model, optimizer, list(zip(seqs, masks, strict=True)), tokenizer.pad_token_id)
        if step % CHECK_EVERY == 0:
            accuracy = _greedy_accuracy(model, tokenizer, check)
            if step % LOG_EVERY == 0:
                log.info("warm start: SFT step %d, train accuracy %.2f", step, accuracy)
            if accuracy >= until:
                break
    install_model(model, staging, paths.model, step, accuracy)
    log.info("warm start done after %d SFT steps (train accuracy %.2f): %s", step, accuracy, paths.model)
    return paths


async def publish_base_policy(store: RedisStore, model_name: str,
                              sampling: dict[str, Any] | None = DEMO_SAMPLING) -> None:
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
