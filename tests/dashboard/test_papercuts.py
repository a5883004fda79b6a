"""The dashboard reads plainly: a replica nobody keeps is gone, not serving; a pass's "served by" as
versions and counts; integer chart axes with integer ticks, each once; an empty panel says so."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from seed import seed

from fulmen.records import ReplicaState, ServiceBeat
from fulmen.store import RedisStore

AXES_JS = Path(__file__).parents[2] / "services" / "dashboard" / "static" / "chart_axes.js"


async def test_a_replica_no_vllm_sync_keeps_is_shown_gone(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """A ready replica whose state is old and whose vllm-sync stopped reads "gone", not serving; a
    fresh one reads "serving"; with a vllm-sync beating, an old state is only one that did not change."""
    await seed(real_store, succeeded=1, queued=0)
    e = real_store.experiment
    await real_store.registry.set_replica(ReplicaState("http://fresh:8001", "v3", ready=True))
    stopped = ReplicaState("http://stopped:8002", "v2", ready=True, updated_time=time.time() - 600)
    await real_store.redis.hset(real_store.keys.replicas, stopped.url, stopped.to_wire())
    page = (await client.get(f"/e/{e}/live?fragment=1")).text
    rows = {url: row for row in page.split("<tr") for url in ("fresh:8001", "stopped:8002") if url in row}
    assert "(serving)" in rows["fresh:8001"] and "gone" not in rows["fresh:8001"]
    assert "(gone: no vllm-sync running; last update 600 s ago)" in rows["stopped:8002"]
    assert "serving" not in rows["stopped:8002"] and "dim" in rows["stopped:8002"]
    beat = ServiceBeat("vllm-sync", "vllm-sync-h-1", "h", 1, None, time.time(), time.time())
    await real_store.redis.hset(real_store.keys.services, beat.instance, beat.to_wire())
    page = (await client.get(f"/e/{e}/live?fragment=1")).text
    assert "gone" not in page and page.count("(serving)") == 2


async def test_served_by_reads_as_versions_and_counts(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """A validation pass's "served by" is "v7 ×3, no answer ×1", never a Python dict."""
    await seed(real_store, succeeded=1, queued=0)
    await real_store.redis.xadd(real_store.keys.validations, {"m": json.dumps(
        {"label": "v7", "step": 7, "accuracy": 0.5, "mean_reward": 0.5, "served_by": {"none": 1, "v7": 3}})})
    page = (await client.get(f"/e/{real_store.experiment}")).text
    assert "v7 ×3, no answer ×1" in page and "v5 ×3" in page
    assert "{&#39;" not in page and "{'" not in page


async def test_every_panel_has_a_no_data_note(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """Each chart of the curves page carries a "no data" note (the script hides it once it has points),
    and the axis script it loads is served."""
    await seed(real_store, succeeded=1, queued=0)
    page = (await client.get(f"/e/{real_store.experiment}/curves")).text
    charts = page.count('class="chart"')
    assert charts >= 2 and page.count('class="no-data dim"') == charts
    assert "/static/chart_axes.js" in page
    assert (await client.get("/static/chart_axes.js")).status_code == 200


def _node(script: str) -> object:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    done = subprocess.run([node, "-e", f"const A = require({json.dumps(str(AXES_JS))});\n{script}"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_integer_axes_get_unique_integer_ticks() -> None:
    """Steps and model versions: ticks are integers in range, each once, never more than asked, and
    one point or none still gets a sensible range; the note hides once a panel has points."""
    ranges = [(0.6, 1.4, 8), (1, 8, 8), (1, 8, 3), (0, 2, 12), (-0.5, 0.5, 4), (3, 3, 5), (1, 2000, 9),
              (0.2, 0.8, 5), (17.25, 99.9, 6), (0, 1, 1)]
    out = _node(f"""
const ranges = {json.dumps(ranges)};
const notes = [];
for (const points of [0, 3]) {{
  const note = {{hidden: false}}, attrs = {{}};
  A.showNoData({{querySelector: () => note, setAttribute: (k, v) => {{ attrs[k] = v; }}}}, points);
  notes.push([note.hidden, attrs["data-points"]]);
}}
console.log(JSON.stringify({{
  splits: ranges.map(([lo, hi, n]) => A.integerSplits(lo, hi, n)),
  single: A.integerRange(3, 3), none: A.integerRange(null, null), notes: notes,
}}));""")
    assert isinstance(out, dict)
    for (lo, hi, most), ticks in zip(ranges, out["splits"], strict=True):
        assert all(isinstance(t, int) and lo <= t <= hi for t in ticks), (lo, hi, ticks)
        assert ticks == sorted(set(ticks)) and len(ticks) <= most, (lo, hi, ticks)
        assert bool(ticks) == any(lo <= n <= hi for n in range(int(lo) - 1, int(hi) + 2)), (lo, hi, ticks)
    assert out["splits"][1] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert out["single"] == [2, 4] and out["none"] == [0, 1]
    assert out["notes"] == [[False, "0"], [True, "3"]]
