"""Open a recipe's dataset from the Hub or a local file/folder, the same way for both, and keep only
the rows its `dataset_format` can train on (bad rows counted per reason in a `DataReport`).

A local .jsonl is read line by line, so one bad line is one dropped row, not a failed file (the
`datasets` json builder fails the whole file, or stream, on one bad line). Streamed datasets are
filtered lazily by the same row rules; their counts are not known at start, so each reader logs
bad rows as it meets them (`StreamedRowCheck`). Read for a packed block stream (`mark_bad_rows`),
a stream keeps its bad rows, flagged with their reason, so the reader that meets one counts it
with the blocks it sends (`RankLocalBlockStream`), and the run sums every reader's counts. Read
unpacked (TRL's pipeline), a stream is checked in the process that iterates it, which adds what it
read and dropped to `STREAM_READS`; `StreamedRowDropsCallback` sums that over ranks after every step.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets.config
import pyarrow as pa
from datasets import Dataset, IterableDataset, load_dataset
from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError

import sft_recipes.loading as loading  # the module: tests stand in for its hub_unreachable
from sft_recipes.data.formats import FORMATS, DatasetFormat
from sft_recipes.data.report import EXCERPT_CHARS, DataReport
from sft_recipes.data.rows import INVALID_JSON, NOT_UTF8, ROW_PROBLEM
from sft_recipes.errors import RecipeError

logger = logging.getLogger(__name__)

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_raw_dataset(data_args) -> Dataset | IterableDataset:
    """The training split named by `DataArguments`, streamed when the recipe asks for it."""
    name = data_args.dataset_name
    if not name:
        raise RecipeError("The recipe has no dataset_name: give a Hub dataset id or a local .jsonl/.parquet/.csv path.")
    split = data_args.dataset_train_split
    path = Path(name)
    if path.is_file():
        builder = LOCAL_BUILDERS.get(path.suffix)
        if builder is None:
            raise RecipeError(f"Cannot read {path}: its suffix is not one of {sorted(LOCAL_BUILDERS)}; convert it to one of "
                              "them, or give a Hub dataset id.")
        with refusing_unreadable(path):
            dataset = load_dataset(builder, data_files={split: str(path)}, split=split,
                                   streaming=data_args.dataset_streaming)
    elif path.is_dir():
        if not getattr(data_args, "dataset_data_files", None):  # data_files chooses the files itself
            refuse_directory_without_data(path / (getattr(data_args, "dataset_data_dir", None) or ""))
        with refusing_unreadable(path):
            dataset = load_dataset(str(path), split=split, streaming=data_args.dataset_streaming,
                                   data_dir=getattr(data_args, "dataset_data_dir", None),
                                   data_files=getattr(data_args, "dataset_data_files", None))
    else:
        key = getattr(data_args, "dataset_key", "dataset_name")
        refuse_missing_local_path(name, key)
        with from_the_hub(name, key):
            dataset = load_dataset(
                name,
                data_args.dataset_config,
                split=split,
                revision=data_args.dataset_revision,
                streaming=data_args.dataset_streaming,
                data_dir=getattr(data_args, "dataset_data_dir", None),
                data_files=getattr(data_args, "dataset_data_files", None),
            )
    if columns := getattr(data_args, "dataset_columns", None):
        dataset = dataset.select_columns(columns)
    if data_args.max_train_samples is not None:
        if isinstance(dataset, IterableDataset):
            dataset = dataset.take(data_args.max_train_samples)
        else:
            dataset = dataset.select(range(min(data_args.max_train_samples, len(dataset))))
    return dataset


@contextmanager
def refusing_unreadable(path: Path) -> Iterator[None]:
    """RecipeError for a local file or folder that `datasets` cannot read (an empty or cut .csv/.json/.parquet, JSON
    that is not rows): its builder's error, not a traceback. ArrowInvalid is a ValueError. A folder without the
    split the recipe asks for is said as such: the file is not at fault."""
    try:
        yield
    except (DatasetGenerationError, ValueError) as error:
        cause = error.__cause__ or error  # DatasetGenerationError only says 'An error occurred'; its cause says what
        if str(cause).startswith("Unknown split"):  # a folder's files name its splits; the recipe asked for another
            raise RecipeError(f"{path}: {str(cause).rstrip('.')}: set dataset_train_split (a `datasets:` entry's "
                              "split) to one of them; a folder's file names give its splits (train.jsonl: train)."
                              ) from None
        raise RecipeError(f"Cannot read the rows of {path} ({str(cause).rstrip('.')}). Fix the file, or write the rows "
                          "as .jsonl (one JSON object per line: a bad line is then a counted drop, not a failed file)."
                          ) from None


@contextmanager
def from_the_hub(name: str, key: str = "dataset_name") -> Iterator[None]:
    """Load the Hub dataset `name`. Where the Hub cannot be asked (`hub_unreachable`), from datasets' cache only (an
    earlier load's), at once: asking would retry for ~23 s first. One that neither the Hub nor that cache gives is one
    refusal: there is no such dataset, it is gated, or a machine without the Hub needs it as files."""
    if mistyped := loading.a_mistyped_local_folder(name):  # `data/samplez`, where no Hub could say otherwise
        raise RecipeError(f"Dataset {name} {mistyped}: fix {key}.")
    unreachable = loading.hub_unreachable()
    was_offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = was_offline or bool(unreachable)  # load_dataset reads it at each call
    try:
        yield
    except (DatasetNotFoundError, ConnectionError) as error:
        if unreachable:
            raise RecipeError(
                f"Dataset {name} is not a file or folder here nor in the datasets cache, and the Hugging Face Hub "
                f"cannot be asked for it ({unreachable}): fix {key}, or download it where the Hub answers "
                f"(`.venv/bin/hf download {name} --repo-type dataset --local-dir DIR`) and give DIR there."
            ) from None
        raise RecipeError(f"Dataset {name} is not a file or folder here and the Hugging Face Hub does not give it "
                          f"({str(error).strip().splitlines()[0]}): fix {key} (its config and revision; HF_TOKEN for a "
                          "gated dataset).") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = was_offline


def refuse_missing_local_path(name: str, key: str = "dataset_name") -> None:
    """RecipeError when `name` is meant as a local file or folder (a path-like name or a data file suffix) and
    is not there; a Hub id passes. Cheap: every rank can check before any rank waits on another."""
    path = Path(name)
    if not path.exists() and (name.startswith((".", "/")) or path.suffix in LOCAL_BUILDERS):
        raise RecipeError(f"Dataset file not found: {path} ({key}). Check the path relative to {Path.cwd()}.")


@dataclass(frozen=True)
class JsonlLine:
    number: int
    row: dict[str, Any] | None  # None: the line is not a JSON object (`problem` says why)
    text: str  # the line; bytes that are not UTF-8 as \xNN escapes
    problem: str | None  # INVALID_JSON, NOT_UTF8 or None


# Row files `datasets` reads from a local folder (optionally compressed); README.md and hidden files are not rows.
FOLDER_DATA_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet", ".csv", ".tsv", ".arrow")
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
NOT_ROWS = ("README.md",)


def _data_suffix(file: Path) -> str:
    suffixes = file.suffixes
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def refuse_directory_without_data(path: Path, key: str = "dataset_name") -> None:
    """RecipeError unless the folder `path` holds row files only (FOLDER_DATA_SUFFIXES), at least one.

    `datasets` fails an empty folder with its own EmptyDatasetError traceback, and reads a stray
    file (notes.txt) as rows of another builder, which then lack the format's columns.
    """
    if not path.is_dir():
        raise RecipeError(f"{path} ({key}) is not a folder inside the dataset folder: check dataset_data_dir.")
    files = sorted(file.relative_to(path) for file in path.rglob("*")
                   if file.is_file() and not any(part.startswith(".") for part in file.relative_to(path).parts)
                   and file.name not in NOT_ROWS)
    data = [file for file in files if _data_suffix(file) in FOLDER_DATA_SUFFIXES]
    stray = [str(file) for file in files if file not in data]
    kinds = "/".join(FOLDER_DATA_SUFFIXES)
    if not data:
        found = f"it holds {_listed(stray)}" if stray else "it is empty"
        raise RecipeError(f"{path} ({key}) is a folder with no data file: {found}. Point {key} at a data file "
                          f"(e.g. train.jsonl), or put the rows in {kinds} files in that folder.")
    if stray:
        raise RecipeError(f"{path} ({key}) is a folder of {len(data)} data file(s) ({_listed([str(f) for f in data])}) "
                          f"and {_listed(stray)}, which are not rows ({kinds}): move them out of the folder, or "
                          f"point {key} at the data file itself.")


def _listed(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def read_jsonl(path: Path) -> Iterator[JsonlLine]:
    """Each non-blank line of a .jsonl file, decoded as strict UTF-8 (a line that is not is a NOT_UTF8 drop)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield JsonlLine(number, None, raw.decode("utf-8", errors="backslashreplace").rstrip("\r\n"), NOT_UTF8)
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            row = row if isinstance(row, dict) else None
            yield JsonlLine(number, row, line.rstrip("\r\n"), INVALID_JSON if row is None else None)


LINES_SAMPLED_FOR_ENCODING = 1000


def likely_encoding(sample: bytes) -> str:
    """A guess at the encoding of bytes that are not UTF-8 text, for the refusal's fix."""
    if sample.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in sample:  # JSON text never holds a NUL byte
        return "UTF-16"
    try:
        sample.decode("cp1252")
    except UnicodeDecodeError:
        return "a legacy single- or multi-byte encoding (e.g. Latin-1, Shift_JIS, GBK)"
    return "Latin-1 / Windows-1252 (cp1252)"


def _utf8_text(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\x00" not in raw  # valid UTF-8, but UTF-16's ASCII: each character followed by a NUL


def refuse_another_encoding(path: Path, key: str = "dataset_name") -> None:
    """RecipeError when `path` is UTF-16, or most of its first LINES_SAMPLED_FOR_ENCODING lines are not UTF-8.

    A few such lines are dropped and counted (`not_utf8`, under max_dropped_share); a file that is
    mostly not UTF-8 is in another encoding, and the fix is to convert it, not to drop it.
    """
    lines = not_utf8 = 0
    undecodable = b""
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            lines += 1
            if not _utf8_text(raw):
                not_utf8 += 1
                undecodable += raw[:4096] if len(undecodable) < 65536 else b""
            if lines == LINES_SAMPLED_FOR_ENCODING:
                break
    if not lines or not_utf8 * 2 <= lines:
        return
    encoding = likely_encoding(undecodable)
    source = {"UTF-16": "UTF-16", "Latin-1 / Windows-1252 (cp1252)": "cp1252"}.get(encoding, "ENCODING")
    raise RecipeError(
        f"{path} ({key}) is not UTF-8: {not_utf8} of its first {lines} lines cannot be decoded; it looks like "
        f"{encoding}. Convert it to UTF-8, e.g. `iconv -f {source} -t UTF-8 {path} > {path.with_suffix('')}"
        f".utf8.jsonl`, and point {key} at the converted file.")


def _local_jsonl(data_args) -> Path | None:
    path = Path(data_args.dataset_name or "")
    return path if path.suffix == ".jsonl" and path.is_file() else None


# Rows of each streamed source checked in this process, and the bad ones per reason (see the module docstring).
STREAM_READS: dict[str, Counter] = {}
ROWS_READ = "rows read"


def rows_read_in_this_process(source: str) -> Counter:
    """The rows of `source` that this process's stream readers checked (ROWS_READ), and the bad ones per reason."""
    return STREAM_READS.get(source, Counter())


def forget_rows_read(source: str) -> None:
    """Start `source`'s counts in this process afresh (rows read before training: peeks at its first rows)."""
    STREAM_READS.pop(source, None)


def count_stream_drop(source: str, reason: str) -> None:
    """One row of `source`, already counted as read by its `StreamedRowCheck`, dropped later on (e.g. when its
    tokens are cut), in this process."""
    STREAM_READS.setdefault(source, Counter())[reason] += 1


class StreamedRowCheck:
    """Keeps the streamed rows a run can train on; shows bad ones as they are read.

    A stream's drop counts are not known at start (nothing reads it up front), so each reader
    process logs the 1st, 10th, 100th... bad row of each reason, with the row, and counts every
    row it checks in `STREAM_READS[source]`.
    """

    def __init__(self, source: str, fmt: DatasetFormat) -> None:
        self.source = source
        self.fmt = fmt
        self.dropped: Counter = Counter()

    def problem(self, row: dict[str, Any] | None, where: str, line: str | None = None,
                line_problem: str | None = INVALID_JSON) -> str | None:
        """Why the row is dropped (counted, and shown if it is the 1st, 10th, 100th... of its reason), or None.

        A row of None is a line that could not be read, for `line_problem`."""
        problem = line_problem if row is None else self.fmt.row_problem(row)
        read = STREAM_READS.setdefault(self.source, Counter())  # looked up each time: training starts it afresh
        read[ROWS_READ] += 1
        if problem is None:
            return None
        read[problem] += 1
        self.dropped[problem] += 1
        count = self.dropped[problem]
        if count == 10 ** (len(str(count)) - 1):  # 1, 10, 100, ...
            text = line if row is None else json.dumps(row, default=str, ensure_ascii=False)
            logger.warning("[data] %s: dropped streamed row (%s, %d so far in this reader), %s: %s", self.source,
                           problem, count, where, text[:EXCERPT_CHARS])
        return problem

    def __call__(self, row: dict[str, Any]) -> bool:  # as a `datasets` filter
        return self.problem(row, "a row") is None

    def mark(self, row: dict[str, Any]) -> dict[str, str | None]:  # as a `datasets` map
        return {ROW_PROBLEM: self.problem(row, "a row")}


def _valid_jsonl_rows(path: str, dataset_format: str, mark_bad_rows: bool = False, mapping: dict | None = None
                      ) -> Iterator[dict[str, Any]]:
    """The rows of a local .jsonl that a streamed run can train on; bad lines are skipped (or, with
    `mark_bad_rows`, yielded empty with their reason in ROW_PROBLEM), not fatal."""
    fmt = FORMATS[dataset_format].with_mapping(mapping) if mapping else FORMATS[dataset_format]
    # As a map-style read stores them (the held-out hash sees the same row); image rows stay as read here.
    columns = fmt.columns if fmt.vision else fmt.stored_columns
    check = StreamedRowCheck(path, fmt)
    for line in read_jsonl(Path(path)):
        row = line.row
        problem = check.problem(row, f"line {line.number}", line.text, line.problem)
        if problem is None:
            good = {column: row.get(column) for column in columns} if fmt.vision else fmt.stored_row(row)
            yield good | ({ROW_PROBLEM: None} if mark_bad_rows else {})
        elif mark_bad_rows:  # its values stay behind: a wrongly typed one would break Arrow
            yield dict.fromkeys(columns) | {ROW_PROBLEM: problem}


def without_marked_rows(rows: IterableDataset) -> IterableDataset:
    """A stream read with `mark_bad_rows`, as the format's own checks read it: good rows only."""
    return rows.filter(lambda row: row[ROW_PROBLEM] is None)


def _refuse_a_file_without_rows(path: Path) -> None:
    raise RecipeError(f"{path} holds no row: it is empty (or blank lines only). Put one JSON object per line in it, "
                      "or point the recipe at the file that holds the rows.")


def _streamed_jsonl(path: Path, data_args, mark_bad_rows: bool) -> tuple[IterableDataset, DataReport]:
    # Read up to the first line that is not blank, not the stream: an empty file would otherwise train on nothing.
    with path.open("rb") as lines:
        if not any(line.strip() for line in lines):
            _refuse_a_file_without_rows(path)
    # `datasets`' json builder fails the whole stream on one bad line; read it line by line instead.
    dataset = IterableDataset.from_generator(_valid_jsonl_rows, gen_kwargs={
        "path": str(path), "dataset_format": data_args.dataset_format, "mark_bad_rows": mark_bad_rows,
        "mapping": getattr(data_args, "dataset_mapping", None)})
    if data_args.max_train_samples is not None:
        dataset = dataset.take(data_args.max_train_samples)
    report = DataReport(source=str(path), streamed=True, stream_key=str(path))
    return dataset, report


def source_format(data_args) -> DatasetFormat:
    """The format a source's rows are read with: its dataset_format, with the source's `mapping` if it has one."""
    mapping = getattr(data_args, "dataset_mapping", None)
    return FORMATS[data_args.dataset_format].with_mapping(mapping) if mapping else FORMATS[data_args.dataset_format]


def _checked_jsonl(path: Path, data_args) -> tuple[Dataset, DataReport]:
    fmt = source_format(data_args)
    report = DataReport(source=str(path))
    rows, line_numbers, seen_columns = [], [], set()
    for line in read_jsonl(path):
        report.rows += 1
        row = line.row
        if row is None:
            report.drop(line.problem, f"line {line.number}", line.text)
            continue
        seen_columns |= row.keys()
        problem = fmt.row_problem(row)
        if problem:
            report.drop(problem, f"line {line.number}", row)
            continue
        rows.append(fmt.stored_row(row))
        line_numbers.append(line.number)
    if not report.rows:
        _refuse_a_file_without_rows(path)
    if seen_columns:  # no line was a JSON object: the refusal below counts them, the columns would say nothing
        fmt.check_columns(sorted(seen_columns), data_args.dataset_name)
    if data_args.max_train_samples is not None:
        rows = rows[: data_args.max_train_samples]
    if not rows:
        report.enforce(0.0)  # raises: nothing is left
    try:
        return Dataset.from_list(rows), report
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as error:  # OverflowError: an integer past 64 bits
        raise RecipeError(_unstorable_rows(path, rows, line_numbers, error)) from None


def _unstorable_rows(path: Path, rows: list[dict[str, Any]], line_numbers: list[int], error: Exception) -> str:
    """Why Arrow could not store the rows: a key whose values have one JSON type in some rows and another in others
    (a column holds one type), named with the first line of each type."""
    first_lines: dict[str, dict[str, int]] = {}  # key path -> JSON type -> the first line holding it
    for row, number in zip(rows, line_numbers):
        for key, json_type in _json_types(row):
            first_lines.setdefault(key, {}).setdefault(json_type, number)
    mixed = next(((key, lines) for key, lines in first_lines.items() if len(lines) > 1), None)
    if mixed is None:
        return f"{path}: the rows cannot be stored as one table ({error}): fix or remove the values Arrow cannot store."
    key, lines = mixed
    where = ", ".join(f"a {json_type} on line {number}" for json_type, number in lines.items())
    return (f"{path}: `{key}` holds values of different types ({where}), and a column holds one type. Give `{key}` "
            "one type in every row, or remove it from the rows.")


def _json_types(value: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(key path, JSON type) of every value under `value`; `messages[].meta` is the key `meta` of each message.
    Integers and floats are one type (Arrow stores both in a float column); null fits every type."""
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _json_types(item, f"{key}.{name}" if key else name)
        json_type = "object"
    elif isinstance(value, list):
        for item in value:
            yield from _json_types(item, f"{key}[]")
        json_type = "list"
    else:
        json_type = {bool: "boolean", int: "number", float: "number", str: "string"}.get(type(value))
    if key and json_type:
        yield key, json_type


def load_checked_dataset(data_args, mark_bad_rows: bool = False) -> tuple[Dataset | IterableDataset, DataReport]:
    """The recipe's training rows without bad ones, and the report of what was dropped and why.

    With `mark_bad_rows`, a streamed dataset keeps its bad rows, flagged in ROW_PROBLEM, for the
    packed block stream to count as it reads them (`without_marked_rows` leaves them out again).

    Raises RecipeError when the columns do not fit `dataset_format`.
    """
    local = _local_jsonl(data_args)
    if local is not None:
        refuse_another_encoding(local)
        if data_args.dataset_streaming:
            return _streamed_jsonl(local, data_args, mark_bad_rows)
        return _checked_jsonl(local, data_args)
    dataset = load_raw_dataset(data_args)
    fmt = source_format(data_args)
    fmt.check_columns(dataset.column_names, data_args.dataset_name)
    report = DataReport(source=data_args.dataset_name)
    if isinstance(dataset, IterableDataset):
        report.streamed, report.stream_key = True, data_args.dataset_name
        check = StreamedRowCheck(data_args.dataset_name, fmt)
        rows = dataset.map(check.mark) if mark_bad_rows else dataset.filter(check)
        if fmt.converts_to_messages:  # a bad row (marked) becomes no conversation
            rows = rows.map(lambda row: fmt.stored_row(row) if not row.get(ROW_PROBLEM) else {"messages": []},
                            remove_columns=[c for c in (dataset.column_names or fmt.columns) if c != "messages"])
        return rows, report
    problems = [fmt.row_problem(row) for row in dataset]
    report.rows = len(problems)
    for index, problem in enumerate(problems):
        if problem:
            report.drop(problem, f"row {index}", dataset[index])
    if report.dropped:
        dataset = dataset.select([index for index, problem in enumerate(problems) if problem is None])
    if fmt.converts_to_messages:
        dataset = dataset.map(fmt.stored_row, remove_columns=dataset.column_names, desc=f"Reading {fmt.name} rows")
    return dataset, report


# ── Mixture entries (`datasets:`, `eval_datasets:`) ─────────────────────────────────────────────

@dataclass(frozen=True)
class DatasetSource:
    """One entry of a recipe's `datasets:` (or `eval_datasets:`) list: TRL 1.16's `DatasetConfig`
    (`path`, `name`, `data_dir`, `data_files`, `split`, `columns`, `fraction`) plus the dataset
    `revision` to pin and the `dataset_format` its rows are in."""

    path: str
    dataset_format: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None
    revision: str | None = None
    mapping: dict[str, str] | None = None  # sharegpt: other column, key and role names (LLaMA-Factory's columns/tags)

    @property
    def label(self) -> str:
        """How the data report names this source."""
        return f"{self.path}:{self.name}" if self.name else self.path

    def as_data_args(self, key: str, streaming: bool, max_rows: int | None = None) -> SourceArguments:
        """This source in the shape the single-dataset loaders read (`DataArguments`' dataset_* names); `key`: the
        recipe key that names it (dataset_name, datasets, eval_datasets)."""
        return SourceArguments(
            dataset_key=key, dataset_name=self.path, dataset_config=self.name, dataset_train_split=self.split,
            dataset_revision=self.revision, dataset_format=self.dataset_format, dataset_streaming=streaming,
            max_train_samples=max_rows, dataset_data_dir=self.data_dir, dataset_data_files=self.data_files,
            dataset_columns=self.columns, dataset_mapping=self.mapping,
        )


@dataclass
class SourceArguments:
    dataset_key: str  # the recipe key that names the source, for a refusal to point at
    dataset_name: str
    dataset_config: str | None
    dataset_train_split: str
    dataset_revision: str | None
    dataset_format: str
    dataset_streaming: bool
    max_train_samples: int | None
    dataset_data_dir: str | None
    dataset_data_files: Any
    dataset_columns: list[str] | None
    dataset_mapping: dict[str, str] | None = None


SOURCE_KEYS = tuple(f.name for f in dataclasses.fields(DatasetSource))


def parse_sources(entries: Any, key: str, default_format: str) -> list[DatasetSource]:
    """A recipe's list of dataset entries -> sources; RecipeError naming every problem and its fix."""
    if not isinstance(entries, list) or not entries:
        raise RecipeError(f"'{key}' must be a non-empty list of entries such as "
                          f"{{path: data/samples/alpaca.jsonl, dataset_format: alpaca, fraction: 0.7}}")
    problems, sources = [], []
    for number, entry in enumerate(entries):
        where = f"{key}[{number}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} must be a mapping with at least `path`, got {entry!r}: write it as "
                            "{path: ..., dataset_format: ...}")
            continue
        for unknown in sorted(set(entry) - set(SOURCE_KEYS)):
            close = difflib.get_close_matches(unknown, SOURCE_KEYS, n=3, cutoff=0.6)
            hint = (f"; did you mean {', '.join(repr(c) for c in close)}?" if close
                    else f": remove it (keys: {', '.join(SOURCE_KEYS)})")
            problems.append(f"{where}: unknown key '{unknown}'{hint}")
        values = {k: v for k, v in entry.items() if k in SOURCE_KEYS}
        values.setdefault("dataset_format", default_format)
        if not isinstance(values.get("path"), str) or not values["path"]:
            problems.append(f"{where} needs `path`: a Hub dataset id or a local file/folder")
        if values["dataset_format"] not in FORMATS:
            problems.append(f"{where}: dataset_format must be one of {list(FORMATS)}, got {values['dataset_format']!r}: "
                            "set the one whose columns the source has")
        fraction = values.get("fraction")
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or fraction <= 0):
            problems.append(f"{where}: fraction must be a number > 0 (its share of the mixture), got {fraction!r}")
        for name in ("name", "data_dir", "split", "revision"):
            if values.get(name) is not None and not isinstance(values[name], str):
                problems.append(f"{where}: {name} must be a string, got {values[name]!r}")
        columns = values.get("columns")
        if columns is not None and not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
            problems.append(f"{where}: columns must be a list of column names, got {columns!r}: write e.g. "
                            "columns: [messages]")
        if values["dataset_format"] in FORMATS:
            problems += FORMATS[values["dataset_format"]].mapping_problems(values.get("mapping"), where)
        if not problems:
            sources.append(DatasetSource(**values))
    given = [entry.get("fraction") is not None for entry in entries if isinstance(entry, dict)]
    if any(given) and not all(given):
        problems.append(f"{key}: give `fraction` on every entry or on none (as TRL's DatasetMixtureConfig)")
    if problems:
        raise RecipeError("; ".join(problems))
    return sources
