"""The policy's log-probabilities of the trained tokens, without full-vocabulary logits.

The output layer runs on ``chunk_tokens`` trained positions at a time, recomputed in the backward;
the result equals the full log-softmax. Why and how: docs/design/trainer.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from fulmen_trainer.batch import TokenBatch

DEFAULT_CHUNK_TOKENS = 1024


def token_logprobs(
    model: Any, batch: TokenBatch, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(token t+1 | tokens ≤ t) at every trained position of ``batch`` ([B, T-1], 0 elsewhere),
    and, with ``entropy``, the entropy of the next-token distribution there (same layout), else None.
    Both carry gradients when the model does."""
    where = batch.mask > 0
    targets = batch.input_ids[:, 1:][where]
    parts = _parts(model)
    if parts is None:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        hidden, head = logits[where], None
    else:
        decoder, head = parts
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        hidden = hidden[:, :-1][where]
    finish = _finisher(model)
    logps, entropies = [], []
    # at least one chunk, even empty: the result stays in the graph of every weight (a backward of a
    # micro-batch with no trained token gives zero gradients, and a DDP rank still all-reduces)
    for lo in range(0, max(len(targets), 1), chunk_tokens):
        h, t = hidden[lo : lo + chunk_tokens], targets[lo : lo + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk, head, finish, h, t, entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(head, finish, h, t, entropy)
        logps.append(lp)
        entropies.append(ent)
    return _scatter(logps, where), _scatter(entropies, where) if entropy else None


class TokenScorer(torch.nn.Module):
    """`token_logprobs` as a module's forward, for wrappers that must see the forward (DDP)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: TokenBatch, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(self.model, batch, chunk_tokens=chunk_tokens, entropy=entropy)


def _chunk(head: Any, finish: Any, hidden: torch.Tensor, targets: torch.Tensor,
           entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = finish((head(hidden) if head is not None else hidden).float())
    norm = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - norm
    if not entropy:
        return logp, logp.new_zeros(())
    return logp, norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _scatter(values: list[torch.Tensor], where: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(where.shape, dtype=torch.float32, device=where.device)
    if not values:
        return out
    return out.masked_scatter(where, torch.cat(values))


def _parts(model: Any) -> tuple[Any, Any] | None:
    """(decoder, output layer) of a causal LM (PEFT-wrapped or not), or None to use its forward."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_decoder = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = get_decoder() if get_decoder is not None else None
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


def _finisher(model: Any) -> Any:
    """What the model's own forward does to its logits after the output layer."""
    config = getattr(model, "config", None)
    scale = getattr(config, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def finish(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return finish
