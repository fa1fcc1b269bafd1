"""Bad rows: dropped by a stated policy, counted per reason, and a refusal when too many go.

Policy, per reason (each dropped row is counted under the first reason that applies):

- `invalid_json`: a line of a local .jsonl file that is not a JSON object. Local .jsonl files are
  read here, line by line, so one bad line is counted instead of failing the whole file (the
  `datasets` json loader rejects the file, and also any file whose column changes type).
- `missing_field`, `not_a_string`, `empty_content`: a required field (alpaca `instruction` /
  `output`, `text`, `messages`, a message's `role` / `content`) is absent or null, is not a
  string (not a list, for `messages`), or is blank. alpaca `input` may be empty or absent, and
  so may a system / developer message's content.
- `unknown_role`: a message role outside KNOWN_ROLES. `no_assistant_turn`: nothing to learn from.
- `overlong`: longer than `max_length` tokens with `overlong_policy: drop`. With the default
  `truncate`, such rows keep their first `max_length` tokens and are counted as truncated; a row
  whose supervised tokens all fall past the cut is dropped by TRL and counted `no_trainable_tokens`.

Training refuses to start (ValueError showing an offending row) when more than
`max_dropped_share` of the rows are dropped, or when no trainable token is left. Streamed datasets
are filtered lazily by the same row rules; their counts are not known at start, so each reader
logs bad rows as it meets them (`StreamedRowCheck`). A streamed local .jsonl is read line by line:
an invalid JSON line is one bad row, not a failed stream.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset, IterableDataset
from transformers import PreTrainedTokenizerBase, TrainerCallback

from sft_recipes.data.formats import REQUIRED_COLUMNS, alpaca_to_prompt_completion, check_columns
from sft_recipes.data.sources import load_raw_dataset
from sft_recipes.tracking import mlflow_enabled

INVALID_JSON = "invalid_json"
MISSING_FIELD = "missing_field"
NOT_A_STRING = "not_a_string"
EMPTY_CONTENT = "empty_content"
UNKNOWN_ROLE = "unknown_role"
NO_ASSISTANT_TURN = "no_assistant_turn"
OVERLONG = "overlong"
NO_TRAINABLE_TOKENS = "no_trainable_tokens"

KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")
OPTIONAL_CONTENT_ROLES = ("system", "developer")
CHAT_FORMATS = ("messages", "reasoning")
_EXCERPT_CHARS = 300
logger = logging.getLogger(__name__)
LENGTH_BATCH = 1000


# ── Row rules ───────────────────────────────────────────────────────────────────────────────────

def _text_problem(value: Any, required: bool = True) -> str | None:
    if value is None:
        return MISSING_FIELD if required else None
    if not isinstance(value, str):
        return NOT_A_STRING
    if required and not value.strip():
        return EMPTY_CONTENT
    return None


def _messages_problem(messages: Any) -> str | None:
    if messages is None:
        return MISSING_FIELD
    if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
        return NOT_A_STRING  # the conversation itself has the wrong type
    if not messages:
        return EMPTY_CONTENT
    for message in messages:
        problem = _text_problem(message.get("role"))
        if problem:
            return problem
        if message["role"] not in KNOWN_ROLES:
            return UNKNOWN_ROLE
        # An empty system prompt is a choice; an empty question or reply is a broken row.
        problem = _text_problem(message.get("content"), required=message["role"] not in OPTIONAL_CONTENT_ROLES)
        if problem or message.get("content") is None:
            return problem or MISSING_FIELD
    if not any(message["role"] == "assistant" for message in messages):
        return NO_ASSISTANT_TURN
    return None


def row_problem(row: dict[str, Any], dataset_format: str) -> str | None:
    """Why `row` cannot be trained on under `dataset_format`, or None when it can."""
    if dataset_format == "alpaca":
        return (_text_problem(row.get("instruction")) or _text_problem(row.get("output"))
                or _text_problem(row.get("input"), required=False))
    if dataset_format == "text":
        return _text_problem(row.get("text"))
    if dataset_format in CHAT_FORMATS:
        return _messages_problem(row.get("messages"))
    raise ValueError(f"Unknown dataset_format {dataset_format!r}.")


# ── Report ──────────────────────────────────────────────────────────────────────────────────────

@dataclass
class DataReport:
    """What happened to the rows: counts per drop reason, the first offending row of each."""

    source: str
    rows: int = 0  # rows (or lines) read
    dropped: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> "where: excerpt"
    truncated: int = 0
    trainable_tokens: int | None = None  # None: not counted (streamed, or masked later)
    streamed: bool = False

    def drop(self, reason: str, where: str, row: Any) -> None:
        self.dropped[reason] += 1
        if reason not in self.examples:
            text = row if isinstance(row, str) else json.dumps(row, default=str, ensure_ascii=False)
            self.examples[reason] = f"{where}: {text[:_EXCERPT_CHARS]}"

    def count_masking(self, dropped: dict[str, int], trainable_tokens: int) -> None:
        """Add the conversations that assistant-only masking dropped, and the supervised tokens left."""
        for reason, count in dropped.items():
            self.dropped[reason] += count
            self.examples.setdefault(reason, "found while masking (scripts/sft.py RECIPE --audit-data N shows rows)")
        self.trainable_tokens = trainable_tokens

    @property
    def kept(self) -> int:
        return self.rows - sum(self.dropped.values())

    @property
    def dropped_share(self) -> float:
        return sum(self.dropped.values()) / self.rows if self.rows else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "rows": self.rows, "kept": self.kept, "dropped": dict(self.dropped),
                "dropped_share": round(self.dropped_share, 6), "truncated": self.truncated,
                "trainable_tokens": self.trainable_tokens, "streamed": self.streamed, "examples": self.examples}

    def format(self) -> str:
        if self.streamed:
            return (f"[data] {self.source}: streamed; bad rows are dropped as they are read, and logged (the 1st, "
                    "10th, 100th... of each reason per reader)")
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.dropped.items())) or "none"
        line = (f"[data] {self.source}: {self.rows} rows, kept {self.kept}, dropped {sum(self.dropped.values())} "
                f"({self.dropped_share:.2%}: {reasons}), truncated {self.truncated}")
        if self.trainable_tokens is not None:
            line += f", trainable tokens {self.trainable_tokens}"
        return "\n".join([line, *(f"  first {reason} row, {example}" for reason, example in sorted(self.examples.items()))])

    def enforce(self, max_dropped_share: float) -> None:
        """ValueError when too many rows were dropped, or nothing is left to learn from."""
        if self.streamed:
            return
        if self.kept == 0 or self.trainable_tokens == 0:
            what = "no row is left" if self.kept == 0 else "the rows left have no trainable (supervised) token"
            raise ValueError(f"Refusing to train: {what}.\n{self.format()}\nFix the dataset (or dataset_format, "
                             "max_length, completion_only_loss) so that rows carry a target to learn.")
        if self.dropped_share > max_dropped_share:
            raise ValueError(
                f"Refusing to train: {self.dropped_share:.2%} of the rows are bad, more than max_dropped_share="
                f"{max_dropped_share}.\n{self.format()}\nFix the rows, check dataset_format, or raise "
                "max_dropped_share if dropping them is intended."
            )


# ── Loading and structural checks ───────────────────────────────────────────────────────────────

def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
    """(line number, row or None when the line is not a JSON object, the line) for each non-blank line."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            yield number, row if isinstance(row, dict) else None, line.rstrip("\n")


def _local_jsonl(data_args) -> Path | None:
    path = Path(data_args.dataset_name or "")
    return path if path.suffix == ".jsonl" and path.is_file() else None


class StreamedRowCheck:
    """Keeps the streamed rows a run can train on; shows bad ones as they are read.

    A stream's drop counts are not known at start (nothing reads it up front), so each reader
    process logs the 1st, 10th, 100th... bad row of each reason, with the row, instead.
    """

    def __init__(self, source: str, dataset_format: str) -> None:
        self.source = source
        self.dataset_format = dataset_format
        self.dropped: Counter = Counter()

    def keep(self, row: dict[str, Any] | None, where: str, line: str | None = None) -> bool:
        problem = INVALID_JSON if row is None else row_problem(row, self.dataset_format)
        if problem is None:
            return True
        self.dropped[problem] += 1
        count = self.dropped[problem]
        if count == 10 ** (len(str(count)) - 1):  # 1, 10, 100, ...
            text = line if row is None else json.dumps(row, default=str, ensure_ascii=False)
            logger.warning("[data] %s: dropped streamed row (%s, %d so far in this reader), %s: %s", self.source,
                           problem, count, where, text[:_EXCERPT_CHARS])
        return False

    def __call__(self, row: dict[str, Any]) -> bool:  # as a `datasets` filter
        return self.keep(row, "a row")


def _valid_jsonl_rows(path: str, dataset_format: str) -> Iterator[dict[str, Any]]:
    """The rows of a local .jsonl that a streamed run can train on; bad lines are skipped, not fatal."""
    required, optional = REQUIRED_COLUMNS[dataset_format]
    check = StreamedRowCheck(path, dataset_format)
    for number, row, line in read_jsonl(Path(path)):
        if check.keep(row, f"line {number}", line):
            yield {column: row.get(column) for column in sorted(required | optional)}


def _streamed_jsonl(path: Path, data_args) -> tuple[IterableDataset, DataReport]:
    # `datasets`' json builder fails the whole stream on one bad line; read it line by line instead.
    dataset = IterableDataset.from_generator(
        _valid_jsonl_rows, gen_kwargs={"path": str(path), "dataset_format": data_args.dataset_format}
    )
    if data_args.max_train_samples is not None:
        dataset = dataset.take(data_args.max_train_samples)
    report = DataReport(source=str(path))
    report.streamed = True
    return dataset, report


def _checked_jsonl(path: Path, data_args) -> tuple[Dataset, DataReport]:
    fmt = data_args.dataset_format
    required, optional = REQUIRED_COLUMNS[fmt]
    report = DataReport(source=str(path))
    rows, seen_columns = [], set()
    for number, row, line in read_jsonl(path):
        report.rows += 1
        if row is None:
            report.drop(INVALID_JSON, f"line {number}", line)
            continue
        seen_columns |= row.keys()
        problem = row_problem(row, fmt)
        if problem:
            report.drop(problem, f"line {number}", row)
            continue
        rows.append({column: row.get(column) for column in sorted(required | optional)})
    check_columns(sorted(seen_columns), fmt, data_args.dataset_name)
    if data_args.max_train_samples is not None:
        rows = rows[: data_args.max_train_samples]
    if not rows:
        report.enforce(0.0)  # raises: nothing is left
    # Only the format's own columns: a stray column whose type changes between rows would break Arrow.
    return Dataset.from_list(rows), report


def load_checked_dataset(data_args) -> tuple[Dataset | IterableDataset, DataReport]:
    """The recipe's training rows without bad ones, and the report of what was dropped and why.

    Raises ValueError when the columns do not fit `dataset_format`.
    """
    local = _local_jsonl(data_args)
    if local is not None:
        return _streamed_jsonl(local, data_args) if data_args.dataset_streaming else _checked_jsonl(local, data_args)
    dataset = load_raw_dataset(data_args)
    check_columns(dataset.column_names, data_args.dataset_format, data_args.dataset_name)
    fmt = data_args.dataset_format
    report = DataReport(source=data_args.dataset_name)
    if isinstance(dataset, IterableDataset):
        report.streamed = True
        return dataset.filter(StreamedRowCheck(data_args.dataset_name, fmt)), report
    problems = [row_problem(row, fmt) for row in dataset]
    report.rows = len(problems)
    for index, problem in enumerate(problems):
        if problem:
            report.drop(problem, f"row {index}", dataset[index])
    if report.dropped:
        dataset = dataset.select([index for index, problem in enumerate(problems) if problem is None])
    return dataset, report


# ── Length policy (needs the tokenizer) ─────────────────────────────────────────────────────────

def _token_counts(rows: dict[str, list], data_args, training_args, tokenizer: PreTrainedTokenizerBase
                  ) -> tuple[list[int], list[int | None]]:
    """(tokens, supervised tokens before truncation, or None when masking decides later), as TRL tokenizes."""
    fmt = data_args.dataset_format
    eos = tokenizer.eos_token or ""
    if fmt in CHAT_FORMATS:  # rendered as the masking module renders it: null fields left out, no special tokens
        conversations = [[{k: v for k, v in message.items() if v is not None} for message in conversation]
                         for conversation in rows["messages"]]
        texts = tokenizer.apply_chat_template(conversations, tokenize=False, **(data_args.chat_template_kwargs or {}))
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return lengths, [None] * len(lengths)
    if fmt == "text":
        texts = [text if text.endswith(eos) else text + eos for text in rows["text"]]
        lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
        return lengths, lengths
    pairs = [alpaca_to_prompt_completion(dict(zip(rows, values))) for values in zip(*rows.values())]
    completions = [p["completion"] if p["completion"].endswith(eos) else p["completion"] + eos for p in pairs]
    lengths = [len(ids) for ids in tokenizer([p["prompt"] + c for p, c in zip(pairs, completions)])["input_ids"]]
    if training_args.completion_only_loss is False:  # TRL's None means completion-only for prompt/completion
        return lengths, lengths
    prompt_lengths = [len(ids) for ids in tokenizer([p["prompt"] for p in pairs])["input_ids"]]
    return lengths, [max(length - prompt, 0) for length, prompt in zip(lengths, prompt_lengths)]


def apply_length_policy(dataset: Dataset | IterableDataset, data_args, training_args,
                        tokenizer: PreTrainedTokenizerBase, report: DataReport) -> Dataset | IterableDataset:
    """Count (and with `overlong_policy: drop`, drop) rows longer than `max_length`; count trainable tokens.

    Streamed datasets and packed blocks are left alone: packing splits long rows, it never cuts them.
    """
    max_length = training_args.max_length
    if isinstance(dataset, IterableDataset) or max_length is None or data_args.pack_blocks:
        return dataset
    keep, trainable, counted = [], 0, True
    for start in range(0, len(dataset), LENGTH_BATCH):
        rows = dataset[start : start + LENGTH_BATCH]
        lengths, supervised = _token_counts(rows, data_args, training_args, tokenizer)
        for index, (length, targets) in enumerate(zip(lengths, supervised), start=start):
            if length > max_length and data_args.overlong_policy == "drop":
                report.drop(OVERLONG, f"row {index} ({length} tokens > max_length {max_length})", dataset[index])
                continue
            if targets is None:
                counted = False
            else:
                # keep_start truncation: the supervised tokens are the last `targets` of the row.
                left = max(min(length, max_length) - (length - targets), 0)
                if left == 0:
                    report.drop(NO_TRAINABLE_TOKENS, f"row {index} (every target past max_length {max_length})",
                                dataset[index])
                    continue
                trainable += left
            report.truncated += length > max_length
            keep.append(index)
    report.trainable_tokens = trainable if counted else None
    return dataset.select(keep) if len(keep) < len(dataset) else dataset


# ── Tracking ────────────────────────────────────────────────────────────────────────────────────

class DataReportCallback(TrainerCallback):
    """Write the report to output_dir/data_report.json; log its counts to MLflow as `data.*` params."""

    def __init__(self, report: DataReport) -> None:
        self.report = report

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        summary = self.report.as_dict()
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        Path(args.output_dir, "data_report.json").write_text(json.dumps(summary, indent=2, default=str))
        if not mlflow_enabled(args):
            return
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.log_params({
                "data.rows": summary["rows"], "data.kept": summary["kept"], "data.truncated": summary["truncated"],
                **{f"data.dropped.{reason}": count for reason, count in summary["dropped"].items()},
            })
