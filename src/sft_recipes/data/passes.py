"""Several passes (epochs) over packed data, each in a new order, with the step count known before training.

A packed stream's readers (rank x dataloader worker, `blocks.reader_index`) each read their own shard; pass 0
reads it in the data's order, every later pass in an order drawn from the seed, the pass and the reader
(`blocks.pass_order`). A pass ends as one pass always has: in the step where the first reader runs out, so no
rank waits in a collective; the other readers' unread blocks are left out of that pass.

Where that step falls depends on every reader's blocks, hence on the tokens of every conversation: before
training, each rank reads and tokenizes its own readers' shards once (the same code the stream runs), keeps each
row's length (or that it was dropped), and packs those lengths in every pass's order to count the pass's blocks
(`count_blocks`). The first micro-batch a reader cannot fill is known from that (`first_short_micro_batch`), the
ranks agree on the earliest (one all-reduce per pass), and the pass lasts until the step holding it
(`steps_in_pass`). Every pass then trains the same number of steps, the fewest any counted pass allows (the
Trainer's epoch loop takes one length), so the learning-rate schedule, the progress bar, the ETA and a resume
mid-pass or at a pass boundary all see the true count: `num_train_epochs` passes (`max_steps: -1`), or as many
passes as `max_steps` needs, as the Trainer does with map-style data.

Map-style data is always counted (it is in memory). A stream is counted only when the run asks for passes
(`max_steps: -1`): with `max_steps` it is read once, and a run it ends early says so (`StopWhenAnyRankExhausted`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sft_recipes.data.blocks import RankLocalBlockStream, StreamStats, _pack_whole_examples, pass_order
from sft_recipes.errors import RecipeError
from sft_recipes.fault.agreement import agree_min


def count_blocks(lengths: Iterable[int], max_length: int, split_examples: bool, window: int) -> int:
    """How many blocks `fill_blocks` makes of examples of these lengths, in this order."""
    if split_examples:  # every block full but the last
        return -(-sum(lengths) // max_length)
    examples = ({"input_ids": range(length), "labels": range(length)} for length in lengths)
    return sum(1 for _ in _pack_whole_examples(examples, max_length, window, join=len))


def first_short_micro_batch(blocks: int, reader: int, readers: int, batch_size: int) -> int:
    """The global micro-batch number (`blocks.reader_index`'s n) of the first micro-batch this reader cannot fill:
    its (blocks // batch_size)-th, which global micro-batch n = that x readers + reader is."""
    return blocks // batch_size * readers + reader


def steps_in_pass(first_short: int, micro_batches_per_step: int) -> int:
    """Optimizer steps of a pass whose earliest short micro-batch is `first_short`: through the step holding it."""
    return -(-first_short // micro_batches_per_step)


def reader_row_lengths(stream: RankLocalBlockStream, worker: tuple[int, int]) -> list[int | None]:
    """Each row of one reader's shard, in the data's order: its example's length, or None when it is dropped."""
    pending = StreamStats()
    lengths: list[int | None] = []
    for example in stream._tokenized(pending, stream.reader_rows(0, worker)):
        # the rows read since the last example were dropped (counted in `pending`), this one kept
        lengths += [None] * (pending.conversations - len(lengths) - 1) + [len(example["input_ids"])]
    return lengths + [None] * (pending.conversations - len(lengths))


@dataclass(frozen=True)
class PackedPasses:
    steps_per_pass: int
    passes: float  # num_train_epochs, or max_steps / steps_per_pass
    max_steps: int
    counted_passes: int
    count_seconds: float

    def describe(self) -> str:
        return (f"[data] packed data: {self.steps_per_pass} step(s) per pass (counted before training over "
                f"{self.counted_passes} pass order(s) in {self.count_seconds:.1f}s): {self.max_steps} steps = "
                f"{self.passes:g} pass(es), each pass in a new order from the seed")


def plan_passes(stream: RankLocalBlockStream, batch_size: int, accumulation: int, workers: int, max_steps: int,
                num_train_epochs: float, timeout_seconds: int) -> PackedPasses:
    """Count the packed data's passes on every rank together (see the module docstring); collective."""
    started = time.perf_counter()
    workers = max(1, workers)
    rows = {stream.reader((worker, workers))[0]: reader_row_lengths(stream, (worker, workers))
            for worker in range(workers)}
    readers = stream.world_size * workers
    micro_batches_per_step = stream.world_size * accumulation
    steps, epoch = None, 0
    while True:
        first_short = min(
            first_short_micro_batch(count_blocks((length for length in pass_order(lengths, stream.seed, epoch, reader)
                                                  if length is not None), stream.max_length, stream.split_examples,
                                                 stream.packing_window), reader, readers, batch_size)
            for reader, lengths in rows.items())
        pass_steps = steps_in_pass(agree_min(first_short, timeout_seconds), micro_batches_per_step)
        steps = pass_steps if steps is None else min(steps, pass_steps)
        if steps == 0:
            raise RecipeError(
                f"the packed data fills no optimizer step in pass {epoch + 1}: a reader has fewer than "
                f"per_device_train_batch_size ({batch_size}) blocks of {stream.max_length} tokens (there are {readers} "
                "readers: processes x max(1, dataloader_num_workers), each packing its own share). Use more data, a "
                "smaller max_length or per_device_train_batch_size, or fewer processes or dataloader workers.")
        epoch += 1
        wanted = math.ceil(num_train_epochs) if max_steps < 0 else math.ceil(max_steps / steps)
        if epoch >= wanted:
            break
    total = max_steps if max_steps > 0 else math.ceil(num_train_epochs * steps)
    stream.micro_batches_per_pass = steps * accumulation
    return PackedPasses(steps_per_pass=steps, passes=total / steps, max_steps=total, counted_passes=epoch,
                        count_seconds=time.perf_counter() - started)
