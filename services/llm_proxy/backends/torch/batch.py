"""The torch engine's running batch: one left-padded KV cache that requests join and leave.

Re-padding the cache when requests join is why the engine serves full-attention models only (see
`fulmen_llm_proxy.backends.torch.engine`). `sample_rows` draws each row's next token from the row's own
seeded generator, so a request's sampling does not depend on what it is batched with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fulmen_llm_proxy.backends.torch.request import Request

if TYPE_CHECKING:
    import torch


class Batch:
    """The running requests and their left-padded KV cache: row i's tokens fill the last columns.

    Every row holds all its tokens but the last one chosen (``next_ids``), which the next decode
    step feeds at position ``positions``. Rows grow in lockstep, so each row's real tokens are a
    suffix of the columns, and dropping leading all-padding columns keeps the cache no longer than
    the longest row.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.rows: list[Request] = []
        self.finished: set[int] = set()  # id() of rows to drop after this iteration
        self.cache: Any = None  # transformers DynamicCache
        self.mask: Any = None  # [rows, columns] int64, 1 = real token
        self.next_ids: Any = None  # [rows] int64
        self.positions: Any = None  # [rows] int64

    def decode(self, model: Any) -> torch.Tensor:
        import torch

        ones = torch.ones(len(self.rows), 1, dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        out = model(
            input_ids=self.next_ids[:, None],
            attention_mask=self.mask,
            position_ids=self.positions[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.positions = self.positions + 1
        return out.logits[:, -1]

    def prefill(self, model: Any, requests: list[Request], pad_id: int, device: Any) -> torch.Tensor:
        """Run the prompts of ``requests`` (left-padded together) and merge them into the batch."""
        import torch
        import torch.nn.functional as F
        from transformers import DynamicCache

        width = max(len(r.prompt) for r in requests)
        ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        lengths = mask.sum(dim=1)
        if not self.rows:
            self.cache, self.mask, self.positions = cache, mask, lengths
            self.next_ids = torch.zeros_like(lengths)
        else:
            columns = max(self.mask.shape[1], width)
            for old, new in zip(self.cache.layers, cache.layers, strict=True):
                old.keys = torch.cat([_pad_kv(old.keys, columns), _pad_kv(new.keys, columns)])
                old.values = torch.cat([_pad_kv(old.values, columns), _pad_kv(new.values, columns)])
            self.mask = torch.cat(
                [F.pad(self.mask, (columns - self.mask.shape[1], 0)), F.pad(mask, (columns - width, 0))]
            )
            self.positions = torch.cat([self.positions, lengths])
            self.next_ids = torch.cat([self.next_ids, torch.zeros_like(lengths)])
        self.rows.extend(requests)
        return out.logits[:, -1]

    def set_next(self, rows: list[Request], tokens: torch.Tensor) -> None:
        # `rows` is the whole batch (decode) or its tail (prefill): either way the last len(rows).
        self.next_ids[len(self.rows) - len(rows) :] = tokens

    def drop_finished(self) -> None:
        if not self.finished:
            return
        keep = [i for i, r in enumerate(self.rows) if id(r) not in self.finished]
        self.finished.clear()
        if not keep:
            self.reset()
            return
        rows = [self.rows[i] for i in keep]
        index = self.mask.new_tensor(keep)
        mask = self.mask[index]
        start = int(mask.any(dim=0).to(mask.dtype).argmax())  # first column some kept row uses
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        self.rows, self.mask = rows, mask[:, start:]
        self.next_ids, self.positions = self.next_ids[index], self.positions[index]


def _pad_kv(x: torch.Tensor, columns: int) -> torch.Tensor:
    """Left-pad a [batch, heads, seq, dim] cache tensor to ``columns`` along seq (masked out)."""
    import torch.nn.functional as F

    return F.pad(x, (0, 0, columns - x.shape[2], 0))


def sample_rows(logits: torch.Tensor, rows: list[Request]) -> torch.Tensor:
    """Temperature and top-p sampling for each row, drawing from the row's own seeded generator."""
    import torch

    temperature = logits.new_tensor([r.params.temperature for r in rows])
    top_p = logits.new_tensor([r.params.top_p for r in rows])
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Nucleus: keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    cumulative = sorted_probs.cumsum(dim=-1)
    sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs >= top_p[:, None], 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    # Inverse-CDF draw: one uniform per row from the row's generator, whatever the batch looks like.
    uniform = torch.tensor([r.rng.random() for r in rows], dtype=cumulative.dtype, device=cumulative.device)
    picks = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None])
    picks = picks.clamp(max=logits.shape[-1] - 1)
    return order.gather(1, picks).squeeze(1)
