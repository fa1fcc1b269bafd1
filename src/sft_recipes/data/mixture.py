"""Training (and eval) rows from one source or a weighted mixture: TRL's `datasets:` recipe key, extended.

Recipe keys (DataArguments): `datasets` (TRL 1.16 `DatasetConfig` entries: path, name, data_dir,
data_files, split, columns, fraction; plus `revision` and `dataset_format` per entry), `streaming`,
`test_split_size` (TRL's names), `eval_datasets` (explicit eval sources, entries of the same shape)
and `mixture_strategy`. The single-dataset keys (`dataset_name` ...) stay: they are a one-entry mixture.

- `fraction` is TRL 1.16's: the source's target share of the mixture's rows, normalised over the
  entries, given on every entry or on none (none: every source whole, as TRL concatenates them).
- How many rows the mixture has is `mixture_strategy`, named and meant as datasets'
  `interleave_datasets(stopping_strategy=...)`: `first_exhausted` (default, TRL's rule) is the
  largest mixture in which no source is repeated; `all_exhausted` is the smallest in which every
  source is used whole, so a source whose share asks for more rows than it has is repeated (the
  report says how often). Map-style rows are drawn with the recipe's `seed` and the sources
  shuffled together (TRL concatenates A then B).
- Streamed (`streaming` or `dataset_streaming`): the sources are interleaved with the normalised
  fractions as probabilities, seeded, under the same `mixture_strategy` (tokenized as they are read
  when unpacked: alpaca and text; conversations are read by the packed block stream). `first_exhausted` is the
  default because a stream is not counted up front: stopping at the first source to run out keeps
  the shares true without silently cycling a small source thousands of times under a large one.
  Packed runs read the mixed rows through the usual per-rank x worker readers
  (`RankLocalBlockStream`, built by `sft_recipes.run.data`); its shared stop ends the pass when the
  first reader runs out.
- Packed runs count what the readers drop and read per source, summed over every rank after every
  step (`MixtureReport.count_stream`): a streamed source's bad rows stay in its stream, flagged,
  and each conversation carries its source's index (`SOURCE_FIELD`); `max_dropped_share` holds
  for each source on the running counts, as it does up front for map-style rows.
- Each source becomes `input_ids` + `labels` through its own format (`DatasetFormat.to_tokens`), so
  alpaca, text and chat sources mix; packed runs (`pack_blocks`) mix chat sources, as conversations.
- Eval rows: `eval_datasets`, or each source's rows held out by `test_split_size`
  (`data/heldout.py`, by row hash, before any row is drawn for training). With `pack_blocks` the
  eval rows are packed whole into block-diagonal blocks by the training packer.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, IterableDataset, List, Value, concatenate_datasets, interleave_datasets

from sft_recipes.data.blocks import IGNORE_INDEX, SOURCE_FIELD, fill_blocks
from sft_recipes.data.formats import CHAT_FORMATS, FORMATS, Tokenization
from sft_recipes.data.heldout import split_held_out
from sft_recipes.data.masking import KEPT, tokenize_conversations
from sft_recipes.data.report import DataReport, MixtureReport, SourceReport
from sft_recipes.data.rows import NO_TRAINABLE_TOKENS, ROW_PROBLEM
from sft_recipes.data.sources import (
    DatasetSource, count_stream_drop, load_checked_dataset, parse_sources, without_marked_rows,
)
from sft_recipes.data.vision_eval import LONGER_THAN_BLOCK, VisionEvalBlocks
from sft_recipes.errors import RecipeError

IMAGES_FIELD = "images"
# How an image travels in a packed image run: the datasets Image feature's storage (bytes, or a resolved path).
IMAGE_RECORDS = List({"bytes": Value("binary"), "path": Value("string")})


# ── Recipe keys ─────────────────────────────────────────────────────────────────────────────────

def is_streamed(data_args) -> bool:
    return bool(data_args.streaming or data_args.dataset_streaming)  # one flag once DataArguments is built


def training_sources(data_args) -> list[DatasetSource]:
    """The recipe's sources: its `datasets` entries, or `dataset_name` as the only one."""
    if data_args.datasets:
        return parse_sources(data_args.datasets, "datasets", data_args.dataset_format)
    return [DatasetSource(path=data_args.dataset_name, dataset_format=data_args.dataset_format,
                          name=data_args.dataset_config, split=data_args.dataset_train_split,
                          revision=data_args.dataset_revision, mapping=getattr(data_args, "dataset_mapping", None))]


def eval_sources(data_args) -> list[DatasetSource]:
    if not data_args.eval_datasets:
        return []
    return parse_sources(data_args.eval_datasets, "eval_datasets", data_args.dataset_format)


def check_data_sources(data_args) -> None:
    """RecipeError naming every problem with the data-source keys of a recipe (run by DataArguments)."""
    problems = []
    if data_args.datasets and data_args.dataset_name:
        problems.append("give either dataset_name (one dataset) or datasets (a mixture), not both")
    if not data_args.datasets and not data_args.dataset_name:
        problems.append("no training data: set dataset_name, or datasets: [{path: ..., dataset_format: ...}, ...]")
    if data_args.datasets and data_args.max_train_samples is not None:
        problems.append("max_train_samples caps a single dataset; in a mixture give each source a fraction")
    size = data_args.test_split_size
    if size is not None and not 0 < size < 1:
        problems.append(f"test_split_size is the share of rows held out for eval, in (0, 1); got {size}: set e.g. "
                        "test_split_size: 0.05")
    if size is not None and data_args.eval_datasets:
        problems.append("give either eval_datasets or test_split_size as the eval data, not both")
    for key, read in (("datasets", training_sources), ("eval_datasets", eval_sources)):
        try:
            sources = read(data_args) if key == "eval_datasets" or data_args.datasets or data_args.dataset_name else []
        except RecipeError as err:
            problems.append(str(err))
            continue
        if key == "eval_datasets" and any(source.fraction is not None for source in sources):
            problems.append("eval_datasets: `fraction` is not used for eval (every eval row counts); remove it")
        if data_args.pack_blocks and (key == "eval_datasets" or data_args.datasets):  # one dataset: the linter's
            problems += [f"{key}: {source.label} has dataset_format {source.dataset_format!r}; pack_blocks packs "
                         f"chat conversations ({' or '.join(CHAT_FORMATS)}): set pack_blocks: false, or "
                         + ("dataset_format: alpaca_chat on this source (its rows as chat conversations)"
                            if source.dataset_format == "alpaca" else "give this source as chat conversations")
                         for source in sources if source.dataset_format not in CHAT_FORMATS]
        problems += [f"{key}: {source.label} has dataset_format vision_messages: {need}" for source in sources
                     if FORMATS[source.dataset_format].vision for need in _vision_needs(data_args, key)]
        if key == "datasets" and is_streamed(data_args) and not data_args.pack_blocks:
            streaming_key = "streaming" if data_args.streaming else "dataset_streaming"
            problems += [f"{source.label} is streamed with dataset_format {source.dataset_format!r}: streamed "
                         "conversations are read by the packed block stream (each rank reads and packs its own "
                         f"shard, counting what it drops): set pack_blocks: true, or {streaming_key}: false"
                         for source in sources if source.dataset_format in CHAT_FORMATS]
    if not data_args.datasets and data_args.dataset_format in FORMATS:
        problems += FORMATS[data_args.dataset_format].mapping_problems(getattr(data_args, "dataset_mapping", None),
                                                                       "dataset_mapping")
    if getattr(data_args, "train_turns", "all") == "last":
        problems += [f"{source.label} has dataset_format {source.dataset_format!r}: train_turns: last picks among the "
                     "assistant turns of chat conversations; give this source as chat, or set train_turns: all"
                     for source in _all_sources(data_args) if not FORMATS[source.dataset_format].chat]
    if problems:
        raise RecipeError("; ".join(problems))


def _all_sources(data_args) -> list[DatasetSource]:
    try:
        return training_sources(data_args) + eval_sources(data_args)
    except RecipeError:
        return []  # already reported


def _vision_needs(data_args, key: str) -> list[str]:
    """What an image source needs from the recipe and does not have (each a problem with its fix)."""
    needs = []
    if not data_args.pack_blocks:
        needs.append("image rows train through the image block stream: set pack_blocks: true")
    if is_streamed(data_args):
        needs.append("image rows are read map-style (their files checked up front): set streaming and "
                     "dataset_streaming false")
    if key == "eval_datasets" and not has_images(data_args):
        needs.append("the run trains on no images, so its eval has no image processing: evaluate image rows in a "
                     "run that trains on image rows, or give eval rows without images")
    return needs


def has_images(data_args) -> bool:
    """Whether any training source of the recipe is an image source (the run then packs image blocks)."""
    return any(FORMATS[source.dataset_format].vision for source in training_sources(data_args))


# ── Shares ──────────────────────────────────────────────────────────────────────────────────────

def mixture_rows(sizes: list[int], fractions: list[float | None], strategy: str) -> list[int]:
    """Rows of each source in the mixture (see the module docstring). No fractions: every source whole."""
    if any(fraction is None for fraction in fractions):
        return list(sizes)
    weights = [fraction / sum(fractions) for fraction in fractions]
    limits = [size / weight for size, weight in zip(sizes, weights)]
    total = min(limits) if strategy == "first_exhausted" else max(limits)
    return [round(weight * total) for weight in weights]


def draw_rows(dataset: Dataset, rows: int, seed: int) -> Dataset:
    """`rows` rows of `dataset`: whole copies while it has too few, then a seeded sample of the rest."""
    copies, rest = divmod(rows, len(dataset)) if len(dataset) else (0, 0)
    sample = dataset.shuffle(seed=seed).select(range(rest))
    return concatenate_datasets([dataset] * copies + [sample]) if copies else sample


def token_counts(dataset: Dataset) -> tuple[int, int]:
    """(tokens, supervised tokens) of `input_ids` + `labels` rows. Supervised: the tokens the causal-LM
    loss is taken over, so a label on a row's first token (nothing predicts it) does not count."""
    tokens = supervised = 0
    if len(dataset) == 0:  # every row dropped: `datasets` keeps no column either (the report refuses it)
        return tokens, supervised
    for batch in dataset.select_columns(["labels"]).iter(batch_size=10_000):
        for labels in batch["labels"]:
            tokens += len(labels)
            supervised += len(labels) - 1 - labels[1:].count(IGNORE_INDEX) if labels else 0
    return tokens, supervised


# ── Building ────────────────────────────────────────────────────────────────────────────────────

@dataclass
class SourceData:
    """What the sources give a run: training rows (`input_ids` + `labels`, or the conversations a
    packed stream reads), eval rows (tokenized, or packed blocks), and the per-source report."""

    train: Dataset | IterableDataset
    eval: Dataset | None
    report: MixtureReport
    raw_train: list[tuple[Dataset | IterableDataset, str]]  # each source's raw rows (image rows: checked), format
    raw_eval: list[tuple[Dataset, str]]  # the same for the eval rows
    # packed eval conversations left out, by reason (eval_blocks): ANSWER_PAST_BLOCK or the masker's drop reason
    eval_left_out: dict[str, int] = field(default_factory=dict)
    # eval_datasets rows that break their format, by reason (dropped as read, as a training source's are)
    eval_dropped: dict[str, int] = field(default_factory=dict)


def _load(source: DatasetSource, key: str, streaming: bool, max_rows: int | None = None, mark_bad_rows: bool = False
          ) -> tuple[Dataset | IterableDataset, DataReport]:
    rows, report = load_checked_dataset(source.as_data_args(key, streaming, max_rows), mark_bad_rows=mark_bad_rows)
    report.source = source.label
    return rows, report


def build_source_data(data_args, tokenization: Tokenization, tokenizer, seed: int, block_length: int | None = None
                      ) -> SourceData:
    """Train and eval rows from the recipe's sources, with the per-source report. `block_length`: the
    packed block size when the run packs (`pack_blocks`); the training rows then stay conversations."""
    streaming = is_streamed(data_args)
    packs = data_args.pack_blocks
    marked = packs and streaming  # bad streamed rows stay in the stream, flagged, for its readers to count
    turns = getattr(data_args, "train_turns", "all")
    report = MixtureReport(streamed=streaming, packed=packs,
                           packing_window=None if not packs or data_args.split_examples else data_args.packing_window)
    train_parts, eval_parts, raw_train = [], [], []
    for index, source in enumerate(training_sources(data_args)):
        fmt = FORMATS[source.dataset_format]
        rows, checked = _load(source, "datasets" if data_args.datasets else "dataset_name", streaming,
                              None if data_args.datasets else data_args.max_train_samples, marked)
        entry = SourceReport(checked=checked, fraction=source.fraction)
        report.sources.append(entry)
        if data_args.test_split_size:
            rows, held_out = split_held_out(rows, data_args.test_split_size)
            entry.eval_rows = len(held_out)
            if len(held_out) == 0:  # a file of mostly bad rows: those are the fix, not test_split_size
                checked.enforce(data_args.max_dropped_share)
                raise RecipeError(f"test_split_size={data_args.test_split_size} holds out no row of {source.label}: "
                                  "raise test_split_size, or give eval_datasets.")
            eval_parts.append((source, _eval_rows(fmt.rows_to_train(held_out, turns), source)))
        rows = fmt.rows_to_train(rows, turns)  # after the split: the same rows are held out whatever shape they train in
        good_rows = without_marked_rows(rows) if marked else rows  # as the format's own checks read them
        if fmt.vision:  # image files checked (drops counted) and stored as records, relative paths resolved
            rows = with_images_checked(rows, source, checked)
        # The sample prompts' rows: image rows as checked, so that a prompt's images are found and readable
        raw_train.append((rows if fmt.vision else good_rows, source.dataset_format))
        if packs:  # the packed stream reads and tokenizes the conversations
            fmt.check_trainable(good_rows, tokenizer, tokenization)
            if streaming:
                rows = rows.map(functools.partial(_from_source, index=index))
        else:
            rows = fmt.to_tokens(rows, tokenizer, tokenization, checked)
            if streaming:  # cut as it is read: a row left without a target is dropped and counted there
                rows = rows.filter(functools.partial(_has_target, source=checked.stream_key))
        train_parts.append(rows)
    eval_dropped = Counter()
    for source in eval_sources(data_args):
        # eval data is finite: read whole, never streamed
        rows, checked = _load(source, "eval_datasets", streaming=False)
        eval_dropped += checked.dropped
        eval_parts.append((source, _eval_rows(FORMATS[source.dataset_format].rows_to_train(rows, turns), source)))
    entries = report.sources
    if streaming:
        columns = ["messages", SOURCE_FIELD, *([ROW_PROBLEM] if marked else [])] if packs else ["input_ids", "labels"]
        train = _interleaved(train_parts, columns, [s.fraction for s in entries], data_args.mixture_strategy, seed)
    else:
        if packs:
            train_parts = [part.add_column(SOURCE_FIELD, [index] * len(part))
                           for index, part in enumerate(with_aligned_messages(train_parts))]
        counts = mixture_rows([len(part) for part in train_parts], [s.fraction for s in entries],
                              data_args.mixture_strategy)
        drawn = [draw_rows(part, count, seed + index) for index, (part, count) in enumerate(zip(train_parts, counts))]
        for entry, part, count, rows in zip(entries, train_parts, counts, drawn):
            entry.available_rows, entry.mixture_rows = len(part), count
            if not packs:
                entry.tokens, entry.supervised_tokens = token_counts(rows)
        train = concatenate_datasets(drawn).shuffle(seed=seed) if len(drawn) > 1 else drawn[0]
    eval_data, eval_left_out = _eval_dataset(eval_parts, packs, tokenization, tokenizer, block_length,
                                             images=has_images(data_args))
    return SourceData(train, eval_data, report, raw_train,
                      [(rows, source.dataset_format) for source, rows in eval_parts], eval_left_out,
                      dict(eval_dropped))


def with_aligned_messages(parts: list[Dataset]) -> list[Dataset]:
    """Sources' `messages` cast to one Arrow type, the union of their message fields (a reasoning
    source adds `thinking`), so that `datasets` can concatenate them. When a source has images, every
    source keeps an `images` column (text-only ones: none per row)."""
    with_images = any(IMAGES_FIELD in part.column_names for part in parts)
    if with_images:
        parts = [part if IMAGES_FIELD in part.column_names else
                 part.add_column(IMAGES_FIELD, [[] for _ in range(len(part))]) for part in parts]
    parts = [part.select_columns(["messages", *([IMAGES_FIELD] if with_images else [])]) for part in parts]
    fields: dict[str, Any] = {}
    for part in parts:
        for key, value in part.features["messages"].feature.items():
            if fields.get(key, Value("null")) == Value("null"):
                fields[key] = value
    features = Features({"messages": List(fields), **({IMAGES_FIELD: IMAGE_RECORDS} if with_images else {})})
    return [part if part.features == features else part.cast(features) for part in parts]


def with_images_checked(rows: Dataset, source: DatasetSource, report: DataReport) -> Dataset:
    """An image source's rows as flat conversations + image records; rows whose images cannot be read are dropped
    into `report` (paths relative to a local data file are read from its folder)."""
    from sft_recipes.data.vision import check_images

    path = Path(source.path)
    kept, _ = check_images(rows, path.parent if path.is_file() else None, report)
    if not kept:
        report.enforce(0.0)  # raises: no row of the source is left
    return Dataset.from_list(kept).cast_column(IMAGES_FIELD, IMAGE_RECORDS)


def _encode_messages(row: dict[str, Any]) -> dict[str, str]:
    return {"messages_json": json.dumps(row["messages"], default=str, ensure_ascii=False)}


def _decode_messages(row: dict[str, str]) -> dict[str, Any]:
    return {"messages": json.loads(row["messages_json"])}


def _has_target(row: dict[str, Any], source: str) -> bool:
    if any(label != IGNORE_INDEX for label in row["labels"][1:]):
        return True
    count_stream_drop(source, NO_TRAINABLE_TOKENS)
    return False


def _from_source(row: dict[str, Any], index: int) -> dict[str, int]:
    return {SOURCE_FIELD: index}


def _interleaved(streams: list[IterableDataset], columns: list[str], fractions: list[float | None], strategy: str,
                 seed: int) -> IterableDataset:
    """One seeded stream of `columns` drawing from every source with the normalised fractions as probabilities.

    A stream's types are not known before it is read, and `datasets` refuses to interleave sources
    whose messages differ in their fields (a reasoning source's `thinking`): conversations travel
    through the interleave as JSON text and are read back after it."""
    streams = [stream.select_columns(columns) for stream in streams]
    if len(streams) == 1:
        return streams[0]
    conversations = "messages" in columns
    if conversations:
        streams = [stream.map(_encode_messages, remove_columns=["messages"]) for stream in streams]
    probabilities = None if None in fractions else [fraction / sum(fractions) for fraction in fractions]
    mixed = interleave_datasets(streams, probabilities=probabilities, seed=seed, stopping_strategy=strategy)
    return mixed.map(_decode_messages, remove_columns=["messages_json"]) if conversations else mixed


ANSWER_PAST_BLOCK = "answer_past_max_length"  # an eval conversation's answer starts after its first block_length tokens


def eval_blocks(rows: Dataset, tokenizer, block_length: int, template_kwargs: dict[str, Any] | None = None
                ) -> tuple[Dataset, dict[str, int]]:
    """Eval conversations packed whole (never split, so each keeps its full context) into
    block-diagonal blocks by the training packer, and how many were left out, by reason. A conversation
    longer than `block_length` keeps its first tokens, as an unpacked eval row is truncated; one with no
    supervised token among them (a long tool schema before the answer: ANSWER_PAST_BLOCK) would add nothing
    to the eval loss, and is left out, as is one the masker drops (its drop reason, as the data report
    names it: no_assistant_turn, ...)."""
    columns = tokenize_conversations(tokenizer, rows["messages"], None, **(template_kwargs or {}))
    examples, left_out = [], Counter()
    for ids, mask, reason in zip(columns["input_ids"], columns["assistant_masks"], columns["drop_reason"]):
        if reason == KEPT and any(mask[:block_length]):
            examples.append({"input_ids": ids, "labels": [token if keep else IGNORE_INDEX
                                                          for token, keep in zip(ids, mask)]})
        else:
            left_out[reason or ANSWER_PAST_BLOCK] += 1
    blocks = list(fill_blocks(examples, block_length, split_examples=False))
    # None left: still the block columns (`Dataset.from_list([])` has none), so the run describes and refuses it
    packed = Dataset.from_list(blocks) if blocks else Dataset.from_dict({"input_ids": [], "labels": [], "seq_lengths": []})
    return packed, dict(left_out)


def _eval_rows(rows: Dataset, source: DatasetSource) -> Dataset:
    """Eval rows in the shape they are evaluated in: an image source's as checked (flat conversations, image
    records; unreadable images dropped into a report of their own, not the training one)."""
    if not FORMATS[source.dataset_format].vision:
        return rows
    return with_images_checked(rows, source, DataReport(source=f"{source.label} (eval)"))


def _eval_dataset(parts: list[tuple[DatasetSource, Dataset]], packs: bool, tokenization: Tokenization, tokenizer,
                  block_length: int | None, images: bool = False) -> tuple[Dataset | None, dict[str, int]]:
    """The eval rows as the run evaluates them, and how many packed ones were left out (`eval_blocks`); an
    image run's stay conversations with their images, which the run packs with the model's image processor
    (`data/vision_eval.py`)."""
    if not parts:
        return None, {}
    if packs and images:
        return concatenate_datasets(with_aligned_messages([rows for _, rows in parts])), {}
    if packs:
        messages = concatenate_datasets(with_aligned_messages([rows for _, rows in parts]))
        return eval_blocks(messages, tokenizer, block_length, tokenization.template_kwargs)
    # Eval rows are not training rows: their drops go to a report of their own, not to max_dropped_share.
    return concatenate_datasets([FORMATS[source.dataset_format].to_tokens(rows, tokenizer, tokenization,
                                                                          DataReport(source=source.label))
                                 for source, rows in parts]), {}


def describe_eval(dataset: Dataset | None, counts: tuple[int, int] = (0, 0), left_out: dict[str, int] | None = None,
                  block_length: int | None = None, dropped: dict[str, int] | None = None) -> str:
    """The `[data] eval:` line; `counts`: the set's (tokens, supervised tokens), token_counts(dataset); `dropped`:
    the eval_datasets rows dropped as read, by reason (SourceData.eval_dropped)."""
    if dataset is None:
        return "[data] eval: none (set test_split_size or eval_datasets)"
    tokens, supervised = counts
    if isinstance(dataset, VisionEvalBlocks):  # an image run's: the blocks' plan, their pixels made when read
        what = f"{dataset.conversations:,} conversations packed whole into {len(dataset):,} blocks"
    elif "seq_lengths" in dataset.column_names:
        what = f"{sum(map(len, dataset['seq_lengths'])):,} conversations packed whole into {len(dataset):,} blocks"
    else:
        what = f"{len(dataset):,} rows"
    if left_out:
        what += f" ({sum(left_out.values()):,} left out: {_left_out_reasons(left_out, block_length)})"
    line = f"[data] eval: {what}, {tokens:,} tokens, {supervised:,} supervised"
    if dropped:
        reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(dropped.items()))
        line += f"; {sum(dropped.values()):,} rows of eval_datasets dropped as read ({reasons})"
    return line


def _left_out_reasons(left_out: dict[str, int], block_length: int | None) -> str:
    said = {ANSWER_PAST_BLOCK: f"without an answer in their first {block_length:,} tokens",
            LONGER_THAN_BLOCK: f"longer than a block of {block_length:,} tokens (images are never cut)"}
    return ", ".join(f"{count:,} {said[reason]}" if reason in said else f"{reason} {count:,}"
                     for reason, count in sorted(left_out.items()))


def refuse_eval_without_answers(dataset: Dataset | None, supervised: int, left_out: dict[str, int],
                                block_length: int | None) -> None:
    """An eval set with no supervised token (`supervised`: token_counts(dataset)[1]) has no eval loss (0 / 0:
    `nan` at every eval); refused before training, on every rank, with what to change."""
    if dataset is None or supervised:
        return
    cause = (f"none of its {sum(left_out.values()):,} conversations has an answer to score "
             f"({_left_out_reasons(left_out, block_length)}; max_length: a packed eval conversation is evaluated "
             "whole from its start, never split)"
             if left_out else f"no eval row keeps a supervised token within max_length={block_length}")
    raise RecipeError(f"The eval set has nothing to score: {cause}. Raise max_length, give eval_datasets with "
                      "shorter conversations, or evaluate nothing (test_split_size: null and eval_strategy: no).")
