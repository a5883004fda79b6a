"""The end of a run: the reward curve as a PNG, a JSON summary, and the final model as a folder.

The curve plots the trainer's mean rollout reward per step (from its metrics file) and the
validation accuracy of every pass. The final model is the latest published version, fetched from
Redis and written as a Hugging Face folder next to the base model's config and tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from fulmen.store import RedisStore


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash: the rest is still worth plotting
    return lines


def plot_curve(path: Path, steps: list[dict[str, Any]], validations: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot([s["step"] for s in steps], [s.get("rollout/reward_mean", 0.0) for s in steps],
                label="train reward (mean per step)", color="tab:blue", alpha=0.8)
    points = [(v["step"], v["accuracy"]) for v in validations if isinstance(v.get("step"), int)]
    if points:
        ax.plot(*zip(*points, strict=True), "o-", label="validation accuracy (greedy)", color="tab:orange")
    ax.set_xlabel("trainer step (model version)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Fulmen: reward curve")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


async def export_final_model(store: RedisStore, base_model_dir: Path, out: Path, resources_id: str = "policy") -> Path | None:
    """The latest published weights as a Hugging Face folder (config and tokenizer from the base)."""
    from safetensors.torch import save_file

    from fulmen.model_versions import fetch_model_version

    try:
        llm = (await store.get_resources(resources_id)).resources.get("llm") or {}
    except Exception:
        return None
    version = llm.get("model_version")
    if not version or version == "base":
        return None
    state = await fetch_model_version(store, version, resource=llm)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base_model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "fulmen_version.json").write_text(json.dumps({"model_version": version}))
    return out
