"""Benchmark: the trainer's recipes, part by part (`--only NAME` runs one part; every part by default).

``demo``: the README's demo (bench/honcho_demo.py: the repository's Procfile and .env in a fresh
folder on free ports, `honcho start`) trained with each RL recipe (``--recipes``: every registered
one but sft by default) for ``--seeds`` seeds (3), each run stopped at the first validation pass at
``--target`` (0.9) or at ``--budget-s`` (600) since `honcho start`. A run differs from the .env only by
FULMEN_ALGORITHM, FULMEN_SEED, the knobs its recipe needs on the demo (the generation limit,
ANSWER_TOKENS, for the recipes that normalise by it or penalise answers near it), a step count too
large to end it, and FULMEN_MODEL_DIR: the warm start, prepared once into ``--cache`` (as the demo
prepares it; reused by every run and every later invocation), so each run is RL only. The warm start
is seed ``--warm-start-seed``'s (0, the README demo's) for every seed, as RL papers fix the base model
and vary the run's seed; ``--warm-start-per-seed`` gives each seed its own (seed 1's reads 0.15
held-out, seed 0's 0.40: a different task more than a different run). The knobs
are resolved as the trainer will resolve them before anything starts. One JSON line per run, then
the per-recipe figures (``--results FILE`` keeps the runs in FILE, so an invocation runs only those not
there yet, and its figures count them all); ``--dry-run`` prints the runs, their environments and knobs, and starts nothing.

    flock /tmp/bench.lock python bench/recipes.py --only demo                  # hours: 9 recipes x 3 seeds
    python bench/recipes.py --only demo --recipes grpo,dapo --seeds 1 --dry-run

``packing``: tokens/s of one training step (Trainer.backward + Trainer.update: forward, backward,
AdamW step; fp32 on the CPU) with ``pack_sequences`` on and off, on one micro-batch of agent traces
with the tool demo's lengths, at Qwen2.5-0.5B's shape (`Qwen2Config`: hidden 896, 14 heads, 2 KV
heads, MLP 4864, vocabulary 151,936, tied embeddings; random weights built here, nothing
downloaded) with ``--layers`` of its 24 layers (4 by default: a 24-layer step takes minutes on two
cores). The lengths: the demo's own tokenizer and chat template (`fulmen_algorithm.demos.tools`) on
calculator tasks, three in four whole conversations (call, tool result, answer: 49 or 51 tokens,
the model's tokens of both turns trained) and one in four a first turn whose call did not parse
(the 25-token prompt and 1 to 12 tokens, as the agent's max_tokens allows). Those are nearly one
length (``--lengths demo``: packing can remove only their 12% of padding), so by default
(``--lengths mixed``) each whole conversation's tool result is longer by 1 to ``--long-results``
(512) characters, log-uniformly: a tool that returns a page beside one that returns a number, 16
traces. ``padding_ceiling`` is padded tokens over the traces' own: what packing could at most win
in the decoder (the output layer and the optimizer cost the same either way). Packed and padded steps
alternate (ABBA), after one warm-up step each; the figures are medians. tokens/s counts the
sequences' own tokens (no padding) over the step's wall time; the same over the process's CPU
seconds (`_per_cpu_s`) is less moved by other tenants of a shared machine.

    flock /tmp/bench.lock python bench/recipes.py --only packing

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout (the demo part
prints a JSON line per run before it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import honcho_demo as honcho

QWEN25_05B = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}
COMPLETE_SHARE = 0.75  # of the traces: whole conversations; the rest stop after a first turn that did not parse


def log(message: str, *args: Any) -> None:
    print(f"[recipes] {message % args}", file=sys.stderr, flush=True)


def demo_traces(count: int, seed: int, long_results: int = 0) -> list[tuple[list[int], list[int]]]:
    """(token ids, mask over the model's tokens) of ``count`` traces with the tool demo's lengths; with
    ``long_results``, each whole conversation's tool result grows by a number of characters drawn
    log-uniformly from 1 to ``long_results`` (a tool that returns a page beside one that returns a
    number: mixed lengths), the rest of the trace as the demo has it."""
    from fulmen.demo import calculator
    from fulmen.demo.tiny_model import load_tiny_model
    from fulmen_algorithm.demos.tools import CALL_TOKENS, _render, build_tool_model, sequence_and_mask

    rng = random.Random(seed)
    grow = random.Random(seed + 1)  # apart: the same traces are whole or cut with and without long results
    with tempfile.TemporaryDirectory() as folder:
        build_tool_model(Path(folder), seed)  # the demo's tokens and template (a 145k-parameter model)
        _, tokenizer = load_tiny_model(folder)
    traces = []
    for demo in calculator.demonstrations(calculator.make_tasks("train", count, seed=seed)):
        messages = demo["messages"]
        if long_results:
            extra = round(math.exp(grow.uniform(0, math.log(long_results))))
            messages = [m | {"content": m["content"] + " " + "".join(grow.choices("0123456789", k=extra))}
                        if m["role"] == "tool" else m for m in messages]
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
    long_results = args.long_results if args.lengths == "mixed" else 0
    traces = demo_traces(args.sequences or (16 if long_results else 64), args.seed, long_results)
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
        "lengths_kind": args.lengths, "layers": args.layers, "layers_note": f"{args.layers} of Qwen2.5-0.5B's 24 (fewer: a step in seconds on 2 cores)",
        "sequences": len(lengths), "tokens": tokens, "padded_tokens": len(lengths) * max(lengths),
        "lengths": lengths_summary(lengths, long_results), "pairs": args.pairs,
        "padding_ceiling": round(len(lengths) * max(lengths) / tokens, 3),
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


def lengths_summary(lengths: list[int], long_results: int) -> dict[str, Any]:
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n] = counts.get(n, 0) + 1
    longer = (f", each tool result longer by 1..{long_results} characters (log-uniform)" if long_results else "")
    return {"source": f"the tool demo's tokenizer and template on calculator tasks: {COMPLETE_SHARE:.0%} whole "
                      f"conversations (call, tool result, answer{longer}), the rest a first turn whose call did not "
                      "parse (prompt + 1..12 tokens); the mix is assumed, not recorded from a run",
            "min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
            "counts": dict(sorted(counts.items()))}


# --- demo: the README's demo trained with each recipe ------------------------------------------------

DEMO_CACHE = honcho.ROOT / ".fulmen" / "bench-recipes"  # warm starts, one folder per seed
VALUE_HEAD_KNOBS = frozenset({"gamma", "gae_lambda", "whiten_advantages", "value_clip", "vf_coef"})
NOT_RL = frozenset({"sft"})  # imitates given answers: not a recipe the demo's rewards can train
# The demo prepares its warm start in the algorithm's process with the .env's torch threads: so here.
PREPARE = ("import logging, sys, torch; from pathlib import Path; "
           "from fulmen_algorithm.demos.arithmetic import prepare_demo; "
           "logging.basicConfig(level=logging.INFO, format='  [warm start] %(message)s'); "
           "n = int(sys.argv[3]); torch.set_num_threads(n) if n else None; prepare_demo(Path(sys.argv[1]), seed=int(sys.argv[2]))")


@dataclass(frozen=True)
class DemoRun:
    """One run of the demo: its recipe, its seed, its warm start's seed, and its settings over the
    repository's .env."""

    recipe: str
    seed: int
    warm_start_seed: int
    env: dict[str, str]


def rl_recipes() -> list[str]:
    """Every registered recipe that trains on rewards."""
    from fulmen_trainer.objectives import algorithms

    return [name for name in algorithms() if name not in NOT_RL]


def recipe_env(recipe: str, seed: int, target: float, cache: Path, warm_start_seed: int) -> dict[str, str]:
    """The run's settings over the .env: the recipe, the seed, its warm start, no step limit, and the
    knobs the recipe cannot run the demo without (the answers' generation limit)."""
    from fulmen_algorithm.demos.arithmetic import ANSWER_TOKENS
    from fulmen_trainer.objectives import recipe_defaults

    env = {"FULMEN_ALGORITHM": recipe, "FULMEN_SEED": str(seed), "FULMEN_MODEL_DIR": str(cache / f"seed-{warm_start_seed}" / "model"),
           "FULMEN_TOTAL_STEPS": "100000", "FULMEN_TARGET_ACCURACY": str(target)}
    defaults = recipe_defaults(recipe)
    if defaults.get("constant_normaliser") or defaults.get("overlong_penalty"):
        env["FULMEN_MAX_RESPONSE_LENGTH"] = str(ANSWER_TOKENS)  # Dr. GRPO's constant; DAPO's overlong limit
    return env


def resolved_knobs(env: dict[str, str]) -> dict[str, Any]:
    """The knobs the trainer will run with, resolved from the .env and ``env`` as it resolves them at
    start: a setting no service reads, or knobs the trainer refuses, raise here, before anything runs."""
    from fulmen.cli.dev import read_dotenv
    from fulmen.settings import TrainerSettings, env_name, known_env_names, load_settings
    from fulmen_trainer.loss import recipe_knobs

    values = {**read_dotenv(honcho.ROOT / ".env"), **env}
    unknown = sorted(set(env) - known_env_names())
    if unknown:
        raise ValueError(f"no service reads {unknown}")
    fields = {f: values[env_name(f)] for f in TrainerSettings.model_fields if env_name(f) in values}
    knobs = dataclasses.asdict(recipe_knobs(load_settings(TrainerSettings, **fields)))
    if not knobs["value_head"]:  # the value head's knobs say nothing without one
        knobs = {k: v for k, v in knobs.items() if k not in VALUE_HEAD_KNOBS}
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in knobs.items()}


def demo_runs(args: argparse.Namespace) -> list[DemoRun]:
    """Seed by seed, every recipe: an interrupted benchmark has every recipe on its first seeds."""
    seeds = range(args.seed, args.seed + args.seeds)
    warm = {s: s if args.warm_start_per_seed else args.warm_start_seed for s in seeds}
    return [DemoRun(r, s, warm[s], recipe_env(r, s, args.target, args.cache, warm[s]))
            for s in seeds for r in args.recipe_names]


def prepare_warm_start(cache: Path, seed: int) -> float:
    """The seed's warm start in ``cache``/seed-N, as the demo prepares it (minutes the first time;
    reused after). The seconds it took."""
    from fulmen.cli.dev import read_dotenv

    threads = read_dotenv(honcho.ROOT / ".env").get("FULMEN_TORCH_THREADS", "0")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", PREPARE, str(cache / f"seed-{seed}"), str(seed), threads], check=True,
                   env=honcho.clean_env(), stdout=sys.stderr)
    return time.perf_counter() - started


def _reached(passes: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((v for v in passes if v["label"] != "v0" and v["accuracy"] >= target), None)


def run_recipe(run: DemoRun, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The demo in ``folder`` with the run's settings, until the target or the budget."""
    redis_port = honcho.write_folder(folder, "Procfile", ".env", run.env)
    started = time.time()
    with honcho.honcho_start(folder, honcho.clean_env()) as process:
        passes = honcho.watch_validations(process, redis_port, f"{run.recipe} seed {run.seed}", started,
                                          args.budget_s, lambda passes: _reached(passes, args.target) is not None)
        exited = process.poll()
    reached = _reached(passes, args.target)
    if exited is not None and reached is None:
        log("%s seed %d: honcho ended (%s) first; its log ends:\n%s", run.recipe, run.seed, exited,
            honcho.log_tail(folder))
    points = honcho.curve(passes, started)
    trained = [c["accuracy"] for c in points if c["label"] != "v0"]
    return {
        "recipe": run.recipe, "seed": run.seed, "warm_start_seed": run.warm_start_seed, "target": args.target,
        "budget_s": args.budget_s,
        "ended": "target" if reached else "budget" if exited is None else f"honcho exited ({exited})",
        "time_to_target_s": round(reached["time"] - started, 1) if reached else None,
        "steps_to_target": reached.get("step") if reached else None,
        "warm_start_accuracy": next((c["accuracy"] for c in points if c["label"] == "v0"), None),
        "final_accuracy": trained[-1] if trained else None, "best_accuracy": max(trained, default=None),
        "wall_s": round(time.time() - started, 1), "env": run.env, "curve": points,
    }


def recipe_figures(results: list[dict[str, Any]], recipes: list[str]) -> dict[str, Any]:
    """Per recipe: runs, runs at the target, the median time to it (a run that missed it counts as
    never: the median is None unless most runs reached it), final accuracy per seed; the fastest."""
    figures: dict[str, Any] = {}
    for recipe in recipes:
        mine = [r for r in results if r["recipe"] == recipe]
        times = [r["time_to_target_s"] for r in mine]
        median = statistics.median([math.inf if t is None else t for t in times]) if times else math.inf
        figures[recipe] = {
            "runs": len(mine), "reached_target": sum(t is not None for t in times),
            "median_time_to_target_s": median if math.isfinite(median) else None,
            "time_to_target_s": {str(r["seed"]): r["time_to_target_s"] for r in mine},
            "final_accuracy": {str(r["seed"]): r["final_accuracy"] for r in mine},
        }
    timed = {name: f["median_time_to_target_s"] for name, f in figures.items() if f["median_time_to_target_s"] is not None}
    return {"recipes": figures, "fastest_recipe": min(timed, key=lambda name: timed[name]) if timed else None}


def demo(args: argparse.Namespace) -> dict[str, Any]:
    """Each recipe on the demo, seed by seed; a JSON line per run (``--dry-run``: its settings)."""
    runs = demo_runs(args)
    knobs = {r.recipe: resolved_knobs(r.env) for r in runs}  # the trainer's refusals, before hours are spent
    head = {"target": args.target, "budget_s": args.budget_s, "seeds": sorted({r.seed for r in runs})}
    if args.dry_run:
        for r in runs:
            print(json.dumps({"recipe": r.recipe, "seed": r.seed, "warm_start_seed": r.warm_start_seed, "env": r.env,
                              "knobs": knobs[r.recipe]}), flush=True)
        return head | {"dry_run": True, "runs": len(runs), "recipe_names": args.recipe_names, "cache": str(args.cache)}
    planned = {(run.recipe, run.seed, run.warm_start_seed) for run in runs}
    kept = done_runs(args.results, args.target, args.budget_s) if args.results else []
    results = [r for r in kept if (r["recipe"], r["seed"], r["warm_start_seed"]) in planned]
    done = {(r["recipe"], r["seed"]) for r in results}
    warm_start_s: dict[int, float] = {}
    for r in runs:
        if (r.recipe, r.seed) in done:
            log("%s seed %d: in %s already, not run again", r.recipe, r.seed, args.results)
            continue
        if r.warm_start_seed not in warm_start_s:
            warm_start_s[r.warm_start_seed] = round(prepare_warm_start(args.cache, r.warm_start_seed), 1)
        with tempfile.TemporaryDirectory(prefix=f"fulmen-recipes-{r.recipe}-") as folder:
            log("%s seed %d: honcho start in %s (budget %.0f s)", r.recipe, r.seed, folder, args.budget_s)
            result = run_recipe(r, args, Path(folder)) | {"knobs": knobs[r.recipe]}
        print(json.dumps(result), flush=True)
        if args.results:
            with args.results.open("a") as f:
                f.write(json.dumps(result) + "\n")
        results.append(result)
    return head | {"warm_start_s": warm_start_s} | recipe_figures(results, args.recipe_names)


def done_runs(path: Path, target: float, budget_s: float) -> list[dict[str, Any]]:
    """The runs ``path`` holds (a JSON line each, as this part prints them) with this target and budget:
    a later invocation with the same file runs only the others, and its figures count them all."""
    if not path.exists():
        return []
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in runs:  # kept before the warm start was a setting: each seed had its own
        r.setdefault("warm_start_seed", r["seed"])
    return [r for r in runs if r.get("target") == target and r.get("budget_s") == budget_s]


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {"packing": packing, "demo": demo}
DRY_RUN_PARTS = frozenset({"demo"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--only", choices=list(PARTS), help="run one part (default: every part)")
    parser.add_argument("--layers", type=int, default=4, help="packing: layers of the 0.5B shape (default 4 of 24)")
    parser.add_argument("--lengths", choices=("mixed", "demo"), default="mixed", help="packing: the traces' "
                        "lengths: the tool demo's (26 to 51 tokens, nearly one length), or mixed (the default): "
                        "the same traces with tool results longer by up to --long-results characters")
    parser.add_argument("--long-results", type=int, default=512, help="packing, mixed: the longest addition to a "
                        "tool result (default 512)")
    parser.add_argument("--sequences", type=int, help="packing: traces in the step (default 64 with the demo's "
                        "lengths: the trainer's default micro_batch; 16 mixed: a padded step of 64 is minutes here)")
    parser.add_argument("--pairs", type=int, default=4, help="packing: timed steps of each kind (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="packing: its seed; demo: the first seed")
    parser.add_argument("--recipes", help="demo: comma-separated recipes (default: every RL recipe)")
    parser.add_argument("--seeds", type=int, default=3, help="demo: seeds per recipe, from --seed (default 3)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="demo: most seconds a run takes (default 600)")
    parser.add_argument("--target", type=float, default=0.9, help="demo: the validation accuracy a run stops at")
    parser.add_argument("--warm-start-seed", type=int, default=0, help="demo: the seed of the warm start every run "
                        "starts from (default 0, the README demo's)")
    parser.add_argument("--warm-start-per-seed", action="store_true", help="demo: each seed its own warm start instead")
    parser.add_argument("--cache", type=Path, default=DEMO_CACHE, help=f"demo: the warm starts (default {DEMO_CACHE})")
    parser.add_argument("--results", type=Path, help="demo: a file of runs (a JSON line each): the runs it holds "
                        "with this target and budget are not run again, each new run is appended, and the figures "
                        "count them all (a benchmark of hours, spread over several invocations)")
    parser.add_argument("--dry-run", action="store_true", help="demo: print the runs and their settings, start nothing "
                        "(the packing part is skipped)")
    args = parser.parse_args(argv)
    names = [args.only] if args.only else list(PARTS)
    if args.dry_run:
        names = [name for name in names if name in DRY_RUN_PARTS]
    if "demo" in names:
        recipes = rl_recipes()
        args.recipe_names = honcho.variant_names(parser, args.recipes, recipes) if args.recipes else recipes
    started = time.perf_counter()
    out: dict[str, Any] = {}
    for name in names:
        out |= PARTS[name](args)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    if "packed_vs_padded_tokens_per_s" in out:  # the packing part's figure ends the line
        out["packed_vs_padded_tokens_per_s"] = out.pop("packed_vs_padded_tokens_per_s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
