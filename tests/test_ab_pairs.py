"""bench/ab_pairs.sh on two stand-in trees whose benchmark prints a known figure: it alternates the
trees, keeps each run's output, and ends with the ratio table and its medians."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stand_in_tree(folder: Path, rates: list[float]) -> Path:
    """A tree with a .venv (this Python) whose bench/store_lifecycle.py prints rates[i] on its i-th run."""
    (folder / "bench").mkdir(parents=True)
    (folder / ".venv" / "bin").mkdir(parents=True)
    (folder / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (folder / ".venv" / "bin" / "activate").write_text(f'PATH="{folder / ".venv" / "bin"}:$PATH"\n')
    (folder / "bench" / "store_lifecycle.py").write_text(
        "import json, pathlib\n"
        f"runs = pathlib.Path({str(folder / 'runs')!r})\n"
        "n = int(runs.read_text()) if runs.exists() else 0\n"
        "runs.write_text(str(n + 1))\n"
        f"print('progress'); print(json.dumps({{'rollouts_per_s': {rates!r}[n]}}))\n")
    return folder


def test_pairs_alternate_and_end_with_the_median_ratio(tmp_path: Path) -> None:
    before = stand_in_tree(tmp_path / "before", [100.0, 100.0, 100.0])
    after = stand_in_tree(tmp_path / "after", [150.0, 90.0, 130.0])
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "bench" / "ab_pairs.sh"), str(before), "3", "store_lifecycle", str(out)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "AFTER_TREE": str(after)})
    assert done.returncode == 0, done.stderr
    runs = [line.split()[2] for line in (out / "log").read_text().splitlines() if " store_lifecycle " in line]
    assert runs == ["before", "after", "after", "before", "before", "after"]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"store_lifecycle.rollouts_per_s": 1.3}
    assert "| store_lifecycle | rollouts_per_s (higher is better) | 100 -> 150, 100 -> 90, 100 -> 130 | 1.30 |" in done.stdout


def test_a_base_that_is_neither_a_folder_nor_a_commit_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(ROOT / "bench" / "ab_pairs.sh"), "no-such-commit"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "neither a folder nor a commit" in done.stderr
