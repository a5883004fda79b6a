"""What the steps of bench/gpu_check.sh share: their command line, the model shapes (real on a GPU,
tiny on a dry run), a model built from its config straight on the device, and the result line.

Each step is a script of its own (``step_<x>.py``), run by the driver under ``timeout``; its last
stdout line is one JSON object: its figures, or ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

QWEN25_05B = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768,
}
QWEN25_7B = {
    "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768,
}
# A dry run: the same code on shapes a 2-core CPU takes in seconds.
TINY = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}
# Dense bf16 peaks (FLOP/s) by the name torch gives the chip; the first match wins.
PEAKS = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12)]


def parse(description: str, configs: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    if configs:
        parser.add_argument("--config", choices=configs, default=configs[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, gloo")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"), help="scratch folder")
    args = parser.parse_args()
    args.device = "cpu" if args.dry_run else "cuda"
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def log(message: str, *values: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message % values}", file=sys.stderr, flush=True)


def emit(result: dict[str, Any]) -> None:
    """The step's figures: its last stdout line."""
    print(json.dumps(result, default=str), flush=True)


def chip() -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak (None: unknown chip, or a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name(0)
    return name, next((peak for key, peak in PEAKS if key in name), None)


def qwen_config(shape: dict[str, Any]) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**shape, rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


@contextmanager
def default_dtype(dtype: Any) -> Any:
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_on_device(shape: dict[str, Any], device: str, dtype: Any, seed: int = 0) -> Any:
    """A randomly initialised Qwen2 causal LM of ``shape``, allocated on ``device`` in ``dtype`` from the
    start (no CPU copy: a 7B model would take minutes to initialise there)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    started = time.perf_counter()
    with torch.device(device), default_dtype(dtype):
        model = Qwen2ForCausalLM(qwen_config(shape))
    log("built %.1fM parameters on %s in %s (%.1f s)", sum(p.numel() for p in model.parameters()) / 1e6, device,
        dtype, time.perf_counter() - started)
    return model


def save_model_dir(folder: Path, shape: dict[str, Any], device: str) -> Path:
    """A Hugging Face model folder for the proxy engine: the model of ``shape`` (bf16 on a GPU, fp32 on
    a CPU) with the tiny model's character tokenizer beside it (ids are what is measured, not text)."""
    import torch

    from fulmen.demo.tiny_model import build_tiny_model

    tokenizer_dir = build_tiny_model(folder / "tokenizer")
    model = build_on_device(shape, device, torch.float32 if device == "cpu" else torch.bfloat16)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / "model" / name).write_bytes((tokenizer_dir / name).read_bytes())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder / "model"


def step_env() -> dict[str, str]:
    """The environment for a child process (torchrun, fulmen dev): this one's, the repo importable."""
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*path, str(ROOT)])
    env["PYTHONUNBUFFERED"] = "1"
    return env
