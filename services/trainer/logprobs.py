"""The policy's log-probabilities of the trained tokens, without full-vocabulary logits, from a
padded micro-batch or from its packed rows.

The output layer runs on ``chunk_tokens`` trained positions at a time, recomputed in the backward;
the result equals the full log-softmax. Packed rows (`pack_micro_batch`) are read with a
block-diagonal causal mask, or by flash attention's varlen kernel from their positions; the result
equals the padded forward's. Why and how: docs/design/trainer.md ("Sequence packing").
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from fulmen_trainer.batch import PackedRows, TokenBatch, first_fit

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 1024
MASK_ATTENTION = ("sdpa", "eager")  # take a 4-D mask as it is (sdpa: boolean, eager: additive)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")  # read sequence starts from the positions
_refused: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # model -> why it cannot pack
_warned: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def token_logprobs(
    model: Any, batch: TokenBatch, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(token t+1 | tokens ≤ t) at every trained position of ``batch`` ([B, T-1], 0 elsewhere),
    and, with ``entropy``, the entropy of the next-token distribution there (same layout), else None.
    Both carry gradients when the model does."""
    logp, ent, _ = scored_tokens(model, batch, chunk_tokens=chunk_tokens, entropy=entropy)
    return logp, ent


def scored_tokens(
    model: Any, batch: TokenBatch, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, entropy: bool = False,
    value_head: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`token_logprobs`, and with ``value_head`` its value of each trained position's last hidden state
    ([B, T-1], 0 elsewhere; None without a head), from the same forward."""
    where = batch.mask > 0
    targets = batch.input_ids[:, 1:][where]
    parts = _parts(model)
    if parts is None and value_head is not None:
        raise ValueError(f"{type(model).__name__} has no separate decoder: a value head has no hidden state to read")
    forward, head = (model, None) if parts is None else parts
    hidden = _trained_states(model, forward, batch, where)
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
    values = None
    if value_head is not None:
        weight = next(value_head.parameters())
        values = _scatter([value_head(hidden.to(weight.dtype)).squeeze(-1).float()], where)
    return _scatter(logps, where), _scatter(entropies, where) if entropy else None, values


def pack_micro_batch(model: Any, batch: TokenBatch, max_tokens: int | None = None) -> TokenBatch:
    """``batch`` with its packed rows for ``model``'s forward (`row_tokens`), or as it is when the model
    cannot take them (one warning per model and reason: the forward then pads, as without packing)."""
    lengths = batch.lengths
    reason = packing_refusal(model, max(lengths, default=0))
    if reason is not None:
        _warn_once(model, reason)
        return batch
    return batch.packed_into(row_tokens(model, lengths, max_tokens))


def packing_refusal(model: Any, longest: int) -> str | None:
    """Why ``model`` cannot score packed rows of sequences up to ``longest`` tokens, or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base in _refused:
        return _refused[base]
    config = getattr(base, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    # the model's own class, under any torch wrapper (FSDP2 subclasses it)
    own = next((c for c in type(base).__mro__ if not c.__module__.startswith("torch.")), type(base))
    reason = None
    if not own.__module__.startswith("transformers.models."):
        reason = f"{own.__name__} is not a transformers model class: whether it honours a 4-D mask is unknown"
    elif attention not in MASK_ATTENTION + VARLEN_ATTENTION:
        reason = f"attention implementation {attention!r} takes neither a 4-D mask nor packed positions"
    if reason is not None:
        _refused[base] = reason
        return reason
    window = _sliding_window(config)
    if attention in MASK_ATTENTION and window is not None and longest > window:
        # one 4-D mask reaches every layer: a sliding-window layer would see the full causal one
        return f"sliding-window attention ({window} tokens) with sequences of {longest} tokens under {attention}"
    return None


def row_tokens(model: Any, lengths: list[int], max_tokens: int | None = None) -> int:
    """The packed rows' length for ``model``: one row under flash attention (its kernel attends within
    each sequence only); under a mask, the row length whose estimated cost is least, counting the
    attention a mask makes every token pay for the whole row (linear layers cost per token, masked
    attention per token and key), among rows of the longest sequence's length times a power of two
    and one row of all; with ``max_tokens``, rows whose tokens stay within it (one row always does)."""
    total, longest = sum(lengths), max(lengths, default=1)
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) in VARLEN_ATTENTION:
        return total
    per_key = _attention_per_key(config)
    options = [longest << k for k in range(16) if longest << k < total] + [total]

    def cost(length: int) -> float:
        rows = len(first_fit(lengths, length))
        return rows * length * (1 + per_key * length)

    fitting = [n for n in options if max_tokens is None or n == total or len(first_fit(lengths, n)) * n <= max_tokens]
    return min(fitting, key=cost)


class TokenScorer(torch.nn.Module):
    """`token_logprobs` as a module's forward, for wrappers that must see the forward (DDP)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: TokenBatch, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(self.model, batch, chunk_tokens=chunk_tokens, entropy=entropy)


def _trained_states(model: Any, forward: Any, batch: TokenBatch, where: torch.Tensor) -> torch.Tensor:
    """``forward``'s output (hidden states, or logits for a model without separate parts) at the
    trained positions, in the order of ``where``: from the packed rows when the batch has them and
    ``model`` takes them, else from the padded batch."""
    rows = batch.packed
    if rows is not None:
        reason = packing_refusal(model, max(batch.lengths, default=0))
        if reason is None:
            try:
                out = _output(forward(**_packed_inputs(model, rows), use_cache=False))
                return out.flatten(0, 1)[rows.index[:, :-1][where]]
            except torch.OutOfMemoryError:
                raise
            except (TypeError, ValueError, RuntimeError) as exc:  # a model that refuses the 4-D mask
                base = model.get_base_model() if hasattr(model, "get_base_model") else model
                reason = _refused[base] = f"its forward refused packed rows ({type(exc).__name__}: {exc})"
        _warn_once(model, reason)
    out = _output(forward(input_ids=batch.input_ids, attention_mask=batch.attention_mask))
    return out[:, :-1][where]


def _output(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def _packed_inputs(model: Any, rows: PackedRows) -> dict[str, torch.Tensor]:
    """The forward's arguments for packed rows: the positions alone for flash attention's varlen
    kernel (one row), else with a [R, 1, L, L] block-diagonal causal mask (True / 0: attend)."""
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    inputs = {"input_ids": rows.input_ids, "position_ids": rows.position_ids}
    if attention in VARLEN_ATTENTION:
        return inputs
    length = rows.input_ids.shape[1]
    causal = torch.ones((length, length), dtype=torch.bool, device=rows.input_ids.device).tril()
    allowed = (rows.segments[:, :, None] == rows.segments[:, None, :]) & causal
    if attention == "eager":  # added to the scores
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
        inputs["attention_mask"] = mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
    else:
        inputs["attention_mask"] = allowed[:, None]
    return inputs


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _attention_per_key(config: Any) -> float:
    """Masked attention's cost per token and key over the linear layers' cost per token (multiply-adds
    per layer: q·k and p·v against the projections and a gated MLP)."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    if not hidden:
        return 1 / 1024
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    mlp = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    linear = hidden * (2 * heads * head_dim + 2 * kv) + 3 * hidden * mlp
    return 2 * heads * head_dim / linear


def _warn_once(model: Any, reason: str) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    seen = _warned.setdefault(base, set())
    if reason not in seen:
        seen.add(reason)
        log.warning("sequence packing off for %s: %s; its micro-batches are padded", type(base).__name__, reason)


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
