"""Ranks that read their own shards of a stream end each pass over the data on the same step.

With `accelerator_config: {dispatch_batches: false}` and a streamed `datasets.IterableDataset`
of at least world-size file shards, accelerate gives every rank its own files, so ranks run out
of data at different times. Under transformers 5.23 a rank that runs out spins through the rest
of its epoch and starts its shard over while the others are still in their first pass: the small
shard is silently repeated, and any collective that only one rank reaches (an epoch-end save, a
short gradient-accumulation step) hangs. Here every rank takes, each optimizer step, only as many
batches as the rank with the fewest got; once any rank is out, the pass is over for all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from sft_recipes.fault.agreement import agree_min


class EndOfDataTogether:
    """Take batches from a per-rank iterator so that every rank gets the same number, and stops together."""

    def __init__(self, timeout_seconds: int) -> None:
        self.timeout_seconds = timeout_seconds
        self._ended: Iterator | None = None  # the pass that some rank has finished

    def take(self, iterator: Iterator, count: int) -> list[Any]:
        """Up to `count` items from `iterator`; every rank must call it with the same `count`."""
        if iterator is self._ended:
            return []  # every rank agreed that this pass is over: no rank reads on
        items = list(itertools.islice(iterator, count))
        agreed = agree_min(len(items), self.timeout_seconds)
        if agreed < count:
            self._ended = iterator
        return items[:agreed]


class EndOfDataTogetherMixin:
    """Trainer mixin: `class Trainer(EndOfDataTogetherMixin, SFTTrainer)` for per-rank streamed shards."""

    @cached_property
    def _end_of_data(self) -> EndOfDataTogether:
        return EndOfDataTogether(self.args.ddp_timeout)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = self._end_of_data.take(epoch_iterator, num_batches)
        return super().get_batch_samples(iter(batches), len(batches), device)
