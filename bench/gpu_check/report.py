"""gpu_check's report: each step's result file (its last stdout line, or its failure) merged into
``gpu_check.json`` (one JSON line) and ``gpu_check.md`` (a table), rewritten after every step so that a
killed run still leaves what it measured. The JSON is printed as the last stdout line.

    python bench/gpu_check/report.py OUT RESULTS_DIR DRY_RUN(0|1) ELAPSED_S
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ORDER = ["install", "b_full", "b_lora", "b_lora7b", "c", "d", "a", "f", "e"]
# the figures worth a row of the table: (step, key, label)
ROWS = [
    ("b_full", "tokens_per_s", "0.5B full fine-tuning bf16: tokens/s"), ("b_full", "mfu", "0.5B full: MFU"),
    ("b_full", "peak_allocated_gib", "0.5B full: peak GPU memory (GiB)"),
    ("b_lora", "tokens_per_s", "0.5B LoRA r=16: tokens/s"), ("b_lora", "mfu", "0.5B LoRA: MFU"),
    ("b_lora", "peak_allocated_gib", "0.5B LoRA: peak GPU memory (GiB)"),
    ("b_lora7b", "tokens_per_s", "7B LoRA r=16, checkpointing, 16k-token micro-batch: tokens/s"),
    ("b_lora7b", "mfu", "7B LoRA: MFU"), ("b_lora7b", "peak_reserved_gib", "7B LoRA: peak GPU memory reserved (GiB)"),
    ("b_lora7b", "fits_24gb", "7B LoRA fits a 24 GB GPU"),
    ("d", "engine_tokens_per_s_c1", "torch engine, 1 request: tokens/s"),
    ("d", "engine_vs_generate_1", "engine / HF generate, batch 1"),
    ("d", "engine_tokens_per_s_c32", "torch engine, 32 concurrent: tokens/s"),
    ("d", "engine_vs_generate_32", "engine / HF generate, batch 32"),
    ("f", "send_s_2", "weight group: a 0.5B bf16 version over gloo into GPU weights (s)"),
    ("f", "gb_per_s_2", "weight group: GB/s"), ("f", "vllm", "vLLM in the image"),
    ("e", "time_to_target_s", "fulmen dev demo: seconds to 0.9 held-out"), ("e", "best_accuracy", "demo: best accuracy"),
]


def load(results: Path) -> dict[str, dict[str, Any]]:
    steps = {}
    for path in sorted(results.glob("*.json")):
        try:
            steps[path.stem] = json.loads(path.read_text())
        except ValueError as e:
            steps[path.stem] = {"status": "failed", "error": f"unreadable result: {e}"}
    return dict(sorted(steps.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else 99))


def table(steps: dict[str, dict[str, Any]], header: str) -> str:
    lines = [header, "", "| step | status | seconds | error (last lines) |", "|---|---|---|---|"]
    for name, step in steps.items():
        error = str(step.get("error", "")).strip().splitlines()[-3:]
        cell = " / ".join(error).replace("|", "\\|")[:300]
        lines.append(f"| {name} | {step.get('status')} | {step.get('seconds', '')} | {cell} |")
    lines += ["", "| figure | value |", "|---|---|"]
    for step, key, label in ROWS:
        value = steps.get(step, {}).get("result", {}).get(key)
        if value is not None:
            lines.append(f"| {label} | {value} |")
    c = steps.get("c", {}).get("result", {}).get("runs", {})
    for run, figures in c.items():
        lines.append(f"| torchrun {run}, 3 steps | {figures.get('status')} ({figures.get('s')} s) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    out, results, dry_run, elapsed = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", float(sys.argv[4])
    steps = load(results)
    chip = next((s["result"]["chip"] for s in steps.values() if "chip" in s.get("result", {})), None)
    summary = {"dry_run": dry_run, "chip": chip, "elapsed_s": round(elapsed, 1),
               "steps": {name: step.get("status") for name, step in steps.items()}, "details": steps}
    (out / "gpu_check.json").write_text(json.dumps(summary, default=str) + "\n")
    (out / "gpu_check.md").write_text(table(steps, f"# gpu_check ({'dry run, CPU' if dry_run else chip}), "
                                                   f"{elapsed:.0f} s"))
    print(json.dumps({"dry_run": dry_run, "chip": chip, "elapsed_s": round(elapsed, 1),
                      "steps": summary["steps"]}))


if __name__ == "__main__":
    main()
