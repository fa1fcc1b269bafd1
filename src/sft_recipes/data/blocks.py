"""Conversations -> fixed-size packed blocks, streamed per rank, with a shared stopping point.

Every optimizer step sees the same token budget: each item is one block of exactly `max_length`
slots (the reference recipe's 32768-token block), built end to end from this rank's own shard of
the data and tokenized only there (no rank tokenizes the whole dataset). The per-token boundary
signals are added later by `BlockDiagonalCollator` from each block's `seq_lengths`.

Ranks run out of data at different times. A rank that has run out keeps yielding fully masked
blocks flagged `stream_exhausted`, so it never leaves a collective early;
`StopWhenAnyRankExhausted` all-reduces the flag at every optimizer step and stops every rank on
the same step (as the reference recipe does with its `ran_out` all-reduce).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node
from torch.utils.data import IterableDataset as TorchIterableDataset
from torch.utils.data import get_worker_info
from transformers import TrainerCallback

from sft_recipes.data.masking import KEPT, tokenize_conversations

IGNORE_INDEX = -100
TOKENIZE_BATCH = 256


def pack_blocks(examples: Iterable[dict[str, list[int]]], max_length: int, split_examples: bool = True
                ) -> Iterator[dict[str, list[int]]]:
    """Greedily fill blocks of `max_length` tokens from examples in arrival order.

    Each example has `input_ids` and `labels`. A block is `input_ids`, `labels` and
    `seq_lengths` (its segments). With `split_examples` an example runs on into the next block
    (every block but the last is full, as in the reference recipe); without, an example that does
    not fit starts a new block, and one longer than `max_length` keeps its first tokens. The last,
    partial block is yielded as is: the collator pads it.
    """
    ids: list[int] = []
    labels: list[int] = []
    lengths: list[int] = []
    for example in examples:
        example_ids, example_labels = example["input_ids"], example["labels"]
        if not split_examples:
            example_ids, example_labels = example_ids[:max_length], example_labels[:max_length]
            if len(ids) + len(example_ids) > max_length:
                yield {"input_ids": ids, "labels": labels, "seq_lengths": lengths}
                ids, labels, lengths = [], [], []
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


@dataclass
class StreamStats:
    """Per-rank counters, exposed to the callbacks (main process only: num_workers=0)."""

    conversations: int = 0
    blocks: int = 0
    real_tokens: int = 0
    token_slots: int = 0
    supervised_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def packing_efficiency(self) -> float:
        return self.real_tokens / self.token_slots if self.token_slots else 0.0


class RankLocalBlockStream(TorchIterableDataset):
    """This rank's shard of a conversation dataset as an endless stream of packed blocks.

    Shards by (rank, dataloader worker) so that no conversation is read twice; after the shard
    ends it yields `exhausted_block()` forever (see the module docstring).
    """

    def __init__(self, dataset: Dataset | IterableDataset, tokenizer, max_length: int, rank: int, world_size: int,
                 split_examples: bool = True, template_kwargs: dict[str, Any] | None = None,
                 messages_field: str = "messages"):
        if isinstance(dataset, Dataset):
            dataset = dataset.to_iterable_dataset(num_shards=max(1, min(len(dataset), 64)))
        self.shard = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.split_examples = split_examples
        self.template_kwargs = template_kwargs or {}
        self.messages_field = messages_field
        self.pad_token_id = tokenizer.pad_token_id
        self.stats = StreamStats()

    def _tokenized(self) -> Iterator[dict[str, list[int]]]:
        batch: list = []
        for row in self.shard:
            batch.append(row[self.messages_field])
            if len(batch) == TOKENIZE_BATCH:
                yield from self._tokenize(batch)
                batch = []
        if batch:
            yield from self._tokenize(batch)

    def _tokenize(self, conversations: list) -> Iterator[dict[str, list[int]]]:
        columns = tokenize_conversations(self.tokenizer, conversations, None, **self.template_kwargs)
        for ids, mask, reason in zip(columns["input_ids"], columns["assistant_masks"], columns["drop_reason"]):
            self.stats.conversations += 1
            if reason != KEPT:
                self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
                continue
            labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask)]
            yield {"input_ids": ids, "labels": labels}

    def exhausted_block(self) -> dict[str, Any]:
        return {"input_ids": [self.pad_token_id] * self.max_length, "labels": [IGNORE_INDEX] * self.max_length,
                "seq_lengths": [self.max_length], "stream_exhausted": 1}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None:
            raise ValueError("RankLocalBlockStream counts its stream in the main process: use dataloader_num_workers: 0.")
        for block in pack_blocks(self._tokenized(), self.max_length, self.split_examples):
            self.stats.blocks += 1
            self.stats.real_tokens += len(block["input_ids"])
            self.stats.token_slots += self.max_length
            self.stats.supervised_tokens += sum(label != IGNORE_INDEX for label in block["labels"])
            yield {**block, "stream_exhausted": 0}
        while True:
            yield self.exhausted_block()


def collate_blocks(collator):
    """Wrap a BlockDiagonalCollator so the `stream_exhausted` flags travel as one tensor."""

    def collate(blocks: list[dict[str, Any]]) -> dict[str, Any]:
        flags = [block.pop("stream_exhausted", 0) for block in blocks]
        batch = collator(blocks)
        batch["stream_exhausted"] = torch.tensor(max(flags))
        return batch

    return collate


class StopWhenAnyRankExhausted(TrainerCallback):
    """All ranks stop on the first optimizer step after which any rank has run out of data."""

    def __init__(self) -> None:
        self.exhausted = False

    def on_step_end(self, args, state, control, **kwargs):
        flag = torch.tensor(float(self.exhausted), device=args.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() > 0:
            control.should_training_stop = True
            control.should_save = True
        return control
