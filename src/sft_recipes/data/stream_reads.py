"""A stream read unpacked (TRL's pipeline): its rows and drops summed over every rank after every step.

`sources.StreamedRowCheck` counts in the process that iterates the stream: the training process
when `dataloader_num_workers` is 0, which the linter requires for a streamed unpacked dataset (a
worker's counts never reach the training process). How accelerate shares a stream among ranks
decides how the counts add up: with `dispatch_batches` rank 0 reads for everyone, and a stream of at
least world-size shards is split among the ranks (the sum over ranks counts each row once); any
other stream is read whole by every rank, each keeping its batches (`IterableDatasetShard`: the
largest count is the rows read). Counting starts when training does (earlier reads are peeks at the
first rows); rows the dataloader has read ahead count as read. `max_dropped_share` is then enforced
on the running share as for a packed stream (`DataReport.count_stream`), on every rank together.
"""

from __future__ import annotations

import torch
from accelerate.data_loader import IterableDatasetShard
from torch.distributed import ReduceOp
from transformers import TrainerCallback

from sft_recipes.data.blocks import SOURCE_SLOTS, SourceCounts, source_counts_from_slots, source_slots
from sft_recipes.data.report import DataReport
from sft_recipes.data.sources import ROWS_READ, forget_rows_read, rows_read_in_this_process


def summed_stream_reads(sources: list[str], device, every_rank_reads_all: bool = False) -> list[SourceCounts]:
    """The rows of each streamed source read and dropped by the ranks, so far: summed, or the largest count when
    every rank reads the whole stream. Collective: one all-reduce."""
    values = []
    for source in sources:
        read = rows_read_in_this_process(source)
        dropped = {reason: count for reason, count in read.items() if reason != ROWS_READ}
        values += source_slots(SourceCounts(conversations=read[ROWS_READ], dropped=dropped))
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(summed, op=ReduceOp.MAX if every_rank_reads_all else ReduceOp.SUM)
    counts = [int(value) for value in summed.tolist()]
    return [source_counts_from_slots(counts[start:start + SOURCE_SLOTS])
            for start in range(0, len(counts), SOURCE_SLOTS)]


class StreamedRowDropsCallback(TrainerCallback):
    """After every step (and at the end) each streamed source's report takes its summed counts and enforces
    the limit."""

    def __init__(self, reports: list[DataReport], max_dropped_share: float) -> None:
        self.reports = [report for report in reports if report.stream_key is not None]
        self.max_dropped_share = max_dropped_share
        self.every_rank_reads_all = False

    def _count(self, args, stream_ended: bool) -> None:
        reads = summed_stream_reads([report.stream_key for report in self.reports], args.device,
                                    self.every_rank_reads_all)
        for report, counts in zip(self.reports, reads):
            report.count_stream(counts, stream_ended, self.max_dropped_share)

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.every_rank_reads_all = isinstance(getattr(train_dataloader, "dataset", None), IterableDatasetShard)
        # What was read before (the trainer's and the sample prompts' peeks at the first rows) is not training.
        for report in self.reports:
            forget_rows_read(report.stream_key)

    def on_step_end(self, args, state, control, **kwargs):
        self._count(args, stream_ended=False)

    def on_train_end(self, args, state, control, **kwargs):
        self._count(args, stream_ended=True)
