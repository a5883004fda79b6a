"""Tasks from Hugging Face datasets: a `save_to_disk` folder (a Dataset, or a DatasetDict and a split),
a .parquet file or an .arrow file, read row by row as `fulmen.tasks.parse_task_lines` reads JSON lines.

Rows are numbered from 0, as ``dataset[n]`` indexes them; a column mapping names the task fields
(`parse_columns`). ``datasets``/``pyarrow`` are imported only when such a file is read. Users:
`fulmen push` (`fulmen.cli.tasks_file`) and the algorithm's `fulmen_algorithm.dataset.load_tasks`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen.errors import InvalidInput
from fulmen.tasks import Task

__all__ = ["DEFAULT_SPLIT", "TaskRows", "is_dataset", "open_rows", "parse_columns"]

DATASET_SUFFIXES = (".parquet", ".arrow")
DEFAULT_SPLIT = "train"
# Rows converted to Python values at a time: bounded memory on a large file, few calls on a small one.
BATCH_ROWS = 1000
NEEDS_DATASETS = "reading {path} needs the Hugging Face `datasets` package: pip install datasets"


def is_dataset(path: str | Path) -> bool:
    """True for what `open_rows` reads (a folder, a .parquet or an .arrow file); False for JSON lines."""
    path = Path(path)
    return path.is_dir() or path.suffix.lower() in DATASET_SUFFIXES


def parse_columns(pairs: str | Sequence[str] | None) -> dict[str, str]:
    """``field=column`` pairs (a list, or one string of them separated by commas) as {field: column}.
    An empty field (``=column``) makes that column's value the whole task."""
    items = pairs.split(",") if isinstance(pairs, str) else list(pairs or ())
    mapping: dict[str, str] = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        field, sep, column = (part.strip() for part in item.partition("="))
        if not sep or not column:
            raise InvalidInput(f"column mapping {item!r} is not field=column (e.g. question=prompt)")
        if field in mapping:
            raise InvalidInput(f"column mapping names task field {field!r} twice")
        mapping[field] = column
    if "" in mapping and len(mapping) > 1:
        raise InvalidInput("a mapping '=column' (the whole task from one column) cannot be combined with others")
    return mapping


@dataclass
class TaskRows:
    """An opened dataset: ``columns``, ``total`` rows, and `rows` to iterate them once."""

    path: Path
    columns: list[str]
    total: int
    batches: Iterator[Any]  # pyarrow tables or record batches, in row order
    mapping: dict[str, str]

    def rows(self) -> Iterator[tuple[int, Task | str]]:
        """(row number, the task or why the row is not one), the column mapping applied."""
        number = 0
        for batch in self.batches:
            for row in batch.to_pylist():
                yield number, apply_mapping(row, self.mapping)
                number += 1


def apply_mapping(row: dict[str, Any], mapping: Mapping[str, str]) -> Task | str:
    """The task of one row: mapped fields renamed from their columns, every other column as it is."""
    if "" in mapping:
        task = row[mapping[""]]
        if not isinstance(task, dict):
            return f"column {mapping['']!r} holds {type(task).__name__}, where a task must be a mapping"
        return task
    if not mapping:
        return row
    sources = set(mapping.values())
    task = {name: value for name, value in row.items() if name not in sources}
    task.update({field: row[column] for field, column in mapping.items()})
    return task


def open_rows(path: str | Path, split: str | None = None, columns: Mapping[str, str] | None = None) -> TaskRows:
    """Open a dataset folder, parquet or arrow file; InvalidInput names a missing split or column."""
    path = Path(path)
    if not path.exists():
        raise InvalidInput(f"dataset {path} does not exist")
    try:
        import pyarrow  # noqa: F401 - the datasets package's own dependency: present with it
    except ImportError:
        raise InvalidInput(NEEDS_DATASETS.format(path=path)) from None
    if path.is_dir():
        names, total, batches = _folder(path, split)
    elif path.suffix.lower() == ".parquet":
        names, total, batches = _parquet(path)
    else:
        names, total, batches = _arrow(path)
    mapping = dict(columns or {})
    missing = sorted({c for c in mapping.values() if c not in names})
    if missing:
        raise InvalidInput(f"dataset {path} has no column {', '.join(map(repr, missing))} (its columns: {names})")
    return TaskRows(path, names, total, batches, mapping)


def _folder(path: Path, split: str | None) -> tuple[list[str], int, Iterator[Any]]:
    try:
        import datasets
    except ImportError:
        raise InvalidInput(NEEDS_DATASETS.format(path=path)) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise InvalidInput(f"{path} is not a dataset folder written by save_to_disk ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        name = split or DEFAULT_SPLIT
        if name not in loaded:
            hint = "" if split else f" and none was given (--split / the split setting; default {DEFAULT_SPLIT!r})"
            raise InvalidInput(f"dataset {path} has no split {name!r}{hint}: its splits are {sorted(loaded)}")
        loaded = loaded[name]
    elif split is not None and split != DEFAULT_SPLIT:
        raise InvalidInput(f"dataset {path} is a single Dataset, not a DatasetDict: it has no split {split!r}")
    # Arrow tables in row order (indices applied), undecoded: an Image column stays its bytes.
    batches = loaded.with_format("arrow").iter(batch_size=BATCH_ROWS)
    return list(loaded.column_names), len(loaded), batches


def _parquet(path: Path) -> tuple[list[str], int, Iterator[Any]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError variants for a file that is not parquet
        raise InvalidInput(f"{path} is not a readable parquet file ({e})") from None
    return list(file.schema_arrow.names), file.metadata.num_rows, file.iter_batches(batch_size=BATCH_ROWS)


def _arrow(path: Path) -> tuple[list[str], int, Iterator[Any]]:
    """An Arrow IPC stream (what `datasets` writes) or an IPC file (pyarrow.ipc.new_file, feather v2)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        table = ipc.open_stream(pa.memory_map(str(path))).read_all()
    except pa.ArrowInvalid:
        try:
            table = ipc.open_file(pa.memory_map(str(path))).read_all()
        except pa.ArrowInvalid as e:
            raise InvalidInput(f"{path} is not an Arrow stream or file ({e})") from None
    return list(table.column_names), table.num_rows, iter(table.to_batches(max_chunksize=BATCH_ROWS))
