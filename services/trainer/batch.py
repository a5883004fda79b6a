"""Samples → padded token tensors, and the model's log-probabilities of them.

A sequence is the sample's prompt followed by its response, right-padded. Position t of every
per-token tensor is about token t+1 (the one the logits at t predict), so the response token j of a
prompt of length P sits at position P + j - 1; ``mask`` is 1 there for the model's own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fulmen.records import Sample


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, T-1] float: trained positions
    behaviour_logp: torch.Tensor  # [B, T-1] float: what the proxy recorded (0 off the mask)
    rewards: torch.Tensor  # [B] float
    group_index: torch.Tensor  # [B] long: 0..G-1, samples of one task share it
    staleness: torch.Tensor  # [B] float: model versions behind the trainer
    sample_ids: list[str]

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def slice(self, lo: int, hi: int) -> TokenBatch:
        """Sequences lo..hi (a micro-batch)."""
        return TokenBatch(
            self.input_ids[lo:hi], self.attention_mask[lo:hi], self.mask[lo:hi], self.behaviour_logp[lo:hi],
            self.rewards[lo:hi], self.group_index[lo:hi], self.staleness[lo:hi], self.sample_ids[lo:hi],
        )

    def split(self, parts: int, index: int) -> TokenBatch:
        """This rank's share: a contiguous slice (ranks agree on the order, so the shares are disjoint)."""
        size = len(self)
        return self.slice(size * index // parts, size * (index + 1) // parts)


def make_batch(
    samples: Sequence[Sample],
    *,
    pad_id: int,
    rewards: Sequence[float],
    group_keys: Sequence[str] | None = None,
    staleness: Sequence[float] | None = None,
    max_len: int | None = None,
) -> TokenBatch:
    """Pad samples into a batch. ``rewards`` are the ones to train on (the caller picks matched or final).
    Sequences longer than ``max_len`` are cut at the end (their cut tokens are not trained)."""
    seqs = [s.prompt_token_ids + s.response_token_ids for s in samples]
    length = max(len(x) for x in seqs)
    if max_len is not None:
        length = min(length, max_len)
    count = len(samples)
    input_ids = torch.full((count, length), pad_id, dtype=torch.long)
    attention = torch.zeros((count, length), dtype=torch.long)
    mask = torch.zeros((count, length - 1))
    behaviour = torch.zeros((count, length - 1))
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        seq = seq[:length]
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        start = len(s.prompt_token_ids) - 1
        n = max(0, min(len(s.response_token_ids), length - len(s.prompt_token_ids)))
        if n:
            mask[i, start : start + n] = torch.tensor(s.response_mask[:n], dtype=torch.float)
            behaviour[i, start : start + n] = torch.tensor(s.response_logprobs[:n], dtype=torch.float)
    keys = list(group_keys if group_keys is not None else [s.group_key for s in samples])
    numbering = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention,
        mask=mask,
        behaviour_logp=behaviour * mask,
        rewards=torch.tensor(list(rewards), dtype=torch.float),
        group_index=torch.tensor([numbering[k] for k in keys], dtype=torch.long),
        staleness=torch.tensor(list(staleness) if staleness is not None else [0.0] * count, dtype=torch.float),
        sample_ids=[s.sample_id for s in samples],
    )


def token_logprobs(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(token t+1 | tokens ≤ t) for every position [B, T-1], and the logits [B, T-1, V]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return logp, logits
