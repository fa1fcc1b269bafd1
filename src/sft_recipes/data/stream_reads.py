"""A stream read unpacked (TRL's pipeline): its rows and drops summed over every rank after every step.

`sources.StreamedRowCheck` counts in the process that iterates the stream: the
training process when `dataloader_num_workers` is 0, which the linter requires for a streamed
unpacked dataset (a worker's counts never reach the training process). With accelerate's
`dispatch_batches` rank 0 reads for everyone, without it each rank reads its own shard: either way
the sum over ranks counts each row once. `max_dropped_share` is then enforced on the running share
as for a packed stream (`DataReport.count_stream`), on every rank together.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from sft_recipes.data.blocks import DROP_REASONS, SourceCounts, drop_slots, drops_from_slots
from sft_recipes.data.report import DataReport
from sft_recipes.data.sources import ROWS_READ, rows_read_in_this_process


def summed_stream_reads(sources: list[str], device) -> list[SourceCounts]:
    """The rows of each streamed source read and dropped by every rank, so far. Collective: one all-reduce."""
    values = []
    for source in sources:
        read = rows_read_in_this_process(source)
        values += [read[ROWS_READ], *drop_slots({reason: count for reason, count in read.items() if reason != ROWS_READ})]
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(summed)
    per_source = len(DROP_REASONS) + 2
    counts = [int(value) for value in summed.tolist()]
    return [SourceCounts(conversations=counts[start], dropped=drops_from_slots(counts[start + 1:start + per_source]))
            for start in range(0, len(counts), per_source)]


class StreamedRowDropsCallback(TrainerCallback):
    """After every step (and at the end) each streamed source's report takes its summed counts and enforces
    the limit."""

    def __init__(self, reports: list[DataReport], max_dropped_share: float) -> None:
        self.reports = [report for report in reports if report.stream_key is not None]
        self.max_dropped_share = max_dropped_share

    def _count(self, args, stream_ended: bool) -> None:
        reads = summed_stream_reads([report.stream_key for report in self.reports], args.device)
        for report, counts in zip(self.reports, reads):
            report.count_stream(counts, stream_ended, self.max_dropped_share)

    def on_step_end(self, args, state, control, **kwargs):
        self._count(args, stream_ended=False)

    def on_train_end(self, args, state, control, **kwargs):
        self._count(args, stream_ended=True)
