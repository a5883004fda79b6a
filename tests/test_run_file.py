"""Run files: one YAML for every process (`fulmen start RUN.yaml`, `--config` on every service), read
under the environment and the flags, with unknown keys refused by their nearest valid name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fulmen.cli import start as start_cli
from fulmen.cli.dev import read_dotenv
from fulmen.cli.main import app
from fulmen.errors import InvalidInput
from fulmen.settings import DemoSettings, ProxySettings, TrainerSettings, load_settings
from fulmen.settings.run_file import read_run_file

ROOT = Path(__file__).resolve().parents[1]
RUNS = sorted((ROOT / "examples" / "runs").glob("*.yaml"))


@pytest.fixture(autouse=True)
def no_fulmen_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FULMEN_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_sections_flatten_into_one_namespace_read_by_each_service(tmp_path: Path) -> None:
    path = write(tmp_path, "experiment: e1\nmodel_dir: m\ntrainer:\n  learning_rate: 0.003\n"
                           "proxy:\n  max_batch: 7\nprocesses:\n  runner: 3\n")
    run = read_run_file(path)
    assert run.values == {"experiment": "e1", "model_dir": "m", "learning_rate": 0.003, "max_batch": 7}
    assert run.where["learning_rate"] == "trainer.learning_rate" and run.processes == {"runner": 3}
    trainer = load_settings(TrainerSettings, config=path)
    proxy = load_settings(ProxySettings, config=path)
    assert (trainer.learning_rate, trainer.experiment, str(trainer.model_dir)) == (0.003, "e1", "m")
    assert (proxy.max_batch, str(proxy.model_dir)) == (7, "m")  # the top-level model_dir reaches both


def test_flag_over_environment_over_dotenv_over_run_file_over_default(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "trainer:\n  learning_rate: 0.1\n  ppo_epochs: 3\n  clip_eps: 0.3\n  kl_coef: 0.5\n")
    monkeypatch.setenv("FULMEN_LEARNING_RATE", "0.2")
    s = load_settings(TrainerSettings, dotenv={"FULMEN_PPO_EPOCHS": "4"}, config=path, clip_eps=0.25)
    assert (s.learning_rate, s.ppo_epochs, s.clip_eps, s.kl_coef, s.max_grad_norm) == (0.2, 4, 0.25, 0.5, 1.0)
    monkeypatch.setenv("FULMEN_CONFIG", str(path))  # the file from the environment, as `fulmen start` passes it
    assert load_settings(TrainerSettings).kl_coef == 0.5


@pytest.mark.parametrize(("text", "message"), [
    ("trainer:\n  learning_rat: 0.1\n", "trainer: unknown setting 'learning_rat'; did you mean 'learning_rate'?"),
    ("learnin_rate: 0.1\n", "unknown top-level key 'learnin_rate'"),
    ("trainr:\n  learning_rate: 0.1\n", "did you mean 'trainer'?"),
    ("trainer:\n  n_samples: 4\n", "'n_samples' is a setting of algorithm, demo, not of trainer"),
    ("redis_url: redis://h:6379\n", "'redis_url' is a secret"),
    ("trainer:\n  groups_per_step: 8\ndemo:\n  groups_per_step: 16\n", "the services share one value"),
    ("- a\n- b\n", "expected a mapping"),
    ("trainer: [1\n", "not valid YAML"),
    ("processes:\n  runner: -1\n", "whole number"),
])
def test_a_bad_run_file_is_refused_saying_what_to_write(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=None) as e:
        read_run_file(write(tmp_path, text))
    assert message in str(e.value)


def test_fulmen_start_checks_every_service_before_anything_starts(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Procfile").write_text("redis: fulmen redis\nrunner: fulmen runner\n")
    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(start_cli.os, "execvpe", lambda file, argv, env: started.append((argv, env)))
    runner = CliRunner()
    bad = write(tmp_path, "trainer:\n  learning_rate: fast\n")
    result = runner.invoke(app, ["start", str(bad)])
    assert result.exit_code == 2 and "learning_rate (FULMEN_LEARNING_RATE)" in result.output and not started
    result = runner.invoke(app, ["start", str(write(tmp_path, "trainer:\n  learning_rat: 1\n"))])
    assert result.exit_code == 2 and "did you mean 'learning_rate'" in result.output and not started
    result = runner.invoke(app, ["start", str(write(tmp_path, "processes:\n  runnr: 2\n"))])
    assert result.exit_code == 2 and "no process 'runnr' in the Procfile" in result.output and not started
    good = write(tmp_path, "trainer:\n  learning_rate: 0.01\nprocesses:\n  runner: 2\n")
    result = runner.invoke(app, ["start", str(good), "-c", "redis=1"])
    assert result.exit_code == 0, result.output
    (argv, env), = started
    assert argv[1:] == ["start", "-f", "Procfile", "-d", ".", "-e", os.devnull, "-c", "runner=2,redis=1"]
    assert env["FULMEN_CONFIG"] == str(good.resolve())


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_the_shipped_run_files_load_for_every_service(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("GPUS", "1")
    result = CliRunner().invoke(app, ["start", str(path), "--check"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("run_file", "env_file"), [("demo.yaml", ".env"), ("tools.yaml", ".env.tools")])
def test_the_demo_run_files_are_the_demos_env_files(run_file: str, env_file: str) -> None:
    """examples/runs/demo.yaml configures every service as the repository's .env does (tools.yaml as .env.tools)."""
    assert {p.stem for p in RUNS} >= {"demo", "tools", "lora", "gpu"}
    dotenv = read_dotenv(ROOT / env_file)
    for cls in (TrainerSettings, ProxySettings, DemoSettings):
        from_env = load_settings(cls, dotenv=dotenv).model_dump(exclude={"config"})
        from_file = load_settings(cls, config=ROOT / "examples/runs" / run_file).model_dump(exclude={"config"})
        assert from_file == from_env, cls.__name__
