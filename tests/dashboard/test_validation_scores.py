"""A validation pass of k samples per task: its pass@j and maj@k in the dashboard and in `fulmen status`."""

from __future__ import annotations

import json

import httpx
import pytest

from fulmen.store import RedisStore

GREEDY = {"label": "v0", "step": 0, "tasks": 3, "accuracy": 0.45, "mean_reward": 0.45, "served_by": {"v0": 3}}
SAMPLED = {"label": "v5", "step": 5, "tasks": 3, "accuracy": 0.5, "mean_reward": 0.5, "served_by": {"v5": 12},
           "samples": 4, "temperature": 1.0, "pass@1": 0.5, "pass@2": 0.722, "pass@4": 0.875, "maj@4": 0.625}


async def _record(store: RedisStore) -> None:
    await store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny"}}, resources_id="policy")  # the run exists
    for result in (GREEDY, SAMPLED):
        await store.redis.xadd(store.keys.validations, {"m": json.dumps(result)})


async def test_the_run_page_and_the_curves_show_pass_at_k(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """The validation table gains a column per pass@j and maj@k ('-' for the greedy pass), and
    curves.json a series per score beside the accuracy."""
    await _record(real_store)
    e = real_store.experiment
    page = (await client.get(f"/e/{e}")).text
    header = page[page.index('<table id="validations">'):].split("</tr>")[0]
    assert [h for h in header.split("<th>")[1:]][:6] == [f"{n}</th>" for n in
                                                         ("pass", "accuracy", "pass@1", "pass@2", "pass@4", "maj@4")]
    rows = page[page.index('<table id="validations">'):page.index("</table>", page.index('<table id="validations">'))]
    assert "<td>0.722</td><td>0.875</td><td>0.625</td>" in rows and "<td>0.450</td><td>-</td><td>-</td>" in rows
    curve = (await client.get(f"/e/{e}/curves.json")).json()["validation"]
    assert curve == {"version": [0, 5], "accuracy": [0.45, 0.5], "pass@1": [None, 0.5], "pass@2": [None, 0.722],
                     "pass@4": [None, 0.875], "maj@4": [None, 0.625]}


async def test_status_shows_each_pass_with_its_scores(real_store: RedisStore, redis_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`fulmen status --json` lists the passes with pass@j and maj@k; the table prints them in a row."""
    import asyncio

    from typer.testing import CliRunner

    from fulmen.cli import service as service_cli
    from fulmen.cli.main import app

    await _record(real_store)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", real_store.experiment)
    runner = CliRunner()
    result = await asyncio.to_thread(runner.invoke, app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    passes = json.loads(result.stdout)["validations"]
    assert [p["label"] for p in passes] == ["v0", "v5"] and "pass@4" not in passes[0]
    assert {k: passes[1][k] for k in ("samples", "pass@1", "pass@2", "pass@4", "maj@4")} == {
        "samples": 4, "pass@1": 0.5, "pass@2": 0.722, "pass@4": 0.875, "maj@4": 0.625}
    monkeypatch.setattr(service_cli.out, "width", 200)
    table = (await asyncio.to_thread(runner.invoke, app, ["status"])).stdout
    assert "accuracy 0.500, pass@1 0.500, pass@2 0.722, pass@4 0.875, maj@4 0.625 (step 5, 4 samples per task)" in table
    assert "accuracy 0.450 (step 0)" in table
