"""Benchmark: Fulmen's trainer at real size (issue 15): GRPO steps on a Qwen2.5-0.5B-shaped model.

A randomly initialised model with Qwen2.5-0.5B's architecture and dimensions (`Qwen2Config`: hidden
896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings) is built from
its config (nothing is downloaded), saved in bf16 with `save_pretrained` into a temporary folder,
and trained for ``--steps`` GRPO steps on ``--samples`` sequences of ``--prompt-tokens`` random
prompt tokens followed by ``--response-tokens`` random response tokens (mask 1, behaviour
log-probability -ln(vocabulary), i.e. the random model's own, so the importance weight is ~1;
rewards 1, 0, 1, 0 in groups of 4, GRPO advantages ±1). Each configuration runs in a fresh process
of its own, so the peak RSS (``ru_maxrss``, 1 GB = 1e9 B) is that configuration's:

- ``lora``: Fulmen's trainer (`load_policy`, `Trainer.train_passes`: backward + update),
  ``lora_rank=16, dtype=bfloat16, gradient_checkpointing=True, device=cpu``: the base stored in
  bf16 and read as fp32 layer by layer, the adapter trained in fp32.
- ``full``: Fulmen's trainer, full fine-tuning, ``dtype=bfloat16, device=cpu``: fp32 master
  weights, fp32 compute on a CPU (bf16 autocast would be CUDA only).
- ``bare``: the same step as a plain PyTorch + PEFT loop written here (no Fulmen code): the base
  loaded in bf16, PEFT LoRA r=16 alpha=32 on all linear layers, Hugging Face gradient checkpointing,
  the frozen bf16 weights read as fp32 by a parametrization written here (the CPU has no fast bf16
  matmul), the response positions' logits from the model's own forward (``logits_to_keep``),
  log-softmax, the same decoupled PPO-clip loss (token mean), backward, gradient clipping, AdamW.

Fulmen LoRA and bare runs alternate (``--repeats`` pairs: lora, bare, lora, bare, ...) and the
figures are medians over the runs; a run's step time is its last step's (the first one warms up).
``overhead_vs_bare_torch`` = Fulmen LoRA step time / bare step time. ``tokens_per_s_lora`` =
samples × (prompt + response tokens) / step time (every token goes through the model; the trained
ones are ``trained_tokens_per_s_lora``). Version sizes are the safetensors blobs the trainer
publishes (`Policy.published_state` through `fulmen.versions.model_version`' serialiser, 1 MB = 1e6 B).

    python bench/trainer_real_size.py            # = --steps 2 --samples 8 --prompt-tokens 192
                                                 #   --response-tokens 64 --repeats 3
    python bench/trainer_real_size.py --quick    # 1 pair of lora/bare runs, shorter sequences

The default run takes ~12 minutes on a quiet 2-vCPU machine and ~25 when other tenants share it
(7 processes: there a LoRA step of 2,048 tokens is ~42 s of fp32 matrix products, a full fine-tuning
step ~48 s); ``--quick`` takes ~3 minutes and gives no figure for the issue. Each step also reports the seconds its threads
waited for a CPU (/proc schedstat): on a shared machine that says which runs other tenants slowed.

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

QWEN25_05B = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}
LORA_RANK, LORA_ALPHA, LR = 16, 32.0, 1e-5
TARGETS = {"peak_rss_gb_lora": 6.0, "overhead_vs_bare_torch": 1.10, "lora_version_mb": 20.0}


def log(message: str, *args: Any) -> None:
    print(f"[trainer_real_size] {message % args}", file=sys.stderr, flush=True)


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --- in a child process ------------------------------------------------------------------------------


class Memory:
    """Peak RSS of this process: overall from ``ru_maxrss``, per phase from a sampling thread."""

    def __init__(self) -> None:
        self.phase = "start"
        self.peaks: dict[str, float] = {}
        try:
            import psutil

            self._process: Any = psutil.Process()
        except ImportError:  # the per-phase peaks are then missing; ru_maxrss is enough for the figure
            self._process = None
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self._process is not None and not self._stop.wait(0.01):
            rss = self._process.memory_info().rss / 1e9
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), rss)

    def mark(self, phase: str) -> None:
        self.phase = phase

    @staticmethod
    def peak_gb() -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux

    def report(self) -> dict[str, float]:
        self._stop.set()
        return {phase: round(gb, 3) for phase, gb in self.peaks.items()}


def build_model(folder: Path, seed: int) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    started = time.perf_counter()
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B))
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(folder)
    size = sum(f.stat().st_size for f in folder.iterdir())
    log("built and saved the model: %.1fM parameters, %.0f MB in %s (%.1f s)", params / 1e6, size / 1e6, folder,
        time.perf_counter() - started)
    return {"parameters": params, "folder_mb": round(size / 1e6, 1)}


def make_samples(args: argparse.Namespace, vocab: int) -> list[Any]:
    import torch

    from fulmen.records import Sample

    generator = torch.Generator().manual_seed(args.seed)
    behaviour = -math.log(vocab)  # the random model's own log-probabilities: importance weight ~1
    samples = []
    for i in range(args.samples):
        ids = torch.randint(1, vocab, (args.prompt_tokens + args.response_tokens,), generator=generator).tolist()
        prompt, response = ids[: args.prompt_tokens], ids[args.prompt_tokens :]
        reward = float(i % 2 == 0)
        samples.append(Sample(f"r{i}.1/t0", "triplet", f"r{i}", f"r{i}.1", f"g{i // 4}", 0, prompt, response,
                              [behaviour] * len(response), [1] * len(response), reward, reward, "base",
                              group_size=4))
    return samples


def advantages_of(samples: list[Any]) -> Any:
    import torch

    from fulmen_trainer.objectives import group_advantages

    keys = {key: n for n, key in enumerate(dict.fromkeys(s.group_key for s in samples))}
    rewards = torch.tensor([s.reward for s in samples])
    return group_advantages(rewards, torch.tensor([keys[s.group_key] for s in samples]))


def compute_dtype_probe(model: Any) -> dict[str, str]:
    """The dtypes the first decoder layer's q projection really multiplies: hooked on its forward."""
    import torch

    seen: dict[str, str] = {}
    target = next(m for name, m in model.named_modules()
                  if name.endswith("layers.0.self_attn.q_proj") or name.endswith("layers.0.self_attn.q_proj.base_layer"))
    target = getattr(target, "base_layer", target)

    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        seen.setdefault("input", str(inputs[0].dtype).removeprefix("torch."))
        seen.setdefault("weight", str(module.weight.dtype).removeprefix("torch."))
        seen.setdefault("output", str(output.dtype).removeprefix("torch."))

    target.register_forward_hook(hook)
    return seen


def cpu_wait_s() -> float:
    """Seconds this process's threads have spent runnable but waiting for a CPU (/proc schedstat):
    other tenants of a shared machine taking the cores."""
    total = 0
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def matmul_probe() -> float:
    """fp32 GFLOP/s of a decoder-sized matrix product just before the steps: how fast the (shared) CPU
    is at that moment."""
    import torch

    a, b = torch.randn(2048, 896), torch.randn(896, 4864)
    a @ b
    started, count = time.perf_counter(), 5
    for _ in range(count):
        a @ b
    return round(2 * 2048 * 896 * 4864 * count / (time.perf_counter() - started) / 1e9, 1)


def version_sizes(state: dict[str, Any]) -> tuple[float, float]:
    """MB of the published blob as it is (fp32) and if its tensors were bf16."""
    import torch

    from fulmen.versions.blobs import serialize as _serialize
    from fulmen.versions.manifest import FULL, Manifest, describe_all

    as_is = len(_serialize(state, Manifest(FULL, None, describe_all(state))))
    bf16 = {name: t.to(torch.bfloat16) for name, t in state.items()}
    as_bf16 = len(_serialize(bf16, Manifest(FULL, None, describe_all(bf16))))
    return round(as_is / 1e6, 2), round(as_bf16 / 1e6, 2)


def run_fulmen(args: argparse.Namespace, mode: str, memory: Memory) -> dict[str, Any]:
    import torch

    from fulmen.settings import TrainerSettings, load_settings
    from fulmen_trainer.plan import StepPlan
    from fulmen_trainer.policy import load_policy
    from fulmen_trainer.trainer import Trainer

    knobs: dict[str, Any] = {"dtype": "bfloat16", "device": "cpu"}
    if mode == "lora":
        knobs.update(lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, gradient_checkpointing=True)
    settings = load_settings(TrainerSettings, model_dir=args.model_dir, algorithm="grpo", learning_rate=LR,
                             micro_batch=args.samples, **knobs)
    memory.mark("load")
    started = time.perf_counter()
    trainer = Trainer(None, settings)  # type: ignore[arg-type]  # no store: only the passes are run
    trainer.policy = load_policy(settings, None)
    trainer.optimizer = torch.optim.AdamW(trainer.policy.trainable_parameters(), lr=LR)
    load_s = time.perf_counter() - started
    rss_loaded = memory.peak_gb()
    trainable = sum(p.numel() for p in trainer.policy.trainable_parameters())
    log("%s: loaded in %.1f s, %.1fM trained parameters, peak RSS so far %.2f GB", mode, load_s, trainable / 1e6,
        rss_loaded)
    dtypes = compute_dtype_probe(trainer.model)
    samples = make_samples(args, trainer.model.config.vocab_size)
    advantages = advantages_of(samples)
    steps, cpu, waits, losses = [], [], [], []
    probe = matmul_probe()
    for step in range(args.steps):
        plan = StepPlan(samples, [s.reward for s in samples], advantages, [s.group_key for s in samples], [])
        memory.mark(f"step{step + 1}")
        started, started_cpu, started_wait = time.perf_counter(), time.process_time(), cpu_wait_s()
        metrics = trainer.train_passes(plan)  # what `train_step` runs for one rank: backward, update
        steps.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        waits.append(cpu_wait_s() - started_wait)
        losses.append(metrics["loss/total"])
        log("%s: step %d %.2f s (%.2f s of CPU, threads waited %.2f s for a CPU), loss %.6f, grad norm %.4g, "
            "peak RSS %.2f GB", mode, step + 1, steps[-1], cpu[-1], waits[-1], losses[-1], metrics["loss/grad_norm"],
            memory.peak_gb())
    if trainer.nonfinite is not None:
        raise RuntimeError(f"a step was not finite: {trainer.nonfinite}")
    peak = memory.peak_gb()
    memory.mark("publish")
    state = trainer.policy.published_state()
    mb, mb_bf16 = version_sizes(state)
    log("%s: published version %.2f MB (%.2f MB in bf16), %d tensors", mode, mb, mb_bf16, len(state))
    return {"mode": mode, "load_s": round(load_s, 2), "step_s": [round(s, 3) for s in steps],
            "step_cpu_s": [round(s, 3) for s in cpu], "step_wait_s": [round(s, 3) for s in waits], "losses": losses, "peak_rss_gb": round(peak, 3),
            "peak_rss_gb_after_load": round(rss_loaded, 3), "trained_parameters": trainable, "version_mb": mb,
            "version_mb_bf16": mb_bf16, "version_tensors": len(state), "compute": dtypes, "probe_gflops": probe}


def run_bare(args: argparse.Namespace, memory: Memory) -> dict[str, Any]:
    """The same step in plain PyTorch + PEFT: no Fulmen code."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.nn.utils import parametrize
    from transformers import AutoModelForCausalLM

    class Upcast(torch.nn.Module):  # written here, not Fulmen's: a frozen bf16 weight read as fp32
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight.float()

    memory.mark("load")
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                             target_modules="all-linear", bias="none", task_type="CAUSAL_LM"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    for module in list(model.modules()):
        for name in ("weight", "bias"):
            tensor = module._parameters.get(name)
            if tensor is not None and not tensor.requires_grad and tensor.dtype == torch.bfloat16:
                parametrize.register_parametrization(module, name, Upcast(), unsafe=True)
    model.train()
    optimizer = torch.optim.AdamW(trainable, lr=LR)
    load_s = time.perf_counter() - started
    rss_loaded = memory.peak_gb()
    log("bare: loaded in %.1f s, %.1fM trained parameters, peak RSS so far %.2f GB", load_s,
        sum(p.numel() for p in trainable) / 1e6, rss_loaded)
    dtypes = compute_dtype_probe(model)

    samples = make_samples(args, model.config.vocab_size)
    input_ids = torch.tensor([s.prompt_token_ids + s.response_token_ids for s in samples])
    attention_mask = torch.ones_like(input_ids)
    targets = input_ids[:, args.prompt_tokens :]
    behaviour = torch.tensor([s.response_logprobs for s in samples])
    rewards = torch.tensor([s.reward for s in samples]).view(-1, 4)
    centred = rewards - rewards.mean(-1, keepdim=True)
    advantages = (centred / (centred.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)).view(-1, 1)
    clip, cap = 0.2, 2.0
    steps, cpu, waits, losses = [], [], [], []
    probe = matmul_probe()
    for step in range(args.steps):
        memory.mark(f"step{step + 1}")
        started, started_cpu, started_wait = time.perf_counter(), time.process_time(), cpu_wait_s()
        # the logits at the positions that predict the response tokens (the last R+1, minus the last)
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       logits_to_keep=args.response_tokens + 1).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        old = logp.detach()
        weight = torch.exp(old - behaviour).clamp(max=cap)
        ratio = torch.exp(logp - old)
        loss = -(weight * torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        waits.append(cpu_wait_s() - started_wait)
        losses.append(float(loss))
        log("bare: step %d %.2f s (%.2f s of CPU, threads waited %.2f s for a CPU), loss %.6f, peak RSS %.2f GB",
            step + 1, steps[-1], cpu[-1], waits[-1], losses[-1], memory.peak_gb())
    return {"mode": "bare", "load_s": round(load_s, 2), "step_s": [round(s, 3) for s in steps],
            "step_cpu_s": [round(s, 3) for s in cpu], "step_wait_s": [round(s, 3) for s in waits], "losses": losses, "peak_rss_gb": round(memory.peak_gb(), 3),
            "peak_rss_gb_after_load": round(rss_loaded, 3), "compute": dtypes, "probe_gflops": probe}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.child == "build":
        result = build_model(args.model_dir, args.seed)
    else:
        torch.manual_seed(args.seed)
        memory = Memory()
        result = run_bare(args, memory) if args.child == "bare" else run_fulmen(args, args.child, memory)
        result["rss_peak_gb_by_phase"] = memory.report()
    print(json.dumps(result), flush=True)


# --- the parent: one process per run ------------------------------------------------------------------


def spawn(args: argparse.Namespace, role: str, folder: Path) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", role, "--model-dir", str(folder),
               "--steps", str(args.steps), "--samples", str(args.samples), "--prompt-tokens", str(args.prompt_tokens),
               "--response-tokens", str(args.response_tokens), "--threads", str(args.threads), "--seed", str(args.seed)]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {role} run failed (exit code {done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - started, 1)
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)  # other tenants of the machine, roughly
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per run (the last one is timed)")
    parser.add_argument("--samples", type=int, default=8, help="sequences per step (groups of 4)")
    parser.add_argument("--prompt-tokens", type=int, default=192, help="prompt tokens per sequence")
    parser.add_argument("--response-tokens", type=int, default=64, help="response (trained) tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of Fulmen LoRA / bare runs, alternated")
    parser.add_argument("--skip-full", action="store_true", help="leave out the full fine-tuning run")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 pair of runs, 8 x (48 + 16) tokens (not the issue's figures)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each run (torch.set_num_threads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=["build", "lora", "full", "bare"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.samples % 4:
        parser.error("--samples must be a multiple of 4 (groups of 4)")
    if args.child is not None:
        child(args)
        return
    if args.quick:
        args.repeats, args.prompt_tokens, args.response_tokens = 1, 48, 16

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fulmen-real-size-") as tmp:
        folder = Path(tmp) / "qwen2.5-0.5b-random"
        log("building a Qwen2.5-0.5B-shaped model from its config (random weights, bf16)")
        built = spawn(args, "build", folder)
        runs: dict[str, list[dict[str, Any]]] = {"lora": [], "bare": [], "full": []}
        for repeat in range(args.repeats):
            for role in ("lora", "bare"):
                log("run %d/%d: %s (%d steps, %d x (%d + %d) tokens)", repeat + 1, args.repeats, role, args.steps,
                    args.samples, args.prompt_tokens, args.response_tokens)
                runs[role].append(spawn(args, role, folder))
        if not args.skip_full:
            log("full fine-tuning run")
            runs["full"].append(spawn(args, "full", folder))

    def step_s(role: str) -> float:
        return statistics.median(r["step_s"][-1] for r in runs[role])

    tokens = args.samples * (args.prompt_tokens + args.response_tokens)
    trained = args.samples * args.response_tokens
    lora, bare, full = runs["lora"], runs["bare"], runs["full"]
    no_bf16 = "avx512_bf16" not in cpu_flags() and "amx_bf16" not in cpu_flags()
    why = "no avx512_bf16/amx_bf16: bf16 matmuls are slow" if no_bf16 else "as Fulmen runs on a CPU"
    result: dict[str, Any] = {
        "bench": "trainer_real_size",
        "peak_rss_gb_lora": max(r["peak_rss_gb"] for r in lora),
        "peak_rss_gb_full": full[0]["peak_rss_gb"] if full else None,
        "step_s_lora": round(step_s("lora"), 2),
        "tokens_per_s_lora": round(tokens / step_s("lora"), 1),
        "overhead_vs_bare_torch": round(step_s("lora") / step_s("bare"), 3),
        "lora_version_mb": lora[0]["version_mb"],
        "full_version_mb": full[0]["version_mb"] if full else None,
        "compute_dtype_lora": (f"{lora[0]['compute']['input']} (base stored bf16, read as fp32 per layer; "
                               f"adapter fp32; {why})"),
        "compute_dtype_full": (f"{full[0]['compute']['input']} (fp32 master weights; bf16 autocast is CUDA only)"
                               if full else None),
        "targets": {"peak_rss_gb_lora": f"<= {TARGETS['peak_rss_gb_lora']}",
                    "overhead_vs_bare_torch": f"<= {TARGETS['overhead_vs_bare_torch']}",
                    "lora_version_mb": f"<= {TARGETS['lora_version_mb']}"},
        "met": {
            "peak_rss_gb_lora": max(r["peak_rss_gb"] for r in lora) <= TARGETS["peak_rss_gb_lora"],
            "overhead_vs_bare_torch": step_s("lora") / step_s("bare") <= TARGETS["overhead_vs_bare_torch"],
            "lora_version_mb": lora[0]["version_mb"] <= TARGETS["lora_version_mb"],
        },
        "step_s_bare": round(step_s("bare"), 2),
        "step_s_full": round(full[0]["step_s"][-1], 2) if full else None,
        "step_s_lora_runs": [r["step_s"] for r in lora],
        "step_s_bare_runs": [r["step_s"] for r in bare],
        "step_s_full_runs": [r["step_s"] for r in full],
        "step_cpu_s_lora_runs": [r["step_cpu_s"] for r in lora],
        "step_cpu_s_bare_runs": [r["step_cpu_s"] for r in bare],
        "overhead_vs_bare_torch_cpu_time": round(statistics.median(r["step_cpu_s"][-1] for r in lora)
                                                 / statistics.median(r["step_cpu_s"][-1] for r in bare), 3),
        "step_wait_s_lora_runs": [r["step_wait_s"] for r in lora],
        "step_wait_s_bare_runs": [r["step_wait_s"] for r in bare],
        "overhead_vs_bare_torch_best": round(min(r["step_s"][-1] for r in lora) / min(r["step_s"][-1] for r in bare), 3),
        "probe_gflops_runs": {role: [r["probe_gflops"] for r in runs[role]] for role in runs if runs[role]},
        "load_avg_1m_after_runs": {role: [r["load_avg_1m_after"] for r in runs[role]] for role in runs if runs[role]},
        "tokens_per_step": tokens,
        "trained_tokens_per_s_lora": round(trained / step_s("lora"), 1),
        "tokens_per_s_full": round(tokens / full[0]["step_s"][-1], 1) if full else None,
        "peak_rss_gb_bare": max(r["peak_rss_gb"] for r in bare),
        "rss_gb_after_load": {role: runs[role][0]["peak_rss_gb_after_load"] for role in runs if runs[role]},
        "rss_peak_gb_by_phase": {role: runs[role][0]["rss_peak_gb_by_phase"] for role in runs if runs[role]},
        "lora_version_mb_bf16": lora[0]["version_mb_bf16"],
        "full_version_mb_bf16": full[0]["version_mb_bf16"] if full else None,
        "full_version_tensors": full[0]["version_tensors"] if full else None,
        "lora_trained_parameters": lora[0]["trained_parameters"],
        "first_loss_fulmen_vs_bare": [lora[0]["losses"][0], bare[0]["losses"][0]],
        "load_s": {role: runs[role][0]["load_s"] for role in runs if runs[role]},
        "model_parameters": built["parameters"], "model_folder_mb": built["folder_mb"],
        "steps": args.steps, "samples": args.samples, "prompt_tokens": args.prompt_tokens,
        "response_tokens": args.response_tokens, "repeats": args.repeats, "quick": args.quick,
        "step_s_is": "the last step of each run; median over runs",
        "elapsed_s": round(time.perf_counter() - started, 1),
        "cpu": cpu_model(), "avx512_bf16": not no_bf16, "cpus": os.cpu_count(), "threads": args.threads,
        "load_avg_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
