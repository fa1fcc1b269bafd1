"""What happened to a dataset's rows: counts per drop reason and the first offending row of each,
and the refusal when too many were dropped or nothing is left to learn; for a mixture, the same per
source plus what each source put into the mixture (`MixtureReport`).

A packed block stream finds some drops only while training (every bad row of a streamed dataset,
and every conversation the masking cannot train on): its readers' counts, summed over ranks after
every step, come in through `count_stream`, which enforces `max_dropped_share` on them once
MIN_ROWS_BEFORE_DROP_LIMIT conversations have been read (or the stream has ended).

Supervised tokens are counted one way everywhere: the causal-LM loss's targets, i.e. the labelled
tokens after each row's first (nothing predicts a row's first token). `kept_supervised_tokens` counts
them in the rows a source kept for training; `supervised_tokens` in the rows training takes from it
(the mixture's draw, or the conversations a packed stream read). Every key of data_report.json is
described in docs/data-report.md.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sft_recipes.data.rows import REASON_FIXES
from sft_recipes.errors import RecipeError

if TYPE_CHECKING:
    from sft_recipes.data.blocks import SourceCounts, StreamStats

EXCERPT_CHARS = 300
# Conversations all ranks' readers must have read before their running share is enforced: 200
# measure a 5% share (the default limit) to about +-1.5 points (one standard error).
MIN_ROWS_BEFORE_DROP_LIMIT = 200


@dataclass
class DataReport:
    """What happened to the rows: counts per drop reason, the first offending row of each."""

    source: str
    rows: int = 0  # rows (or lines) read
    dropped: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> "where: excerpt"
    truncated: int = 0
    kept_supervised_tokens: int | None = None  # loss targets in the kept rows; None: not counted (streamed, packed)
    streamed: bool = False
    stream_key: str | None = None  # a stream: the name its readers count it under (`sources.STREAM_READS`)
    stream_rows: int | None = None  # rows read while training, all ranks (None: nothing read while training)
    stream_dropped: Counter = field(default_factory=Counter)  # what they dropped, per reason

    def drop(self, reason: str, where: str, row: Any) -> None:
        self.dropped[reason] += 1
        if reason not in self.examples:
            text = row if isinstance(row, str) else json.dumps(row, default=str, ensure_ascii=False)
            self.examples[reason] = f"{where}: {text[:EXCERPT_CHARS]}"

    def count_masking(self, dropped: dict[str, int], supervised_tokens: int) -> None:
        """Add the conversations that assistant-only masking dropped, and the supervised tokens left."""
        for reason, count in dropped.items():
            self.dropped[reason] += count
            self.examples.setdefault(reason, "found while masking (scripts/sft.py RECIPE --audit-data N shows rows)")
        self.kept_supervised_tokens = supervised_tokens

    @property
    def kept(self) -> int:
        return self.rows - sum(self.dropped.values())

    @property
    def dropped_share(self) -> float:
        """The share of rows dropped. With a packed stream, the shares kept up front and while reading
        multiply: the stream reads only the rows kept up front (all of them, for a streamed dataset)."""
        rows, dropped = self.rows, sum(self.dropped.values())
        if not self.stream_rows:
            return dropped / rows if rows else 0.0
        stream_dropped = sum(self.stream_dropped.values())
        if not rows:  # a streamed dataset: the stream reads every row
            return stream_dropped / self.stream_rows
        both = rows * self.stream_rows  # in integers, so that the share is exact
        return (both - (rows - dropped) * (self.stream_rows - stream_dropped)) / both

    def count_stream(self, total: StreamStats | SourceCounts, stream_ended: bool, max_dropped_share: float) -> None:
        """Take the packed stream's running counts of these rows (all ranks); RecipeError when the share is too high."""
        self.stream_rows, self.stream_dropped = total.conversations, Counter(total.dropped)
        judged = total.conversations >= MIN_ROWS_BEFORE_DROP_LIMIT or stream_ended
        if judged and self.dropped_share > max_dropped_share:
            raise RecipeError(
                f"Refusing to go on: {self.dropped_share:.2%} of the rows of {self.source} are dropped, more than "
                f"max_dropped_share={max_dropped_share} ({self.describe_stream()}; summed over every rank, judged from "
                f"{MIN_ROWS_BEFORE_DROP_LIMIT} rows read or at the end of the stream). "
                f"{self.format_that_fits()}Fix the rows, check "
                "dataset_format and the chat template (`.venv/bin/python scripts/sft.py RECIPE --audit-data 5` shows rows), or raise "
                "max_dropped_share if dropping them is intended."
            )

    def _stream_drops(self) -> str:
        return ", ".join(f"{reason} {count}" for reason, count in sorted(self.stream_dropped.items())) or "none"

    def describe_stream(self) -> str:
        before = f"after {sum(self.dropped.values())} of {self.rows} rows dropped up front, " if self.rows else ""
        return f"{before}the stream read {self.stream_rows} rows while training and dropped {self._stream_drops()}"

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "rows": self.rows, "kept": self.kept, "dropped": dict(self.dropped),
                "dropped_share": round(self.dropped_share, 6), "truncated": self.truncated,
                "kept_supervised_tokens": self.kept_supervised_tokens, "streamed": self.streamed, "examples": self.examples,
                "read_while_training": None if self.stream_rows is None else
                {"rows": self.stream_rows, "dropped": dict(self.stream_dropped)}}

    def mlflow_params(self) -> dict[str, Any]:
        return report_params(self.as_dict())

    def format(self) -> str:
        if self.streamed and self.stream_rows is None:
            return (f"[data] {self.source}: streamed; bad rows are dropped as they are read, logged (the 1st, "
                    "10th, 100th... of each reason per reader) and counted over all readers")
        if self.streamed:
            return f"[data] {self.source}: streamed; {self.describe_stream()} ({self.dropped_share:.2%})"
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.dropped.items())) or "none"
        # The rows as read and checked; their tokens are on the mixture's line (what training takes from them).
        line = (f"[data] {self.source}: {self.rows} rows read, kept {self.kept}, dropped {sum(self.dropped.values())} "
                f"({self.dropped_share:.2%}: {reasons}), truncated {self.truncated}")
        if self.stream_rows is not None:
            line += (f"; packed while training: {self.stream_rows} read, dropped {self._stream_drops()} "
                     f"({self.dropped_share:.2%} dropped in all)")
        return "\n".join([line, *(f"  first {reason} row, {example}" for reason, example in sorted(self.examples.items()))])

    def enforce(self, max_dropped_share: float) -> None:
        """ValueError when too many rows were dropped, or nothing is left to learn from."""
        if self.streamed:
            return
        # One line (the `error:` line a user reads last): the report's counts and its first row of each reason.
        counts = "; ".join(line.strip() for line in self.format().splitlines()).removeprefix("[data] ")
        fits = self.format_that_fits()
        if self.kept == 0 or self.kept_supervised_tokens == 0:
            what = "no row is left" if self.kept == 0 else "the rows left have no trainable (supervised) token"
            raise RecipeError(f"Refusing to train: {what} ({counts}). {fits}Fix the dataset (or dataset_format, "
                              "max_length, completion_only_loss) so that rows carry a target to learn.")
        if self.dropped_share > max_dropped_share:
            raise RecipeError(
                f"Refusing to train: {self.dropped_share:.2%} of the rows are bad, more than max_dropped_share="
                f"{max_dropped_share} ({counts}). {fits}Fix the rows, check dataset_format, or raise max_dropped_share "
                "if dropping them is intended."
            )

    def format_that_fits(self) -> str:
        """The fix of a drop reason that names the format reading those rows (`rows.REASON_FIXES`), as a sentence."""
        dropped = self.dropped + self.stream_dropped
        fixes = [REASON_FIXES[reason] for reason in sorted(dropped) if reason in REASON_FIXES]
        return "".join(f"{fix[0].upper()}{fix[1:]}. " for fix in fixes)


def report_params(summary: dict[str, Any], prefix: str = "data.") -> dict[str, Any]:
    """A report's counts (`as_dict()`) as MLflow params."""
    return {f"{prefix}rows": summary["rows"], f"{prefix}kept": summary["kept"],
            f"{prefix}truncated": summary["truncated"],
            **{f"{prefix}dropped.{reason}": count for reason, count in summary["dropped"].items()}}


@dataclass
class SourceReport:
    """One source of a mixture: its checked rows (DataReport) and what it put into the mixture."""

    checked: DataReport
    fraction: float | None = None
    available_rows: int = 0  # kept training rows (after held-out rows, drops and masking)
    mixture_rows: int = 0  # rows drawn into the mixture (more than available_rows: repeated)
    eval_rows: int = 0
    # Of the rows training takes from this source: the mixture's draw, or (packed) the conversations its stream
    # read, counted whole as read. None: not counted yet (a packed stream counts as it reads).
    tokens: int | None = None
    supervised_tokens: int | None = None
    conversations_read: int | None = None  # packed: conversations the steps run read of it (kept or dropped)

    @property
    def times_used(self) -> float:
        """Rows drawn per training row: below 1 a sample of the source, above 1 it is repeated."""
        return self.mixture_rows / self.available_rows if self.available_rows else 0.0


@dataclass
class MixtureReport:
    """The data report of a run built from sources (`mixture.py`): totals as DataReport's, and one entry per source."""

    sources: list[SourceReport] = field(default_factory=list)
    streamed: bool = False
    packed: bool = False  # read by the packed block stream: tokens counted while training
    # packed: the supervised tokens inside the blocks the steps trained, all ranks (the sum of the ranks'
    # `[data] ... trained on` lines). The sources' counts take each conversation whole when read, so they
    # also hold what no trained block holds: the part of the last conversations past the last block
    # (split_examples), or the conversations still waiting in the packing window (whole conversations).
    supervised_tokens_in_trained_blocks: int | None = None
    packing_window: int | None = None  # packed whole (split_examples: false): how many may wait to be packed

    def _share(self, source: SourceReport) -> float | None:
        counted = [s.supervised_tokens for s in self.sources]
        if None in counted or not sum(counted):
            return None
        return source.supervised_tokens / sum(counted)

    def source_dict(self, source: SourceReport) -> dict[str, Any]:
        share = self._share(source)
        return {**source.checked.as_dict(), "fraction": source.fraction, "training_rows": source.available_rows,
                "mixture_rows": source.mixture_rows, "times_used": round(source.times_used, 4),
                "eval_rows": source.eval_rows, "conversations_read": source.conversations_read,
                "tokens": source.tokens, "supervised_tokens": source.supervised_tokens,
                "supervised_token_share": None if share is None else round(share, 6)}

    def as_dict(self) -> dict[str, Any]:
        dropped = sum((Counter(s.checked.dropped) for s in self.sources), Counter())
        rows = sum(s.checked.rows for s in self.sources)
        supervised = [s.supervised_tokens for s in self.sources]
        # Rows each source was judged on: read up front, else (a stream) read while training.
        judged = [s.checked.rows or s.checked.stream_rows or 0 for s in self.sources]
        streams = [s.checked for s in self.sources if s.checked.stream_rows is not None]
        read_while_training = None if not streams else {
            "rows": sum(c.stream_rows for c in streams),
            "dropped": dict(sum((Counter(c.stream_dropped) for c in streams), Counter()))}
        return {"source": ", ".join(s.checked.source for s in self.sources), "rows": rows,
                "kept": rows - sum(dropped.values()), "dropped": dict(dropped),
                "dropped_share": round(sum(s.checked.dropped_share * n for s, n in zip(self.sources, judged))
                                       / sum(judged), 6) if sum(judged) else 0.0,
                "read_while_training": read_while_training,
                "truncated": sum(s.checked.truncated for s in self.sources),
                "tokens": None if None in [s.tokens for s in self.sources] else sum(s.tokens for s in self.sources),
                "supervised_tokens": None if None in supervised else sum(supervised), "streamed": self.streamed,
                "eval_rows": sum(s.eval_rows for s in self.sources),
                "supervised_tokens_in_trained_blocks": self.supervised_tokens_in_trained_blocks,
                "sources": [self.source_dict(s) for s in self.sources]}

    def mlflow_params(self) -> dict[str, Any]:
        summary = self.as_dict()
        params = {**report_params(summary), "data.eval_rows": summary["eval_rows"]}
        for index, source in enumerate(summary["sources"]):
            prefix = f"data.source{index}."
            params.update(report_params(source, prefix))
            params.update({prefix + key: source[key] for key in ("mixture_rows", "times_used", "eval_rows", "tokens",
                                                                 "supervised_tokens", "supervised_token_share")})
        return params

    def format(self) -> str:
        lines = []
        mixture = len(self.sources) > 1
        for index, source in enumerate(self.sources):
            entry = self.source_dict(source)
            name = f"source {index} " if mixture else ""
            lines.append(source.checked.format().replace("[data] ", f"[data] {name}", 1))
            repeated = f", repeated {entry['times_used']:.2f}x" if source.times_used > 1 else ""
            share = entry["supervised_token_share"]
            if entry["supervised_tokens"] is not None:
                counted = f"{entry['tokens']:,} tokens, {entry['supervised_tokens']:,} supervised"
                counted += f" ({share:.1%} of the mixture's)" if mixture and share is not None else ""
            else:
                counted = "tokens counted while training" if self.packed else "tokens not counted (tokenized as read)"
            fraction = f" (fraction {source.fraction})" if source.fraction is not None else ""
            available = "" if self.streamed else f" of {source.available_rows:,} training rows"
            if source.conversations_read is not None:  # a packed stream, at the end: what the steps run read
                drawn = (f"read by the steps run: {source.conversations_read:,} conversations{available}{fraction}, "
                         f"{counted} (each conversation counted whole when read)")
            else:
                drawn = ("streamed" if self.streamed else
                         f"{source.mixture_rows:,}{available}{repeated}") + f"{fraction}, {counted}"
                drawn = f"{'in the mixture' if mixture else 'drawn for training'}: {drawn}"
            lines.append(f"  {drawn}; eval rows {source.eval_rows:,}")
        if self.supervised_tokens_in_trained_blocks is not None:
            read = sum(source.supervised_tokens or 0 for source in self.sources)
            untrained = ("the last conversations' parts past the last block" if self.packing_window is None else
                         "conversations still waiting to be packed when the steps ended (whole conversations are "
                         f"packed best-fit among up to packing_window={self.packing_window:,} read ahead)")
            lines.append(f"[data] trained: {self.supervised_tokens_in_trained_blocks:,} supervised tokens in the "
                         "blocks the steps ran (as `all ranks trained on` says); the other "
                         f"{read - self.supervised_tokens_in_trained_blocks:,} of the {read:,} read were in {untrained}")
        return "\n".join(lines)

    def enforce(self, max_dropped_share: float) -> None:
        for source in self.sources:
            source.checked.enforce(max_dropped_share)

    def count_stream(self, total: StreamStats, stream_ended: bool, max_dropped_share: float) -> None:
        """Take the packed stream's running counts per source (all ranks); RecipeError when a source's share
        of dropped rows is too high."""
        self.supervised_tokens_in_trained_blocks = total.supervised_tokens
        for index, source in enumerate(self.sources):
            counts = total.sources.get(index)
            if counts is None:  # nothing of it read yet
                continue
            source.tokens, source.supervised_tokens = counts.tokens, counts.supervised_tokens
            source.conversations_read = counts.conversations
            source.checked.count_stream(counts, stream_ended, max_dropped_share)
