"""The ratio table of a `bench/ab_pairs.sh` run: for each benchmark's headline figures, each round's
before -> after and the median of after / before, in Markdown (what bench/RESULTS.md takes).

    python bench/ab_table.py OUT_DIR

The last line of stdout is ONE JSON object: the median ratio per figure (``<bench>.<figure>``).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

# the figures each benchmark is judged by, and whether lower is better
FIGURES: dict[str, list[tuple[str, bool]]] = {
    "store_lifecycle": [("rollouts_per_s", False)],
    "runner_overhead": [("rollouts_per_s", False), ("runner_cpu_ms_per_rollout", True)],
    "proxy_overhead": [("added_p50_ms_c1", True), ("proxy_cpu_ms_per_req_c1", True)],
    "adapter_throughput": [("rollouts_per_s", False), ("adapter_cpu_us_per_rollout", True)],
}


def last_json(path: Path) -> dict | None:
    """The JSON object on the last line of a benchmark's output, or None if the run failed."""
    lines = path.read_text().strip().splitlines() if path.exists() else []
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def rounds_of(out: Path, bench: str) -> list[tuple[dict | None, dict | None]]:
    numbers = sorted({int(p.stem.rsplit("-", 1)[1]) for p in out.glob(f"{bench}-*-*.out")})
    return [(last_json(out / f"{bench}-before-{r}.out"), last_json(out / f"{bench}-after-{r}.out")) for r in numbers]


def table(out: Path) -> tuple[list[str], dict[str, float]]:
    lines = ["| benchmark | figure | each round: before -> after | median after / before |", "|---|---|---|---|"]
    medians: dict[str, float] = {}
    for bench, figures in FIGURES.items():
        rounds = rounds_of(out, bench)
        if not rounds:
            continue
        for name, lower_is_better in figures:
            pairs = [(b[name], a[name]) for b, a in rounds if b and a and b.get(name) and a.get(name) is not None]
            if not pairs:
                lines.append(f"| {bench} | {name} | (no complete pair: see {out}/log) | |")
                continue
            median = statistics.median(a / b for b, a in pairs)
            medians[f"{bench}.{name}"] = round(median, 3)
            cells = ", ".join(f"{b:g} -> {a:g}" for b, a in pairs)
            better = "lower is better" if lower_is_better else "higher is better"
            lines.append(f"| {bench} | {name} ({better}) | {cells} | {median:.2f} |")
    return lines, medians


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python bench/ab_table.py OUT_DIR (the folder bench/ab_pairs.sh wrote)")
    lines, medians = table(Path(sys.argv[1]))
    print("\n".join(lines))
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
