"""Benchmark: the trainer's recipes, part by part (`--only NAME` runs one part; every part by default).

``packing``: tokens/s of one training step (Trainer.backward + Trainer.update: forward, backward,
AdamW step; fp32 on the CPU) with ``pack_sequences`` on and off, on one micro-batch of agent traces
with the tool demo's lengths, at Qwen2.5-0.5B's shape (`Qwen2Config`: hidden 896, 14 heads, 2 KV
heads, MLP 4864, vocabulary 151,936, tied embeddings; random weights built here, nothing
downloaded) with ``--layers`` of its 24 layers (4 by default: a 24-layer step takes minutes on two
cores). The lengths: the demo's own tokenizer and chat template (`fulmen_algorithm.demos.tools`) on
calculator tasks, three in four whole conversations (call, tool result, answer: 49 or 51 tokens,
the model's tokens of both turns trained) and one in four a first turn whose call did not parse
(the 25-token prompt and 1 to 12 tokens, as the agent's max_tokens allows). Packed and padded steps
alternate (ABBA), after one warm-up step each; the figures are medians. tokens/s counts the
sequences' own tokens (no padding) over the step's wall time; the same over the process's CPU
seconds (`_per_cpu_s`) is less moved by other tenants of a shared machine.

    flock /tmp/bench.lock python bench/recipes.py --only packing

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

QWEN25_05B = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}
COMPLETE_SHARE = 0.75  # of the traces: whole conversations; the rest stop after a first turn that did not parse


def log(message: str, *args: Any) -> None:
    print(f"[recipes] {message % args}", file=sys.stderr, flush=True)


def demo_traces(count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(token ids, mask over the model's tokens) of ``count`` traces with the tool demo's lengths."""
    from fulmen.demo import calculator
    from fulmen.demo.tiny_model import load_tiny_model
    from fulmen_algorithm.demos.tools import CALL_TOKENS, _render, build_tool_model, sequence_and_mask

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as folder:
        build_tool_model(Path(folder), seed)  # the demo's tokens and template (a 145k-parameter model)
        _, tokenizer = load_tiny_model(folder)
    traces = []
    for demo in calculator.demonstrations(calculator.make_tasks("train", count, seed=seed)):
        messages = demo["messages"]
        if rng.random() < COMPLETE_SHARE:
            traces.append(sequence_and_mask(tokenizer, messages))
        else:
            prompt = _render(tokenizer, messages[:1], True)
            n = rng.randint(1, CALL_TOKENS)
            traces.append((prompt + [rng.randrange(4, len(tokenizer)) for _ in range(n)], [0] * len(prompt) + [1] * n))
    return traces


def step_plan(traces: list[tuple[list[int], list[int]]], vocab: int) -> Any:
    """A GRPO step over the traces: groups of 4, rewards 1, 0, 1, 0, advantages ±1, behaviour
    log-probs -ln(vocab) (a random model's own)."""
    import math

    import torch

    from fulmen.records import Sample
    from fulmen_trainer.plan import StepPlan

    samples = []
    for i, (ids, mask) in enumerate(traces):
        start = mask.index(1)
        response, trained = ids[start:], mask[start:]
        reward = float(i % 2 == 0)
        samples.append(Sample(f"r{i}.1/traj", "trajectory", f"r{i}", f"r{i}.1", f"g{i // 4}", 0, ids[:start], response,
                              [-math.log(vocab)] * len(response), trained, reward, reward, "base", group_size=4))
    advantages = torch.tensor([1.0 if s.reward else -1.0 for s in samples])
    return StepPlan(samples, [s.reward or 0.0 for s in samples], advantages, [s.group_key for s in samples], [])


def packing(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of a training step packed and padded, alternating, in this process."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fulmen.settings import TrainerSettings, load_settings
    from fulmen_trainer.policy import Policy
    from fulmen_trainer.trainer import Trainer

    shape = {**QWEN25_05B, "num_hidden_layers": args.layers}
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa")).float().train()
    traces = demo_traces(args.sequences, args.seed)
    plan = step_plan(traces, shape["vocab_size"])
    lengths = [len(ids) for ids, _ in traces]
    log("model: %d layers, %.1fM parameters; %d traces, %d tokens (%d padded)", args.layers,
        sum(p.numel() for p in model.parameters()) / 1e6, len(traces), sum(lengths), len(lengths) * max(lengths))
    trainers = {}
    for packed in (True, False):
        settings = load_settings(TrainerSettings, model_dir=Path(tempfile.gettempdir()), algorithm="grpo",
                                 learning_rate=1e-6, micro_batch=len(traces), pack_sequences=packed)
        trainer = Trainer(None, settings)  # type: ignore[arg-type]  # no store: steps only
        trainer.policy = Policy(model, settings, torch.device("cpu"))
        trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
        trainers[packed] = trainer
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}  # the process's CPU seconds: less moved by other tenants
    abba = [p for _ in range(args.pairs) for p in (True, False, False, True)][: 2 * args.pairs]
    order = [True, False, *abba]  # a warm-up step of each, then packed and padded in ABBA order
    for i, packed in enumerate(order):
        started, started_cpu = time.perf_counter(), time.process_time()
        trainers[packed].backward(plan)
        trainers[packed].update()
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
        if i >= 2:  # the first of each is a warm-up
            times[packed].append(seconds)
            cpu[packed].append(cpu_seconds)
        log("%s step: %.1f s, %.1f CPU s%s", "packed" if packed else "padded", seconds, cpu_seconds,
            " (warm-up)" if i < 2 else "")
    tokens = sum(lengths)
    packed_tps = tokens / statistics.median(times[True])
    padded_tps = tokens / statistics.median(times[False])
    return layout_figures(model, trainers[True], plan, lengths) | {
        "layers": args.layers, "layers_note": f"{args.layers} of Qwen2.5-0.5B's 24 (fewer: a step in seconds on 2 cores)",
        "sequences": len(lengths), "tokens": tokens, "padded_tokens": len(lengths) * max(lengths),
        "lengths": lengths_summary(lengths), "pairs": args.pairs,
        "step_s_packed": [round(t, 2) for t in times[True]], "step_s_padded": [round(t, 2) for t in times[False]],
        "step_cpu_s_packed": [round(t, 2) for t in cpu[True]], "step_cpu_s_padded": [round(t, 2) for t in cpu[False]],
        "packed_vs_padded_tokens_per_cpu_s": round(statistics.median(cpu[False]) / statistics.median(cpu[True]), 3),
        "tokens_per_s_packed": round(packed_tps, 1), "tokens_per_s_padded": round(padded_tps, 1),
        "packed_vs_padded_tokens_per_s": round(packed_tps / padded_tps, 3),
    }


def layout_figures(model: Any, trainer: Any, plan: Any, lengths: list[int]) -> dict[str, Any]:
    """The packed rows the step used."""
    from fulmen_trainer.logprobs import pack_micro_batch

    rows = pack_micro_batch(model, trainer._batch(plan)).packed
    assert rows is not None, "the model refused packed rows"
    return {"packed_rows": int(rows.input_ids.shape[0]), "packed_row_tokens": int(rows.input_ids.shape[1])}


def lengths_summary(lengths: list[int]) -> dict[str, Any]:
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n] = counts.get(n, 0) + 1
    return {"source": f"the tool demo's tokenizer and template on calculator tasks: {COMPLETE_SHARE:.0%} whole "
                      "conversations (call, tool result, answer), the rest a first turn whose call did not parse "
                      "(prompt + 1..12 tokens); the mix is assumed, not recorded from a run",
            "min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
            "counts": dict(sorted(counts.items()))}


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {"packing": packing}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--only", choices=list(PARTS), help="run one part (default: every part)")
    parser.add_argument("--layers", type=int, default=4, help="packing: layers of the 0.5B shape (default 4 of 24)")
    parser.add_argument("--sequences", type=int, default=64, help="packing: traces in the step (default 64: one "
                        "micro-batch, the trainer's default micro_batch)")
    parser.add_argument("--pairs", type=int, default=4, help="packing: timed steps of each kind (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out: dict[str, Any] = {}
    for name in [args.only] if args.only else list(PARTS):
        out |= PARTS[name](args)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    if "packed_vs_padded_tokens_per_s" in out:  # the packing part's figure ends the line
        out["packed_vs_padded_tokens_per_s"] = out.pop("packed_vs_padded_tokens_per_s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
