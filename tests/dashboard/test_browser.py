"""The dashboard in a real browser (Debian's headless Chromium through chromedriver) against a live
short run: an LLM proxy on a tiny model, a runner with the demo's agent and the adapter, as processes.
Every page loads without console errors; a click on a rollout shows its span tree with the proxy's
LLM call; the reward curve renders with points; the live view updates when new rollouts finish.

Screenshots go to ``$CI_ARTIFACTS`` (default ``artifacts/``, which CI keeps); the README shows
copies of them (docs/). Without Chromium the test skips, except under CI (``CI`` set), where it fails:
`deploy/chromium.sh`, part of the test command, installs it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ops_helpers import FULMEN, ROOT, get, service_env, wait_for
from procs import stop

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import TrainStep
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port
from fulmen.telemetry.steps import append_step

pytestmark = pytest.mark.slow
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("CI_ARTIFACTS", ROOT / "artifacts")) / "screenshots"
TASKS = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((12, 30), (25, 17), (40, 41), (9, 90))]
WAIT_S = 120  # a page or a run's progress; generous for a busy machine


def _browser_or_skip() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing} missing under CI: deploy/chromium.sh should have installed them")
        pytest.skip(f"{missing} not installed (deploy/chromium.sh installs them)")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def _console_errors(driver: object) -> list[dict[str, object]]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]  # type: ignore[attr-defined]


def _shot(driver: object, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / name))  # type: ignore[attr-defined]


async def _finished(store: RedisStore) -> int:
    return int(await store.redis.xlen(store.keys.finished))


async def test_dashboard_in_a_browser_during_a_live_run(
    real_store: RedisStore, redis_url: str, tmp_path: Path, browser: object
) -> None:
    """Pages load clean, the span tree shows the proxy's call, the curve has points, live view follows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver: object = browser
    model = build_tiny_model(tmp_path / "tiny")
    port = free_port()
    env = service_env(redis_url, real_store.experiment, tmp_path, FULMEN_DASHBOARD_PORT=str(port))
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny", "model_version": "v0"}},
                                   resources_id="policy")
    for i, task in enumerate(TASKS):
        await real_store.rollouts.enqueue_rollout(task, rollout_id=f"first-{i}", mode="train")
    services = [
        subprocess.Popen([FULMEN, *args], env=env, cwd=ROOT)
        for args in (["llm-proxy", "--backend", "torch", "--model-dir", str(model), "--port", "0"],
                     ["runner", "--agent", "examples.arithmetic_agent:agent", "--concurrency", "2"],
                     ["adapter"], ["dashboard"])
    ]
    try:
        deadline = time.monotonic() + WAIT_S
        while await _finished(real_store) < len(TASKS):
            assert all(p.poll() is None for p in services), "a service exited early"
            assert time.monotonic() < deadline, "the first rollouts did not finish"
            await asyncio.sleep(0.2)
        for step in range(1, 9):  # the trainer's step records, as its leader writes them
            await append_step(real_store.redis, real_store.keys,
                              TrainStep(step, f"v{step}", 0.3 + 0.05 * step, 1.0 / step, 16, time.time(),
                                        {"loss/kl": 0.01 * step, "loss/entropy": 1.2, "perf/tokens_per_s": 800.0}))
        sampled = {"samples": 4, "pass@1": 0.61, "pass@2": 0.7, "pass@4": 0.8, "maj@4": 0.66}  # a pass of k=4
        for version, accuracy in ((0, 0.44), (4, 0.52), (8, 0.61)):  # as validation passes record them
            await real_store.redis.xadd(real_store.keys.validations, {"m": json.dumps(
                {"label": f"v{version}", "step": version, "accuracy": accuracy, "mean_reward": accuracy,
                 **(sampled if version == 8 else {})})})
        wait_for(lambda: get(port, "/healthz")[0] == 200, WAIT_S, "the dashboard")
        base = f"http://127.0.0.1:{port}"
        e = real_store.experiment

        for path in ("/", f"/e/{e}", f"/e/{e}/dead-letters"):
            driver.get(base + path)  # type: ignore[attr-defined]
            assert "fulmen" in driver.title  # type: ignore[attr-defined]
            assert _console_errors(driver) == [], path

        # a click on a rollout shows its span tree with the proxy's LLM call
        driver.get(f"{base}/e/{e}/rollouts?status=succeeded,failed")  # type: ignore[attr-defined]
        links = driver.find_elements(By.CSS_SELECTOR, "a.rollout-link")  # type: ignore[attr-defined]
        assert len(links) == len(TASKS)
        links[0].click()
        call = WebDriverWait(driver, WAIT_S).until(
            lambda d: d.find_element(By.CSS_SELECTOR, "ul.span-tree li.kind-llm_call"))
        served = {p.model_version for p in await real_store.registry.query_proxies()}
        assert call.find_element(By.CSS_SELECTOR, ".served-version").text in served  # the proxy's version
        assert "prompt +" in call.find_element(By.CSS_SELECTOR, ".token-counts").text
        assert "+" in call.find_element(By.CSS_SELECTOR, ".messages").text  # the question the agent sent
        assert _console_errors(driver) == []
        _shot(driver, "rollout-span-tree.png")

        # the curves render with points
        driver.get(f"{base}/e/{e}/curves")  # type: ignore[attr-defined]
        reward = WebDriverWait(driver, WAIT_S).until(
            lambda d: d.find_element(By.CSS_SELECTOR, '.chart[data-label="train reward"][data-points="8"]'))
        assert reward.find_elements(By.CSS_SELECTOR, "canvas")
        validation = driver.find_element(By.CSS_SELECTOR, '.chart[data-label="validation accuracy"][data-points="3"]')
        legend = validation.find_element(By.CSS_SELECTOR, ".u-legend").text
        assert all(name in legend for name in ("accuracy", "pass@2", "pass@4", "maj@4")), legend  # a curve per score
        assert _console_errors(driver) == []
        _shot(driver, "curves.png")

        # the live view updates when new rollouts finish
        driver.get(f"{base}/e/{e}/live")  # type: ignore[attr-defined]
        shown = int(driver.find_element(By.ID, "finished-count").text)  # type: ignore[attr-defined]
        assert shown == len(TASKS)
        for i, task in enumerate(TASKS):
            await real_store.rollouts.enqueue_rollout(task, rollout_id=f"later-{i}", mode="train")
        WebDriverWait(driver, WAIT_S).until(
            lambda d: int(d.find_element(By.ID, "finished-count").text) == 2 * len(TASKS))
        assert "later-" in driver.find_element(By.ID, "recent-finished").text  # type: ignore[attr-defined]
        assert _console_errors(driver) == []
        _shot(driver, "live.png")
    finally:
        stop(services, timeout_s=10)
    docs = ROOT / "docs"
    if os.environ.get("UPDATE_DASHBOARD_DOCS"):  # refresh the README's copies by hand, not on every run
        for name in ("rollout-span-tree.png", "curves.png", "live.png"):
            shutil.copy(ARTIFACTS / name, docs / f"dashboard-{name}")
