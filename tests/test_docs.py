"""The documentation site: `mkdocs build --strict` passes (the CLI, settings and records reference
pages are generated from the code by docs/hooks.py), every setting has a description, and the README
stays a front door that links into docs/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs"))
import hooks  # noqa: E402  (docs/hooks.py: the generator the site build runs)

sys.path.remove(str(REPO / "docs"))


def test_every_setting_has_a_description() -> None:
    """The settings reference is generated from the fields: one without a description is a hole in it."""
    missing = [
        f"{cls.__name__}.{name}"
        for cls in hooks.settings_classes()
        for name, field in cls.model_fields.items()  # type: ignore[attr-defined]
        if not (field.description or "").strip()
    ]
    assert missing == []


def test_settings_reference_names_every_environment_variable() -> None:
    from fulmen.settings import known_env_names

    page = hooks.settings_reference()
    assert {name for name in known_env_names() if f"`{name}`" not in page} == set()
    assert "`REDIS_URL`" in page


def test_cli_reference_has_every_command_and_option() -> None:
    group = hooks._fulmen_command()
    page = hooks.cli_reference()
    for name, command in group.commands.items():
        assert f"## `fulmen {name}`" in page
        for param in command.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("--") and not getattr(param, "hidden", False):
                    assert opt in page, (name, opt)


@pytest.mark.timeout(300)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """The whole site builds with every warning an error: nav, links and anchors all resolve."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for page in [
        "reference/cli/index.html",
        "reference/settings/index.html",
        "benchmarks/results/index.html",
    ]:
        assert (tmp_path / "site" / page).is_file()


def test_readme_is_a_front_door() -> None:
    """At most 250 lines, and every docs/ page it links to exists (the links work on GitHub too)."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert links
    assert [link for link in links if not (REPO / link).exists()] == []


def test_settings_grouped_by_their_group() -> None:
    """A field whose json_schema_extra names a group is listed under that group's heading."""
    from pydantic import Field

    from fulmen.settings.base import CommonSettings

    class Grouped(CommonSettings):
        lr: float = Field(0.1, description="Step size.", json_schema_extra={"group": "optimiser"})
        rank: int = Field(8, description="Adapter rank.", json_schema_extra={"group": "LoRA"})

    page = "\n".join(hooks._class_section(Grouped, set(CommonSettings.model_fields)))
    assert "### Grouped: LoRA" in page and "### Grouped: optimiser" in page
    assert page.index("`FULMEN_RANK`") < page.index("### Grouped: optimiser") < page.index("`FULMEN_LR`")
