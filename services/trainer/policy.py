"""The model the trainer trains: its device and precision, LoRA or full fine-tuning, the reference
for the KL term, ppo_gae's value head beside it, and what a model version publishes (never the head).

Precision, LoRA and the KL reference, and why: docs/design/trainer.md; figures: bench/RESULTS.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fulmen.devices import resolve_device, resolve_dtype
from fulmen.settings import TrainerSettings
from fulmen.versions.lora import LORA_FORMAT, lora_description
from fulmen_trainer.batch import TokenBatch
from fulmen_trainer.distributed.gradients import trained
from fulmen_trainer.logprobs import scored_tokens, token_logprobs
from fulmen_trainer.objectives import recipe_defaults
from fulmen_trainer.values import load_value_head, new_value_head


class Policy:
    """The trained model and everything that depends on how it is held."""

    def __init__(self, model: Any, settings: TrainerSettings, device: torch.device, reference: Any = None) -> None:
        self.model = model
        self.s = settings
        self.device = device
        self.lora = settings.lora_rank is not None
        self.reference = reference
        self.scorer: Any = None  # the forward that takes part in gradient exchange (a DDP wrapper), if any
        self.gather: Any = None  # FSDP: a collective that returns the whole state on rank 0
        self.autocast_dtype = resolve_dtype(settings.dtype) if device.type == "cuda" else None
        # ppo_gae: hidden → 1 on the last hidden state; not part of ``model``, so never published
        self.value_head: torch.nn.Linear | None = None

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or (self.lora and self.s.kl_coef > 0)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The trained weights (the adapter's with LoRA), then the value head's, if any (last: a
        checkpoint's optimizer state is numbered in this order)."""
        head = list(self.value_head.parameters()) if self.value_head is not None else []
        return trained(self.model) + head

    def score(self, batch: TokenBatch, chunk_tokens: int, entropy: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`logprobs`, and the value head's values of the trained positions (None without a head),
        from one forward."""
        if self.value_head is None:
            return (*self.logprobs(batch, chunk_tokens, entropy), None)
        with self.compute():
            return scored_tokens(self.model, batch, chunk_tokens=chunk_tokens, entropy=entropy,
                                 value_head=self.value_head)

    def logprobs(self, batch: TokenBatch, chunk_tokens: int, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The trained tokens' log-probabilities (and entropy) under the policy, through the scorer
        when there is one (see `fulmen_trainer.logprobs`)."""
        with self.compute():
            if self.scorer is not None:
                return self.scorer(batch, chunk_tokens, entropy)
            return token_logprobs(self.model, batch, chunk_tokens=chunk_tokens, entropy=entropy)

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Under DDP, only the last micro-batch of a pass all-reduces (the others accumulate locally)."""
        if self.scorer is not None and hasattr(self.scorer, "set_requires_gradient_sync"):  # FSDP2
            self.scorer.set_requires_gradient_sync(last)
        elif self.scorer is not None and not last and hasattr(self.scorer, "no_sync"):
            return self.scorer.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """The forward's precision: bf16 autocast on CUDA with ``dtype=bfloat16``, else as stored."""
        if self.autocast_dtype is None or self.autocast_dtype == torch.float32:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            yield

    @contextlib.contextmanager
    def as_reference(self) -> Iterator[Any]:
        """The KL reference model: the base with the adapter off (LoRA), else the frozen copy."""
        if self.lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.reference

    def published_state(self, *, exact: bool = False) -> dict[str, torch.Tensor]:
        """What a model version holds: the adapter (LoRA), else every weight, in ``publish_dtype``
        (``exact``: fp32) and without the second name of a tied weight (lm_head = embeddings; the
        proxies and vLLM tie it again). Under FSDP every rank calls it (the shards are gathered) and
        only rank 0's answer holds the weights."""
        full = self.gather() if self.gather is not None else None
        if self.lora:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.model, state_dict=full)
        else:
            state = full if full is not None else self.model.state_dict()
        dtype = torch.float32 if exact else self.publish_dtype
        published: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        for name, tensor in state.items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if key in seen:
                continue
            seen.add(key)
            tensor = tensor.detach()
            published[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        return published

    @property
    def publish_dtype(self) -> torch.dtype:
        return resolve_dtype(self.s.dtype if self.s.publish_dtype == "auto" else self.s.publish_dtype)

    def published_format(self) -> dict[str, Any] | None:
        """How the proxies apply a published state (None: full weights, loaded as they are)."""
        if not self.lora:
            return None
        config = self.model.peft_config["default"]
        return {"format": LORA_FORMAT, "lora": lora_description(config.r, config.lora_alpha, config.use_rslora)}

    def load_published(self, state: dict[str, torch.Tensor]) -> None:
        """Take the weights of a published version (a rank catching up with its leader)."""
        if self.lora:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, state)
        else:
            self.model.load_state_dict(state, strict=False)


def load_policy(settings: TrainerSettings, checkpoint: Path | None) -> Policy:
    """The model from ``checkpoint`` (a folder `Policy` saved: full weights or an adapter) or, at the
    start of a run, from ``settings.model_dir``; on its device, in its precision, ready to train."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype)
    lora = settings.lora_rank is not None
    # trained weights stay fp32 (master weights); only frozen ones are stored in bf16
    stored = dtype if lora else torch.float32
    source = settings.model_dir if lora or checkpoint is None else checkpoint
    attention = _attention(settings, device)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=stored, **attention).to(device)
    if settings.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora:
        model = _with_adapter(model, settings, checkpoint)
    reference = None
    if settings.kl_coef > 0 and not lora:
        reference = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=resolve_dtype(settings.reference_dtype),
                                                         **(attention if settings.reference_device == "same" else {}))
        reference = reference.to(device if settings.reference_device == "same" else settings.reference_device)
        reference.eval().requires_grad_(False)
        if reference.dtype != torch.float32:
            _compute_in_fp32(reference)
    if device.type != "cuda" and stored != torch.float32:
        _compute_in_fp32(model)
    model.train()
    policy = Policy(model, settings, device, reference)
    if recipe_defaults(settings.algorithm).get("value_head"):
        policy.value_head = new_value_head(model, device)
        if checkpoint is not None:  # ``checkpoint`` is the folder's model/; the head sits beside it
            load_value_head(policy.value_head, checkpoint.parent)
    return policy


def _attention(settings: TrainerSettings, device: torch.device) -> dict[str, str]:
    """Flash attention's varlen kernel for packed rows on CUDA in bf16, when flash_attn is installed;
    otherwise the model's default (SDPA reads packed rows through a 4-D mask)."""
    if not (settings.pack_sequences and device.type == "cuda" and settings.dtype == "bfloat16"):
        return {}
    try:
        import flash_attn  # noqa: F401
    except (ImportError, OSError):  # not installed, or built for another torch
        return {}
    return {"attn_implementation": "flash_attention_2"}


def _with_adapter(model: Any, settings: TrainerSettings, checkpoint: Path | None) -> Any:
    from peft import LoraConfig, PeftModel, get_peft_model

    if checkpoint is not None:
        model = PeftModel.from_pretrained(model, checkpoint, is_trainable=True)
    else:
        targets = settings.lora_target_modules
        config = LoraConfig(
            r=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
            target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
            bias="none", task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
    for p in model.parameters():  # master weights: the adapter trains in fp32 whatever the base's dtype
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


class _Upcast(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.float()


def _compute_in_fp32(model: Any) -> None:
    """Frozen low-precision weights are read as fp32 by the layers that use them (a parametrization:
    the stored tensor stays bf16; the fp32 copy lives only while its layer computes)."""
    from torch.nn.utils import parametrize

    seen: set[int] = set()
    for module in list(model.modules()):
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is None or weight.requires_grad or weight.dtype == torch.float32:
            continue
        key = id(module)
        if key in seen or parametrize.is_parametrized(module, "weight"):
            continue
        seen.add(key)
        parametrize.register_parametrization(module, "weight", _Upcast(), unsafe=True)
        bias = module._parameters.get("bias")
        if bias is not None and not bias.requires_grad and bias.dtype != torch.float32:
            parametrize.register_parametrization(module, "bias", _Upcast(), unsafe=True)
