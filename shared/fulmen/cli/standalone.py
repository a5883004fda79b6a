"""What a command run on its own brings up for itself: the embedded Redis when none answers, a model
folder to serve (the tiny model when the user names none), and an LLM proxy when none is registered.

`fulmen run-once` and `fulmen train` use it so that a fresh clone needs no set-up; the proxy runs as
a `fulmen llm-proxy` child process (the `fulmen` package imports no service)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fulmen.errors import FulmenError
from fulmen.settings import CommonSettings
from fulmen.store import RedisStore

log = logging.getLogger("fulmen")
Say = Callable[[str], object]  # where a command tells the user what it does

TINY_MODEL_DIR = "tiny-model"  # under the data folder: the model served when the user names none
PROXY_START_S = 180.0  # a proxy loading a large model may take minutes
PROXY_HINT_EVERY_S = 10.0
LOG_TAIL_CHARS = 3000


def redis_answers(settings: CommonSettings, timeout_s: float = 0.5) -> bool:
    """Whether something listens where the embedded Redis would (only asked when REDIS_URL is unset)."""
    try:
        with socket.create_connection(("127.0.0.1", settings.redis_port), timeout=timeout_s):
            return True
    except OSError:
        return False


def ensure_redis(settings: CommonSettings, stack: contextlib.ExitStack, say: Say = print) -> bool:
    """Start the embedded Redis for this command when REDIS_URL is unset and none is running; True if
    started (it stops when ``stack`` closes; its data stays in the data folder)."""
    if not settings.embedded or redis_answers(settings):
        return False
    from fulmen.store.redis.embedded import EmbeddedRedis

    folder = settings.data_dir / "redis"
    stack.enter_context(EmbeddedRedis(folder, port=settings.redis_port))
    say(f"no Redis was running: started the embedded one on 127.0.0.1:{settings.redis_port} for this "
        f"command (data in {folder}; `fulmen redis` keeps one up between commands)")
    return True


def tiny_model_dir(settings: CommonSettings) -> Path:
    """The tiny model's folder in the data folder, built on first use (seconds; nothing downloaded)."""
    folder = settings.data_dir / TINY_MODEL_DIR
    if not (folder / "config.json").exists():
        from fulmen.demo.tiny_model import build_tiny_model

        settings.data_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=settings.data_dir))
        build_tiny_model(staging)
        with contextlib.suppress(OSError):  # another command built it meanwhile: theirs is as good
            staging.rename(folder)
    return folder


def proxy_command(experiment: str, port: int, model_dir: Path | None, upstream_url: str | None,
                  model_name: str | None) -> list[str]:
    """`fulmen llm-proxy` on loopback: the torch backend on ``model_dir``, or ``upstream_url`` (OpenAI API)."""
    command = [sys.executable, "-m", "fulmen.cli.main", "llm-proxy", "--experiment", experiment,
               "--host", "127.0.0.1", "--port", str(port)]
    if upstream_url:
        command += ["--backend", "openai", "--upstream-urls", upstream_url]
    else:
        command += ["--backend", "torch", "--model-dir", str(model_dir)]
    if model_name:
        command += ["--model-name", model_name]
    return command


@contextlib.asynccontextmanager
async def running_proxy(store: RedisStore, command: list[str], say: Say = print) -> AsyncIterator[str]:
    """Run ``command`` (a `fulmen llm-proxy`) until the block ends; yields its base URL once it has
    registered in ``store``. Its log goes to a file, shown when it fails to come up."""
    port = command[command.index("--port") + 1]
    base_url = f"http://127.0.0.1:{port}"
    log_file = tempfile.NamedTemporaryFile(prefix="fulmen-proxy-", suffix=".log", delete=False)  # noqa: SIM115
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        await _wait_registered(store, process, base_url, Path(log_file.name), say)
        yield base_url
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10.0)
            except TimeoutError:
                process.kill()
                await process.wait()
        log_file.close()
        with contextlib.suppress(OSError):
            os.unlink(log_file.name)


async def _wait_registered(store: RedisStore, process: asyncio.subprocess.Process, base_url: str,
                           log_path: Path, say: Say) -> None:
    started = time.monotonic()
    next_hint = started + PROXY_HINT_EVERY_S
    while True:
        if any(p.base_url.rstrip("/") == base_url for p in await store.registry.query_proxies()):
            return
        if process.returncode is not None:
            raise FulmenError(f"the LLM proxy exited with code {process.returncode} before it came up; its log:\n"
                              f"{_tail(log_path)}")
        waited = time.monotonic() - started
        if waited > PROXY_START_S:
            raise FulmenError(f"the LLM proxy did not come up within {PROXY_START_S:.0f} s; its log:\n{_tail(log_path)}")
        if time.monotonic() >= next_hint:
            next_hint += PROXY_HINT_EVERY_S
            say(f"still waiting for the LLM proxy to load its model ({waited:.0f} s; log: {log_path})")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), 0.25)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"
