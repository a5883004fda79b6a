"""Check: every recipe knob's test fails when the knob is switched off (mutation testing, by hand-picked
mutations: each replaces the code that reads one knob with code that ignores it).

A temporary git worktree of HEAD gets one mutation at a time; its packages are imported from it (a
folder of links, first on PYTHONPATH, beats this venv's editable install), and the knob's test runs
there. A test that still passes is a test that cannot catch its knob being ignored. This checkout and
any running service are never touched.

    python bench/knob_mutations.py                 # every mutation, about 2 minutes
    python bench/knob_mutations.py dapo gae        # those whose description holds a word

Progress goes to stderr; ONE JSON object on the last line of stdout: each mutation's verdict and
``all_fail`` (true when every test failed under its mutation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER_TESTS = "tests/trainer/"
SERVICES = ("adapter", "algorithm", "dashboard", "llm_proxy", "runner", "trainer", "vllm_sync")
# (what is switched off, the file, the code that reads the knob, the code that ignores it, the test)
MUTATIONS = [
    ("DAPO clip-higher ignored (high = low)", "services/trainer/loss.py",
     "high = _first(s.clip_eps_high, _number(d.get(\"clip_eps_high\")), s.clip_eps)", "high = low",
     TRAINER_TESTS + "test_recipes.py::test_dapo_clips_higher_above_one_than_below"),
    ("dynamic sampling ignored", "services/trainer/groups.py", "        if self.dynamic_sampling:", "        if False:",
     TRAINER_TESTS + "test_recipes.py::test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal"),
    ("Dr. GRPO divides by std", "services/trainer/objectives.py",
     "return group_advantages(r.values, r.groups, scale=False)  # the group's std",
     "return group_advantages(r.values, r.groups, scale=True)  # the group's std",
     TRAINER_TESTS + "test_recipes.py::test_dr_grpo_advantages_are_not_divided_by_the_group_std"),
    ("Dr. GRPO constant normaliser ignored", "services/trainer/plan.py", "    if knobs.constant_normaliser:", "    if False:",
     TRAINER_TESTS + "test_recipes.py::test_dr_grpo_divides_the_summed_loss_by_a_constant_not_by_lengths"),
    ("overlong penalty ignored", "services/trainer/plan.py",
     "penalty = knobs.overlong(tokens) if knobs.overlong is not None else torch.zeros_like(reward_t)",
     "penalty = torch.zeros_like(reward_t)", TRAINER_TESTS + "test_recipes.py::test_overlong_penalty_lowers_a_long_answer_s_advantage"),
    ("GSPO ratio per token", "services/trainer/objectives.py",
     'tis_cap=tis_cap, ratio=policy_ratio(logp, prox, mask, "sequence"))', 'tis_cap=tis_cap, ratio=policy_ratio(logp, prox, mask, "token"))',
     TRAINER_TESTS + "test_recipes.py::test_gspo_clips_whole_sequences"),
    ("RLOO uses the group mean", "services/trainer/objectives.py",
     "return leave_one_out_advantages(r.values, r.groups)", "return group_advantages(r.values, r.groups, scale=False)",
     TRAINER_TESTS + "test_recipes.py::test_rloo_subtracts_the_mean_of_the_others"),
    ("REINFORCE++ not whitened", "services/trainer/objectives.py",
     "return whitened(group_advantages(r.values, r.groups, scale=False), r.tokens)", "return group_advantages(r.values, r.groups, scale=False)",
     TRAINER_TESTS + "test_recipes.py::test_reinforce_pp_whitens_over_the_whole_batch_s_tokens"),
    ("GAE lambda ignored (lam = 1)", "services/trainer/objectives.py",
     "advantage = delta + gamma * lam * next_advantage", "advantage = delta + gamma * next_advantage",
     "tests/trainer/test_value_head.py::test_gae_with_lambda_zero_is_the_one_step_td_error"),
    ("GAE gamma ignored (gamma = 1)", "services/trainer/objectives.py",
     "    mask = mask.to(values.dtype)\n    rows, positions = values.shape", "    gamma = 1.0\n    mask = mask.to(values.dtype)\n    rows, positions = values.shape",
     "tests/trainer/test_value_head.py::test_gamma_discounts_per_trained_token"),
    ("GAE's return minus value broken (values not subtracted)", "services/trainer/objectives.py",
     "delta = reward + gamma * next_value - values[:, t]", "delta = reward + gamma * next_value",
     "tests/trainer/test_value_head.py::test_gae_with_lambda_one_and_gamma_one_is_the_monte_carlo_return_minus_the_value"),
    ("whiten_advantages ignored", "services/trainer/values.py", "    if knobs.whiten_advantages:", "    if False:",
     "tests/trainer/test_value_head.py::test_advantages_are_whitened_over_the_step_s_tokens_when_asked"),
    ("value clip ignored", "services/trainer/objectives.py", "    if clip is None:\n        return 0.5 * plain", "    if True:\n        return 0.5 * plain",
     "tests/trainer/test_value_head.py::test_the_value_clip_binds"),
    ("vf_coef ignored", "services/trainer/loss.py", "total = total + knobs.vf_coef * value_loss(s, mask, values)",
     "total = total + value_loss(s, mask, values)", "tests/trainer/test_value_head.py::test_vf_coef_weighs_the_value_loss_into_the_loss"),
    ("reinforce's one pass ignored", "services/trainer/loss.py",
     "passes=1 if math.isinf(low) or math.isinf(high) else s.ppo_epochs,", "passes=s.ppo_epochs,",
     "tests/trainer/test_ppo_epochs.py::test_reinforce_makes_one_pass_whatever_ppo_epochs_says"),
    ("dynamic sampling's left-out groups capped as lost ones", "services/algorithm/scheduler.py",
     "return min(untrained, cap) + min(filtered, FILTERED_ROUNDS * cap)", "return min(untrained, cap)",
     "tests/algorithm/test_scheduler.py::test_groups_dynamic_sampling_left_out_are_replaced_up_to_ten_rounds"),
]


def mutated_run(tree: Path, links: Path, rel: str, old: str, new: str, test: str) -> tuple[int, str]:
    path = tree / rel
    text = path.read_text()
    if text.count(old) != 1:
        return -1, f"the code to mutate is found {text.count(old)} times in {rel}: update this script"
    path.write_text(text.replace(old, new))
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test],
                             cwd=tree, env={**os.environ, "PYTHONPATH": str(links)}, capture_output=True, text=True,
                             timeout=600)
    finally:
        path.write_text(text)
    lines = run.stdout.strip().splitlines()
    return run.returncode, lines[-1] if lines else run.stderr[-300:]


def main(words: list[str]) -> dict[str, object]:
    chosen = [m for m in MUTATIONS if not words or any(w.lower() in m[0].lower() for w in words)]
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="fulmen-mutations-") as tmp:
        tree, links = Path(tmp) / "tree", Path(tmp) / "links"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), "HEAD"], check=True)
        try:
            links.mkdir()
            (links / "fulmen").symlink_to(tree / "shared" / "fulmen")
            for name in SERVICES:
                (links / f"fulmen_{name}").symlink_to(tree / "services" / name)
            for what, rel, old, new, test in chosen:
                code, last = mutated_run(tree, links, rel, old, new, test)
                verdict = "fails" if code == 1 else "passes" if code == 0 else "error"
                print(f"[knob_mutations] {verdict:6} {what}: {test.split('::')[-1]} -> {last}", file=sys.stderr, flush=True)
                verdicts.append({"switched_off": what, "test": test, "test_under_mutation": verdict})
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return {"mutations": verdicts, "all_fail": all(v["test_under_mutation"] == "fails" for v in verdicts)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
