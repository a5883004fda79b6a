"""gpu_check step b: Fulmen's training step (`Trainer.train_passes`: backward and AdamW update) on a
randomly initialised Qwen2.5-shaped model built from its config on the device, one configuration a run:

    python bench/gpu_check/step_b.py --config full|lora|lora7b [--dry-run]

The policy is put together as `fulmen_trainer.policy.load_policy` does (its adapter, checkpointing and
precision helpers), only from a model built on the GPU rather than read from a folder. FLOP counts
and MFU: see ``flops`` below.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from common import QWEN25_05B, QWEN25_7B, TINY, build_on_device, chip, emit, log, parse

from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen_trainer.objectives import group_advantages
from fulmen_trainer.plan import StepPlan
from fulmen_trainer.policy import Policy, _compute_in_fp32, _with_adapter
from fulmen_trainer.trainer import Trainer

# config: (shape, knobs, samples, prompt tokens, response tokens, timed steps); a dry run shrinks them
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], int, int, int, int]] = {
    "full": (QWEN25_05B, {"micro_batch_tokens": 8192}, 16, 512, 512, 4),
    "lora": (QWEN25_05B, {"lora_rank": 16, "micro_batch_tokens": 8192}, 16, 512, 512, 4),
    "lora7b": (QWEN25_7B, {"lora_rank": 16, "gradient_checkpointing": True, "micro_batch_tokens": 16384},
               4, 2048, 2048, 2),
}
GIB = 1 << 30


def policy_on_device(settings: TrainerSettings, shape: dict[str, Any], device: str) -> Policy:
    """`load_policy` without the folder: trained weights fp32 (master weights), a LoRA base in the
    training dtype, checkpointing and the adapter as it sets them."""
    lora = settings.lora_rank is not None
    stored = torch.bfloat16 if lora and settings.dtype == "bfloat16" else torch.float32
    model = build_on_device(shape, device, stored)
    if settings.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora:
        model = _with_adapter(model, settings, None)
    if device == "cpu" and stored != torch.float32:
        _compute_in_fp32(model)
    model.train()
    return Policy(model, settings, torch.device(device))


def samples_of(count: int, prompt: int, response: int, vocab: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    behaviour = -math.log(vocab)  # the random model's own: importance weights ~1
    out = []
    for i in range(count):
        ids = torch.randint(3, vocab, (prompt + response,), generator=generator).tolist()
        reward = float(i % 2 == 0)
        out.append(Sample(f"r{i}.1/t0", "triplet", f"r{i}", f"r{i}.1", f"g{i // 4}", 0, ids[:prompt], ids[prompt:],
                          [behaviour] * response, [1] * response, reward, reward, "base", group_size=4))
    return out


def flops(model: Any, lora: bool, checkpointing: bool) -> tuple[float, float, str]:
    """Model FLOPs per token (the MFU numerator) and hardware FLOPs per token, with how they count.
    N = the weights of every linear layer, output layer included (attention scores left out).
    Full fine-tuning: 6N (forward 2N, backward 4N). LoRA: the frozen base costs its forward (2N) and
    the backward through it to the inputs (2N), no weight gradients: 4N, plus 6 x the adapter's
    weights; gradient checkpointing's second forward (2N) counts as hardware FLOPs only."""
    base = adapter = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if "lora_" in name:
                adapter += module.weight.numel()
            else:
                base += module.weight.numel()
    model_flops = 6.0 * base if not lora else 4.0 * base + 6.0 * adapter
    hardware = model_flops + (2.0 * base if checkpointing else 0.0)
    how = ("6N" if not lora else "4N + 6N_lora") + (" (+2N recompute in hardware FLOPs)" if checkpointing else "")
    return model_flops, hardware, how


def run(config: str, dry_run: bool, device: str, work: Path) -> dict[str, Any]:
    shape, knobs, count, prompt, response, steps = CONFIGS[config]
    if dry_run:
        shape, count, prompt, response, steps = TINY, 4, 24, 16, 2
        knobs = {**knobs, "micro_batch_tokens": 64}
    settings = load_settings(TrainerSettings, model_dir=work, algorithm="grpo", learning_rate=1e-5, device=device,
                             dtype="float32" if dry_run else "bfloat16", **knobs)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(None, settings)  # type: ignore[arg-type]  # no store: only the passes run
    trainer.policy = policy_on_device(settings, shape, device)
    trainer.optimizer = torch.optim.AdamW(trainer.policy.trainable_parameters(), lr=1e-5)
    model_flops, hardware_flops, how = flops(trainer.model, settings.lora_rank is not None,
                                             settings.gradient_checkpointing)
    samples = samples_of(count, prompt, response, shape["vocab_size"])
    groups = torch.tensor([i // 4 for i in range(count)])
    advantages = group_advantages(torch.tensor([s.reward for s in samples]), groups)
    tokens = count * (prompt + response)
    times, losses = [], []
    for step in range(steps + 1):  # the first warms up (kernels, allocator)
        plan = StepPlan(samples, [s.reward for s in samples], advantages, [s.group_key for s in samples], [])
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = trainer.train_passes(plan)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(metrics["loss/total"])
        log("%s: step %d %.3f s, loss %.5f, grad norm %.4g", config, step, times[-1], losses[-1],
            metrics["loss/grad_norm"])
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"a loss was not finite: {losses}")
    step_s = sorted(times[1:])[len(times[1:]) // 2]
    name, peak = chip()
    result: dict[str, Any] = {
        "config": config, "chip": name, "tokens_per_step": tokens, "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1), "flops_per_token": model_flops, "flops_count": how,
        "trained_parameters": sum(p.numel() for p in trainer.policy.trainable_parameters()),
        "micro_batch_tokens": settings.micro_batch_tokens, "gradient_checkpointing": settings.gradient_checkpointing,
    }
    if peak:
        result["mfu"] = round(model_flops * tokens / step_s / peak, 4)
        result["hfu"] = round(hardware_flops * tokens / step_s / peak, 4)
        result["peak_flops"] = peak
    if cuda:
        result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
        # a 24 GB card (24 GiB) less ~0.6 GiB of CUDA context and what the caching allocator wastes
        result["fits_24gb"] = result["peak_reserved_gib"] <= 23.0
    return result


def main() -> None:
    args = parse(__doc__ or "", list(CONFIGS))
    emit(run(args.config, args.dry_run, args.device, args.work))


if __name__ == "__main__":
    main()
