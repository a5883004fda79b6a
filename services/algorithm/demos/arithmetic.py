"""The demo's preparation: arithmetic tasks, a tiny Llama from scratch, and a brief SFT warm start.

The model folder appears last (renamed into place), so nobody reads half a model. Why the warm
start stops at ``until``: docs/design/demo.md.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen.demo import arithmetic
from fulmen.demo.warm_start import Example, WarmStartPlan, install_model, preparing, warm_start

log = logging.getLogger(__name__)

# An answer is at most 4 digits and the end token: 5 tokens are enough, more only cost time.
ANSWER_TOKENS = 5
# The policy samples at temperature 1 during training (GRPO needs different answers within a group).
TRAIN_TEMPERATURE = 1.0
DEMO_SAMPLING = {"temperature": TRAIN_TEMPERATURE, "max_tokens": ANSWER_TOKENS}
N_TRAIN, N_VAL = 4000, 300
# The warm start: batches of demonstrations until greedy accuracy on the first CHECK_TASKS training
# tasks reaches 0.4 (checked every 2 steps: it is the slow part), at most 1000 steps.
WARM_START = WarmStartPlan(until=0.4, max_steps=1000, batch_size=64, lr=3e-3, check_every=2, log_every=20)
CHECK_TASKS = 200
# With the tiny model kit's 0.2, GRPO stays flat (bench/RESULTS.md, recipe search).
INITIALIZER_RANGE = 0.02


@dataclass(frozen=True)
class DemoPaths:
    model: Path
    train: Path
    val: Path


def greedy_accuracy(model, tokenizer, tasks: list[dict], max_tokens: int = ANSWER_TOKENS) -> float:  # type: ignore[no-untyped-def]
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


def sft_example(tokenizer: Any, demo: dict[str, Any]) -> Example:
    """A demonstration's chat prompt then answer and end token, the loss on the answer's tokens."""
    prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": demo["prompt"]}],
                                                     add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False).input_ids
    answer = [*tokenizer(demo["completion"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def prepare_demo(folder: Path, *, seed: int = 0, n_train: int = N_TRAIN, n_val: int = N_VAL,
                 until: float = WARM_START.until, max_sft_steps: int = WARM_START.max_steps) -> DemoPaths:
    """Idempotent: a folder prepared before is reused as it is (by one process at a time)."""
    paths = DemoPaths(folder / "model", folder / "train.jsonl", folder / "val.jsonl")
    with preparing(folder):
        if (paths.model / "config.json").exists() and paths.train.exists() and paths.val.exists():
            log.info("demo prepared before in %s", folder)
        else:
            _build_demo(folder, paths, seed, n_train, n_val, until, max_sft_steps)
    return paths


def _build_demo(folder: Path, paths: DemoPaths, seed: int, n_train: int, n_val: int, until: float,
                max_sft_steps: int) -> None:
    import torch

    from fulmen.demo.tiny_model import TinyModelSpec, build_tiny_model, load_tiny_model

    torch.manual_seed(seed)
    train = arithmetic.make_tasks("train", n_train, seed=seed)
    arithmetic.write_jsonl(paths.train, train)
    arithmetic.write_jsonl(paths.val, arithmetic.make_tasks("val", n_val, seed=seed))
    staging = folder / ".model-staging"
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(staging, TinyModelSpec(initializer_range=INITIALIZER_RANGE), seed=seed)
    model, tokenizer = load_tiny_model(staging)
    examples = [sft_example(tokenizer, d) for d in arithmetic.demonstrations(train, seed=seed)]
    check = train[:CHECK_TASKS]
    plan = dataclasses.replace(WARM_START, until=until, max_steps=max_sft_steps)
    step, accuracy = warm_start(model, examples, tokenizer.pad_token_id, lambda: greedy_accuracy(model, tokenizer, check),
                                plan, seed=seed)
    install_model(model, staging, paths.model, step, accuracy)
    log.info("warm start done after %d SFT steps (train accuracy %.2f): %s", step, accuracy, paths.model)
