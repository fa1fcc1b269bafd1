"""Conversations -> fixed-size packed blocks, streamed per rank, with a shared stopping point.

Every optimizer step sees the same token budget: each item is one block of exactly `max_length`
slots (the reference recipe's 32768-token block), built end to end from one reader's own shard of
the data and tokenized only there (no rank tokenizes the whole dataset); a reader is one
(rank, dataloader worker) pair. The per-token boundary signals are added later by
`BlockDiagonalCollator` from each block's `seq_lengths`.

Readers run out of data at different times. One that has run out keeps yielding fully masked
blocks flagged `stream_exhausted`, so its rank never leaves a collective early;
`StopWhenAnyRankExhausted` all-reduces the flag at every optimizer step and stops every rank on
the same step (as the reference recipe does with its `ran_out` all-reduce). Finite data whose passes
were counted before training (`data/passes.py`) instead ends each pass on its counted step, and the
stream reads its shard again, in the next pass's order (`pass_order`).

Conversations dropped on the way (bad streamed rows, flagged while reading; conversations the
masking cannot train on) are counted by the reader that meets them and travel with its blocks
(`StreamStats`); the same all-reduce sums them over every rank, so `max_dropped_share` is
enforced on every rank together (`DataReport.count_stream`). A mixture's conversations carry their
source's index (`SOURCE_FIELD`): conversations, tokens, supervised tokens and drops are also
counted per source, for the per-source report and limits.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node
from torch.utils.data import IterableDataset as TorchIterableDataset
from torch.utils.data import get_worker_info
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from sft_recipes.data.masking import DROP_REASONS as MASKING_DROP_REASONS
from sft_recipes.data.masking import KEPT, tokenize_conversations
from sft_recipes.data.rows import ROW_DROP_REASONS, ROW_PROBLEM
from sft_recipes.errors import RecipeError

IGNORE_INDEX = -100
TOKENIZE_BATCH = 256
PACKING_WINDOW = 1024  # examples a whole-example block may choose from (DataArguments.packing_window)
# The reasons summed over ranks one by one (an all-reduce needs the same slots on every rank);
# any other is summed under OTHER_REASONS.
DROP_REASONS = tuple(dict.fromkeys((*ROW_DROP_REASONS, *MASKING_DROP_REASONS)))
OTHER_REASONS = "other_reasons"
SOURCE_FIELD = "source_index"  # which source of the recipe's `datasets` a conversation came from (0 without)


SHUFFLE_BUFFER = 10_000  # rows a pass after the first is shuffled over: a reader's whole shard when it is smaller


def pass_order(rows: Iterable[Any], seed: int, epoch: int, reader: int, buffer: int = SHUFFLE_BUFFER) -> Iterator[Any]:
    """One reader's rows in the order of pass `epoch`: the data's order in pass 0, then an order drawn from the seed,
    the pass and the reader (a shuffle over `buffer` waiting rows, the whole shard when it holds fewer).

    The draws depend on the rows' positions only, never on their content, so the same call orders a reader's rows
    and the list of their lengths alike (`data.passes` counts a pass's blocks from those lengths).
    """
    if epoch == 0:
        yield from rows
        return
    rng = random.Random(f"{seed}:{epoch}:{reader}")  # a str seed is hashed with SHA-512: the same in every process
    waiting: list[Any] = []
    for row in rows:
        if len(waiting) < buffer:
            waiting.append(row)
            continue
        slot = rng.randrange(buffer)
        yield waiting[slot]
        waiting[slot] = row
    rng.shuffle(waiting)
    yield from waiting


def unbatched(batches: Iterable[dict[str, list[Any]]]) -> Iterator[dict[str, Any]]:
    for batch in batches:
        columns = list(batch)
        yield from (dict(zip(columns, values)) for values in zip(*batch.values()))


def batched(rows: Iterable[dict[str, Any]], size: int) -> Iterator[dict[str, list[Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield {column: [r[column] for r in batch] for column in batch[0]}
            batch = []
    if batch:
        yield {column: [r[column] for r in batch] for column in batch[0]}


def fill_blocks(examples: Iterable[dict[str, list[int]]], max_length: int, split_examples: bool = True,
                window: int = PACKING_WINDOW) -> Iterator[dict[str, list[int]]]:
    """Fill blocks of `max_length` tokens from a stream of examples.

    Each example has `input_ids` and `labels`. A block is `input_ids`, `labels` and `seq_lengths`
    (its segments). With `split_examples` (the reference recipe) examples go end to end in arrival
    order and one that does not fit runs on into the next block: every block but the last is full.
    Without, examples stay whole (one longer than `max_length` keeps its first tokens) and are
    packed best-fit over a window (`_pack_whole_examples`). The last, partial block is yielded as
    is: the collator pads it.
    """
    if not split_examples:
        yield from _pack_whole_examples(examples, max_length, window)
        return
    ids: list[int] = []
    labels: list[int] = []
    lengths: list[int] = []
    for example in examples:
        example_ids, example_labels = example["input_ids"], example["labels"]
        while example_ids:
            take = min(len(example_ids), max_length - len(ids))
            ids += example_ids[:take]
            labels += example_labels[:take]
            lengths.append(take)
            example_ids, example_labels = example_ids[take:], example_labels[take:]
            if len(ids) == max_length:
                yield {"input_ids": ids, "labels": labels, "seq_lengths": lengths}
                ids, labels, lengths = [], [], []
    if ids:
        yield {"input_ids": ids, "labels": labels, "seq_lengths": lengths}


def _pack_whole_examples(examples: Iterable[dict[str, Any]], max_length: int, window: int,
                         join: Callable[[list[dict[str, Any]]], Any] | None = None) -> Iterator[dict[str, Any]]:
    """Each block starts with the oldest waiting example, then takes the longest waiting ones that still fit.

    Up to `window` examples wait; `window=1` is plain arrival order. On UltraChat-like data at 8192
    tokens this fills ~99% of the slots against ~88% in arrival order, about as full as TRL's
    best-fit-decreasing over the whole dataset (benchmarks/README.md), yet it streams, and an example
    is never trained more than about `window` examples away from its place in the data. An example's
    other fields (an image example's pixels and positions) travel with it (`join_examples`; `join` replaces it:
    counting blocks needs only how many there are).
    """
    if window < 1:
        raise ValueError(f"packing_window must be at least 1 (1 packs in arrival order), got {window}.")
    arrivals = iter(examples)
    waiting: dict[int, dict[str, Any]] = {}
    by_length: list[tuple[int, int]] = []  # sorted (length, -arrival): the longest fitting, oldest first
    order: deque[int] = deque()  # arrival numbers; ones already packed are skipped lazily
    arrived = 0

    def refill() -> None:
        nonlocal arrived
        while len(waiting) < window:
            example = next(arrivals, None)
            if example is None:
                return
            if len(example["input_ids"]) > max_length:
                example = {**example, "input_ids": example["input_ids"][:max_length],
                           "labels": example["labels"][:max_length]}
            if example["input_ids"]:
                waiting[arrived] = example
                bisect.insort(by_length, (len(example["input_ids"]), -arrived))
                order.append(arrived)
                arrived += 1

    refill()
    while waiting:
        while order[0] not in waiting:
            order.popleft()
        oldest = order.popleft()
        members = [waiting.pop(oldest)]
        by_length.remove((len(members[0]["input_ids"]), -oldest))
        refill()
        room = max_length - len(members[0]["input_ids"])
        while room and by_length:
            best = bisect.bisect_right(by_length, (room, 1)) - 1  # (room, 1) sorts after every (room, -arrival)
            if best < 0:
                break
            length, negative_arrival = by_length.pop(best)
            members.append(waiting.pop(-negative_arrival))
            refill()
            room -= length
        yield (join or join_examples)(members)


def join_examples(members: list[dict[str, Any]]) -> dict[str, Any]:
    """One block of whole examples, in order: tokens, labels, segment lengths, and any other per-example field
    (`EXAMPLE_TENSORS`: tensors joined along the axis of their examples)."""
    block = {"input_ids": [token for member in members for token in member["input_ids"]],
             "labels": [label for member in members for label in member["labels"]],
             "seq_lengths": [len(member["input_ids"]) for member in members]}
    for key, axis in EXAMPLE_TENSORS.items():
        if key in members[0]:
            block[key] = torch.cat([member[key] for member in members], dim=axis)
    return block


# Per-example tensors that image examples carry into their block (see data/vision.py): patches, grids, t/h/w
# positions, and how many images each example has; and the eval rows a block is made of (data/vision_eval.py).
EXAMPLE_TENSORS = {"pixel_values": 0, "image_grid_thw": 0, "mrope_positions": 1, "num_images": 0, "row_index": 0}


@dataclass
class SourceCounts:
    """What a block stream read of one source: conversations (kept or dropped), the kept ones' tokens and
    supervised tokens (the causal-LM targets: a label on a conversation's first token does not count), drops."""

    conversations: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def add(self, other: SourceCounts) -> None:
        self.conversations += other.conversations
        self.tokens += other.tokens
        self.supervised_tokens += other.supervised_tokens
        for reason, count in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + count


@dataclass
class StreamStats:
    """Counts of one stretch of a block stream; they add up, so workers' counts can travel with their blocks."""

    conversations: int = 0
    blocks: int = 0
    real_tokens: int = 0
    token_slots: int = 0
    supervised_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    squared_segment_lengths: int = 0  # sum of L^2 over the real segments: the attention term of the FLOPs
    sources: dict[int, SourceCounts] = field(default_factory=dict)  # the conversations' counts per source

    def add(self, other: StreamStats) -> StreamStats:
        self.conversations += other.conversations
        self.blocks += other.blocks
        self.real_tokens += other.real_tokens
        self.token_slots += other.token_slots
        self.supervised_tokens += other.supervised_tokens
        self.squared_segment_lengths += other.squared_segment_lengths
        for reason, count in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + count
        for source, counts in other.sources.items():
            self.sources.setdefault(source, SourceCounts()).add(counts)
        return self

    def drop(self, reason: str, source: int = 0) -> None:
        """One conversation of `source` read and dropped."""
        self.conversations += 1
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        counts = self.sources.setdefault(source, SourceCounts())
        counts.conversations += 1
        counts.dropped[reason] = counts.dropped.get(reason, 0) + 1

    def keep(self, labels: list[int], source: int = 0) -> None:
        """One conversation of `source` read and kept, with its labels."""
        self.conversations += 1
        counts = self.sources.setdefault(source, SourceCounts())
        counts.conversations += 1
        counts.tokens += len(labels)
        counts.supervised_tokens += len(labels) - 1 - labels[1:].count(IGNORE_INDEX) if labels else 0

    def take_read(self) -> StreamStats:
        """The conversations counted so far (total, drops, per source), handed over and reset here."""
        read = StreamStats(conversations=self.conversations, dropped=self.dropped, sources=self.sources)
        self.conversations, self.dropped, self.sources = 0, {}, {}
        return read

    @property
    def packing_efficiency(self) -> float:
        return self.real_tokens / self.token_slots if self.token_slots else 0.0

    def describe(self) -> str:
        dropped = ", ".join(f"{count} {reason}" for reason, count in sorted(self.dropped.items())) or "none"
        return (f"{self.conversations:,} conversations read (dropped: {dropped}), {self.blocks:,} blocks, "
                f"packing efficiency {self.packing_efficiency:.2%}, {self.supervised_tokens:,} supervised tokens in those "
                "blocks (the data report counts each conversation read whole, also what no trained block holds)")


def reader_index(rank: int, ranks: int, worker: int) -> int:
    """Which of the `ranks x workers` readers (and shards) the dataloader worker `worker` of `rank` is.

    Rank r's i-th micro-batch comes from its worker i % workers (torch's DataLoader takes the
    workers' batches in turn), and every optimizer step takes the next `accumulation` micro-batches
    of every rank. Numbering global micro-batches n = i * ranks + r, step s takes n in
    [s * G/b, (s + 1) * G/b) on any layout with the global batch G of b-block micro-batches; the
    reader `worker * ranks + rank` is then n % readers and serves it as its (n // readers)-th. So
    which block of which reader a step trains on depends on the reader count only: 2 ranks x 2
    workers, 1 x 4 and 4 x 1 train the same blocks at every step, and resume each other exactly.
    (`rank * workers + worker` read the same shards in another order on each layout.)
    """
    return worker * ranks + rank


class RankLocalBlockStream(TorchIterableDataset):
    """This rank's shard of a conversation dataset as an endless stream of packed blocks.

    Each (rank, dataloader worker) pair is one reader of `world_size x num_workers`, with its own
    disjoint shard: whole files when the dataset's shard count divides evenly, else every n-th
    conversation. Only that reader tokenizes its conversations. After the shard ends it yields
    `exhausted_block()` forever (see the module docstring). Every block carries the `StreamStats`
    of what its reader consumed since its previous block (`stream_stats`), so the counts reach the
    training process from worker processes too. `epoch` is the pass the next iteration reads (in
    `pass_order`); `micro_batches_per_pass` is this rank's count per pass when the passes were counted
    before training (`data.passes`), None when the stream is read once and ends where it ends.
    """

    def __init__(self, dataset: Dataset | IterableDataset, tokenizer, max_length: int, rank: int, world_size: int,
                 split_examples: bool = True, template_kwargs: dict[str, Any] | None = None,
                 messages_field: str = "messages", packing_window: int = PACKING_WINDOW, num_sources: int = 1,
                 seed: int = 0):
        if isinstance(dataset, Dataset):
            dataset = dataset.to_iterable_dataset(num_shards=max(1, min(len(dataset), 64)))
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.split_examples = split_examples
        self.packing_window = packing_window
        self.template_kwargs = template_kwargs or {}
        self.messages_field = messages_field
        self.num_sources = num_sources  # conversations carry SOURCE_FIELD when the recipe has several sources
        self.pad_token_id = tokenizer.pad_token_id
        self.seed = seed
        self.epoch = 0  # set by the trainer before each pass; workers take it when they start (each pass)
        self.micro_batches_per_pass: int | None = None

    def reader(self, worker: tuple[int, int] | None = None) -> tuple[int, int]:
        """(this rank's reader of dataloader worker `worker`, the number of readers); `worker` is (index, count),
        by default the worker this runs in."""
        if worker is None:
            info = get_worker_info()
            worker = (info.id, info.num_workers) if info is not None else (0, 1)
        return reader_index(self.rank, self.world_size, worker[0]), self.world_size * worker[1]

    def reader_shard(self, worker: tuple[int, int] | None = None) -> IterableDataset:
        """The conversations of that reader."""
        reader, readers = self.reader(worker)
        return split_dataset_by_node(self.dataset, rank=reader, world_size=readers)

    def reader_rows(self, epoch: int, worker: tuple[int, int] | None = None) -> Iterator[dict[str, list[Any]]]:
        """That reader's rows, in batches, in the order of pass `epoch`."""
        # `.iter()` (unlike `__iter__`) does not split the shard again among dataloader workers.
        batches = self.reader_shard(worker).iter(batch_size=TOKENIZE_BATCH)
        if epoch == 0:
            return batches
        return batched(pass_order(unbatched(batches), self.seed, epoch, self.reader(worker)[0]), TOKENIZE_BATCH)

    def _tokenized(self, pending: StreamStats, batches: Iterable[dict[str, list[Any]]]
                   ) -> Iterator[dict[str, list[int]]]:
        for batch in batches:
            rows = len(batch[self.messages_field])
            problems = batch.get(ROW_PROBLEM) or [None] * rows  # flagged while reading
            sources = batch.get(SOURCE_FIELD) or [0] * rows
            good = [conversation for conversation, problem in zip(batch[self.messages_field], problems) if not problem]
            columns = tokenize_conversations(self.tokenizer, good, None, **self.template_kwargs) if good else {}
            tokenized = zip(columns.get("input_ids", ()), columns.get("assistant_masks", ()),
                            columns.get("drop_reason", ()))
            for problem, source in zip(problems, sources):  # in reading order: each drop travels with its block
                if problem:
                    pending.drop(problem, source)
                    continue
                ids, mask, reason = next(tokenized)
                if reason != KEPT:
                    pending.drop(reason, source)
                    continue
                labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask)]
                pending.keep(labels, source)
                yield {"input_ids": ids, "labels": labels}

    def exhausted_block(self) -> dict[str, Any]:
        return {"input_ids": [self.pad_token_id] * self.max_length, "labels": [IGNORE_INDEX] * self.max_length,
                "seq_lengths": [self.max_length], "stream_exhausted": 1}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        consumed = StreamStats()  # conversations read by the tokenizing generator, not yet reported
        rows = self.reader_rows(self.epoch)
        for block in fill_blocks(self._tokenized(consumed, rows), self.max_length, self.split_examples,
                                 self.packing_window):
            stats = consumed.take_read()
            stats.blocks, stats.real_tokens, stats.token_slots = 1, len(block["input_ids"]), self.max_length
            stats.supervised_tokens = len(block["labels"]) - block["labels"].count(IGNORE_INDEX)
            stats.squared_segment_lengths = sum(length * length for length in block["seq_lengths"])
            yield {**block, "stream_exhausted": 0, "stream_stats": stats}
        tail = self.exhausted_block()
        tail["stream_stats"] = consumed.take_read()
        yield tail
        while True:
            yield self.exhausted_block()


def collate_blocks(collator):
    """Wrap a BlockDiagonalCollator so the `stream_exhausted` flags travel as one tensor and the blocks'
    `stream_stats` as their sum (both popped by the trainer before the model sees the batch)."""

    def collate(blocks: list[dict[str, Any]]) -> dict[str, Any]:
        flags = [block.pop("stream_exhausted", 0) for block in blocks]
        stats = StreamStats()
        for block in blocks:
            stats.add(block.pop("stream_stats", StreamStats()))
        batch = collator(blocks)
        batch["stream_exhausted"] = torch.tensor(max(flags))
        batch["stream_stats"] = stats
        return batch

    return collate


SUMMED_COUNTERS = ("conversations", "blocks", "real_tokens", "token_slots", "supervised_tokens",
                   "squared_segment_lengths")


SOURCE_COUNTERS = ("conversations", "tokens", "supervised_tokens")


REASON_SLOTS = len(DROP_REASONS) + 1  # every known drop reason, then OTHER_REASONS
SOURCE_SLOTS = len(SOURCE_COUNTERS) + REASON_SLOTS


def _drop_slots(dropped: dict[str, int]) -> list[int]:
    other = sum(count for reason, count in dropped.items() if reason not in DROP_REASONS)
    return [dropped.get(reason, 0) for reason in DROP_REASONS] + [other]


def _drops_from_slots(slots: list[int]) -> dict[str, int]:
    return {reason: count for reason, count in zip((*DROP_REASONS, OTHER_REASONS), slots) if count}


def source_slots(counts: SourceCounts) -> list[int]:
    """`counts` as SOURCE_SLOTS numbers, the same slots on every rank (for an all-reduce)."""
    return [*(getattr(counts, name) for name in SOURCE_COUNTERS), *_drop_slots(counts.dropped)]


def source_counts_from_slots(slots: list[int]) -> SourceCounts:
    return SourceCounts(**dict(zip(SOURCE_COUNTERS, slots)), dropped=_drops_from_slots(slots[len(SOURCE_COUNTERS):]))


def summed_over_ranks(stats: StreamStats, exhausted: bool, device, num_sources: int = 1
                       ) -> tuple[StreamStats, bool]:
    """(every rank's counts summed, whether any rank has run out): one all-reduce.

    Every rank sends the same slots: the totals, then `num_sources` sources' counts and drops."""
    values = [float(exhausted), *(getattr(stats, name) for name in SUMMED_COUNTERS), *_drop_slots(stats.dropped)]
    for index in range(num_sources):
        values += source_slots(stats.sources.get(index, SourceCounts()))
    summed = torch.tensor(values, dtype=torch.float64, device=device)  # exact integers up to 2**53
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(summed)
    exhausted_ranks, *counts = (int(value) for value in summed.tolist())
    start = len(SUMMED_COUNTERS) + REASON_SLOTS
    total = StreamStats(**dict(zip(SUMMED_COUNTERS, counts)),
                        dropped=_drops_from_slots(counts[len(SUMMED_COUNTERS):start]))
    for index in range(num_sources):
        total.sources[index] = source_counts_from_slots(counts[start + index * SOURCE_SLOTS:][:SOURCE_SLOTS])
    return total, exhausted_ranks > 0


class StopWhenAnyRankExhausted(TrainerCallback, ExportableState):
    """All ranks stop on the first optimizer step after which any rank has run out of data.

    A stream that ends before any rank trained on a supervised token is an error on every rank (a
    dataset with nothing to learn), raised before the stopping step is saved or exported. After
    every step `total` holds every rank's counts summed, and `on_total(total, stream_ended)` sees
    them on every rank (the drop limit: a refusal it raises is raised on every rank together).

    With `passes_counted` (finite data counted before training, `data.passes`) a reader runs out only in
    the last step of a pass, which the Trainer's own epoch loop ends: nothing stops here. Otherwise the
    step where the stream ended is kept in the checkpoints' trainer_state.json (`data_ended_at_step`),
    so a later run resuming from them knows why there is nothing left to read.
    """

    def __init__(self, trained: StreamStats,
                 on_total: Callable[[StreamStats, bool], None] | None = None, num_sources: int = 1,
                 passes_counted: bool = False) -> None:
        self.exhausted = False
        self.trained = trained  # what this rank has trained on so far: the trainer adds each batch's counts
        self.on_total = on_total
        self.num_sources = num_sources  # the recipe's sources: the same on every rank
        self.passes_counted = passes_counted
        self.total = StreamStats()
        self.data_ended_at_step: int | None = None

    def state(self) -> dict[str, Any]:
        return {"args": {}, "attributes": {"data_ended_at_step": self.data_ended_at_step}}

    def on_train_begin(self, args, state, control, **kwargs):
        # A checkpoint written before this callback kept a state has no entry, and the Trainer's save indexes it.
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())

    def on_step_end(self, args, state, control, **kwargs):
        self.total, stream_ended = summed_over_ranks(self.trained, self.exhausted, args.device, self.num_sources)
        if self.on_total is not None:
            self.on_total(self.total, stream_ended)
        if self.passes_counted:
            self.exhausted = False  # the next pass reads its shard again
            return control
        if stream_ended:
            if self.total.supervised_tokens == 0:
                raise RecipeError(
                    "Refusing to go on: the packed stream ended before any rank trained on a supervised token, so "
                    f"the dataset has nothing to learn (this rank: {self.trained.describe()}). Streamed rows that "
                    "break the dataset_format rules are dropped as they are read: check dataset_name and "
                    "dataset_format, and look at the rows with `.venv/bin/python scripts/sft.py RECIPE --audit-data 5`."
                )
            self.data_ended_at_step = state.global_step
            control.should_training_stop = True
            control.should_save = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.data_ended_at_step is not None and self.data_ended_at_step < state.max_steps and \
                state.is_world_process_zero:
            print(data_ended_line(self.data_ended_at_step, state.max_steps), flush=True)


def data_ended_line(step: int, max_steps: int) -> str:
    """The one line a run whose stream ended before max_steps prints (and run_summary.json keeps)."""
    return (f"[data] the packed stream ended at step {step} of max_steps {max_steps}: one pass over the streamed data, "
            "the run ends here. A stream is read once; to train several passes pass --max_steps -1 "
            "--num_train_epochs N (the stream is then counted before training, every pass in a new order).")
