"""Issue 7's demo recipe, in pure torch: a tiny Llama, a brief SFT warm start, then GRPO on arithmetic.

No Redis, no services: this runs the learning problem of the end-to-end demo in one process on one
core (``torch.set_num_threads(1)``), so the recipe (model size, SFT calibration, GRPO settings) can be
searched and its compute measured apart from the pipeline's overheads.

What one run does (every number below is a flag; the defaults are the recipe found for issue 7,
see "Demo recipe search (issue 7)" in bench/RESULTS.md):

1. Builds the tiny model with `fulmen.demo.tiny_model.build_tiny_model` (character tokenizer, chat
   template; hidden 64, 2 layers, 4 heads, ``initializer_range=0.02``: 145k parameters).
2. SFT warm start on `fulmen.demo.arithmetic.demonstrations` of training tasks (2-digit addition), in the
   chat format the demo agent uses through the proxy's ``/v1/chat/completions`` with one user
   message, i.e. the token sequence ``<bos><|user|>23+48=<eos><|assistant|>71<eos>`` (loss on
   ``71<eos>`` only); batch 64, AdamW lr 3e-3. It stops as soon as greedy accuracy on 200 *training*
   tasks, checked every ``--sft-check-every`` steps, reaches ``--sft-until`` (0.4): the SFT curve is
   steep (~0.1 to ~0.9 within 150 steps), so a fixed step count would land anywhere on it; stopping
   on a measured accuracy lands the warm start at 0.38–0.43 on validation for the 3 seeds tried.
3. GRPO: each step draws ``--prompts`` training tasks, samples ``--n`` completions of each at
   ``--temperature`` (at most ``--max-tokens`` tokens, stopping at eos), rewards them with
   `fulmen.demo.arithmetic.reward`, computes group-relative advantages ``(r - mean) / (std + 1e-4)`` and
   takes ``--updates`` AdamW steps on the PPO-clip (``--clip``) token-level loss with the behaviour
   logprobs of the sampling pass (the first update is plain policy gradient, ratio 1). Groups whose
   rewards are all equal carry no signal and are left out (they still count in the token
   normalisation). No KL term, no entropy bonus; gradient norm clipped at ``--grad-clip``. The lr
   warms up linearly over ``--warmup`` steps, then decays linearly to ``--lr-final`` over
   ``--decay-steps``.
4. Every ``--eval-every`` steps: greedy accuracy on ``--n-val`` held-out validation tasks (their
   operand pairs never occur in training, see `fulmen.demo.arithmetic.split_of`), with wall time since
   the start, GRPO compute seconds (sampling + training, evaluation excluded) and rollouts so far.

``--grpo off`` keeps the warm start and only evaluates it (the issue's baseline: GRPO switched off,
the model stays at its warm start). ``--warm-cache DIR`` reuses the warm start of an identical
model/SFT configuration (for searching GRPO settings); ``--sft-eval-every N`` prints the SFT curve.

    python bench/recipe_search.py                       # the recipe, seed 0
    python bench/recipe_search.py --seed 1 --grpo off   # the baseline
Output: one JSON line per evaluation, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))

from fulmen.demo import arithmetic
from fulmen.demo.tiny_model import TinyModelSpec, build_tiny_model, load_tiny_model


@dataclass
class Config:
    seed: int = 0
    # task
    digits: int = 2
    ops: str = "+"
    n_train: int = 6000
    n_val: int = 300
    # model
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    init_range: float = 0.02  # Llama's usual 0.02: learns ~3x faster than the tiny-model default 0.2
    # SFT warm start
    sft_steps: int = 1000  # an upper bound; sft_until ends it
    sft_batch: int = 64
    sft_lr: float = 3e-3
    carry_slip: float = 0.0  # careless-teacher demonstrations (fulmen.demo.arithmetic.demonstrations)
    sft_until: float = 0.4  # >0: stop SFT once greedy accuracy on 200 *training* tasks reaches this
    sft_check_every: int = 2
    warmup: int = 20  # GRPO lr warm-up steps (linear)
    lr_final: float = 2e-4  # >0: after warm-up, decay linearly from lr to lr_final over decay_steps
    decay_steps: int = 600
    sft_eval_every: int = 0  # >0: print the SFT curve (for calibrating sft_steps)
    # GRPO
    grpo: str = "on"
    prompts: int = 32
    n: int = 4
    lr: float = 7e-4
    updates: int = 2
    clip: float = 0.2
    temperature: float = 1.0
    max_tokens: int = 5
    steps: int = 450
    seconds: float = 600.0
    eval_every: int = 10
    target: float = 0.9
    stop_at_target: bool = False
    weight_decay: float = 0.0
    adam_beta2: float = 0.99
    grad_clip: float = 1.0  # 0 = no clipping
    warm_cache: str = ""  # a folder: reuse the warm start of an identical model/SFT config


class Policy:
    """The model and its token-level helpers: prompt encoding, batched sampling, sequence logprobs."""

    def __init__(self, cfg: Config, folder: Path) -> None:
        spec = TinyModelSpec(hidden_size=cfg.hidden, num_layers=cfg.layers, num_heads=cfg.heads,
                             initializer_range=cfg.init_range)
        build_tiny_model(folder, spec, seed=cfg.seed)
        self.model, self.tok = load_tiny_model(folder)
        self.eos = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id
        self._cache: dict[str, list[int]] = {}

    def prompt_ids(self, question: str) -> list[int]:
        ids = self._cache.get(question)
        if ids is None:
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            )
            ids = self._cache[question] = self.tok(text, add_special_tokens=False).input_ids
        return ids

    def answer_ids(self, answer: str) -> list[int]:
        return [*self.tok(answer, add_special_tokens=False).input_ids, self.eos]

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], max_tokens: int, temperature: float) -> list[list[int]]:
        """One completion per prompt (left-padded batch, KV cache); a completion ends with eos if it stopped."""
        model = self.model
        model.eval()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1]
        last_pos = pos[:, -1]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        tokens: list[torch.Tensor] = []
        for _ in range(max_tokens):
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(F.softmax(logits / temperature, -1), 1).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad), nxt)
            tokens.append(nxt)
            done = done | (nxt == self.eos)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
            last_pos = last_pos + 1
            out = model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=last_pos[:, None],
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1]
        rows = torch.stack(tokens, 1).tolist()
        completions = []
        for row in rows:
            c = []
            for t in row:
                if t == self.pad:
                    break
                c.append(t)
                if t == self.eos:
                    break
            completions.append(c)
        return completions

    def text(self, completion: list[int]) -> str:
        return self.tok.decode([t for t in completion if t != self.eos], skip_special_tokens=True)

    def token_logprobs(
        self, prompts: list[list[int]], completions: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprob of each completion token ([B, T], right-padded) and the mask of real tokens."""
        seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [self.pad] * (width - len(s)) for s in seqs])
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        tmask = torch.zeros_like(logp)
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            tmask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1
        return logp, tmask


def evaluate(policy: Policy, tasks: list[dict[str, Any]], max_tokens: int) -> float:
    return evaluate_detail(policy, tasks, max_tokens)[0]


def evaluate_detail(policy: Policy, tasks: list[dict[str, Any]], max_tokens: int) -> tuple[float, float]:
    """Greedy accuracy, and the fraction of carry tasks answered with the carry-less sum (the teacher's slip)."""
    prompts = [policy.prompt_ids(t["question"]) for t in tasks]
    completions = policy.sample(prompts, max_tokens, temperature=0.0)
    texts = [policy.text(c) for c in completions]
    acc = sum(arithmetic.reward(t, x) for t, x in zip(tasks, texts, strict=True)) / len(tasks)
    carry = [
        (t, x)
        for t, x in zip(tasks, texts, strict=True)
        if t["op"] == "+" and arithmetic.carryless_sum(t["a"], t["b"]) != t["a"] + t["b"]
    ]
    slips = sum(arithmetic.parse_answer(x) == str(arithmetic.carryless_sum(t["a"], t["b"])) for t, x in carry)
    return acc, slips / max(1, len(carry))


def run(cfg: Config, log=print) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    t_start = time.perf_counter()
    train = arithmetic.make_tasks("train", cfg.n_train, seed=cfg.seed, digits=cfg.digits, ops=cfg.ops)
    val = arithmetic.make_tasks("val", cfg.n_val, seed=cfg.seed, digits=cfg.digits, ops=cfg.ops)
    with tempfile.TemporaryDirectory() as tmp:
        policy = Policy(cfg, Path(tmp))
    model = policy.model

    # --- SFT warm start -----------------------------------------------------------------------
    demos = arithmetic.demonstrations(train, carry_slip=cfg.carry_slip, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0, betas=(0.9, 0.99))
    model.train()
    cached = None
    if cfg.warm_cache:
        key = "-".join(
            str(getattr(cfg, k))
            for k in (
                "seed",
                "digits",
                "ops",
                "n_train",
                "hidden",
                "layers",
                "heads",
                "init_range",
                "sft_steps",
                "sft_batch",
                "sft_lr",
                "carry_slip",
                "sft_until",
                "sft_check_every",
            )
        )
        cached = Path(cfg.warm_cache) / f"warm-{key}.pt"
        if cached.exists():
            state = torch.load(cached)
            model.load_state_dict(state["model"])
            version, internal, gauss = state["rng"]
            rng.setstate((version, tuple(internal), gauss))
            torch.set_rng_state(state["torch_rng"])
    check = train[:200]
    sft_done = 0
    for step in range(cfg.sft_steps if cached is None or not cached.exists() else 0):
        if cfg.sft_until and step % cfg.sft_check_every == 0 and step:
            if evaluate(policy, check, cfg.max_tokens) >= cfg.sft_until:
                break
            model.train()
        sft_done = step + 1
        batch = rng.sample(demos, cfg.sft_batch)
        prompts = [policy.prompt_ids(d["prompt"]) for d in batch]
        targets = [policy.answer_ids(d["completion"]) for d in batch]
        logp, tmask = policy.token_logprobs(prompts, targets)
        loss = -(logp * tmask).sum() / tmask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cfg.sft_eval_every and (step + 1) % cfg.sft_eval_every == 0:
            acc, slip = evaluate_detail(policy, val, cfg.max_tokens)
            log(
                json.dumps(
                    {
                        "seed": cfg.seed,
                        "sft_step": step + 1,
                        "loss": round(float(loss.detach()), 3),
                        "val_acc": acc,
                        "slip_rate": round(slip, 3),
                        "seconds": round(time.perf_counter() - t_start, 1),
                    }
                )
            )
            model.train()
    if cached is not None and not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"model": model.state_dict(), "rng": list(rng.getstate()), "torch_rng": torch.get_rng_state()},
            cached,
        )
    sft_seconds = time.perf_counter() - t_start
    acc0 = evaluate(policy, val, cfg.max_tokens)
    curve = [
        {"step": 0, "seconds": round(time.perf_counter() - t_start, 1), "val_acc": acc0, "train_reward": None}
    ]
    log(
        json.dumps(
            {
                "seed": cfg.seed,
                "phase": "warm_start",
                "sft_steps_done": sft_done,
                "sft_seconds": round(sft_seconds, 1),
                "val_acc": acc0,
            }
        )
    )

    # --- GRPO -----------------------------------------------------------------------------------
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, cfg.adam_beta2)
    )

    def lr_factor(i: int) -> float:
        if cfg.warmup and i < cfg.warmup:
            return (i + 1) / cfg.warmup
        if cfg.lr_final:
            frac = min(1.0, (i - cfg.warmup) / cfg.decay_steps)
            return 1.0 + frac * (cfg.lr_final / cfg.lr - 1.0)
        return 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    t_grpo = time.perf_counter()
    sampled_tokens = 0
    rollouts = 0
    reached = None
    step = 0
    rewards_window: list[float] = []
    compute = {"sample": 0.0, "train": 0.0, "eval": 0.0}
    while cfg.grpo == "on" and step < cfg.steps and time.perf_counter() - t_grpo < cfg.seconds:
        step += 1
        t0 = time.perf_counter()
        tasks = rng.sample(train, cfg.prompts)
        prompts = [policy.prompt_ids(t["question"]) for t in tasks for _ in range(cfg.n)]
        completions = policy.sample(prompts, cfg.max_tokens, cfg.temperature)
        rewards = torch.tensor(
            [
                arithmetic.reward(t, policy.text(c))
                for t, c in zip([t for t in tasks for _ in range(cfg.n)], completions, strict=True)
            ]
        )
        sampled_tokens += sum(len(c) for c in completions)
        rollouts += len(completions)
        rewards_window.append(float(rewards.mean()))
        g = rewards.view(cfg.prompts, cfg.n)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        keep = [i for i in range(len(prompts)) if (g.std(1) > 0).repeat_interleave(cfg.n)[i]]
        t1 = time.perf_counter()
        compute["sample"] += t1 - t0
        if keep:
            kp = [prompts[i] for i in keep]
            kc = [completions[i] for i in keep]
            ka = adv[keep]
            model.train()
            old = None
            for _ in range(cfg.updates):
                logp, tmask = policy.token_logprobs(kp, kc)
                if old is None:
                    old = logp.detach()
                ratio = torch.exp(logp - old)
                a = ka[:, None]
                obj = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a)
                # token-level aggregation over the whole batch (groups without signal count as zeros,
                # so the step size does not grow when few groups carry signal)
                loss = -(obj * tmask).sum() / max(1.0, float(tmask.sum()) * len(prompts) / len(keep))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
            sched.step()
        compute["train"] += time.perf_counter() - t1
        if step % cfg.eval_every == 0:
            t2 = time.perf_counter()
            acc, slip = evaluate_detail(policy, val, cfg.max_tokens)
            compute["eval"] += time.perf_counter() - t2
            point = {
                "step": step,
                "seconds": round(time.perf_counter() - t_start, 1),
                "grpo_compute_s": round(compute["sample"] + compute["train"], 1),
                "rollouts": rollouts,
                "val_acc": acc,
                "slip_rate": round(slip, 3),
                "train_reward": round(sum(rewards_window) / len(rewards_window), 3),
                "mean_len": round(sum(len(c) for c in completions) / len(completions), 2),
                "eg": f"{tasks[0]['question']}{tasks[0]['answer']} "
                + "|".join(policy.text(c) for c in completions[: cfg.n]),
            }
            rewards_window = []
            curve.append(point)
            log(json.dumps({"seed": cfg.seed, **point}))
            if reached is None and acc >= cfg.target:
                reached = point
                if cfg.stop_at_target:
                    break
    summary = {
        "summary": True,
        "config": asdict(cfg),
        "warm_start_acc": acc0,
        "final_acc": curve[-1]["val_acc"],
        "best_acc": max(p["val_acc"] for p in curve),
        "reached_target": reached,
        "steps": step,
        "rollouts": rollouts,
        "sampled_tokens": sampled_tokens,
        "tokens_per_step": round(sampled_tokens / max(1, step), 1),
        "compute_s": {k: round(v, 1) for k, v in compute.items()},
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    log(json.dumps(summary))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, default in asdict(Config()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    run(Config(**vars(parser.parse_args())))


if __name__ == "__main__":
    main()
