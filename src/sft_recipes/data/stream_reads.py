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


def summed_stream_reads(source: str, device) -> SourceCounts:
    """The rows of `source` read and dropped by every rank's stream, so far. Collective."""
    read = rows_read_in_this_process(source)
    dropped = {reason: count for reason, count in read.items() if reason != ROWS_READ}
    values = torch.tensor([read[ROWS_READ], *drop_slots(dropped)], dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(values)
    rows, *slots = (int(value) for value in values.tolist())
    assert len(slots) == len(DROP_REASONS) + 1
    return SourceCounts(conversations=rows, dropped=drops_from_slots(slots))


class StreamedRowDropsCallback(TrainerCallback):
    """After every step (and at the end) the report takes the stream's summed counts and enforces the limit."""

    def __init__(self, report: DataReport, max_dropped_share: float) -> None:
        self.report = report
        self.max_dropped_share = max_dropped_share

    def _count(self, args, stream_ended: bool) -> None:
        reads = summed_stream_reads(self.report.source, args.device)
        self.report.count_stream(reads, stream_ended, self.max_dropped_share)

    def on_step_end(self, args, state, control, **kwargs):
        self._count(args, stream_ended=False)

    def on_train_end(self, args, state, control, **kwargs):
        self._count(args, stream_ended=True)
