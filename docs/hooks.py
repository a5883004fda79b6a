"""MkDocs hooks: the CLI and settings reference pages, written from the code at build time; the
benchmark record included as it is; the design notes found in docs/design/ put in the nav.

Registered in mkdocs.yml (`hooks:`); `tests/test_docs.py` builds the site with `--strict`.
"""

from __future__ import annotations

import enum
import re
import types
import typing
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
CLI_PAGE = "reference/cli.md"
SETTINGS_PAGE = "reference/settings.md"
RECORDS_PAGE = "reference/records-generated.md"
RESULTS_PAGE = "benchmarks/results.md"
DESIGN_SECTION = "Design notes"


# --- the CLI ------------------------------------------------------------------------------------


def _fulmen_command() -> Any:
    """The `fulmen` click group, with every service's command registered, as `fulmen --help` sees it."""
    import typer

    import fulmen.cli.main as cli

    cli._add_service_commands()
    return typer.main.get_command(cli.app)


def _text(text: str) -> str:
    """Prose from the code as Markdown: ``<data_dir>`` shown, not taken for an HTML tag (code spans kept)."""
    parts = text.split("`")
    parts[::2] = [part.replace("<", "&lt;").replace(">", "&gt;") for part in parts[::2]]
    return "`".join(parts)


def _cell(text: str) -> str:
    return _text(" ".join(text.split())).replace("|", "\\|")


def _help_text(text: str) -> str:
    """A command's help as Markdown: typer's `\\b` markers dropped, paragraphs kept."""
    lines = [line for line in text.splitlines() if line.strip() != "\b"]
    return _text("\n".join(lines).strip())


def _command_section(name: str, command: Any, ctx_parent: Any) -> list[str]:
    import click

    ctx = click.Context(command, info_name=name, parent=ctx_parent)
    usage = " ".join(command.collect_usage_pieces(ctx))
    out = [f"## `fulmen {name}`", "", "```text", f"fulmen {name} {usage}".rstrip(), "```", ""]
    if command.help:
        out += [_help_text(command.help), ""]
    rows = []
    for param in command.params:
        record = param.get_help_record(ctx)
        if record is None:  # a hidden option, or an argument typer gives no help
            if getattr(param, "param_type_name", "") != "argument":
                continue
            record = (param.human_readable_name, "")
        spelled, help_ = record
        rows.append(f"| `{_cell(spelled)}` | {_cell(help_)} |")
    if rows:
        out += ["| option | what it does |", "|---|---|", *rows, ""]
    return out


def cli_reference() -> str:
    import click

    group = _fulmen_command()
    root = click.Context(group, info_name="fulmen")
    out = [
        "# The CLI",
        "",
        "Generated from the code (`fulmen <command> --help` says the same). Every option also comes from",
        "its environment variable (a flag beats the environment, which beats the default); an unknown",
        "`FULMEN_*` variable is an error. The settings behind the options: [Settings](settings.md).",
        "",
    ]
    names = sorted(group.commands)
    out += [
        f"- [`fulmen {n}`](#fulmen-{n}): {_cell((group.commands[n].help or '').split(chr(10))[0])}"
        for n in names
    ]
    out.append("")
    for name in names:
        out += _command_section(name, group.commands[name], root)
    return "\n".join(out) + "\n"


# --- the settings -------------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(m.value) for m in annotation)
    if isinstance(annotation, type) and origin is None:
        return annotation.__name__
    text = str(annotation)
    text = re.sub(r"\b(typing|pathlib|pydantic\.types|pydantic)\.", "", text)
    return text


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        return "(computed)"
    value = field.default
    if value is PydanticUndefined:
        return "(required)"
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        value = value.value
    shown = (repr(value) if isinstance(value, str) else str(value)).replace("|", "\\|")
    return f"`{shown}`"


def _group(field: Any) -> str | None:
    extra = field.json_schema_extra
    return extra.get("group") if isinstance(extra, dict) else None


def settings_classes() -> tuple[type, ...]:
    from fulmen.settings.base import CommonSettings

    try:
        from fulmen.settings.services import SERVICE_SETTINGS
    except ImportError:  # the classes may move within fulmen.settings; the package names them
        from fulmen.settings import SERVICE_SETTINGS  # type: ignore[attr-defined,no-redef]
    return tuple(dict.fromkeys((CommonSettings, *SERVICE_SETTINGS)))


def _table(fields: list[tuple[str, Any]]) -> list[str]:
    from fulmen.settings import env_name

    out = ["| field | environment | type | default | description |", "|---|---|---|---|---|"]
    for name, field in fields:
        out.append(
            f"| `{name}` | `{env_name(name)}` | {_cell(_type_name(field.annotation))} | {_default(field)} "
            f"| {_cell(field.description or '')} |"
        )
    return [*out, ""]


def _class_section(cls: type, common: set[str]) -> list[str]:
    own = [(n, f) for n, f in cls.model_fields.items() if n not in common]  # type: ignore[attr-defined]
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    out = [f"## {cls.__name__}", ""]
    if doc and not doc.startswith(("Usage docs", "Base class")):
        out += [" ".join(doc.split()), ""]
    if common:
        out += ["The [common settings](#commonsettings), and:", ""]
    if not own:
        return [*out, "(nothing of its own)", ""]
    groups: dict[str | None, list[tuple[str, Any]]] = {}
    for name, field in own:
        groups.setdefault(_group(field), []).append((name, field))
    if list(groups) == [None]:
        return out + _table(own)
    for group, fields in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
        out += [f"### {cls.__name__}: {group or 'other'}", "", *_table(fields)]
    return out


def settings_reference() -> str:
    classes = settings_classes()
    common_cls = classes[0]
    common = set(common_cls.model_fields)  # type: ignore[attr-defined]
    out = [
        "# Settings",
        "",
        "Generated from the code: every field of every service's settings class. Each is read from its",
        "environment variable (`.env` too) and, where the command has one, from its flag",
        "([the CLI](cli.md)); a flag beats the environment, which beats the default. An unknown `FULMEN_*`",
        "variable is an error, a variable another service reads is not (honcho gives every process the",
        "same `.env`). `REDIS_URL` carries the Redis password and is never logged.",
        "",
        *[f"- [{c.__name__}](#{c.__name__.lower()})" for c in classes],
        "",
    ]
    out += _class_section(common_cls, set())
    for cls in classes[1:]:
        out += _class_section(cls, common)
    return "\n".join(out) + "\n"


# --- the records ---------------------------------------------------------------------------------


def _first_paragraph(obj: Any) -> str:
    doc = (obj.__doc__ or "").strip()
    if doc.startswith(
        f"{getattr(obj, '__name__', '')}("
    ):  # the signature dataclasses write when none is given
        return ""
    return _text(" ".join(doc.split("\n\n")[0].split()))


def records_reference() -> str:
    """Every record dataclass and status enum of `fulmen.records`, module by module."""
    import dataclasses
    import importlib
    import pkgutil

    import fulmen.records as package

    out = [
        "# Records: every field",
        "",
        "Generated from `fulmen.records`: each record the services exchange, with its fields, and each",
        "enumeration with its values. What they mean together: [Records](records.md).",
        "",
    ]
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        own = [
            obj
            for name, obj in vars(module).items()
            if isinstance(obj, type)
            and obj.__module__ == module.__name__
            and not name.startswith("_")
            and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        ]
        if not own:
            continue
        out += [f"## `{module.__name__}`", "", _first_paragraph(module), ""]
        for obj in own:
            doc = _first_paragraph(obj)
            out += [f"### `{obj.__name__}`", "", *([doc, ""] if doc else [])]
            if issubclass(obj, enum.Enum):
                out += [", ".join(f"`{m.value}`" for m in obj), ""]
                continue
            try:
                hints = typing.get_type_hints(obj)
            except Exception:  # a forward reference it cannot resolve: the annotation as written
                hints = {}
            out += ["| field | type |", "|---|---|"]
            for field in dataclasses.fields(obj):
                if field.name.startswith("_"):
                    continue
                out.append(f"| `{field.name}` | {_cell(_type_name(hints.get(field.name, field.type)))} |")
            out.append("")
    return "\n".join(out) + "\n"


# --- hooks --------------------------------------------------------------------------------------


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Every docs/design/*.md in the "Design notes" section of the nav, index first."""
    design = Path(config["docs_dir"]) / "design"
    notes = sorted(p for p in design.glob("*.md") if p.name != "index.md")
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and DESIGN_SECTION in entry:
            pages: list[Any] = ["design/index.md"] if (design / "index.md").exists() else []
            pages += [f"design/{p.name}" for p in notes]
            entry[DESIGN_SECTION] = pages
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    generated = {
        CLI_PAGE: cli_reference(),
        SETTINGS_PAGE: settings_reference(),
        RECORDS_PAGE: records_reference(),
        RESULTS_PAGE: (ROOT / "bench" / "RESULTS.md").read_text(),
    }
    for uri, content in generated.items():
        files.append(File.generated(config, uri, content=content))
    return files
