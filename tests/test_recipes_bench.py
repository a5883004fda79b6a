"""bench/recipes.py's demo part without running it: the dry run lists every RL recipe for every seed,
each with the settings and knobs its trainer will resolve, and the figures name the fastest recipe."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fulmen_algorithm.demos.arithmetic import ANSWER_TOKENS
from fulmen_trainer.objectives import RecipeKnobs, algorithms, recipe_defaults

ROOT = Path(__file__).resolve().parents[1]
# What differs between two runs of one seed: the recipe, and the knobs the recipe needs.
RECIPE_SETTINGS = {"FULMEN_ALGORITHM", "FULMEN_MAX_RESPONSE_LENGTH"}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recipes_bench", ROOT / "bench" / "recipes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def dry_run(bench: ModuleType, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    bench.main(["--only", "demo", "--dry-run", *argv])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return lines[:-1], lines[-1]


def test_the_dry_run_lists_every_rl_recipe_for_every_seed_and_starts_nothing(
        bench: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every registered recipe but sft, on seeds --seed.. --seed+--seeds-1, all from the warm start of
    seed 0 (or --warm-start-seed; each seed its own with --warm-start-per-seed); within a seed the runs
    differ only by the recipe's settings; no warm start is prepared."""
    cache = tmp_path / "cache"
    for flags, warm in (((), lambda seed: 0), (("--warm-start-seed", "7"), lambda seed: 7),
                        (("--warm-start-per-seed",), lambda seed: seed)):
        runs, _ = dry_run(bench, capsys, "--seed", "3", "--seeds", "2", "--cache", str(cache), *flags)
        assert all(r["env"]["FULMEN_MODEL_DIR"] == str(cache / f"seed-{warm(r['seed'])}" / "model") for r in runs)
        assert all(r["warm_start_seed"] == warm(r["seed"]) for r in runs)
    runs, summary = dry_run(bench, capsys, "--seed", "3", "--seeds", "2", "--cache", str(cache))
    rl = [name for name in algorithms() if name != "sft"]
    assert {"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo", "reinforce"} <= set(rl)
    assert sorted((r["recipe"], r["seed"]) for r in runs) == sorted((name, seed) for name in rl for seed in (3, 4))
    for r in runs:
        env = r["env"]
        assert (env["FULMEN_ALGORITHM"], env["FULMEN_SEED"]) == (r["recipe"], str(r["seed"]))
        assert int(env["FULMEN_TOTAL_STEPS"]) >= 10_000  # the target or the budget ends a run, not the steps
        assert float(env["FULMEN_TARGET_ACCURACY"]) == 0.9
    for seed in (3, 4):
        shared = [{k: v for k, v in r["env"].items() if k not in RECIPE_SETTINGS} for r in runs if r["seed"] == seed]
        assert all(env == shared[0] for env in shared)
    assert summary["dry_run"] is True and summary["runs"] == 2 * len(rl) and summary["seeds"] == [3, 4]
    assert not cache.exists()


def test_each_recipe_runs_with_its_own_knobs_and_the_length_limit_it_needs(
        bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The knobs the trainer resolves are the recipe's defaults; Dr. GRPO's constant and DAPO's
    overlong penalty are the answers' generation limit (without it Dr. GRPO would not start)."""
    runs, _ = dry_run(bench, capsys, "--seeds", "1")
    knobs = {r["recipe"]: r["knobs"] for r in runs}
    for name, resolved in knobs.items():
        for knob, value in recipe_defaults(name).items():
            if knob in RecipeKnobs.__dataclass_fields__:
                assert resolved[knob] == (value if value != float("inf") else "inf"), (name, knob)
    assert knobs["dr_grpo"]["constant_normaliser"] and knobs["dr_grpo"]["max_response_length"] == ANSWER_TOKENS
    assert knobs["dapo"]["overlong"] == {"max_length": ANSWER_TOKENS, "buffer": 1, "factor": 1.0}
    assert knobs["dapo"]["dynamic_sampling"] and knobs["grpo"]["overlong"] is None
    dr_grpo = next(r["env"] for r in runs if r["recipe"] == "dr_grpo")
    with pytest.raises(ValueError, match="max_response_length"):
        bench.resolved_knobs({k: v for k, v in dr_grpo.items() if k != "FULMEN_MAX_RESPONSE_LENGTH"})


def test_a_recipe_that_is_not_rl_or_not_registered_is_a_usage_error(bench: ModuleType) -> None:
    """--recipes names registered RL recipes only."""
    for recipes in ("grpo,sft", "grpo,grpo_typo"):
        with pytest.raises(SystemExit) as exited:
            bench.main(["--only", "demo", "--dry-run", "--recipes", recipes])
        assert exited.value.code == 2


def test_the_fastest_recipe_is_the_fastest_median_over_every_seed(bench: ModuleType) -> None:
    """A run that missed the target counts as never: one fast seed in three does not make a recipe
    the fastest, and a recipe with two in three has the median of all three."""
    def result(recipe: str, seed: int, seconds: float | None) -> dict[str, Any]:
        return {"recipe": recipe, "seed": seed, "time_to_target_s": seconds, "final_accuracy": 0.9 if seconds else 0.5}

    results = [result("steady", 0, 100.0), result("steady", 1, 300.0), result("steady", 2, None),
               result("lucky", 0, 50.0), result("lucky", 1, None), result("lucky", 2, None)]
    figures = bench.recipe_figures(results, ["steady", "lucky"])
    assert figures["fastest_recipe"] == "steady"
    assert figures["recipes"]["steady"]["median_time_to_target_s"] == 300.0
    assert figures["recipes"]["steady"]["reached_target"] == 2
    assert figures["recipes"]["lucky"]["median_time_to_target_s"] is None
    assert figures["recipes"]["lucky"]["final_accuracy"] == {"0": 0.9, "1": 0.5, "2": 0.5}


def test_a_results_file_keeps_its_runs_and_the_figures_count_them(
        bench: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --results, a run the file holds (same target and budget) is not run again and counts in
    the figures; one with another budget is neither skipped nor counted; a new run is appended."""
    def line(recipe: str, seed: int, seconds: float | None, budget: float = 900.0) -> str:
        return json.dumps({"recipe": recipe, "seed": seed, "target": 0.9, "budget_s": budget,
                           "time_to_target_s": seconds, "final_accuracy": 0.9 if seconds else 0.5})

    results = tmp_path / "runs.jsonl"
    results.write_text(line("grpo", 0, 200.0) + "\n" + line("dapo", 0, 150.0, budget=600.0) + "\n")
    ran: list[tuple[str, int]] = []

    def fake_run(run: Any, args: Any, folder: Path) -> dict[str, Any]:
        ran.append((run.recipe, run.seed))
        return json.loads(line(run.recipe, run.seed, 100.0))

    monkeypatch.setattr(bench, "run_recipe", fake_run)
    monkeypatch.setattr(bench, "prepare_warm_start", lambda cache, seed: 0.0)
    bench.main(["--only", "demo", "--recipes", "grpo,dapo", "--seeds", "1", "--budget-s", "900",
                "--results", str(results), "--cache", str(tmp_path / "cache")])
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert ran == [("dapo", 0)]
    assert summary["recipes"]["grpo"]["time_to_target_s"] == {"0": 200.0}
    assert summary["recipes"]["dapo"]["time_to_target_s"] == {"0": 100.0}
    assert summary["fastest_recipe"] == "dapo"
    assert [json.loads(s)["recipe"] for s in results.read_text().splitlines()] == ["grpo", "dapo", "dapo"]


def test_mixed_lengths_lengthen_only_the_tool_results(bench: ModuleType) -> None:
    """The packing part's mixed traces are the demo's traces with longer tool results: the model's
    tokens (what is trained) are the same ones, and the untrained tokens grow, unevenly."""
    demo = bench.demo_traces(12, seed=1)
    mixed = bench.demo_traces(12, seed=1, long_results=512)
    assert [sum(m) for _, m in mixed] == [sum(m) for _, m in demo]
    grown = [len(b) - len(a) for (a, _), (b, _) in zip(demo, mixed, strict=True)]
    assert min(grown) >= 0 and len(set(grown)) > 3
    for (ids, mask), (long_ids, long_mask) in zip(demo, mixed, strict=True):
        assert [t for t, m in zip(ids, mask, strict=True) if m] == [t for t, m in zip(long_ids, long_mask, strict=True) if m]
