"""Samples → padded token tensors, their micro-batches, and a micro-batch packed into rows.

A sequence is the sample's prompt followed by its response, right-padded. Position t of every
per-token tensor is about token t+1 (the one the logits at t predict), so the response token j of a
prompt of length P sits at position P + j - 1; ``mask`` is 1 there for the model's own tokens.
Packed rows (`PackedRows`) change only what the forward reads; every per-token tensor keeps this
layout. How a forward reads them: `fulmen_trainer.logprobs`; why: docs/design/trainer.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fulmen.records import Sample


@dataclass
class PackedRows:
    """A micro-batch's sequences end to end in rows of one length, no padding between them: what a
    packed forward reads, and where each token went. Built by `TokenBatch.packed_into`."""

    input_ids: torch.Tensor  # [R, L] long: the sequences end to end; a row's tail is filler (id 0)
    position_ids: torch.Tensor  # [R, L] long: 0 at each sequence's first token
    segments: torch.Tensor  # [R, L] long: the sequence each token is of; row r's tail is segment B + r
    index: torch.Tensor  # [B, T] long: where token t of sequence b sits in the rows, flattened (r * L + column)

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(self.input_ids.to(device), self.position_ids.to(device), self.segments.to(device),
                          self.index.to(device))


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
    packed: PackedRows | None = None  # set on a micro-batch about to be scored (`packed_into`), else None

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def lengths(self) -> list[int]:
        """Each sequence's length, without its padding."""
        return [int(n) for n in self.attention_mask.sum(-1)]

    def slice(self, lo: int, hi: int) -> TokenBatch:
        """Sequences lo..hi (a micro-batch)."""
        return TokenBatch(
            self.input_ids[lo:hi], self.attention_mask[lo:hi], self.mask[lo:hi], self.behaviour_logp[lo:hi],
            self.rewards[lo:hi], self.group_index[lo:hi], self.staleness[lo:hi], self.sample_ids[lo:hi],
        )

    def to(self, device: torch.device) -> TokenBatch:
        """The tensors a forward pass reads, on ``device`` (a no-op on the CPU)."""
        if self.input_ids.device == device:
            return self
        return TokenBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.mask.to(device),
            self.behaviour_logp.to(device), self.rewards, self.group_index, self.staleness, self.sample_ids,
            self.packed.to(device) if self.packed is not None else None,
        )

    def trimmed(self) -> TokenBatch:
        """The same sequences without the padding columns that none of them reaches (a micro-batch of
        short sequences cut from a batch padded for a long one)."""
        length = max(int(self.attention_mask.sum(-1).max()) if len(self) else 1, 2)
        if length >= self.input_ids.shape[1]:
            return self
        return TokenBatch(
            self.input_ids[:, :length], self.attention_mask[:, :length], self.mask[:, : length - 1],
            self.behaviour_logp[:, : length - 1], self.rewards, self.group_index, self.staleness, self.sample_ids,
        )

    def micro_batches(self, max_sequences: int, max_tokens: int | None = None,
                      packed: bool = False) -> list[tuple[int, int]]:
        """Consecutive ranges [lo, hi) of at most ``max_sequences`` sequences whose padded size
        (sequences × the longest one's length; ``packed``: the sum of their lengths, which one packed
        row holds) stays within ``max_tokens``; a sequence longer than the budget is a micro-batch of
        its own. The order of the sequences is kept."""
        ranges, lo, longest, total = [], 0, 0, 0
        for i, length in enumerate(self.lengths):
            size = i - lo
            grown, summed = max(longest, length), total + length
            over = max_tokens is not None and (summed if packed else grown * (size + 1)) > max_tokens
            if size and (size >= max_sequences or over):
                ranges.append((lo, i))
                lo, grown, summed = i, length, length
            longest, total = grown, summed
        if lo < len(self):
            ranges.append((lo, len(self)))
        return ranges

    def packed_into(self, row_tokens: int) -> TokenBatch:
        """The same batch with its sequences also laid end to end in rows of ``row_tokens`` (or the
        longest sequence's length, if longer), longest first, each in the first row with room for it;
        each sequence keeps its own positions (0 at its first token)."""
        lengths = self.lengths
        layout = first_fit(lengths, row_tokens)
        width = max(row_tokens, *lengths)
        input_ids = torch.zeros((len(layout), width), dtype=torch.long)
        positions = torch.zeros((len(layout), width), dtype=torch.long)
        segments = torch.zeros((len(layout), width), dtype=torch.long)
        index = torch.zeros(self.input_ids.shape, dtype=torch.long)
        ids = self.input_ids.cpu()
        for r, members in enumerate(layout):
            column = 0
            for b in members:
                n = lengths[b]
                input_ids[r, column : column + n] = ids[b, :n]
                positions[r, column : column + n] = torch.arange(n)
                segments[r, column : column + n] = b
                index[b, :n] = r * width + column + torch.arange(n)
                column += n
            # the tail attends to itself only (a query that may attend to nothing would make NaNs)
            positions[r, column:] = torch.arange(width - column)
            segments[r, column:] = len(self) + r
        packed = PackedRows(input_ids, positions, segments, index).to(self.input_ids.device)
        return TokenBatch(self.input_ids, self.attention_mask, self.mask, self.behaviour_logp, self.rewards,
                          self.group_index, self.staleness, self.sample_ids, packed)

    def split(self, parts: int, index: int) -> TokenBatch:
        """This rank's share: a contiguous slice (ranks agree on the order, so the shares are disjoint)."""
        size = len(self)
        return self.slice(size * index // parts, size * (index + 1) // parts)


def first_fit(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Sequences (their indices) per row: longest first, each in the first row with room for it
    (first-fit decreasing); a sequence longer than ``row_tokens`` fills a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((r for r, left in enumerate(room) if lengths[b] <= left), None)
        if fit is None:
            rows.append([b])
            room.append(row_tokens - lengths[b])
        else:
            rows[fit].append(b)
            room[fit] -= lengths[b]
    return rows


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

