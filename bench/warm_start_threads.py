"""Benchmark: the demo's SFT warm start on one torch thread and on two, alone and beside a busy core.

Times the two parts of the warm start (`fulmen.demo.warm_start`) on the demo's model and data: a
greedy accuracy check of 200 training tasks and an SFT step of 64 demonstrations, first with the
machine to itself, then with a busy-loop process on one core (as under honcho or a second pytest
worker).

    python bench/warm_start_threads.py [--checks 5] [--steps 20]

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fulmen.demo import arithmetic
from fulmen.demo.tiny_model import TinyModelSpec, build_tiny_model, load_tiny_model
from fulmen.demo.warm_start import sft_step
from fulmen_algorithm.demos.arithmetic import (
    CHECK_TASKS,
    INITIALIZER_RANGE,
    WARM_START,
    greedy_accuracy,
    sft_example,
)


def measure(folder: Path, threads: int, checks: int, steps: int) -> dict[str, float]:
    """Seconds per greedy check and per SFT step on ``threads`` torch threads, from the same start."""
    torch.set_num_threads(threads)
    model, tokenizer = load_tiny_model(folder)
    train = arithmetic.make_tasks("train", 4000, seed=0)
    examples = [sft_example(tokenizer, d) for d in arithmetic.demonstrations(train, seed=0)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START.lr, betas=(0.9, 0.99))
    rng = random.Random(0)
    started = time.perf_counter()
    for _ in range(checks):
        greedy_accuracy(model, tokenizer, train[:CHECK_TASKS])
    check_s = (time.perf_counter() - started) / checks
    started = time.perf_counter()
    for _ in range(steps):
        sft_step(model, optimizer, rng.sample(examples, WARM_START.batch_size), tokenizer.pad_token_id)
    return {"check_s": round(check_s, 4), "step_s": round((time.perf_counter() - started) / steps, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=5, help="greedy checks timed per case")
    parser.add_argument("--steps", type=int, default=20, help="SFT steps timed per case")
    args = parser.parse_args()
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "model", TinyModelSpec(initializer_range=INITIALIZER_RANGE), seed=0)
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for threads in (1, 2):
                    got = measure(folder, threads, args.checks, args.steps)
                    where = "busy" if busy else "quiet"
                    print(f"{where}, {threads} thread(s): {got}", file=sys.stderr)
                    result[f"{where}_{threads}_thread_check_s"] = got["check_s"]
                    result[f"{where}_{threads}_thread_step_s"] = got["step_s"]
            finally:
                if hog is not None:
                    hog.kill()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
