"""Raw rows -> the dataset (and collator) handed to SFTTrainer, per `dataset_format`."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow.compute as pc
from datasets import Dataset, IterableDataset

from sft_recipes.data.blocks import RankLocalBlockStream, collate_blocks
from sft_recipes.data.formats import alpaca_to_prompt_completion
from sft_recipes.data.masking import tokenize_dataset
from sft_recipes.data.packing import BlockDiagonalCollator
from sft_recipes.data.reasoning import check_reasoning_is_trained
from sft_recipes.data.validation import DataReport


def prepare_train_dataset(raw: Dataset | IterableDataset, data_args, tokenizer, training_args,
                          report: DataReport | None = None
                          ) -> tuple[Dataset | IterableDataset | RankLocalBlockStream, Callable | None]:
    """The training dataset and, when the recipe packs, the collator that must go with it.

    Conversations dropped while masking a map-style chat dataset are added to `report`, with the
    supervised tokens left (packed streams count theirs as they go: `StreamStats`).
    """
    if data_args.dataset_format == "alpaca":
        return raw.map(alpaca_to_prompt_completion, remove_columns=raw.column_names), None
    if data_args.dataset_format == "text":
        return raw, None
    template_kwargs = data_args.chat_template_kwargs or {}
    if data_args.dataset_format == "reasoning":  # then trained exactly like messages
        check_reasoning_is_trained(raw, tokenizer, **template_kwargs)
    if data_args.pack_blocks:
        stream = RankLocalBlockStream(
            raw, tokenizer, training_args.max_length, training_args.process_index, training_args.world_size,
            split_examples=data_args.split_examples, template_kwargs=template_kwargs,
            packing_window=data_args.packing_window,
        )
        collator = BlockDiagonalCollator(training_args.max_length, tokenizer.pad_token_id, block_per_row=True)
        return stream, collate_blocks(collator)
    if isinstance(raw, IterableDataset):
        raise ValueError("dataset_streaming with dataset_format: messages needs `pack_blocks: true`.")
    dataset, dropped = tokenize_dataset(raw, tokenizer, max_length=training_args.max_length, **template_kwargs)
    if report is not None:
        report.count_masking(dropped, supervised_tokens(dataset))
    return dataset, None


def supervised_tokens(dataset: Dataset) -> int:
    """Sum of `assistant_masks` over the (filtered) rows, in Arrow: no token goes through Python."""
    batches = dataset.with_format("arrow").iter(batch_size=10_000)
    return sum(pc.sum(pc.list_flatten(batch.column("assistant_masks"))).as_py() or 0 for batch in batches)
