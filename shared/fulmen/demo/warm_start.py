"""What both demos' SFT warm starts share: one masked next-token step on a padded batch, and moving the
finished model folder into place (renamed last, so the services waiting for it never read half a model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def sft_step(model: Any, optimizer: Any, batch: list[tuple[list[int], list[int]]], pad: int) -> float:
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


def install_model(model: Any, staging: Path, final: Path, sft_steps: int, accuracy: float) -> None:
    """Save the warm-started model in ``staging`` with its record, then rename it to ``final``."""
    model.save_pretrained(staging, safe_serialization=True)
    (staging / "warm_start.json").write_text(json.dumps({"sft_steps": sft_steps, "train_accuracy": accuracy}))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
