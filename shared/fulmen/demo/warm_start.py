"""Both demos' SFT warm start: masked next-token steps on batches of demonstrations until the greedy
accuracy on some training tasks reaches ``until``, then the model folder moved into place (renamed
last, so the services waiting for it never read half a model), one process at a time per folder
(`preparing`). Why it stops early: docs/design/demo.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen import progress

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # token ids, and the loss mask over them


@dataclass(frozen=True)
class WarmStartPlan:
    """The numbers of a warm start: how it steps, when it checks its accuracy, when it stops."""

    until: float  # stop once the greedy accuracy reaches it
    max_steps: int
    batch_size: int
    lr: float  # AdamW's, with betas (0.9, 0.99)
    check_every: int  # SFT steps between two accuracy checks (the slow part)
    log_every: int
    check_below_loss: float | None = None  # None: check whatever the loss; else only below it
    check_last_step: bool = False  # check after the last step too, whatever ``check_every`` says

    def check_now(self, step: int, loss: float) -> bool:
        on_schedule = step % self.check_every == 0 and (self.check_below_loss is None or loss < self.check_below_loss)
        return on_schedule or (self.check_last_step and step == self.max_steps)


def sft_step(model: Any, optimizer: Any, batch: list[Example], pad: int) -> float:
    """One optimizer step on (token ids, loss mask) pairs: the mean log-loss over masked tokens. The loss."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch])
    attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
    target = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float)[:, 1:]
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(logp * target).sum() / target.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.item())


def warm_start(model: Any, examples: Sequence[Example], pad: int, accuracy_of: Callable[[], float],
               plan: WarmStartPlan, *, seed: int, name: str = "warm start") -> tuple[int, float]:
    """SFT on batches of ``examples`` drawn by ``random.Random(seed)`` until ``accuracy_of()`` (the
    greedy accuracy on some training tasks, in eval mode; it leaves the model in train mode) reaches
    ``plan.until``, or for ``plan.max_steps``. The steps taken and the last accuracy measured."""
    import torch

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.99))
    model.train()
    accuracy, step, measured = 0.0, 0, ""
    with progress.bar(name, plan.max_steps) as bar:  # on a terminal only: the log has its lines
        for step in range(1, plan.max_steps + 1):
            loss = sft_step(model, optimizer, rng.sample(examples, plan.batch_size), pad)
            checked = plan.check_now(step, loss)
            if checked:
                accuracy = accuracy_of()
                measured = f", train accuracy {accuracy:.2f}"
                if step % plan.log_every == 0:
                    log.info("%s: SFT step %d, loss %.3f, train accuracy %.2f", name, step, loss, accuracy)
            bar.update(completed=step, note=f"loss {loss:.3f}{measured}")
            if checked and accuracy >= plan.until:
                break
    return step, accuracy


@contextlib.contextmanager
def preparing(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s preparation lock (a file lock, released by the OS if the process dies): two
    demos started in one working folder, as two experiments are, prepare it once between them; the
    second waits, then finds it prepared, instead of building over the first one's files."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".prepare.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is preparing %s: waiting for it", folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def install_model(model: Any, staging: Path, final: Path, sft_steps: int, accuracy: float) -> None:
    """Save the warm-started model in ``staging`` with its record, then rename it to ``final``."""
    model.save_pretrained(staging, safe_serialization=True)
    (staging / "warm_start.json").write_text(json.dumps({"sft_steps": sft_steps, "train_accuracy": accuracy}))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
